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

# ---- --explain: what was live at the peak, by call site, annotation and stream -------------
python3 - "$tmp/framed.pickle" <<'EOP'
import pickle, sys
MiB = 1 << 20
A = 0x7f0000000000
def ev(action, addr, size, t, frames=()):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": [dict(f) for f in frames]}
torch_frame = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}
trace = [ev("segment_alloc", A, 20 * MiB, 1),
         ev("alloc", A, 8 * MiB, 2, [torch_frame, {"filename": "/home/u/train.py", "line": 10, "name": "fwd"}]),
         ev("alloc", A + 8 * MiB, 4 * MiB, 20, [{"filename": "/home/u/train.py", "line": 20, "name": "bwd"}])]
notes = [{"stage": "START", "name": "step", "device": 0, "time_us": 10},
         {"stage": "END", "name": "step", "device": 0, "time_us": 30}]
pickle.dump({"segments": [], "device_traces": [trace], "external_annotations": notes},
            open(sys.argv[1], "wb"))
EOP
if "$cca" replay "$tmp/framed.pickle" --explain --json >"$tmp/ex.json" 2>"$tmp/err" &&
    python3 - "$tmp/ex.json" <<'EOP'
import json, sys
d = json.load(open(sys.argv[1]))
x, MiB = d["explain"], 1 << 20
assert x["reserved_bytes"] == 20 * MiB == d["replay"]["peak_reserved_bytes"], x
assert x["live_bytes"] == 12 * MiB and x["live_allocations"] == 2, x
assert x["cached_free_bytes"] == 8 * MiB and x["segments_with_free"] == 1, x
frames = {f["name"]: f["bytes"] for f in x["frames"]}
assert frames == {"/home/u/train.py:10 fwd": 8 * MiB, "/home/u/train.py:20 bwd": 4 * MiB}, frames
notes = {a["name"]: a["bytes"] for a in x["annotations"]}
assert notes == {"(no annotation open)": 8 * MiB, "step": 4 * MiB}, notes
assert x["streams"] == [{"name": "default stream", "bytes": 12 * MiB, "allocations": 2}], x["streams"]
assert [s["settings"] for s in d["settings"]][0] == "expandable_segments:True", d["settings"]
EOP
then ok explain_frames_annotations; else fail explain_frames_annotations "$(cat "$tmp/err" "$tmp/ex.json")"; fi

if "$cca" replay "$trace" --explain --json >"$tmp/ex2.json" 2>"$tmp/err" &&
    "$cca" replay "$trace" --explain >"$tmp/ex2.txt" 2>>"$tmp/err" &&
    python3 - "$tmp/ex2.json" "$tmp/ex2.txt" <<'EOP'
import json, sys
d = json.load(open(sys.argv[1]))
text = open(sys.argv[2]).read()
x, r = d["explain"], d["replay"]
assert x["reserved_bytes"] == r["peak_reserved_bytes"] == r["expected"]["peak_reserved_bytes"]
assert x["live_bytes"] + x["cached_free_bytes"] == x["reserved_bytes"], x
assert sum(s["bytes"] for s in x["streams"]) == x["live_bytes"], x["streams"]
assert len(x["streams"]) == 2, x["streams"]
assert sum(s["bytes"] for s in x["free_segments"]) == x["cached_free_bytes"], x["free_segments"]
for want in ("At the peak", "Live memory by call site", "Live memory by stream",
             "Cached free memory by segment", "expandable_segments:True"):
    assert want in text, want
EOP
then ok explain_bundled; else fail explain_bundled "$(cat "$tmp/err")"; fi

# ---- --fit: the smallest device found by replay, checked at its edge --------------------------
if "$cca" replay "$trace" --fit '' 'expandable_segments:True' --json >"$tmp/fit.json" 2>"$tmp/err" &&
    python3 - "$cca" "$trace" "$tmp/fit.json" <<'EOP'
import json, subprocess, sys
cca, trace = sys.argv[1], sys.argv[2]
rows = json.load(open(sys.argv[3]))
assert [r["settings"] for r in rows] == ["", "expandable_segments:True"], rows
def ooms(settings, cap):
    out = subprocess.run([cca, "replay", trace, "--settings", settings, "--cap", str(cap), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["unexpected_ooms"]
for r in rows:
    assert r["fits"] and 0 < r["fit_bytes"] <= r["peak_reserved_bytes"] + (2 << 20), r
    assert ooms(r["settings"], r["fit_bytes"]) == 0, r
    assert ooms(r["settings"], r["fit_bytes"] - (2 << 20)) > 0, r
EOP
then ok fit; else fail fit "$(cat "$tmp/err" "$tmp/fit.json")"; fi

if "$cca" replay "$trace" --fit >"$tmp/fit.txt" 2>&1 && grep -q "^(the trace's own)" "$tmp/fit.txt" &&
    grep -q "^compact_memory:True" "$tmp/fit.txt"; then ok fit_defaults; else fail fit_defaults "$(cat "$tmp/fit.txt")"; fi

# ---- the command line as a user expects it -----------------------------------------------
if "$cca" replay "$trace" --compare '' 'expandable_segments:True' --json --addresses trace >"$tmp/cj" 2>&1 &&
    python3 -c "
import json, sys
rows = json.load(open(sys.argv[1]))
assert [r['settings'] for r in rows] == ['', 'expandable_segments:True'], rows
assert rows[0]['address_mismatches'] == 0 and 'memory_stats' in rows[1]
" "$tmp/cj"; then ok compare_json_addresses; else fail compare_json_addresses "$(head -c 300 "$tmp/cj")"; fi

if "$cca" replay "$trace" --compare '' --addresses trace >"$tmp/ca" 2>&1 && grep -q "addr mismatches" "$tmp/ca" &&
    grep -Eq '^\(default\).* 0$' "$tmp/ca"; then ok compare_addresses_column; else fail compare_addresses_column "$(cat "$tmp/ca")"; fi

for opt in --settings --cap --svg --snapshot --device; do
    "$cca" replay "$trace" $opt >/dev/null 2>"$tmp/err"
    rc=$?
    if [ $rc -eq 2 ] && grep -q -- "$opt needs a value" "$tmp/err"; then ok "no_value$opt"; else fail "no_value$opt" "rc $rc $(cat "$tmp/err")"; fi
done
"$cca" replay "$trace" --settings --json >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 2 ] && grep -q -- "--settings needs a value" "$tmp/err"; then ok value_is_an_option; else fail value_is_an_option "rc $rc"; fi

for cap in 18014398509481985K 18446744073709551616 99999999999999999999T -1 ''; do
    "$cca" replay "$trace" --cap "$cap" >/dev/null 2>"$tmp/err"
    rc=$?
    if [ $rc -eq 2 ] && grep -q "expected a size" "$tmp/err"; then ok "cap_refused '$cap'"; else fail "cap_refused '$cap'" "rc $rc"; fi
done

"$cca" replay --fit "$trace" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 2 ] && grep -q "put TRACE first" "$tmp/err"; then ok trace_after_fit; else fail trace_after_fit "rc $rc"; fi

mkfifo "$tmp/fifo"
timeout 20 "$cca" replay "$tmp/fifo" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 1 ] && grep -q "not a regular file" "$tmp/err"; then ok fifo_refused; else fail fifo_refused "rc $rc"; fi

"$cca" replay "$tmp/missing.pickle" >/dev/null 2>"$tmp/err"
if [ "$(grep -o "missing.pickle" "$tmp/err" | wc -l)" -eq 1 ]; then ok path_named_once; else fail path_named_once "$(cat "$tmp/err")"; fi
printf 'not a pickle' >"$tmp/junk.pickle"
"$cca" replay "$tmp/junk.pickle" >/dev/null 2>"$tmp/err"
if [ "$(grep -o "junk.pickle" "$tmp/err" | wc -l)" -eq 1 ]; then ok path_named_once_format; else fail path_named_once_format "$(cat "$tmp/err")"; fi

# under a small device the first mismatch is PyTorch's success and cca's OOM, said whole
if "$cca" replay "$trace" --cap 64M >"$tmp/oom" 2>&1 &&
    grep "address mismatches" "$tmp/oom" | grep -q "failed (out of memory), PyTorch's did not$"; then ok oom_line_whole
else fail oom_line_whole "$(grep mismatches "$tmp/oom")"; fi

# a failed --snapshot/--svg write: a clean error, nothing leaked (LeakSanitizer in make test)
for flag in --snapshot --svg; do
    "$cca" replay "$trace" $flag "$tmp/no/such/dir/out" >/dev/null 2>"$tmp/err"
    rc=$?
    if [ $rc -eq 1 ] && grep -q "cannot" "$tmp/err" && ! grep -q "LeakSanitizer" "$tmp/err"; then
        ok "failed_write$flag"
    else fail "failed_write$flag" "rc $rc $(head -5 "$tmp/err")"; fi
done

# ---- --svg keeps transient peaks: the axis tops at the highest active bytes of any event ------
svgtrace=tests/data/traces/gpt2_train_default.pickle.gz
if "$cca" snapshot "$svgtrace" --svg "$tmp/peak.svg" 2>"$tmp/err" &&
    python3 - "$svgtrace" "$tmp/peak.svg" <<'EOP'
import gzip, pickle, re, sys
d = pickle.load(gzip.open(sys.argv[1]))
live, cur, peak = {}, 0, 0
for e in d["device_traces"][0]:
    if e["action"] == "alloc":
        live[e["addr"]] = e["size"]; cur += e["size"]; peak = max(peak, cur)
    elif e["action"] == "free_completed" and e["addr"] in live:
        cur -= live.pop(e["addr"])
v, u = float(peak), 0
while v >= 1024 and u < 4:
    v /= 1024; u += 1
want = "%.1f%s" % (v, ["B", "KiB", "MiB", "GiB", "TiB"][u])
svg = open(sys.argv[2]).read()
axis = re.search(r'text-anchor="end"><text[^>]*>([^<]*)<', svg).group(1)
assert axis == want, (axis, want)
EOP
then ok svg_keeps_peaks; else fail svg_keeps_peaks "$(cat "$tmp/err")"; fi

# the segments at the peak of reserved memory, rebuilt from the trace's events: a hand-made
# trace (the peak is its last event: 22 MiB in 2 segments, 3 live blocks, one freed and
# waiting for its stream) and GPT-2's
python3 - "$tmp/peakmap.pickle" <<'EOP'
import pickle, sys
MiB, A = 1 << 20, 0x7f0000000000
def ev(a, addr, size, stream=0):
    return {"action": a, "addr": addr, "size": size, "stream": stream, "time_us": 0}
trace = [ev("segment_alloc", A, 20 * MiB), ev("alloc", A, 8 * MiB), ev("alloc", A + 8 * MiB, 4 * MiB),
         ev("free_requested", A, 8 * MiB), ev("free_completed", A, 8 * MiB),
         ev("segment_alloc", A + 32 * MiB, 2 * MiB, 7), ev("alloc", A + 32 * MiB, 512, 7),
         ev("free_requested", A + 8 * MiB, 4 * MiB), ev("alloc", A + 32 * MiB + 512, 512, 7)]
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"))
EOP
if "$cca" snapshot "$tmp/peakmap.pickle" --svg "$tmp/peakmap.svg" 2>"$tmp/err" &&
    "$cca" snapshot "$svgtrace" --svg "$tmp/gpt2.svg" 2>>"$tmp/err" &&
    python3 - "$tmp/peakmap.svg" "$tmp/gpt2.svg" "$svgtrace" <<'EOP'
import gzip, pickle, re, sys
svg = open(sys.argv[1]).read()
title = re.search(r"device 0 at the peak of reserved memory: ([^<]*)<", svg).group(1)
assert title == "22.0MiB reserved, 4.0MiB allocated, after event 8 of 9 (2 segments)", title
states = re.findall(r"<title>0x[0-9a-f]+: [^,]*, (active_[a-z_]+)</title>", svg)
assert sorted(states) == ["active_allocated", "active_allocated", "active_pending_free"], states
# GPT-2: the peak's segment count as the trace's events give it
d = pickle.load(gzip.open(sys.argv[3]))
live, best, count = set(), 0, 0
res = 0
for e in d["device_traces"][0]:
    if e["action"] == "segment_alloc":
        live.add(e["addr"]); res += e["size"]
    elif e["action"] == "segment_free":
        live.discard(e["addr"]); res -= e["size"]
    if res > best:
        best, count = res, len(live)
title = re.search(r"device 0 at the peak of reserved memory: ([^<]*)<", open(sys.argv[2]).read()).group(1)
assert title.endswith("(%d segments)" % count) and title.startswith("%.1fGiB reserved" % (best / 2**30)), title
EOP
then ok svg_segments_at_the_peak; else fail svg_segments_at_the_peak "$(cat "$tmp/err")"; fi

# sizes near 2^62 summed in the picture: no signed overflow (UBSan in make test), a finite axis
python3 - "$tmp/huge.pickle" <<'EOP'
import pickle, sys
big = 1 << 62
n = 410  # more than the picture's 400 own bands: the rest are summed into one
trace = [{"action": "alloc", "addr": (i + 1) << 20, "size": big + i, "stream": 0, "time_us": i} for i in range(n)]
trace += [{"action": "free_completed", "addr": (i + 1) << 20, "size": big + i, "stream": 0, "time_us": n} for i in range(n)]
pickle.dump({"segments": [], "device_traces": [trace]}, open(sys.argv[1], "wb"))
EOP
"$cca" snapshot "$tmp/huge.pickle" --svg "$tmp/huge.svg" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 0 ] && ! grep -q "runtime error" "$tmp/err" && python3 -c "
import math, re, sys
pts = re.findall(r'points=\"([^\"]*)\"', open(sys.argv[1]).read())
vals = [float(v) for p in pts for xy in p.split() for v in xy.split(',')]
assert pts and all(math.isfinite(v) for v in vals)
" "$tmp/huge.svg"; then
    ok svg_huge_sizes
else fail svg_huge_sizes "rc $rc $(head -3 "$tmp/err")"; fi

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
