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
        self.assertEqual(pt.read_results(self.log), {"test_cuda.py::TestCuda::test_a": "PASSED",
                                                     "test_cuda.py::TestCuda::test_b": "FAILED",
                                                     "test_cuda.py::TestCudaMallocAsync::test_c": "ERROR"})
        other = os.path.join(self.tmp.name, "two.log")
        with open(other, "w") as f:  # a second file's tests, under a folder, keep their file
            f.write(LOG + "profiler/test_memory_profiler.py::TestX::test_a PASSED   [ 50%]\n")
        found = pt.read_results(other)
        self.assertEqual(found["profiler/test_memory_profiler.py::TestX::test_a"], "PASSED")
        self.assertEqual(found["test_cuda.py::TestCuda::test_a"], "PASSED")

    def test_differing(self):
        results = {"native": {"T::a": "PASSED", "T::b": "PASSED", "T::c": "FAILED", "T::d": "PASSED"},
                   "cca": {"T::a": "PASSED", "T::b": "FAILED", "T::c": "FAILED"}}
        self.assertEqual(pt.differing(results, "native", "cca"), (["T::b"], ["T::d"]))
        self.assertEqual(pt.differing(results, "native-expandable", "cca-expandable"), ([], []))

    def test_failure_report_is_the_end_of_the_tests_section(self):
        text = pt.failure_text([self.log], "test_cuda.py::TestCuda::test_b").splitlines()
        self.assertEqual(len(text), pt.FAILURE_LINES + 1)  # the section's end and the summary line
        self.assertEqual(text[-3:-1], ["E   AssertionError: 0.0 != 1.0", "test_cuda.py:4760: AssertionError"])
        self.assertNotIn("another failure", text)  # the next test's section is not part of it
        self.assertEqual(text[-1], "FAILED test_cuda.py::TestCuda::test_b - AssertionError: 0.0 != 1.0")
        self.assertNotIn("    line 0", text)  # only the last lines
        error = pt.failure_text([self.log], "test_cuda.py::TestCudaMallocAsync::test_c")
        self.assertIn("setup went wrong", error)
        self.assertIsNone(pt.failure_text([self.log], "test_cuda.py::TestCuda::test_missing"))

    def test_failure_report_from_the_first_log_that_has_it(self):
        other = os.path.join(self.tmp.name, "rerun.log")
        with open(other, "w") as f:
            f.write("test_cuda.py::TestCuda::test_b FAILED\n"
                    "_______ TestCuda.test_b _______\nE   from the re-run\n"
                    "=========== short test summary info ===========\n")
        self.assertIn("from the re-run", pt.failure_text([other, self.log], "test_cuda.py::TestCuda::test_b"))
        self.assertIn("0.0 != 1.0", pt.failure_text([os.path.join(self.tmp.name, "absent"), self.log],
                                                     "test_cuda.py::TestCuda::test_b"))

    def test_rerun_replaces_results_it_reached(self):
        """A re-run's result replaces the first one and is marked; a test the re-run did not
        reach keeps its first result, unmarked. Tests of several files re-run in one process."""
        runs = [("native", False, False), ("cca", True, False)]
        b, q, t = "test_cuda.py::TestCuda::test_b", "test_cuda.py::TestCuda::test_q", "test_cuda_trace.py::T::test_t"
        results = {"native": {b: "PASSED", q: "PASSED", t: "PASSED"},
                   "cca": {b: "FAILED", q: "FAILED", t: "FAILED"}}
        logs = {"native": [], "cca": []}
        started = []

        def fake_start(cmds, env, folder, log):
            started.append((cmds, env.get("CCA_TORCH_INSTALL"), folder, env["CCA_PYTORCH_TEST_FILE"]))
            with open(log, "w") as f:
                f.write("%s %s\n" % (b, "PASSED" if "CCA_TORCH_INSTALL" not in env else "FAILED"))
                f.write("%s PASSED\n" % t)

            class Done:
                returncode = 0
                pid = -1

                def poll(self):
                    return 0
            return Done()
        saved = pt.start
        pt.start = fake_start
        suite = pt.Suite(self.tmp.name, [("test_cuda.py", "memory"), ("test_cuda_trace.py", None)],
                         [os.path.join(self.tmp.name, "test_cuda.py"), os.path.join(self.tmp.name, "test_cuda_trace.py")])
        try:
            again = pt.rerun(runs, results, logs, suite, "/lib.so", pt.time.time() + 60, self.tmp.name, False)
        finally:
            pt.start = saved
        self.assertEqual([c[1] for c in started], [None, "1"])  # natively, then with cca
        self.assertEqual(len(started[0][0]), 1)  # one process per side
        self.assertEqual(started[0][0][0][3:6], [b, q, t])
        self.assertEqual(started[0][2], self.tmp.name)
        self.assertEqual(started[0][3].split(os.pathsep), suite.paths)
        self.assertEqual(again, {("native", b), ("cca", b), ("native", t), ("cca", t)})
        self.assertEqual(results["cca"], {b: "FAILED", q: "FAILED", t: "PASSED"})
        self.assertTrue(logs["cca"][0].endswith("pytorch-tests-rerun-cca.log"))

    def test_files_and_commands(self):
        """test_cuda.py (and the file that runs its tests with expandable segments) take -k's
        expression unless given one; other files run all their tests; one pytest per file, in
        one shell when several."""
        self.assertEqual(pt.parse_file("test_cuda.py", "memory"), ("test_cuda.py", "memory"))
        self.assertEqual(pt.parse_file("test_cuda_expandable_segments.py", "pool"),
                         ("test_cuda_expandable_segments.py", "pool"))
        self.assertEqual(pt.parse_file("test_cuda.py:graph", "memory"), ("test_cuda.py", "graph"))
        self.assertEqual(pt.parse_file("test_cuda.py:", "memory"), ("test_cuda.py", None))
        self.assertEqual(pt.parse_file("profiler/test_memory_profiler.py", "memory"),
                         ("profiler/test_memory_profiler.py", None))
        cmds = pt.pytest_commands("/t", [("test_cuda.py", "memory"), ("inductor/x.py", None)])
        self.assertEqual([c[3:6] for c in cmds], [["test_cuda.py", "-k", "memory"], ["inductor/x.py", "-v", "-rA"]])
        self.assertIn("--rootdir", cmds[1])  # node ids keep their folder
        os.makedirs(os.path.join(self.tmp.name, "test", "profiler"))
        open(os.path.join(self.tmp.name, "test", "profiler", "p.py"), "w").close()
        self.assertEqual(pt.find_file(self.tmp.name, "profiler/p.py"),
                         os.path.join(self.tmp.name, "test", "profiler", "p.py"))
        self.assertIsNone(pt.find_file(self.tmp.name, "absent.py"))

    def test_each_process_has_its_own_extensions_folder(self):
        """Processes at once never share a folder for the tests' C++ extensions; logs are
        unbuffered, so a process stopped at its time limit shows how far it got."""
        envs = [pt.test_env(c, e, "/lib.so", ["/t/test_cuda.py"], False, s)
                for c in (False, True) for e in (False, True) for s in ("0/2", "1/2")]
        folders = [env["TORCH_EXTENSIONS_DIR"] for env in envs]
        self.assertEqual(len(set(folders)), len(folders))
        self.assertTrue(all(env["PYTHONUNBUFFERED"] == "1" for env in envs))
        self.assertTrue(all(env["CCA_PYTEST_HARD_EXIT"] == "1" for env in envs))
        self.assertEqual(envs[0]["CCA_PYTORCH_TEST_FILE"], "/t/test_cuda.py")

    def test_compat_fills_renamed_and_missing_names(self):
        """A name the installed helpers renamed is taken from its new name; a missing flag is
        False; the modules are stand-ins put where the test file imports from."""
        import types
        fake = types.ModuleType("torch.testing._internal.inductor_utils")
        fake.HAS_CUDA_AND_TRITON = True
        names = ["torch", "torch.testing", "torch.testing._internal", fake.__name__]
        saved = {n: sys.modules.get(n) for n in names}
        for n in names[:-1]:
            sys.modules[n] = types.ModuleType(n)
        sys.modules[fake.__name__] = fake
        path = os.path.join(self.tmp.name, "test_x.py")
        with open(path, "w") as f:
            f.write("from torch.testing._internal.inductor_utils import HAS_CUDA, HAS_CPU\n")
        try:
            filled = compat._fill(path)
        finally:
            for n, m in saved.items():
                if m is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = m
        self.assertEqual(sorted(filled), ["inductor_utils.HAS_CPU", "inductor_utils.HAS_CUDA"])
        self.assertIs(fake.HAS_CUDA, True)
        self.assertIs(fake.HAS_CPU, False)

    def test_hard_exit_ends_a_process_a_thread_holds(self):
        """With CCA_PYTEST_HARD_EXIT=1, pytest's end (unconfigure) ends the process with the
        session's exit status even while a non-daemon thread would keep it alive; without,
        the hook returns."""
        import subprocess
        script = ("import importlib.util, os, sys, threading\n"
                  "spec = importlib.util.spec_from_file_location('c', sys.argv[1])\n"
                  "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c)\n"
                  "stop = threading.Event()\n"
                  "threading.Thread(target=stop.wait).start()  # never set: holds the process\n"
                  "c.pytest_sessionfinish(None, 3)\n"
                  "c.pytest_unconfigure(None)\n"
                  "print('returned', flush=True)\n"
                  "stop.set()\n")
        path = os.path.join(ROOT, "tests", "cuda", "pytorch_compat", "cca_pytorch_compat.py")
        for hard in ("1", ""):
            env = dict(os.environ, CCA_PYTEST_HARD_EXIT=hard)
            proc = subprocess.run([sys.executable, "-c", script, path], env=env, capture_output=True,
                                  text=True, timeout=60)
            if hard:
                self.assertEqual((proc.returncode, proc.stdout), (3, ""))
            else:
                self.assertEqual((proc.returncode, proc.stdout), (0, "returned\n"))

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
