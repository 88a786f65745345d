#!/usr/bin/env python3
"""Regenerate the seed corpus of fuzz_replay (tests/fuzz/corpus/replay/): four
bundled traces, whole and cut to their first 300 events, at pickle protocols 2
and 4, one gzipped; each file is one option byte (fuzz_replay.c says what its
bits pick) followed by the snapshot. Files are named by content hash."""
import gzip, hashlib, os, pickle

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, 'corpus', 'replay')
traces = os.path.join(os.path.dirname(here), 'data', 'traces')
os.makedirs(out, exist_ok=True)


def add(option, raw):
    data = bytes([option]) + raw
    with open(os.path.join(out, hashlib.sha1(data).hexdigest()), 'wb') as f:
        f.write(data)


for name in ('two_stream_pipeline_default', 'mempool_default', 'graph_mlp_default',
             'graph_mlp_expandable'):
    with gzip.open(os.path.join(traces, name + '.pickle.gz')) as f:
        snap = pickle.load(f)
    add(0, pickle.dumps(snap, protocol=4))
    cut = dict(snap)
    cut['device_traces'] = [snap['device_traces'][0][:300]]
    add(1, pickle.dumps(cut, protocol=4))          # fresh addresses
    add(2 | 8, pickle.dumps(cut, protocol=2))      # PyTorch's default settings, a 64 MiB cap
    add(6 | 16, pickle.dumps(cut, protocol=4))     # expandable segments on a 1 GiB device
with gzip.open(os.path.join(traces, 'two_stream_pipeline_default.pickle.gz')) as f:
    add(0, gzip.compress(pickle.dumps(pickle.load(f), protocol=4), mtime=0))
