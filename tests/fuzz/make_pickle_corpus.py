#!/usr/bin/env python3
"""Regenerate the seed corpus of fuzz_pickle (tests/fuzz/corpus/pickle/):
small pickles from Python's own pickler at every protocol, hand-made ones for
opcodes the pickler rarely emits, truncated and corrupted variants, and a
slice of a real PyTorch snapshot. Files are named by content hash."""
import gzip, hashlib, os, pickle, struct

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, 'corpus', 'pickle')
root = os.path.dirname(os.path.dirname(here))
os.makedirs(out, exist_ok=True)
seeds = []

values = [None, True, False, 0, 1, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31,
          2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 2**200, -(2**300), 1.5, -0.0,
          float('inf'), float('nan'), 1e300, '', 'abc', 'h\u00e9llo \u2603 \U0001f600', 'x' * 300,
          b'', b'\x00\xff', b'y' * 300, bytearray(b'ba'), (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4),
          [], [1], list(range(1100)), {}, {'a': 1}, {i: str(i) for i in range(1100)},
          {'k': [1, (2, 'k'), {'k': None}]}, {(1, 'a'): 1, 2.5: 'f', None: 0, b'b': 1}]
shared = ['s']
values.append([shared, shared, {'x': shared}])
cyc = []
cyc.append(cyc)
values.append(cyc)
d = {}
d['self'] = d
values.append(d)
t_list = []
t = (t_list,)
t_list.append(t)
values.append(t)
values.append({'events': [{'action': 'alloc', 'addr': 140251855060992 + i * 512, 'size': 512 * i,
                           'stream': 0, 'time_us': 1795298354144794 + i,
                           'compile_context': 'N/A', 'user_metadata': ''} for i in range(40)]})

for v in values:
    for proto in range(0, 6):
        try:
            seeds.append(pickle.dumps(v, protocol=proto))
        except Exception:
            pass

# Hand-made: opcodes Python's pickler does not emit for plain data.
def le4(n): return struct.pack('<I', n)
def le8(n): return struct.pack('<Q', n)
hand = [
    b'\x80\x04N2\x86.',                                   # DUP, TUPLE2
    b'\x80\x04(NN0\x85.',                                  # POP
    b'\x80\x04N(NN1\x85.',                                 # POP_MARK
    b'\x80\x04(0N.',                                       # POP of a mark
    b'\x80\x04\x8b' + le4(9) + b'\x01' * 8 + b'\x00.',     # LONG4
    b'\x80\x04\x8d' + le8(3) + b'abc.',                    # BINUNICODE8
    b'\x80\x04\x8e' + le8(2) + b'ab.',                     # BINBYTES8
    b'\x80\x05\x96' + le8(2) + b'ab.',                     # BYTEARRAY8
    b'\x80\x04]q\x00h\x00a.',                              # BINPUT/BINGET self-list
    b'\x80\x04]r' + le4(7) + b'j' + le4(7) + b'a.',        # LONG_BINPUT/LONG_BINGET
    b'I12345\n.', b'I-7\n.', b'I01\n.', b'I00\n.', b'L123L\n.', b'L-9223372036854775808\n.',
    b'(I1\nI2\nd.', b'(I1\nI2\nl.', b'(I1\nI2\nt.',
    b'\x80\x04}(K\x01K\x02K\x01K\x03u.',                  # duplicate key
    b'\x80\x04}K\x01\x88sK\x01\x89s.',                    # 1 and True one key
    b'\x80\x04\x95' + le8(3) + b'K\x01.',                  # FRAME
    # errors
    b'\x80\x04c__builtin__\nset\n.', b'\x80\x04R.', b'\x80\x06N.', b'\x80\x04\x8c\x05ab',
    b'\x80\x04X' + le4(0xffffffff) + b'a.', b'\x80\x04\x8c\x02\xff\xfe.', b'\x80\x04h\x05.',
    b'\x80\x04u.', b'\x80\x04(u.', b'\x80\x04}(K\x01u.', b'\x80\x04]]K\x01s.', b'\x80\x04a.',
    b'\x80\x04\x95' + le8(1 << 40) + b'N.', b'\x80\x04(.', b'N', b'', b'\x80\x04\x8b' + le4(0x80000000) + b'.',
    b'\x80\x04K\x01r' + le4(0xfffffff0) + b'.', b'\x80\x04(]K\x01\x85K\x01u.',
    b'\x80\x04' + b']' * 200 + b'a' * 199 + b'.',        # nesting
    b'\x80\x04N' + b'\x85' * 1500 + b'.',                  # deep tuple nesting
]
seeds += hand

# A slice of a real snapshot: the first events and the allocator settings.
with gzip.open(os.path.join(root, 'tests', 'data', 'traces', 'two_stream_pipeline_default.pickle.gz')) as f:
    snap = pickle.load(f)
small = {'device_traces': [snap['device_traces'][0][:60]], 'segments': snap['segments'][:2],
         'allocator_settings': snap['allocator_settings']}
real = pickle.dumps(small, protocol=4)
seeds.append(real)
seeds.append(gzip.compress(real))
seeds.append(gzip.compress(real)[:-10])

# Shared references through the memo: lists sharing each other ("billion laughs",
# 2^depth values of JSON from a few bytes a level), and records (event dicts) a pickler
# shared: twice in one list, across APPENDS batches, with a kept field, an inner list.
def laughs(depth, top):
    a = []
    for _ in range(depth):
        a = [a, a]
    return pickle.dumps({top: [a]} if top else a, protocol=4)
seeds += [laughs(20, None), laughs(40, 'segments'), laughs(300, None)]
ev = [{'action': 'alloc', 'addr': 4096 * i, 'size': 512, 'stream': 0} for i in range(4)]
seeds.append(pickle.dumps({'device_traces': [[ev[0], ev[1], ev[2], ev[1]]]}, protocol=4))
seeds.append(pickle.dumps({'device_traces': [ev[:2], [ev[0], ev[3]]]}, protocol=2))
many = [{'action': 'free', 'addr': i} for i in range(1100)]
seeds.append(pickle.dumps({'device_traces': [many + many[:3]]}, protocol=4))
seeds.append(pickle.dumps({'segments': ev[:2], 'device_traces': [[ev[1], ev[0]]]}, protocol=4))
seeds.append(pickle.dumps({'device_traces': [ev[:2], ev[:2]]}, protocol=4))
seeds.append(pickle.dumps({'device_traces': [[ev[0]]], 'x': ev[0]}, protocol=4))

# Decompression bombs: 1 MiB of zeros in 1 KiB of gzip (refused at its first opcode),
# a 1 MiB string at the top, and 1 MiB of zeros after a pickle's STOP.
big = 1 << 20
seeds.append(gzip.compress(bytes(big), 9))
seeds.append(gzip.compress(b'\x80\x04\x8d' + struct.pack('<Q', big) + b'a' * big + b'.', 9))
seeds.append(gzip.compress(pickle.dumps({'device_traces': [[ev[0]]]}, protocol=4) + bytes(big), 9))
seeds.append(gzip.compress(b'\x80\x04\x8d' + struct.pack('<Q', 1 << 40) + b'a' * 65536, 9))

# Truncated and corrupted variants of a few seeds.
base = [pickle.dumps({'a': [1, 2.5, 'x', (None, True)], 'b': {'c': b'd'}}, protocol=4), real[:2000] + b'.']
for b in base:
    for cut in range(0, len(b), max(1, len(b) // 40)):
        seeds.append(b[:cut])
    for i in range(0, len(b), max(1, len(b) // 40)):
        seeds.append(b[:i] + bytes([b[i] ^ 0x5a]) + b[i + 1:])

total = 0
for s in seeds:
    name = hashlib.sha1(s).hexdigest()
    with open(os.path.join(out, name), 'wb') as f:
        f.write(s)
    total += len(s)
print(len(seeds), 'seeds,', total, 'bytes')
