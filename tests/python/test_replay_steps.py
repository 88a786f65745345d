"""The replay's last step: the trace's period and the backend calls of its last period.

The period is checked against scripts/periodic_plan_bound.py's own search (every shift
tried, in Python), and the maps of the last step against what PyTorch itself recorded
there: replayed with PyTorch's settings and addresses, cca maps exactly what PyTorch
mapped, so the segment events of the trace's last period are the expected count.

Run by ctest (python_package, with the package's tests); by hand:
  CCA_BACKEND=sim PYTHONPATH=python python3 -m unittest discover -s tests/python -p 'test_replay_steps.py'
"""
import gzip
import importlib.util
import os
import pickle
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("CCA_BACKEND", "sim")

import cca  # noqa: E402

TRACES = os.path.join(ROOT, "tests", "data", "traces")
MiB = 1 << 20


def plan_bound():
    spec = importlib.util.spec_from_file_location(
        "periodic_plan_bound", os.path.join(ROOT, "scripts", "periodic_plan_bound.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trace_events(path):
    with gzip.open(path, "rb") as f:
        return pickle.load(f)["device_traces"][0]


def expected_last_step(events, find_period):
    """(period, backend allocations, backend frees) of the last period, from the trace."""
    sizes = [e["size"] for e in events if e["action"] == "alloc"]
    found = find_period(sizes)
    if not found:
        return 0, 0, 0
    p = found[0]
    starts = [i for i, e in enumerate(events) if e["action"] == "alloc"]
    tail = events[starts[len(sizes) - p]:]
    maps = sum(e["action"] in ("segment_alloc", "segment_map") for e in tail)
    unmaps = sum(e["action"] in ("segment_free", "segment_unmap") for e in tail)
    return p, maps, unmaps


class LastStep(unittest.TestCase):
    def test_period_and_maps_as_pytorch_recorded_them(self):
        find_period = plan_bound().find_period
        for name in ("gpt2_train_default", "gpt2_train_expandable", "resnet50_train_default",
                     "resnet50_train_expandable", "gpt2_train_gc07", "two_stream_pipeline_default",
                     "mempool_default"):
            path = os.path.join(TRACES, name + ".pickle.gz")
            p, maps, unmaps = expected_last_step(trace_events(path), find_period)
            r = cca.replay(path)
            self.assertEqual(r["address_mismatches"], 0, name)
            self.assertEqual(r["step_allocations"], p, name)
            if p:
                self.assertEqual((r["last_step_segment_allocs"], r["last_step_segment_frees"]),
                                 (maps, unmaps), name)
        # the training traces repeat (the periods the script finds: one step each)
        self.assertGreater(cca.replay(os.path.join(TRACES, "gpt2_train_default.pickle.gz"))
                           ["step_allocations"], 0)

    def test_a_loop_that_grows_in_its_last_step(self):
        """A synthetic loop: each step allocates and frees the same blocks; in the last
        step one block is larger than ever before, so that step, and only it, maps."""
        steps = 12
        events = []
        for s in range(steps):
            a = (s + 1) << 32
            big = (64 if s == steps - 1 else 8) * MiB
            sizes = [4 * MiB, 2 * MiB, 6 * MiB, big, 1 * MiB]
            for k, size in enumerate(sizes):
                events.append({"action": "alloc", "addr": a + (k << 24), "size": size, "stream": 0})
            for k, size in enumerate(sizes):
                for action in ("free_requested", "free_completed"):
                    events.append({"action": action, "addr": a + (k << 24), "size": size, "stream": 0})
        snap = {"segments": [], "device_traces": [events]}
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "loop.pickle")
            with open(path, "wb") as f:
                pickle.dump(snap, f)
            for settings in ("", "expandable_segments:True"):
                r = cca.replay(path, settings=settings)
                self.assertEqual(r["step_allocations"], 5, settings)
                self.assertGreaterEqual(r["last_step_segment_allocs"], 1, settings)
                self.assertEqual(r["last_step_segment_allocs"], r["late_segment_allocs"], settings)
                # one step less: a steady loop, nothing mapped in its last step
                snap_steady = {"segments": [], "device_traces": [events[:-15]]}
                steady = os.path.join(d, "steady.pickle")
                with open(steady, "wb") as f:
                    pickle.dump(snap_steady, f)
                r = cca.replay(steady, settings=settings)
                self.assertEqual(r["step_allocations"], 5, settings)
                self.assertEqual((r["last_step_segment_allocs"], r["last_step_segment_frees"]), (0, 0),
                                 settings)

    def test_no_period(self):
        """Allocations that never repeat: no step, and no count for one."""
        events = [{"action": "alloc", "addr": k + 1, "size": (k + 1) * 512, "stream": 0}
                  for k in range(64)]
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "flat.pickle")
            with open(path, "wb") as f:
                pickle.dump({"segments": [], "device_traces": [events]}, f)
            r = cca.replay(path, settings="")
            self.assertEqual(r["step_allocations"], 0)
            self.assertEqual((r["last_step_segment_allocs"], r["last_step_segment_frees"]), (0, 0))


if __name__ == "__main__":
    unittest.main()
