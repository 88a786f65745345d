#!/usr/bin/env python3
"""PyTorch's own tests four ways: natively and with cca installed, each without and with
expandable segments. By default test/test_cuda.py, restricted to its memory, allocator, graph,
pool, snapshot and pinned-memory tests; --file names other test files of the same revision
(each with its own -k expression, or all its tests). Prints one table (test, native, cca,
native+expandable, cca+expandable) and the tests that pass natively and fail with cca; exits 1
if there are any.

The test files are upstream code, kept out of the repository: put pytorch/pytorch's test/ files
(a revision near the installed torch) under .pytorch-tests/, at the same relative paths
(test_cuda.py, profiler/test_memory_profiler.py, inductor/test_cudagraph_trees.py...; a leading
test/ is also looked in). cca is installed in each test process, and in the processes the tests
start, by tests/cuda/pytorch_site/sitecustomize.py (PYTHONPATH), before the first CUDA call.
Where the expecttest package is missing (common_utils imports it), tests/cuda/pytorch_shim
provides a minimal one.

Two ways to run them. One after another (each run gets a quarter of the budget), when the
budget allows that (SEQUENTIAL_NEED seconds), or at once (--parallel, the default under that
budget): the four runs start together on the one GPU, each split into --shards processes
(cca_pytorch_compat's CCA_PYTEST_SHARD), each running pytest on the files one after another,
with its own log. A test that then passes natively and not with cca (either pair) may have
been disturbed by the concurrent runs (a memory-capacity test, a memory fraction): it is run
again alone, serially, natively and with cca (all such tests of a pair in one process per side,
nothing else running), and the table shows the result of that run, marked "*". For each
regression left, the end of its failure (pytest's report of it) is printed.

Usage: scripts/pytorch_tests.py [LIBCCA_SO] [--budget SECONDS] [-k EXPRESSION] [--parallel]
       [--shards N] [--tests DIR] [--file PATH[:EXPRESSION]]...
       [--only native|cca|native-expandable|cca-expandable]...
  -k applies to test_cuda.py (the default file); --file PATH:EXPR runs PATH's tests that EXPR
  selects (pytest -k), --file PATH all of PATH's tests; --file replaces the default file.
"""
import argparse
import collections
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELECT = "memory or alloc or graph or pool or snapshot or pinned"
RUNS = (("native", False, False), ("cca", True, False), ("native-expandable", False, True),
        ("cca-expandable", True, True))
PAIRS = (("native", "cca"), ("native-expandable", "cca-expandable"))
SEQUENTIAL_NEED = 1000.0  # four runs of the ~180 selected tests, ~250 s each, one after another
FAILURE_LINES = 40
EXTENSIONS = os.path.join(tempfile.gettempdir(), "cca-pytorch-tests-extensions")
LINE = re.compile(r"^(\S+\.py::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
LINE_AFTER = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+\.py::\S+)")


# the test files of a run: folder (pytest's rootdir and working directory), files
# [(path relative to folder, -k expression or None)], paths (absolute, for the compat plugin)
Suite = collections.namedtuple("Suite", "folder files paths")


def find_file(folder, rel):
    for path in (os.path.join(folder, rel), os.path.join(folder, "test", rel)):
        if os.path.isfile(path):
            return path
    return None


# files that run test_cuda.py's tests: without an expression of their own, -k's applies
TEST_CUDA = ("test_cuda.py", "test_cuda_expandable_segments.py")


def parse_file(spec, default_select):
    """"PATH[:EXPRESSION]" -> (PATH, EXPRESSION, or None for all of its tests); "PATH" alone is
    all of its tests, except for TEST_CUDA's files, which take -k's expression."""
    rel, colon, select = spec.partition(":")
    if not colon and os.path.basename(rel) in TEST_CUDA:
        select = default_select
    return rel, (select or None)


def has_module(name):
    proc = subprocess.run([sys.executable, "-c", "import " + name], capture_output=True)
    return proc.returncode == 0


def test_env(use_cca, expandable, lib, test_files, shim, shard=None):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCA_ALLOC_CONF", "CCA_TORCH_INSTALL",
              "CCA_PYTEST_SHARD"):
        env.pop(k, None)
    # pytorch_compat's plugin lets test files slightly newer than the installed torch import
    paths = [os.path.join(ROOT, "python"), os.path.join(ROOT, "tests", "cuda", "pytorch_compat")]
    if shim:
        paths.append(os.path.join(ROOT, "tests", "cuda", "pytorch_shim"))
    env["CCA_PYTORCH_TEST_FILE"] = os.pathsep.join(os.path.abspath(f) for f in test_files)
    if use_cca:
        paths.insert(0, os.path.join(ROOT, "tests", "cuda", "pytorch_site"))
        env["CCA_TORCH_INSTALL"] = "1"
    env["CCA_LIBRARY"] = lib
    env["PYTHONUNBUFFERED"] = "1"  # a log shows how far a process stopped at its time limit got
    env["CCA_PYTEST_HARD_EXIT"] = "1"  # no exit handler holds a process, and the next file, back
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if shard:
        env["CCA_PYTEST_SHARD"] = shard
    # each process builds the tests' C++ extensions (load_inline) in a folder of its own:
    # processes at once would race on one, and tests build different sources under one name
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(EXTENSIONS, "%s%s-%s" % (
        "cca" if use_cca else "native", "-expandable" if expandable else "", (shard or "all").replace("/", "of")))
    return env


def pytest_commands(folder, files=None, tests=None):
    """One pytest command per file on its selected tests (files: [(PATH, EXPRESSION or None)],
    PATH relative to folder), or one on the given tests (full node ids)."""
    common = ["-v", "-rA", "-p", "no:cacheprovider", "-p", "cca_pytorch_compat", "--timeout=90",
              "--no-header", "-W", "ignore", "--rootdir", folder]
    if tests:
        return [[sys.executable, "-m", "pytest"] + list(tests) + common]
    return [[sys.executable, "-m", "pytest", rel] + (["-k", select] if select else []) + common
            for rel, select in files]


def start(cmds, env, folder, log):
    """The commands, one after another, started in their own process group (stopped whole at
    the time limit), in folder."""
    out = open(log, "w")
    cmd = cmds[0] if len(cmds) == 1 else ["bash", "-c", " ; ".join(shlex.join(c) for c in cmds)]
    try:
        return subprocess.Popen(cmd, cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_all(procs, until):
    """Wait for every process until the time until; stop those still running then.
    Returns each one's exit status ("timeout" where stopped)."""
    while time.time() < until and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    rcs = []
    for p in procs:
        if p.poll() is None:
            stop(p)
            rcs.append("timeout")
        else:
            rcs.append(p.returncode)
    return rcs


def read_results(log):
    results = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                results[m.group(1)] = m.group(2)
                continue
            m = LINE_AFTER.match(line)
            if m:
                results[m.group(2)] = m.group(1)
    return results


def report_run(name, results, rcs, seconds, logs):
    print("%-18s %4d tests, %4d passed, rc %s, %.0f s (%s)" % (
        name, len(results), sum(v == "PASSED" for v in results.values()),
        "/".join(str(rc) for rc in rcs), seconds, ", ".join(logs)))
    sys.stdout.flush()


def run_sequential(runs, suite, lib, budget, log_dir, shim):
    """Each run after the other, a quarter of the budget each. Returns results and logs."""
    results, logs = {}, {}
    deadline = time.time() + budget
    for i, (name, use_cca, expandable) in enumerate(runs):
        limit = max(30.0, (deadline - time.time()) / (len(runs) - i))
        log = os.path.join(log_dir, "pytorch-tests-%s.log" % name)
        t0 = time.time()
        proc = start(pytest_commands(suite.folder, suite.files), test_env(use_cca, expandable, lib, suite.paths, shim),
                     suite.folder, log)
        rcs = wait_all([proc], t0 + limit)
        results[name], logs[name] = read_results(log), [log]
        report_run(name, results[name], rcs, time.time() - t0, logs[name])
    return results, logs


def run_parallel(runs, suite, lib, until, log_dir, shim, shards):
    """The runs at once, each in shards pytest processes, until the time until."""
    procs, where = [], []
    t0 = time.time()
    for name, use_cca, expandable in runs:
        for k in range(shards):
            log = os.path.join(log_dir, "pytorch-tests-%s%s.log" % (name, "-%d" % k if shards > 1 else ""))
            env = test_env(use_cca, expandable, lib, suite.paths, shim, "%d/%d" % (k, shards) if shards > 1 else None)
            procs.append(start(pytest_commands(suite.folder, suite.files), env, suite.folder, log))
            where.append((name, log))
    rcs = wait_all(procs, until)
    results, logs, codes = {}, {}, {}
    for (name, log), rc in zip(where, rcs):
        results.setdefault(name, {}).update(read_results(log))
        logs.setdefault(name, []).append(log)
        codes.setdefault(name, []).append(rc)
    for name, _, _ in runs:
        report_run(name, results[name], codes[name], time.time() - t0, logs[name])
    return results, logs


def differing(results, native, ours):
    """Tests that pass natively and not with cca: (run with a result, not run)."""
    ran, missing = [], []
    for t in sorted(results.get(native, {})):
        if results[native][t] == "PASSED" and results.get(ours, {}).get(t) != "PASSED":
            (ran if t in results.get(ours, {}) else missing).append(t)
    return ran, missing


def rerun(runs, results, logs, suite, lib, deadline, log_dir, shim):
    """Each pair's differing tests again, alone: natively, then with cca, one process each,
    nothing else running. Their results replace the parallel ones. Returns the re-run tests
    as {(run, test)}."""
    by_name = {r[0]: r for r in runs}
    jobs = []
    for native, ours in PAIRS:
        if native in by_name and ours in by_name:
            ran, missing = differing(results, native, ours)
            if ran or missing:
                jobs.append((native, ours, ran + missing))
    again = set()
    left = 2 * len(jobs)
    for native, ours, tests in jobs:
        print("re-run alone (%s, %s): %s" % (native, ours, " ".join(tests)))
        for name in (native, ours):
            _, use_cca, expandable = by_name[name]
            limit = max(20.0, (deadline - time.time()) / left)
            left -= 1
            log = os.path.join(log_dir, "pytorch-tests-rerun-%s.log" % name)
            t0 = time.time()
            proc = start(pytest_commands(suite.folder, tests=tests),
                         test_env(use_cca, expandable, lib, suite.paths, shim), suite.folder, log)
            rc = wait_all([proc], t0 + limit)
            found = read_results(log)
            print("  %-18s %d of %d re-run, %d passed, rc %s, %.0f s (%s)" % (
                name, len(found), len(tests), sum(v == "PASSED" for v in found.values()), rc[0],
                time.time() - t0, log))
            sys.stdout.flush()
            for t in tests:  # a test the re-run did not reach keeps its first result
                if t in found:
                    results[name][t] = found[t]
                    again.add((name, t))
            logs[name] = [log] + logs[name]  # failures are looked for here first
    return again


def failure_text(logs, test, lines=FAILURE_LINES):
    """The last lines of pytest's report of test's failure (its FAILURES/ERRORS section, with
    its short-summary line), from the first log that has one; else the lines the log has from
    the test's start; None when no log names it."""
    name = test.split("::")[-1]
    dotted = test.split("::", 1)[-1].replace("::", ".")
    header = re.compile(r"^_{3,} (?:ERROR at \w+ of )?(?:%s|%s) _{3,}\s*$" % (re.escape(dotted), re.escape(name)))
    any_header = re.compile(r"^(_{3,} .* _{3,}|={3,}.*={3,})\s*$")
    for log in logs:
        try:
            with open(log, errors="replace") as f:
                text = f.read().splitlines()
        except OSError:
            continue
        summary = [l for l in text if re.match(r"^(FAILED|ERROR) %s\b" % re.escape(test), l)]
        for i, line in enumerate(text):
            if header.match(line):
                j = i + 1
                while j < len(text) and not any_header.match(text[j]):
                    j += 1
                return "\n".join(text[i:j][-lines:] + summary)
        for i, line in enumerate(text):
            if line.startswith(test + " ") or line.rstrip().endswith(" " + test):
                return "\n".join(text[i:i + lines] + summary)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib", nargs="?", default=os.path.join(ROOT, "build", "libcca.so"))
    ap.add_argument("--budget", type=float, default=360.0)
    ap.add_argument("-k", dest="select", default=SELECT)
    ap.add_argument("--tests", default=os.path.join(ROOT, ".pytorch-tests"))
    ap.add_argument("--file", dest="files", action="append", default=[],
                    help="PATH[:EXPRESSION] under --tests (default: test_cuda.py with -k's expression)")
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--parallel", action="store_true",
                    help="the runs at once (default when the budget is under %d s)" % SEQUENTIAL_NEED)
    ap.add_argument("--sequential", action="store_true", help="the runs one after another")
    ap.add_argument("--shards", type=int, default=2, help="pytest processes per run in parallel (default 2)")
    ap.add_argument("--logs", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-out"))
    a = ap.parse_args()
    t_start = time.time()
    folder = os.path.abspath(a.tests)
    files, paths = [], []
    for spec in a.files or ["test_cuda.py"]:
        rel, select = parse_file(spec, a.select)
        path = find_file(folder, rel)
        if not path:
            print("FAIL pytorch-tests: no %s under %s (put pytorch/pytorch's test/%s there: upstream "
                  "code, kept out of the repository)" % (rel, folder, rel))
            return 1
        files.append((os.path.relpath(path, folder), select))
        paths.append(path)
        runs_test_cuda = find_file(folder, "test_cuda.py") if os.path.basename(rel) == TEST_CUDA[1] else None
        if runs_test_cuda:
            paths.append(runs_test_cuda)  # it runs test_cuda.py's code: its imports are filled too
    suite = Suite(folder, files, paths)
    print("files: " + ", ".join("%s (%s)" % (rel, "-k " + repr(sel) if sel else "all") for rel, sel in files))
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
    probe = ("import torch, cca.torch; x = torch.zeros(1, device='cuda'); "
             "print(cca.torch.installed(), torch.cuda.memory_allocated() > 0)")
    env = dict(os.environ, CCA_LIBRARY=lib, CCA_TORCH_INSTALL="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "tests", "cuda", "pytorch_site"), os.path.join(ROOT, "python")]))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    env.pop("CCA_ALLOC_CONF", None)
    probe_run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if probe_run.returncode != 0 or probe_run.stdout.split() != ["adapter", "True"]:
        print("FAIL pytorch-tests: cca is not installed in a test process:\n%s%s"
              % (probe_run.stdout, probe_run.stderr[-3000:]))
        return 1
    runs = [r for r in RUNS if not a.only or r[0] in a.only]
    deadline = t_start + a.budget
    parallel = not a.sequential and (a.parallel or a.budget < SEQUENTIAL_NEED)
    again = set()
    if parallel:
        # most of the time for the runs at once, the rest for re-running differing tests alone
        reserve = min(120.0, max(0.25 * a.budget, min(60.0, 0.4 * a.budget)))
        print("the %d runs at once, %d pytest processes each, until %.0f s; re-runs after" % (
            len(runs), max(1, a.shards), deadline - reserve - time.time()))
        results, logs = run_parallel(runs, suite, lib, deadline - reserve, a.logs, shim,
                                     max(1, a.shards))
        again = rerun(runs, results, logs, suite, lib, deadline, a.logs, shim)
    else:
        results, logs = run_sequential(runs, suite, lib, deadline - time.time(), a.logs, shim)
    tests = sorted(set().union(*[set(r) for r in results.values()]))
    names = [r[0] for r in runs]
    short = {"PASSED": "pass", "FAILED": "FAIL", "ERROR": "ERROR", "SKIPPED": "skip", "XFAIL": "xfail",
             "XPASS": "xpass"}
    width = max([len(t) for t in tests] + [4])

    def cell(n, t):
        return short.get(results[n].get(t), "not run") + ("*" if (n, t) in again else "")
    print()
    print("| %-*s | %s |" % (width, "test", " | ".join("%-17s" % n for n in names)))
    print("|%s|%s|" % ("-" * (width + 2), "|".join("-" * 19 for _ in names)))
    for t in tests:
        print("| %-*s | %s |" % (width, t, " | ".join("%-17s" % cell(n, t) for n in names)))
    print("| %-*s | %s |" % (width, "passed", " | ".join(
        "%-17s" % sum(v == "PASSED" for v in results[n].values()) for n in names)))
    if again:
        print("* re-run alone, serially, natively and with cca, after the runs at once: its result")
    regressions, unreached = [], []
    for native, ours in PAIRS:
        if native in results and ours in results:
            ran, missing = differing(results, native, ours)
            regressions += [(ours, t, results[ours][t]) for t in ran]
            unreached += [(ours, t) for t in missing]
    print()
    if regressions:
        print("Pass natively, fail with cca:")
        for mode, t, what in regressions:
            native = mode.replace("cca", "native")
            how = ", confirmed alone" if (mode, t) in again and (native, t) in again else \
                ", runs at once only" if parallel else ""
            print("  %-15s %s (%s%s)" % (mode, t, what, how))
        for mode, t, what in regressions:
            text = failure_text(logs.get(mode, []), t)
            print()
            print("---- %s %s: %s" % (mode, t, "end of its failure report" if text else "no report found in its logs"))
            if text:
                print(text)
    else:
        print("No test passes natively and fails with cca (%s)." % ", ".join(names))
    if unreached:
        print("Pass natively, not reached with cca in the time: %s" % ", ".join(
            "%s %s" % (mode, t) for mode, t in unreached))
    empty = [n for n in names if not results[n]]
    if empty:
        print("No test result from: %s (see the logs)" % ", ".join(empty))
    failed = regressions or unreached or empty
    print("%s pytorch-tests: %d pass natively and not with cca, %d not reached with cca (%.0f s)" % (
        "FAIL" if failed else "PASS", len(regressions), len(unreached), time.time() - t_start))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
