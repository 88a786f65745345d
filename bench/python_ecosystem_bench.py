"""Allocate + free from Python through CuPy and Numba: cca (cca.cupy, cca.numba)
beside each library's own allocator (CuPy's MemoryPool; Numba's default
cuMemAlloc/cuMemFree with its deferred frees) and RMM's pool where RMM is
installed.

Usage: python3 bench/python_ecosystem_bench.py [LIBCCA] [--ops N] [--pairs N] [--repeat R]
  LIBCCA: the libcca.so to use (sets CCA_LIBRARY; else the cca package on
  PYTHONPATH finds its own). Each configuration runs in its own process.

Workloads, timed with time.perf_counter_ns around the Python calls (no GPU work):
  pair 512 B, pair 1 MiB: one allocation and its free, --pairs times
      (cupy.cuda.alloc(size) and dropping the pointer; Numba's
      context.memalloc(size) and dropping it);
  random mix: --ops operations (default 20,000) of a fixed sequence (seed 42):
      sizes log-uniform from 512 B to 32 MiB, at most 64 blocks live, an
      allocation or the free of a random live block with equal odds.
Each figure is the median of --repeat runs after one warm-up run, in ns per
operation (a pair counts as one). Prints RESULT lines and a table.
"""
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import time


# the GPU checks' helpers (numba_cuda_numpy_compat)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "cuda"))
from torch_common import numba_cuda_numpy_compat  # noqa: E402

numba_cuda_numpy_compat()

HERE = os.path.abspath(__file__)
CONFIGS = ["cupy-pool", "cupy-cca", "cupy-rmm", "numba-default", "numba-cca", "numba-rmm"]
NOTES = {
    "cupy-pool": "CuPy's MemoryPool (its default)",
    "cupy-cca": "cca.cupy.install()",
    "cupy-rmm": "rmm_cupy_allocator on an RMM pool",
    "numba-default": "Numba's own (cuMemAlloc/cuMemFree, frees deferred)",
    "numba-cca": "NUMBA_CUDA_MEMORY_MANAGER=cca.numba",
    "numba-rmm": "RMMNumbaManager on an RMM pool",
}


def mix_ops(n, seed=42, live_max=64):
    """The random mix as a list of ("a", size) and ("f", index into the live list)."""
    rng = random.Random(seed)
    ops, live = [], 0
    lo, hi = math.log2(512), math.log2(32 << 20)
    for _ in range(n):
        if live == 0 or (live < live_max and rng.random() < 0.5):
            ops.append(("a", int(2 ** rng.uniform(lo, hi))))
            live += 1
        else:
            ops.append(("f", rng.randrange(live)))
            live -= 1
    return ops


def time_pairs(alloc, size, n):
    t0 = time.perf_counter_ns()
    for _ in range(n):
        p = alloc(size)
        del p
    return (time.perf_counter_ns() - t0) / n


def time_mix(alloc, ops):
    live = []
    t0 = time.perf_counter_ns()
    for kind, arg in ops:
        if kind == "a":
            live.append(alloc(arg))
        else:
            live[arg] = live[-1]
            live.pop()
    elapsed = time.perf_counter_ns() - t0
    del live
    return elapsed / len(ops)


def setup(config):
    """(alloc(size) -> an object that frees when dropped, reserved_bytes() or None)."""
    if config.startswith("cupy"):
        import cupy
        if config == "cupy-cca":
            import cca
            import cca.cupy
            cca.cupy.install()
            return cupy.cuda.alloc, lambda: cca.memory_stats()["reserved_bytes.all.current"]
        if config == "cupy-rmm":
            import rmm
            from rmm.allocators.cupy import rmm_cupy_allocator
            rmm.reinitialize(pool_allocator=True)
            cupy.cuda.set_allocator(rmm_cupy_allocator)
            return cupy.cuda.alloc, None
        pool = cupy.get_default_memory_pool()
        return cupy.cuda.alloc, pool.total_bytes
    from numba import cuda
    if config == "numba-cca":
        import cca
        import cca.numba
        cuda.set_memory_manager(cca.numba.CCAMemoryManager)
        reserved = lambda: cca.memory_stats()["reserved_bytes.all.current"]  # noqa: E731
    elif config == "numba-rmm":
        import rmm
        from rmm.allocators.numba import RMMNumbaManager
        rmm.reinitialize(pool_allocator=True)
        cuda.set_memory_manager(RMMNumbaManager)
        reserved = None
    else:
        reserved = None
    ctx = cuda.current_context()
    return ctx.memalloc, reserved


def worker(config, ops_n, pairs, repeat):
    alloc, reserved = setup(config)
    ops = mix_ops(ops_n)
    out = {}
    for name, fn in (("pair_512", lambda: time_pairs(alloc, 512, pairs)),
                     ("pair_1MiB", lambda: time_pairs(alloc, 1 << 20, pairs)),
                     ("random_mix", lambda: time_mix(alloc, ops))):
        fn()  # warm-up
        gc.collect()
        runs = []
        for _ in range(repeat):
            runs.append(fn())
            gc.collect()
        out[name] = statistics.median(runs)
        print("RESULT %s %s ns_per_op=%.0f" % (config, name, out[name]), flush=True)
    if reserved is not None:
        print("RESULT %s reserved_after_mix MiB=%.1f" % (config, reserved() / 2**20), flush=True)
    return 0


def available(config):
    mods = {"cupy": "cupy", "numba": "numba.cuda"}
    need = [mods[config.split("-")[0]]] + (["rmm"] if config.endswith("-rmm") else [])
    for m in need:
        try:
            __import__(m)
        except ImportError:
            return "no %s here" % m
    return None


def main(argv):
    def opt(name, default):
        if name in argv:
            i = argv.index(name)
            value = int(argv[i + 1])
            del argv[i:i + 2]
            return value
        return default
    if "--worker" in argv:
        i = argv.index("--worker")
        return worker(argv[i + 1], int(argv[i + 2]), int(argv[i + 3]), int(argv[i + 4]))
    ops_n, pairs, repeat = opt("--ops", 20000), opt("--pairs", 20000), opt("--repeat", 3)
    env = dict(os.environ)
    if argv:
        env["CCA_LIBRARY"] = os.path.abspath(argv[0])
    rows = {}
    for config in CONFIGS:
        why = available(config)
        if why:
            print("SKIPPED %s: %s" % (config, why), flush=True)
            rows[config] = None
            continue
        proc = subprocess.run([sys.executable, HERE, "--worker", config, str(ops_n), str(pairs),
                               str(repeat)], env=env, capture_output=True, text=True, timeout=300)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            print("FAILED %s:\n%s" % (config, proc.stderr[-3000:]), flush=True)
            rows[config] = None
            continue
        vals = {}
        for line in proc.stdout.splitlines():
            f = line.split()
            if f[:1] == ["RESULT"]:
                vals[f[2]] = float(f[3].split("=")[1])
        rows[config] = vals
    print()
    print("Allocate + free from Python, ns per operation (lower is better); %d-op random mix, "
          "%d pairs, median of %d runs:" % (ops_n, pairs, repeat))
    print("| configuration | pair 512 B | pair 1 MiB | random mix | reserved after mix | allocator |")
    print("|---|---:|---:|---:|---:|---|")
    for config in CONFIGS:
        v = rows[config]
        if v is None:
            print("| %s | - | - | - | - | %s (not run: %s) |" % (config, NOTES[config],
                                                                available(config) or "failed"))
            continue
        res = "%.0f MiB" % v["reserved_after_mix"] if "reserved_after_mix" in v else "-"
        print("| %s | %.0f | %.0f | %.0f | %s | %s |" % (config, v["pair_512"], v["pair_1MiB"],
                                                        v["random_mix"], res, NOTES[config]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
