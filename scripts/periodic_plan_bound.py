#!/usr/bin/env python3
"""Memory a placement planned ahead could reserve for a PyTorch memory trace.

    scripts/periodic_plan_bound.py TRACE.pickle[.gz] [--device N]

Reads a PyTorch memory snapshot (its device_traces) and prints, in MiB:

- the peak of live bytes (the sum of the sizes of the blocks allocated and
  not yet freed, at its highest);
- the height of an offline placement of every block of the trace: blocks
  taken by size, largest first, each put at the lowest offset where no block
  that is live at the same time lies (greedy by size);
- for a trace that repeats (a training loop): the period, in allocations,
  found by comparing the sequence of allocation sizes with itself shifted,
  and the height of a placement that repeats every period: the blocks live
  through a whole period where they are, below, and the blocks allocated in
  one period placed greedily by size with their lifetimes taken modulo the
  period, so the same placement serves the next period and the next.

- for a trace with a CUDA graph capture (`cca_meta["pool_events"]`): the graph
  pool floor, the least any allocator can reserve at its peak while the graph's
  memory stays where the capture put it (a graph replays into the addresses it
  captured): from the capture's end to the graph's deletion its private pool
  holds at least the capture's peak of live bytes, beside the other live blocks.

A placement that repeats needs no map and no unmap once it is made, and its
height over the peak of live bytes is what it reserves beyond the physical
limit. The placement is computed from the whole trace (it knows every block's
lifetime); an allocator would have to learn it from the periods it has seen.
Frees are taken at free_completed (free_requested where a trace has none).
"""
import argparse
import gzip
import itertools
import pickle
import sys


def load_events(path, device):
    """The trace's allocations and frees, each with its index among all the trace's events
    (as `cca_meta["pool_events"]` counts them), and the program's pool operations."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            snap = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        sys.exit("%s: cannot read a snapshot: %s" % (path, e))
    if not isinstance(snap, dict):
        sys.exit("%s: not a PyTorch memory snapshot (no dict at its root)" % path)
    traces = snap.get("device_traces") or []
    if device >= len(traces):
        sys.exit("%s: no trace for device %d" % (path, device))
    ev = traces[device]
    completed = any(e["action"] == "free_completed" for e in ev)
    free_action = "free_completed" if completed else "free_requested"
    kept = [(i, e) for i, e in enumerate(ev) if e["action"] in ("alloc", free_action)]
    pool_ops = (snap.get("cca_meta") or {}).get("pool_events") or []
    return [e for _, e in kept], [i for i, _ in kept], pool_ops


def graph_pool_floor(events, index, pool_ops):
    """The least any allocator can reserve at its peak while it leaves a CUDA graph's memory
    where the capture put it (a graph replays into the addresses it captured): from a
    graph_capture to its graph_delete, the graph's private pool holds at least the peak of
    live bytes of the blocks allocated on the capture stream during the capture (its
    kernels write each of them at every replay), beside the other blocks live at each
    moment. The highest such sum over the trace, or None for a trace with no capture."""
    captures = []  # [stream, begin, end, delete]
    for op in pool_ops:
        if op.get("op") == "graph_capture":
            captures.append([op.get("stream"), op["at"], None, None, tuple(op.get("pool", ()))])
        elif op.get("op") in ("graph_capture_end", "graph_delete"):
            for c in captures:
                if c[4] == tuple(op.get("pool", ())):
                    if op["op"] == "graph_capture_end" and c[2] is None:
                        c[2] = op["at"]
                    elif op["op"] == "graph_delete" and c[3] is None:
                        c[3] = op["at"]
    if not captures:
        return None
    live = {}
    owner = {}  # addr -> capture number, for blocks allocated in a capture
    pool_live = [0] * len(captures)
    pool_peak = [0] * len(captures)
    total = best = 0
    for e, i in zip(events, index):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            for k, (stream, begin, end, _, _) in enumerate(captures):
                if begin <= i and (end is None or i < end) and e["stream"] == stream:
                    owner[e["addr"]] = k
                    pool_live[k] += e["size"]
                    pool_peak[k] = max(pool_peak[k], pool_live[k])
                    break
        else:
            size = live.pop(e["addr"], 0)
            total -= size
            k = owner.pop(e["addr"], None)
            if k is not None:
                pool_live[k] -= size
        need = total
        for k, (_, begin, end, delete, _) in enumerate(captures):
            if end is not None and end <= i and (delete is None or i < delete):
                need += pool_peak[k] - pool_live[k]  # its capture's peak, kept mapped
        best = max(best, need)
    return best


def blocks_of(events):
    """Blocks as (size, alloc time, free time, allocation ordinal), time the index
    among the events; the allocations' sizes and times by ordinal; the live peak."""
    live = {}
    blocks = []
    sizes = []
    times = []
    cur = peak = 0
    for t, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], t, len(sizes))
            sizes.append(e["size"])
            times.append(t)
            cur += e["size"]
            peak = max(peak, cur)
        elif e["addr"] in live:
            size, ta, k = live.pop(e["addr"])
            cur -= size
            blocks.append((size, ta, t, k))
    end = len(events)
    for size, ta, k in live.values():
        blocks.append((size, ta, end, k))
    return blocks, sizes, times, peak


def place(items, overlaps, shifts=(0,)):
    """Greedy by size: items (size, start, length); returns the height. Two items overlap
    where overlaps(start, length, start, length) holds, which it may only where their
    spans [start, start + length) meet with the second one moved by one of the shifts.

    The items placed are indexed by time: a tree over the time line holds each of them
    at the nodes that cover its span (those containing a time are found from its leaf
    up), and buckets hold them by their start. The items a span meets are those that
    contain its start and those that start after it, before its end; a shifted copy of
    the span is looked up for each shift, and overlaps decides among what is found."""
    placed = []
    height = 0
    if not items:
        return height
    first = min(a for _, a, _ in items)
    last = max(max(a, a + n) for _, a, n in items)
    size_t = 1
    while size_t < last - first:
        size_t *= 2
    tree = [None] * (2 * size_t)  # node -> the items placed whose span it covers
    width = 16
    starts = [[] for _ in range((last - first) // width + 1)]  # by start, width at a time
    for size, a, n in sorted(items, key=lambda x: (-x[0], x[1])):
        found = []
        for shift in shifts:
            q = a - shift - first  # the span shifted, on the index's time line
            if 0 <= q < size_t:
                node = q + size_t
                while node:
                    if tree[node]:
                        found.extend(tree[node])
                    node >>= 1
            after, before = max(q + 1, 0), min(q + n, last - first + 1)  # starts in (q, q + n)
            if after < before:
                for bucket in starts[after // width:(before - 1) // width + 1]:
                    found.extend(k for k in bucket if after <= placed[k][2] - first < before)
        if len(shifts) > 1:
            found = set(found)
        taken = sorted((off, off + s) for off, s, b, m in map(placed.__getitem__, found)
                       if overlaps(a, n, b, m))
        off = 0
        for lo, hi in taken:
            if off + size <= lo:
                break
            off = max(off, hi)
        k = len(placed)
        placed.append((off, size, a, n))
        height = max(height, off + size)
        lo, hi = a - first + size_t, min(a - first + n, size_t) + size_t
        while lo < hi:
            if lo & 1:
                if tree[lo] is None:
                    tree[lo] = []
                tree[lo].append(k)
                lo += 1
            if hi & 1:
                hi -= 1
                if tree[hi] is None:
                    tree[hi] = []
                tree[hi].append(k)
            lo >>= 1
            hi >>= 1
        starts[(a - first) // width].append(k)
    return height


def find_period(sizes):
    """(shift, share alike): the shift at which the last two thirds of the sizes repeat
    best (the shortest of equals), 90% alike or more; None if none is.

    The sizes are compared many at a time: numbered by value, their numbers' bytes
    laid out as big integers, XORed, and the zero bytes counted. A shift is given up
    once it has more unlike sizes than would let it be chosen."""
    n = len(sizes)
    lo = n // 3
    best = None
    numbers = {}
    numbered = [numbers.setdefault(s, len(numbers)) for s in sizes]
    planes = [bytes((c >> (8 * k)) & 255 for c in numbered)
              for k in range(max(1, ((len(numbers) - 1).bit_length() + 7) // 8))]

    def alike(p, i, j):
        """How many of the sizes i to j are those p further."""
        x = 0
        for plane in planes:
            x |= (int.from_bytes(plane[i:j], "little")
                  ^ int.from_bytes(plane[i + p:j + p], "little"))
        return x.to_bytes(j - i, "little").count(0)

    for p in range(2, n // 2):
        span = n - p - lo
        if span < 8:
            break
        least = 0.9 if best is None else max(0.9, best[1] + 1e-9)
        need = max(int(least * span) - 2, 0)  # the fewest alike sizes that can be chosen
        while need <= span and not (need / span >= 0.9 and
                                    (best is None or need / span > best[1] + 1e-9)):
            need += 1
        if need > span:
            continue
        unlike = 0
        i = lo
        while i < n - p and unlike <= span - need:
            j = min(n - p, i + max(span - need - unlike + 1, 4096))
            unlike += (j - i) - alike(p, i, j)
            i = j
        if unlike > span - need:
            continue
        same = span - unlike
        score = same / span
        if score >= 0.9 and (best is None or score > best[1] + 1e-9):
            best = (p, score)
            if score == 1.0:
                break
    return best


def repeating_window(blocks, times, p):
    """A window of w = p allocations, or 2, 3 or 4 times p where a block outlives a
    shorter one, starting at the allocation, in the periods before the last, at which
    the fewest bytes are live: (w, its first and end times, its blocks as (size, start
    in the window, lifetime)); None if the trace holds no such window."""
    change = [0] * (max((f for _, _, f, _ in blocks), default=0) + 2)
    for s, a, f, _ in blocks:
        if a < f:
            change[a + 1] += s
            change[f + 1] -= s
    live = list(itertools.accumulate(change))  # at t: the sizes of the blocks with a < t <= f
    for mult in (1, 2, 3, 4):
        w = mult * p
        first = len(times) - w - p
        if first < 0:
            return None
        k0 = min(range(first, first + p), key=lambda k: (live[times[k]], k))
        t0, t1 = times[k0], times[k0 + w]
        period = [(s, a - t0, f - a) for s, a, f, k in blocks if k0 <= k < k0 + w]
        if max(n for _, _, n in period) < t1 - t0:
            return w, t0, t1, period
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    events, index, pool_ops = load_events(args.trace, args.device)
    blocks, sizes, times, peak = blocks_of(events)
    mib = 1024.0 * 1024.0
    print("trace                 %s" % args.trace)
    print("allocations           %d" % len(sizes))
    print("peak live             %.1f MiB" % (peak / mib))
    if not peak:
        return
    floor = graph_pool_floor(events, index, pool_ops)
    if floor is not None:
        print("graph pool floor      %.1f MiB  (%.4f of the peak)" % (floor / mib, floor / peak))
    whole = place([(s, a, f - a) for s, a, f, _ in blocks],
                  lambda a, n, b, m: a < b + m and b < a + n)
    print("offline placement     %.1f MiB  (%.4f of the peak)" % (whole / mib, whole / peak))
    found = find_period(sizes)
    if not found:
        print("period                none found (no repeating sequence of allocations)")
        return
    p, score = found
    window = repeating_window(blocks, times, p)
    if not window:
        print("period                %d allocations (%.0f%% alike); blocks outlive every window "
              "the trace holds: no repeating placement" % (p, 100 * score))
        return
    w, t0, t1, period = window
    span = t1 - t0
    through = [s for s, a, f, _ in blocks if a < t0 and f >= t1]
    base = sum(through)

    def overlaps_mod(a, n, b, m):
        return any(a < b + s + m and b + s < a + n for s in (-span, 0, span))

    height = place(period, overlaps_mod, (-span, 0, span))
    print("period                %d allocations (%.0f%% alike); placement repeated every %d, "
          "%d blocks (%.1f MiB) live through it" % (p, 100 * score, w, len(through), base / mib))
    print("repeating placement   %.1f MiB  (%.4f of the peak)" % ((base + height) / mib,
                                                                 (base + height) / peak))
    if base + height < peak:
        print("                      (under the peak live: the trace's peak is outside the "
              "repeating window; this bounds the loop, not the trace)")


if __name__ == "__main__":
    main()
