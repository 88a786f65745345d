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
