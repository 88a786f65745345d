#!/usr/bin/env python3
"""PyTorch's own test/test_cuda.py, restricted to the memory, allocator, graph, pool, snapshot
and pinned-memory tests, four ways: natively and with cca installed, each without and with
expandable segments. Prints one table (test, native, cca, native+expandable, cca+expandable)
and the tests that pass natively and fail with cca; exits 1 if there are any.

The test file is upstream code, kept out of the repository: put test/test_cuda.py of
pytorch/pytorch (a revision near the installed torch) at .pytorch-tests/test_cuda.py (or
.pytorch-tests/test/test_cuda.py). cca is installed in each test process, and in the
processes the tests start, by tests/cuda/pytorch_site/sitecustomize.py (PYTHONPATH), before
the first CUDA call. Where the expecttest package is missing (test_cuda.py's
common_utils imports it), tests/cuda/pytorch_shim provides a minimal one.

Usage: scripts/pytorch_tests.py [LIBCCA_SO] [--budget SECONDS] [-k EXPRESSION]
       [--tests DIR] [--only native|cca|native-expandable|cca-expandable]...
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELECT = "memory or alloc or graph or pool or snapshot or pinned"
RUNS = (("native", False, False), ("cca", True, False), ("native-expandable", False, True),
        ("cca-expandable", True, True))
LINE = re.compile(r"^(\S+\.py::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
LINE_AFTER = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+\.py::\S+)")


def find_test_file(folder):
    for rel in ("test_cuda.py", os.path.join("test", "test_cuda.py")):
        path = os.path.join(folder, rel)
        if os.path.isfile(path):
            return path
    return None


def has_module(name):
    proc = subprocess.run([sys.executable, "-c", "import " + name], capture_output=True)
    return proc.returncode == 0


def run_one(name, use_cca, expandable, test_file, lib, select, limit, log_dir, shim):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCA_ALLOC_CONF", "CCA_TORCH_INSTALL"):
        env.pop(k, None)
    # pytorch_compat's plugin lets a test file slightly newer than the installed torch import
    paths = [os.path.join(ROOT, "python"), os.path.join(ROOT, "tests", "cuda", "pytorch_compat")]
    if shim:
        paths.append(os.path.join(ROOT, "tests", "cuda", "pytorch_shim"))
    env["CCA_PYTORCH_TEST_FILE"] = os.path.abspath(test_file)
    if use_cca:
        paths.insert(0, os.path.join(ROOT, "tests", "cuda", "pytorch_site"))
        env["CCA_TORCH_INSTALL"] = "1"
    env["CCA_LIBRARY"] = lib
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, "-m", "pytest", os.path.basename(test_file), "-k", select, "-v", "-rA",
           "-p", "no:cacheprovider", "-p", "cca_pytorch_compat", "--timeout=90", "--no-header", "-W", "ignore"]
    log = os.path.join(log_dir, "pytorch-tests-%s.log" % name)
    t0 = time.time()
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, cwd=os.path.dirname(test_file), env=env, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    results = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                results[m.group(1).split("::", 1)[1]] = m.group(2)
                continue
            m = LINE_AFTER.match(line)
            if m:
                results[m.group(2).split("::", 1)[1]] = m.group(1)
    print("%-18s %4d tests, %4d passed, rc %s, %.0f s (%s)" % (
        name, len(results), sum(v == "PASSED" for v in results.values()), rc, time.time() - t0, log))
    sys.stdout.flush()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib", nargs="?", default=os.path.join(ROOT, "build", "libcca.so"))
    ap.add_argument("--budget", type=float, default=360.0)
    ap.add_argument("-k", dest="select", default=SELECT)
    ap.add_argument("--tests", default=os.path.join(ROOT, ".pytorch-tests"))
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--logs", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-out"))
    a = ap.parse_args()
    test_file = find_test_file(a.tests)
    if not test_file:
        print("FAIL pytorch-tests: no test_cuda.py under %s (put pytorch/pytorch's test/test_cuda.py "
              "there: upstream code, kept out of the repository)" % a.tests)
        return 1
    if not has_module("torch") or not has_module("pytest"):
        print("SKIPPED: torch or pytest missing")
        return 77
    shim = not has_module("expecttest")
    if shim:
        print("expecttest is missing here: tests/cuda/pytorch_shim's minimal one is used")
    if not has_module("pytest_timeout"):
        print("FAIL pytorch-tests: pytest-timeout is missing (a hung test would take the whole budget)")
        return 1
    lib = os.path.abspath(a.lib)
    os.makedirs(a.logs, exist_ok=True)
    # the adapter built once, here, so that no test process compiles it
    env = dict(os.environ, CCA_LIBRARY=lib, PYTHONPATH=os.path.join(ROOT, "python"))
    build = subprocess.run([sys.executable, "-c", "import cca.torch; print(cca.torch.build_adapter())"],
                           env=env, capture_output=True, text=True)
    if build.returncode != 0:
        print("FAIL pytorch-tests: the adapter did not build:\n" + (build.stdout + build.stderr)[-3000:])
        return 1
    print("adapter:", build.stdout.strip())
    # a test process of the cca runs serves its tensors from cca (checked the way they start)
    probe = ("import torch, cca.torch; torch.zeros(1, device='cuda'); "
             "print(cca.torch.installed(), torch.cuda.memory_allocated() > 0)")
    env = dict(os.environ, CCA_LIBRARY=lib, CCA_TORCH_INSTALL="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "tests", "cuda", "pytorch_site"), os.path.join(ROOT, "python")]))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    probe_run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if probe_run.returncode != 0 or probe_run.stdout.split() != ["adapter", "True"]:
        print("FAIL pytorch-tests: cca is not installed in a test process:\n%s%s"
              % (probe_run.stdout, probe_run.stderr[-3000:]))
        return 1
    runs = [r for r in RUNS if not a.only or r[0] in a.only]
    results = {}
    deadline = time.time() + a.budget
    for i, (name, use_cca, expandable) in enumerate(runs):
        limit = max(30.0, (deadline - time.time()) / (len(runs) - i))
        results[name] = run_one(name, use_cca, expandable, test_file, lib, a.select, limit, a.logs, shim)
    tests = sorted(set().union(*[set(r) for r in results.values()]))
    names = [r[0] for r in runs]
    short = {"PASSED": "pass", "FAILED": "FAIL", "ERROR": "ERROR", "SKIPPED": "skip", "XFAIL": "xfail",
             "XPASS": "xpass"}
    width = max([len(t) for t in tests] + [4])
    print()
    print("| %-*s | %s |" % (width, "test", " | ".join("%-17s" % n for n in names)))
    print("|%s|%s|" % ("-" * (width + 2), "|".join("-" * 19 for _ in names)))
    for t in tests:
        print("| %-*s | %s |" % (width, t, " | ".join(
            "%-17s" % short.get(results[n].get(t), "not run") for n in names)))
    print("| %-*s | %s |" % (width, "passed", " | ".join(
        "%-17s" % sum(v == "PASSED" for v in results[n].values()) for n in names)))
    regressions = []
    for native, ours in (("native", "cca"), ("native-expandable", "cca-expandable")):
        if native in results and ours in results:
            for t in tests:
                if results[native].get(t) == "PASSED" and results[ours].get(t) != "PASSED":
                    regressions.append((ours, t, results[ours].get(t, "not run")))
    print()
    if regressions:
        print("Pass natively, fail with cca:")
        for mode, t, what in regressions:
            print("  %-15s %s (%s)" % (mode, t, what))
    else:
        print("No test passes natively and fails with cca (%s)." % ", ".join(names))
    print("%s pytorch-tests: %d pass natively and not with cca" % ("FAIL" if regressions else "PASS",
                                                                   len(regressions)))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
