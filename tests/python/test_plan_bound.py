"""scripts/periodic_plan_bound.py on small traces whose answers are known.

Run by ctest (python_package, with the package's tests); by hand:
  python3 -m unittest discover -s tests/python -p 'test_plan_bound.py'
"""
import gzip
import os
import pickle
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "periodic_plan_bound.py")
MiB = 1 << 20


def snapshot(events):
    return {"segments": [], "device_traces": [events]}


def ev(action, addr, size):
    return {"action": action, "addr": addr, "size": size, "stream": 0}


def loop(periods):
    """Per period: a 4 MiB block, a 2 MiB block that outlives it, a 3 MiB block,
    a 1 MiB one. Live bytes: 4, 6, 2, 5, 3, 4, 1, 0 MiB."""
    out = []
    for p in range(periods):
        a = (p + 1) << 32
        out += [ev("alloc", a, 4 * MiB), ev("alloc", a + 1, 2 * MiB),
                ev("free_completed", a, 4 * MiB), ev("alloc", a + 2, 3 * MiB),
                ev("free_completed", a + 1, 2 * MiB), ev("alloc", a + 3, 1 * MiB),
                ev("free_completed", a + 2, 3 * MiB), ev("free_completed", a + 3, 1 * MiB)]
    return out


def run(snap, gz=True):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.pickle" + (".gz" if gz else ""))
        with (gzip.open if gz else open)(path, "wb") as f:
            pickle.dump(snap, f)
        out = subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True,
                             check=True).stdout
    return {line[:22].strip(): line[22:].strip() for line in out.splitlines()}


class PlanBound(unittest.TestCase):
    def test_a_repeating_loop_is_placed_at_its_live_peak(self):
        r = run(snapshot(loop(6)))
        self.assertEqual(r["allocations"], "24")
        self.assertEqual(r["peak live"], "6.0 MiB")
        self.assertTrue(r["offline placement"].startswith("6.0 MiB"), r)
        self.assertTrue(r["period"].startswith("4 allocations (100% alike)"), r)
        self.assertTrue(r["repeating placement"].startswith("6.0 MiB  (1.0000"), r)

    def test_a_block_that_outlives_its_period_doubles_the_window(self):
        # a 1 MiB block allocated first in each period is freed only after the next
        # period's first allocation: the placement repeats every two periods. Live:
        # 2 MiB, 1, then 5 with the period's 4 MiB block. Greedy by size puts the 4 MiB
        # blocks at 0 and the 1 MiB ones at 4 and 5 in turn (6 MiB); 5 would need
        # them at 0 and 4 in turn, the 4 MiB block moving with them.
        events = []
        prev = None
        for p in range(8):
            a = (p + 1) << 32
            events.append(ev("alloc", a + 9, 1 * MiB))
            if prev is not None:
                events.append(ev("free_completed", prev, 1 * MiB))
            prev = a + 9
            events += [ev("alloc", a, 4 * MiB), ev("free_completed", a, 4 * MiB)]
        r = run(snapshot(events), gz=False)
        self.assertEqual(r["peak live"], "5.0 MiB")
        self.assertTrue(r["period"].startswith("2 allocations (100% alike); placement repeated "
                                               "every 4,"), r)
        self.assertEqual(r["repeating placement"], "6.0 MiB  (1.2000 of the peak)")

    def test_no_period_in_a_trace_that_does_not_repeat(self):
        events = []
        for k in range(40):
            events.append(ev("alloc", k, (k * 7919 % 97 + 1) * MiB))
            if k % 3 == 2:
                events.append(ev("free_completed", k - 1, ((k - 1) * 7919 % 97 + 1) * MiB))
        r = run(snapshot(events))
        self.assertEqual(r["period"], "none found (no repeating sequence of allocations)")

    def test_a_graphs_pool_keeps_its_captures_peak(self):
        # A (10 MiB) lives throughout; a capture on stream 7 allocates P1 (8) and P2 (4)
        # and frees P1: the graph's pool peaks at 12 MiB. After the capture B (20 MiB)
        # comes and goes while P2 lives: 34 MiB live, but the pool keeps its 12: 42. Once
        # the graph is deleted C (30 MiB): 40 MiB live, the trace's peak.
        def on(stream, e):
            e["stream"] = stream
            return e
        events = [ev("alloc", 1, 10 * MiB),
                  on(7, ev("alloc", 2, 8 * MiB)), on(7, ev("alloc", 3, 4 * MiB)),
                  on(7, ev("free_completed", 2, 8 * MiB)),
                  ev("alloc", 4, 20 * MiB), ev("free_completed", 4, 20 * MiB),
                  on(7, ev("free_completed", 3, 4 * MiB)),
                  ev("alloc", 5, 30 * MiB), ev("free_completed", 5, 30 * MiB),
                  ev("free_completed", 1, 10 * MiB)]
        snap = snapshot(events)
        snap["cca_meta"] = {"pool_events": [
            {"at": 1, "op": "graph_capture", "pool": [1, 0], "stream": 7},
            {"at": 4, "op": "graph_capture_end", "pool": [1, 0]},
            {"at": 7, "op": "graph_delete", "pool": [1, 0]}]}
        r = run(snap)
        self.assertEqual(r["peak live"], "40.0 MiB")
        self.assertEqual(r["graph pool floor"], "42.0 MiB  (1.0500 of the peak)")
        # without the capture noted, no floor line
        self.assertNotIn("graph pool floor", run(snapshot(events)))

    def test_the_bundled_graph_trace_cannot_go_below_1092(self):
        path = os.path.join(ROOT, "tests", "data", "traces", "graph_mlp_default.pickle.gz")
        out = subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True,
                             check=True).stdout
        r = {line[:22].strip(): line[22:].strip() for line in out.splitlines()}
        self.assertEqual(r["graph pool floor"], "497.1 MiB  (1.0924 of the peak)")

    def test_a_file_that_is_not_a_snapshot_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            for name, data in (("list.pickle", pickle.dumps([1, 2])), ("junk.pickle", b"junk")):
                path = os.path.join(d, name)
                with open(path, "wb") as f:
                    f.write(data)
                r = subprocess.run([sys.executable, SCRIPT, path], capture_output=True, text=True)
                self.assertEqual(r.returncode, 1)
                self.assertIn(path, r.stderr)
                self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main()
