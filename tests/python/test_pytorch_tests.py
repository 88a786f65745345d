"""scripts/pytorch_tests.py's decisions, without torch or a GPU: which tests are re-run alone
(pass natively, not with cca), how a re-run replaces the first results, the failure report
printed for a regression, and the sharding of a run over several pytest processes."""
import importlib.util
import os
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pt = _load("pytorch_tests", os.path.join(ROOT, "scripts", "pytorch_tests.py"))
compat = _load("cca_pytorch_compat", os.path.join(ROOT, "tests", "cuda", "pytorch_compat", "cca_pytorch_compat.py"))

LOG = """\
test_cuda.py::TestCuda::test_a PASSED                                    [ 10%]
test_cuda.py::TestCuda::test_b FAILED                                    [ 20%]
test_cuda.py::TestCudaMallocAsync::test_c ERROR                          [ 30%]

==================================== ERRORS ====================================
_________________ ERROR at setup of TestCudaMallocAsync.test_c _________________
setup went wrong
=================================== FAILURES ===================================
_______________________________ TestCuda.test_b ________________________________
BODY
E   AssertionError: 0.0 != 1.0
test_cuda.py:4760: AssertionError
_______________________________ TestCuda.test_z ________________________________
another failure
=========================== short test summary info ============================
PASSED test_cuda.py::TestCuda::test_a
FAILED test_cuda.py::TestCuda::test_b - AssertionError: 0.0 != 1.0
ERROR test_cuda.py::TestCudaMallocAsync::test_c - setup went wrong
""".replace("BODY", "\n".join("    line %d" % i for i in range(60)))


class PytorchTests(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.log = os.path.join(self.tmp.name, "run.log")
        with open(self.log, "w") as f:
            f.write(LOG)

    def test_results_read_from_a_log(self):
        self.assertEqual(pt.read_results(self.log), {"TestCuda::test_a": "PASSED", "TestCuda::test_b": "FAILED",
                                                     "TestCudaMallocAsync::test_c": "ERROR"})

    def test_differing(self):
        results = {"native": {"T::a": "PASSED", "T::b": "PASSED", "T::c": "FAILED", "T::d": "PASSED"},
                   "cca": {"T::a": "PASSED", "T::b": "FAILED", "T::c": "FAILED"}}
        self.assertEqual(pt.differing(results, "native", "cca"), (["T::b"], ["T::d"]))
        self.assertEqual(pt.differing(results, "native-expandable", "cca-expandable"), ([], []))

    def test_failure_report_is_the_end_of_the_tests_section(self):
        text = pt.failure_text([self.log], "TestCuda::test_b").splitlines()
        self.assertEqual(len(text), pt.FAILURE_LINES + 1)  # the section's end and the summary line
        self.assertEqual(text[-3:-1], ["E   AssertionError: 0.0 != 1.0", "test_cuda.py:4760: AssertionError"])
        self.assertNotIn("another failure", text)  # the next test's section is not part of it
        self.assertEqual(text[-1], "FAILED test_cuda.py::TestCuda::test_b - AssertionError: 0.0 != 1.0")
        self.assertNotIn("    line 0", text)  # only the last lines
        error = pt.failure_text([self.log], "TestCudaMallocAsync::test_c")
        self.assertIn("setup went wrong", error)
        self.assertIsNone(pt.failure_text([self.log], "TestCuda::test_missing"))

    def test_failure_report_from_the_first_log_that_has_it(self):
        other = os.path.join(self.tmp.name, "rerun.log")
        with open(other, "w") as f:
            f.write("test_cuda.py::TestCuda::test_b FAILED\n"
                    "_______ TestCuda.test_b _______\nE   from the re-run\n"
                    "=========== short test summary info ===========\n")
        self.assertIn("from the re-run", pt.failure_text([other, self.log], "TestCuda::test_b"))
        self.assertIn("0.0 != 1.0", pt.failure_text([os.path.join(self.tmp.name, "absent"), self.log],
                                                     "TestCuda::test_b"))

    def test_rerun_replaces_results_it_reached(self):
        """A re-run's result replaces the first one and is marked; a test the re-run did not
        reach keeps its first result, unmarked."""
        runs = [("native", False, False), ("cca", True, False)]
        results = {"native": {"TestCuda::test_b": "PASSED", "TestCuda::test_q": "PASSED"},
                   "cca": {"TestCuda::test_b": "FAILED", "TestCuda::test_q": "FAILED"}}
        logs = {"native": [], "cca": []}
        started = []

        def fake_start(cmd, env, test_file, log):
            started.append((cmd, env.get("CCA_TORCH_INSTALL")))
            with open(log, "w") as f:
                f.write("test_cuda.py::TestCuda::test_b %s\n" % ("PASSED" if "CCA_TORCH_INSTALL" not in env
                                                                  else "FAILED"))

            class Done:
                returncode = 0
                pid = -1

                def poll(self):
                    return 0
            return Done()
        saved = pt.start
        pt.start = fake_start
        try:
            again = pt.rerun(runs, results, logs, os.path.join(self.tmp.name, "test_cuda.py"), "/lib.so",
                             pt.time.time() + 60, self.tmp.name, False)
        finally:
            pt.start = saved
        self.assertEqual([c[1] for c in started], [None, "1"])  # natively, then with cca
        self.assertEqual(started[0][0][3:5], ["test_cuda.py::TestCuda::test_b", "test_cuda.py::TestCuda::test_q"])
        self.assertEqual(again, {("native", "TestCuda::test_b"), ("cca", "TestCuda::test_b")})
        self.assertEqual(results["cca"], {"TestCuda::test_b": "FAILED", "TestCuda::test_q": "FAILED"})
        self.assertTrue(logs["cca"][0].endswith("pytorch-tests-rerun-cca.log"))

    def test_shards(self):
        items = list(range(10))
        parts = [compat.shard_of(items, "%d/3" % k)[0] for k in range(3)]
        self.assertEqual(sorted(sum(parts, [])), items)  # every test in exactly one shard
        self.assertEqual(parts[1], [1, 4, 7])
        self.assertEqual(compat.shard_of(items, "0/1"), (items, []))
        for bad in ("3/3", "-1/2", "0/0"):
            with self.assertRaises(ValueError):
                compat.shard_of(items, bad)


if __name__ == "__main__":
    sys.exit(unittest.main())
