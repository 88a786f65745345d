#!/usr/bin/env python3
"""CPU time (user + sys) of each ctest test of a build folder, for finding where
`make test` goes on a machine shared with others, where wall time is noise.

    scripts/test-times.py build-asan [-L label] [-R regex] [-E regex] [-j N] [--top N]

Runs the tests ctest would run (its own list: `ctest --show-only=json-v1`, with
each test's environment and working folder), N at a time, and takes each one's
CPU time from wait4(2) (the test and every process it waited for). Prints the
slowest first, then the totals; exits 1 if a test failed. The sanitizer options
are those of scripts/run-tests.sh.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time


def tests_of(build, args):
    cmd = ["ctest", "--test-dir", build, "--show-only=json-v1"]
    for flag, value in (("-L", args.label), ("-R", args.regex), ("-E", args.exclude)):
        if value:
            cmd += [flag, value]
    data = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    tests = []
    for t in data["tests"]:
        if "command" not in t:  # its program is not built
            continue
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        tests.append({"name": t["name"], "command": t["command"],
                      "env": props.get("ENVIRONMENT", []),
                      "cwd": props.get("WORKING_DIRECTORY", build),
                      "skip": props.get("SKIP_RETURN_CODE")})
    return tests


def run_one(t, results, lock):
    env = dict(os.environ)
    env.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
    env.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")
    for kv in t["env"]:
        k, _, v = kv.partition("=")
        env[k] = v
    start = time.monotonic()
    p = subprocess.Popen(t["command"], cwd=t["cwd"], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = rc = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    state = "passed" if rc == 0 else ("skipped" if t["skip"] is not None and rc == int(t["skip"])
                                      else "FAILED (%d)" % rc)
    with lock:
        results.append((t["name"], usage.ru_utime + usage.ru_stime, wall, state))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("-L", dest="label")
    ap.add_argument("-R", dest="regex")
    ap.add_argument("-E", dest="exclude")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--top", type=int, default=0, help="print only the N slowest")
    args = ap.parse_args()
    tests = tests_of(args.build, args)
    results, lock = [], threading.Lock()
    pending = list(tests)
    def worker():
        while True:
            with lock:
                if not pending:
                    return
                t = pending.pop(0)
            run_one(t, results, lock)
    start = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(max(1, args.j))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - start
    results.sort(key=lambda r: -r[1])
    shown = results[:args.top] if args.top else results
    print("%-40s %9s %9s  %s" % ("test", "cpu s", "wall s", "result"))
    for name, cpu, w, state in shown:
        print("%-40s %9.1f %9.1f  %s" % (name, cpu, w, state))
    failed = sum(1 for r in results if r[3].startswith("FAILED"))
    print("%d tests, %.1f s of CPU (user+sys), %.1f s wall at -j %d; %d failed"
          % (len(results), sum(r[1] for r in results), wall, args.j, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
