#!/usr/bin/env python3
"""Cut a recorded trace at one of its program operations, so that a replay's figures are the
phase before it.

    python3 scripts/trace-phase.py TRACE.pickle.gz K OUT.pickle.gz

Keeps the events before operation K of cca_meta["pool_events"] (counted from 0; its own
`snapshot` event dropped) and the operations before it, and drops the trace's final
statistics (they are the whole run's). A trace of bench/torch_bench.py's models
(`scripts/record-trace.py torch_bench 0 TRACE`) notes an empty_cache and a reset of the peaks
before each model, so cutting at the empty_cache of the next model gives one model's
figures: K = 4 ends ResNet-50's inference, 8 GPT-2's generation. Then
`cca replay OUT.pickle.gz --addresses fresh --compare '' 'compact_memory:True'`.
"""
import gzip
import pickle
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, k, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with gzip.open(src) as f:
        snap = pickle.load(f)
    meta = dict(snap.get("cca_meta", {}))
    ops = meta.get("pool_events", [])
    if not 0 <= k < len(ops):
        sys.exit("%s has %d program operations; K must be below that" % (src, len(ops)))
    events = snap["device_traces"][0]
    snap["device_traces"] = [events[:ops[k]["at"] - 1]]
    meta["pool_events"] = ops[:k]
    meta.pop("final_memory_stats", None)
    meta.pop("final_memory_summary", None)
    snap["cca_meta"] = meta
    with gzip.open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    print("%s: %d events, %d operations (cut before %s)" % (
        out, len(snap["device_traces"][0]), k, ops[k]["op"]))


if __name__ == "__main__":
    main()
