"""Arguments the package hands to C: integers out of their C type's range and strings
holding a NUL are refused with ValueError before anything reaches libcca (ctypes would
wrap the integers, 2**40 as a C int being 0, and cut the strings at the NUL).

Run by ctest (python_package) with the other tests of tests/python.
"""
import os
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("CCA_BACKEND", "sim")

import cca  # noqa: E402
from cca import _lib  # noqa: E402

TWO_STREAM = os.path.join(ROOT, "tests", "data", "traces", "two_stream_pipeline_default.pickle.gz")


class Arguments(unittest.TestCase):
    def setUp(self):
        self.lib = _lib.load()
        self.was_initialized = cca.is_initialized()

    def tearDown(self):
        # a refused call reaches nothing, so it initialises nothing either
        self.assertEqual(cca.is_initialized(), self.was_initialized)

    def test_integers_out_of_range(self):
        for kwargs in ({"device": 2 ** 40}, {"device": 2 ** 31}, {"device": -2 ** 31 - 1},
                       {"cap": -1}, {"cap": 2 ** 64}, {"total_memory": -1},
                       {"total_memory": 2 ** 64 + 1}):
            with self.subTest(**kwargs):
                with self.assertRaises(ValueError) as cm:
                    cca.replay(TWO_STREAM, **kwargs)
                name = next(iter(kwargs))
                self.assertIn("replay: %s=" % name, str(cm.exception))
        for bad in (2 ** 64, -1):
            with self.assertRaises(ValueError):
                cca.record_history(max_entries=bad)
        for fn in (cca.memory_stats, cca.device_stats, cca.memory_summary,
                   cca.reset_peak_stats, cca.reset_accumulated_stats):
            with self.subTest(fn=fn.__name__):
                with self.assertRaises(ValueError) as cm:
                    fn(2 ** 32)  # device 0 once wrapped
                self.assertIn(fn.__name__, str(cm.exception))

    def test_wrong_types(self):
        with self.assertRaises(TypeError):
            cca.replay(TWO_STREAM, cap="1")
        with self.assertRaises(TypeError):
            cca.record_history(max_entries=1.5)
        with self.assertRaises(TypeError):
            cca.settings(12)

    def test_strings_with_a_nul(self):
        with self.assertRaises(ValueError) as cm:
            cca.settings("max_split_size_mb:64\0,roundup_power2_divisions:3")
        self.assertIn("NUL", str(cm.exception))
        with self.assertRaises(ValueError):
            cca.replay(TWO_STREAM + "\0.txt")
        with self.assertRaises(ValueError):
            cca.replay(TWO_STREAM, settings="max_split_size_mb:64\0garbage")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out")
            with self.assertRaises(ValueError):
                cca.replay(TWO_STREAM, snapshot=out + "\0.pickle")
            with self.assertRaises(ValueError):
                cca.replay(TWO_STREAM, svg=out + "\0.svg")
            with self.assertRaises(ValueError):
                cca.snapshot_to_svg(TWO_STREAM, out + "\0.svg")
            with self.assertRaises(ValueError):
                cca.dump_snapshot(out + "\0.pickle")
            self.assertEqual(os.listdir(tmp), [])  # nothing written under a cut name
        with self.assertRaises(ValueError):
            cca.snapshot_to_json(TWO_STREAM + "\0")
        with self.assertRaises(ValueError):
            cca.snapshot_to_json(os.fsencode(TWO_STREAM) + b"\0")

    def test_values_in_range_pass_through(self):
        self.assertEqual(_lib.size_arg("f", "n", _lib.SIZE_MAX), _lib.SIZE_MAX)
        self.assertEqual(_lib.size_arg("f", "n", 0), 0)
        self.assertEqual(_lib.size_arg("f", "n", 4.0), 4)
        self.assertEqual(_lib.device_arg("f", _lib.INT_MIN), _lib.INT_MIN)
        self.assertEqual(_lib.device_arg("f", _lib.INT_MAX), _lib.INT_MAX)
        self.assertEqual(_lib.text_arg("f", "s", None), None)
        self.assertEqual(_lib.text_arg("f", "s", "a:b"), b"a:b")
        self.assertEqual(_lib.path_arg("f", "p", "x/y"), b"x/y")
        self.assertEqual(cca.settings("max_split_size_mb:64")["max_split_size_mb"][0], "64")


if __name__ == "__main__":
    unittest.main()
