#!/bin/sh
# test_cli_snapshot.sh - `cca replay --snapshot/--svg` and `cca snapshot`:
# the pickle cca writes after replaying a real PyTorch trace has PyTorch's
# keys and types and equals PyTorch's own snapshot; it replays again with
# the same allocations; JSON and SVG conversions parse.
# Usage: sh tests/unit/test_cli_snapshot.sh path/to/cca
set -u
CCA=${1:?usage: test_cli_snapshot.sh path/to/cca}
TRACE=tests/data/traces/two_stream_pipeline_default.pickle.gz
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT INT TERM

check() {
    name=$1; shift
    if "$@" >"$tmp/out" 2>"$tmp/err"; then
        echo "ok   $name"; passed=$((passed + 1))
    else
        echo "FAIL $name"; cat "$tmp/out" "$tmp/err"; failed=$((failed + 1))
    fi
}

expect_rc() {
    want=$1; shift
    "$@" >/dev/null 2>&1
    [ $? -eq "$want" ]
}

check replay_writes_snapshot_and_svg \
    "$CCA" replay "$TRACE" --snapshot "$tmp/out.pickle.gz" --svg "$tmp/out.svg"

check snapshot_matches_pytorch python3 -c "
import gzip, pickle
ref = pickle.load(gzip.open('$TRACE'))
me = pickle.load(gzip.open('$tmp/out.pickle.gz'))
sig = lambda d: {k: type(v) for k, v in d.items()}
assert set(ref) == set(me), (set(ref), set(me))
assert sig(me['allocator_settings']) == sig(ref['allocator_settings'])
for s, r in zip(me['segments'], ref['segments']):
    assert sig(s) == sig(r)
    for b, rb in zip(s['blocks'], r['blocks']):
        assert sig(b) == sig(rb)
strip = lambda s: {k: v for k, v in s.items() if k != 'frames'}
assert [strip(s) for s in me['segments']] == [strip(s) for s in ref['segments']]
assert len(me['device_traces']) == len(ref['device_traces'])
for e, r in zip(me['device_traces'][0], ref['device_traces'][0]):
    assert sig(e) == sig(r)
    assert [e[k] for k in ('action', 'addr', 'size', 'stream')] == [r[k] for k in ('action', 'addr', 'size', 'stream')]
assert len(me['device_traces'][0]) == len(ref['device_traces'][0])
"

check replay_of_cca_snapshot_same_allocations sh -c "
    a=\$(\"$CCA\" replay $TRACE --json | python3 -c 'import json, sys; print(json.load(sys.stdin)[\"allocs\"])')
    b=\$(\"$CCA\" replay $tmp/out.pickle.gz --json | python3 -c 'import json, sys; d = json.load(sys.stdin); print(d[\"allocs\"]) if d[\"address_mismatches\"] == 0 else print(-1)')
    [ \"\$a\" = \"\$b\" ] && [ \"\$a\" -gt 0 ]"

check replay_svg_parses python3 -c "
import xml.etree.ElementTree as ET
r = ET.parse('$tmp/out.svg').getroot()
assert r.tag == '{http://www.w3.org/2000/svg}svg'
assert len(r.findall('.//{http://www.w3.org/2000/svg}polygon')) > 10
assert 'http' not in open('$tmp/out.svg').read().replace('http://www.w3.org/2000/svg', '')
"

check snapshot_json_equals_pickle sh -c "
    \"$CCA\" snapshot $TRACE --json -o $tmp/ref.json &&
    python3 -c \"
import gzip, json, pickle
ref = pickle.load(gzip.open('$TRACE'))
js = json.load(open('$tmp/ref.json'))
norm = lambda x: [norm(v) for v in x] if isinstance(x, (list, tuple)) else {k: norm(v) for k, v in x.items()} if isinstance(x, dict) else x
assert norm(ref) == js
\""

check snapshot_json_stdout sh -c "\"$CCA\" snapshot $tmp/out.pickle.gz --json | python3 -c 'import json, sys; assert json.load(sys.stdin)[\"segments\"]'"

check snapshot_svg_of_pytorch_file sh -c "
    \"$CCA\" snapshot $TRACE --svg $tmp/ref.svg &&
    python3 -c \"import xml.etree.ElementTree as ET; ET.parse('$tmp/ref.svg')\""

# `cca snapshot FILE --json OUT` as the command list says: the same JSON as -o OUT and stdout
check snapshot_json_out_positional sh -c "
    \"$CCA\" snapshot $TRACE --json $tmp/pos.json &&
    \"$CCA\" snapshot $TRACE --json -o $tmp/opt.json &&
    \"$CCA\" snapshot $TRACE --json >$tmp/std.json &&
    cmp -s $tmp/pos.json $tmp/opt.json && cmp -s $tmp/pos.json $tmp/std.json &&
    \"$CCA\" snapshot --json $TRACE | cmp -s - $tmp/std.json"

check snapshot_missing_value sh -c "
    \"$CCA\" snapshot $TRACE --svg 2>$tmp/e1; [ \$? -eq 2 ] && grep -q -- '--svg needs a value' $tmp/e1 &&
    \"$CCA\" snapshot $TRACE --json -o 2>$tmp/e2; [ \$? -eq 2 ] && grep -q -- '-o needs a value' $tmp/e2"

check snapshot_fifo_refused sh -c "
    mkfifo $tmp/fifo && timeout 20 \"$CCA\" snapshot $tmp/fifo --json 2>$tmp/e3; [ \$? -eq 1 ] &&
    grep -q 'not a regular file' $tmp/e3"

check snapshot_path_named_once sh -c "
    \"$CCA\" snapshot $tmp/missing.pickle --json 2>$tmp/e4; [ \$(grep -o missing.pickle $tmp/e4 | wc -l) -eq 1 ]"

# A pickle whose lists share each other through the memo (40 levels: 2^41 values of
# JSON from 467 bytes) is refused at once; before, the JSON grew until memory ran out.
check snapshot_json_of_shared_lists_refused sh -c "
    python3 -c \"
import pickle
a = []
for i in range(40):
    a = [a, a]
open('$tmp/laughs.pickle', 'wb').write(pickle.dumps({'segments': [a]}, protocol=4))
\" &&
    ! timeout 60 \"$CCA\" snapshot $tmp/laughs.pickle --json -o $tmp/laughs.json 2>$tmp/laughs.err &&
    grep -q 'shared values' $tmp/laughs.err && [ ! -s $tmp/laughs.json ]"

# A 256 MiB string where a snapshot's dict should be, in 256 KiB of gzip: replay refuses
# it at its opcode (offset 2), before inflating it.
check replay_refuses_a_string_at_once sh -c "
    python3 -c \"
import pickle, zlib
z = zlib.compressobj(1, zlib.DEFLATED, 31)
out = [z.compress(b'\\\\x80\\\\x04\\\\x8d' + (1 << 28).to_bytes(8, 'little'))]
piece = b'a' * (1 << 20)
out += [z.compress(piece) for _ in range(256)]
out.append(z.compress(b'.') + z.flush())
open('$tmp/str.pickle.gz', 'wb').write(b''.join(out))
\" &&
    ! \"$CCA\" replay $tmp/str.pickle.gz 2>$tmp/str.err &&
    grep -q 'top-level value (str) is not a dict at offset 2' $tmp/str.err"

usage_errors() {
    expect_rc 2 "$CCA" snapshot &&
    expect_rc 2 "$CCA" snapshot "$TRACE" &&
    expect_rc 2 "$CCA" snapshot "$TRACE" --json --svg x.svg &&
    expect_rc 2 "$CCA" snapshot "$TRACE" --bogus &&
    expect_rc 1 "$CCA" snapshot "$tmp/missing.pickle" --json &&
    expect_rc 1 "$CCA" snapshot "$tmp/ref.json" --json &&
    expect_rc 1 "$CCA" replay "$TRACE" --snapshot /nonexistent-dir/x.pickle
}
check usage_errors usage_errors

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
