#!/bin/sh
# cca replay from the command line: the JSON object and its keys, the human
# report, --compare's table, and clear errors with non-zero exits.
set -u
cca=$1
trace=tests/data/traces/two_stream_pipeline_default.pickle.gz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
fail() { echo "FAIL $1: $2"; failed=$((failed + 1)); }

if "$cca" replay "$trace" --json >"$tmp/out.json" 2>"$tmp/err" &&
    python3 - "$tmp/out.json" <<'EOP'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("allocs", "segment_allocs", "segment_frees", "ooms", "peak_reserved_bytes",
          "peak_allocated_bytes", "peak_requested_bytes", "address_mismatches",
          "memory_stats", "memory_summary", "events_per_second"):
    assert k in d, k
assert len(d["memory_stats"]) == 122
assert d["address_mismatches"] == 0
assert d["allocs"] == d["expected"]["allocs"]
assert d["peak_reserved_bytes"] == d["memory_stats"]["reserved_bytes.all.peak"]
assert "cca CUDA memory summary" in d["memory_summary"]
EOP
then ok json; else fail json "$(cat "$tmp/err")"; fi

if "$cca" replay "$trace" >"$tmp/out" 2>&1 && grep -q "address mismatches           0" "$tmp/out" &&
    grep -q "memory_summary identical     yes" "$tmp/out"; then ok human
else fail human "$(head -5 "$tmp/out")"; fi

if "$cca" replay "$trace" --compare '' 'max_split_size_mb:64' 'roundup_power2_divisions:4' >"$tmp/cmp" 2>&1 &&
    [ "$(grep -c 'MiB' "$tmp/cmp")" -eq 3 ] && grep -q '^(default)' "$tmp/cmp"; then ok compare
else fail compare "$(cat "$tmp/cmp")"; fi

if "$cca" replay "$trace" --compare 'bogus_key:1' >"$tmp/cmp2" 2>&1; then fail compare_error "exit 0"
elif grep -q "Unrecognized key" "$tmp/cmp2"; then ok compare_error
else fail compare_error "$(cat "$tmp/cmp2")"; fi

"$cca" replay tests/data/traces/missing.pickle >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 1 ] && grep -q "cannot open" "$tmp/err"; then ok missing_file; else fail missing_file "rc $rc"; fi

"$cca" replay "$trace" --settings 'max_split_size_mb:1' >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 1 ] && grep -q "max_split_size_mb" "$tmp/err"; then ok bad_settings; else fail bad_settings "rc $rc"; fi

"$cca" replay "$trace" --cap 12Q >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 2 ] && grep -q -- "--cap 12Q" "$tmp/err"; then ok bad_cap; else fail bad_cap "rc $rc"; fi

# a 64 MiB device cannot hold what the trace needs: OOMs are counted, not fatal
if "$cca" replay "$trace" --cap 64M --json >"$tmp/cap.json" 2>&1 &&
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['ooms'] > 0, d['ooms']" "$tmp/cap.json"; then
    ok small_cap
else fail small_cap "$(head -c 300 "$tmp/cap.json")"; fi

# --event-lag: the GPU running behind; compact's growths then pass pending granules
if "$cca" replay "$trace" --settings compact_memory:True --event-lag 10 --json >"$tmp/lag.json" 2>&1 &&
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['compact_pending_growths'] > 0, d" "$tmp/lag.json"; then
    ok event_lag
else fail event_lag "$(head -c 300 "$tmp/lag.json")"; fi

"$cca" replay "$trace" --event-lag -1 >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 2 ] && grep -q -- "--event-lag -1" "$tmp/err"; then ok bad_event_lag; else fail bad_event_lag "rc $rc"; fi

# replayed while read (the trace ran with PyTorch's defaults), or after with --sequential
if "$cca" replay "$trace" --json >"$tmp/ovl.json" 2>&1 &&
    "$cca" replay "$trace" --json --sequential >"$tmp/seq.json" 2>&1 &&
    python3 - "$tmp/ovl.json" "$tmp/seq.json" <<'EOP'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
assert a["overlapped"] is True and b["overlapped"] is False, (a["overlapped"], b["overlapped"])
for d in (a, b):
    for k in ("events_per_second", "replay_seconds", "load_seconds", "overlapped"):
        del d[k]
assert a == b
EOP
then ok sequential; else fail sequential "$(head -c 300 "$tmp/ovl.json")"; fi

# a snapshot recorded mid-run (its first 100 events gone, as a wrapped ring leaves it), one with a
# second device, one with a negative size
python3 - "$trace" "$tmp" <<'EOP'
import copy, gzip, pickle, sys
d = pickle.load(gzip.open(sys.argv[1]))
cut = copy.deepcopy(d)
cut["device_traces"][0] = cut["device_traces"][0][100:]
pickle.dump(cut, open(sys.argv[2] + "/cut.pickle", "wb"))
two = copy.deepcopy(cut)
two["device_traces"].append(copy.deepcopy(d["device_traces"][0]))
for s in d["segments"]:
    s = copy.deepcopy(s)
    s["device"] = 1
    two["segments"].append(s)
pickle.dump(two, open(sys.argv[2] + "/two.pickle", "wb"))
bad = copy.deepcopy(d)
bad["device_traces"][0][5]["size"] = -512
pickle.dump(bad, open(sys.argv[2] + "/bad.pickle", "wb"))
EOP
if "$cca" replay "$tmp/cut.pickle" --json >"$tmp/cut.json" 2>&1 &&
    python3 - "$tmp/cut.json" <<'EOP'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["recorded_part_only"] is True and d["inferred_blocks"] > 0 and d["inferred_segments"] > 0, d
assert d["address_mismatches"] == 0 and d["inconsistencies"] == 0, d
assert d["expected"]["memory_stats_mismatches"] == 0, d["expected"]
assert d["peak_reserved_bytes"] == d["expected"]["peak_reserved_bytes"]
EOP
then ok recorded_mid_run; else fail recorded_mid_run "$(head -c 300 "$tmp/cut.json")"; fi
"$cca" replay "$tmp/cut.pickle" >"$tmp/cut.txt" 2>&1
if grep -q "before the first event .* inferred; the figures cover the recorded part" "$tmp/cut.txt"; then
    ok recorded_mid_run_report; else fail recorded_mid_run_report "$(head -c 300 "$tmp/cut.txt")"; fi

if "$cca" replay "$tmp/two.pickle" --json >"$tmp/two.json" 2>&1 &&
    python3 -c "import json,sys; a=json.load(open(sys.argv[1])); assert [d['device'] for d in a] == [0, 1] and a[1]['recorded_part_only'] is False and a[0]['recorded_part_only'] is True, a" "$tmp/two.json" &&
    "$cca" replay "$tmp/two.pickle" --device 1 --json >"$tmp/one.json" 2>&1 &&
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['device'] == 1 and d['device_count'] == 2, d" "$tmp/one.json"; then
    ok several_devices
else fail several_devices "$(head -c 300 "$tmp/two.json")"; fi

"$cca" replay "$tmp/bad.pickle" >"$tmp/bad.txt" 2>&1
rc=$?
"$cca" replay "$tmp/bad.pickle" --strict >/dev/null 2>"$tmp/err"
src=$?
if [ $rc -eq 0 ] && grep -q "inconsistent input           1  first: event 5: size -512" "$tmp/bad.txt" &&
    [ $src -eq 1 ] && grep -q "inconsistent trace: event 5: size -512" "$tmp/err"; then
    ok strict
else fail strict "rc $rc, strict rc $src: $(head -c 300 "$tmp/err")"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
