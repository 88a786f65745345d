"""PyTorch's hooks around its allocator, with cca installed, against native PyTorch: each job
runs once natively and once with cca.torch.install(), each in a fresh process, and compares.
Exits 77 when torch or a GPU is missing.

Usage: python3 tests/cuda/torch_hooks.py [LIBCCA_SO] [--job NAME]...
  jobs: accelerator (torch.accelerator's memory functions), disable (caching_allocator_enable
  False: raw and tensor allocations bypass the cache), no-caching
  (PYTORCH_NO_CUDA_MEMORY_CACHING=1), snapshot-entry (a snapshot's own entry shows in the next
  one only), profiler (torch.profiler's memory events), settings (_snapshot's
  allocator_settings after run-time changes), alloc-conf (with PYTORCH_ALLOC_CONF and
  PYTORCH_CUDA_ALLOC_CONF both set, the second decides), late-conf (PYTORCH_ALLOC_CONF set after
  install, before CUDA starts, chooses the backend: PyTorch's test_allocator_backend),
  fraction-conf (per_process_memory_fraction from PYTORCH_CUDA_ALLOC_CONF, 0.0 included, and
  its refusal of -0.1 and 1.1: test_allocator_memory_fraction_setting),
  gpu-trace (torch.cuda._gpu_trace and CSAN see every allocation and free), pool-id (the
  allocator's trace trackers, as NCCL's registration hook attaches them, see each entry's
  MemPool; a small C++ extension compiled with torch's load_inline). All by default.
"""
import json
import os
import sys

from torch_common import run_json_worker, skipped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

JOBS = ("accelerator", "disable", "no-caching", "snapshot-entry", "profiler", "settings", "alloc-conf",
        "late-conf", "fraction-conf", "gpu-trace", "pool-id")
CHILD_JOBS = ("late-conf", "fraction-conf")  # each starts its own processes, as PyTorch's tests

TRACKER_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <mutex>
#include <tuple>
#include <vector>

static std::mutex seen_lock;
static std::vector<std::tuple<int, unsigned long long, unsigned long long>> seen;

void attach() {
    c10::cuda::CUDACachingAllocator::get()->attachAllocatorTraceTracker(
        [](const c10::cuda::CUDACachingAllocator::TraceEntry& te) {
            std::lock_guard<std::mutex> g(seen_lock);
            seen.emplace_back(static_cast<int>(te.action_), te.mempool_.first, te.mempool_.second);
        });
}

std::vector<std::tuple<int, unsigned long long, unsigned long long>> entries() {
    std::lock_guard<std::mutex> g(seen_lock);
    return seen;
}
"""
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "snapshot", "oom")


def start(mode):
    import cca.torch
    if mode == "cca":
        assert cca.torch.install() == "adapter", cca.torch.adapter_error()
    import torch
    torch.zeros(1, device="cuda")  # initialise
    return torch


def job_accelerator(torch):
    """test_cuda.py's test_memory_stats through torch.accelerator."""
    import gc
    gc.collect()
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    initialised = getattr(torch._C, "_accelerator_isAllocatorInitialized", None)
    out = {"initialised": initialised() if initialised else None}
    before = torch.accelerator.memory_stats()
    out["has_active"] = "active_bytes.all.current" in before
    a0 = before.get("active_bytes.all.current", -1)
    x = torch.randn(256, device="cuda")
    s = torch.accelerator.memory_stats()
    out["active_delta"] = s.get("active_bytes.all.current", -1) - a0
    out["allocated_delta"] = torch.accelerator.memory_allocated() - before.get("allocated_bytes.all.current", 0)
    out["reserved_matches_cuda"] = torch.accelerator.memory_reserved() == torch.cuda.memory_reserved()
    out["max_allocated_matches_cuda"] = torch.accelerator.max_memory_allocated() == torch.cuda.max_memory_allocated()
    del x
    gc.collect()
    torch.accelerator.empty_cache()
    s = torch.accelerator.memory_stats()
    out["freed"] = s.get("active_bytes.all.freed", -1)
    out["reserved_after_empty"] = torch.accelerator.memory_reserved()
    torch.accelerator.reset_peak_memory_stats()
    out["peak_after_reset"] = torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()
    return out


def job_disable(torch):
    """test_cuda.py's test_cachingAllocator_raw_alloc: with the cache disabled, raw allocations
    and tensors come from cudaMalloc each time and leave the cache's figures alone."""
    torch.cuda.empty_cache()
    stream = torch.cuda.current_stream().cuda_stream
    r0, a0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.caching_allocator_enable(False)
    out = {"enabled_off": torch.cuda.is_caching_allocator_enabled() if hasattr(
        torch.cuda, "is_caching_allocator_enabled") else None}
    ptrs = [torch._C._cuda_cudaCachingAllocator_raw_alloc(1 << 20, stream) for _ in range(3)]
    t = torch.empty(1 << 20, device="cuda")
    out["reserved_delta_off"] = torch.cuda.memory_reserved() - r0
    out["allocated_delta_off"] = torch.cuda.memory_allocated() - a0
    t.fill_(1)
    out["tensor_ok"] = float(t.sum().item()) == float(1 << 20)
    del t
    for p in ptrs:
        torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    torch.cuda.caching_allocator_enable(True)
    p = torch._C._cuda_cudaCachingAllocator_raw_alloc(1 << 20, stream)
    out["reserved_grows_on"] = torch.cuda.memory_reserved() > r0
    torch._C._cuda_cudaCachingAllocator_raw_delete(p)
    return out


def job_no_caching(torch):
    """PYTORCH_NO_CUDA_MEMORY_CACHING=1 (set by the parent): no cache at all."""
    x = torch.empty(4 << 20, device="cuda")
    addr = x.data_ptr()
    reserved = torch.cuda.memory_reserved()
    del x
    y = torch.empty(4 << 20, device="cuda")
    y.fill_(2)
    return {"reserved_while_live": reserved, "reserved_after": torch.cuda.memory_reserved(),
            "value_ok": float(y[-1].item()) == 2.0, "nonzero_address": addr != 0}


def job_snapshot_entry(torch):
    """test_cpp_memory_snapshot_pickle: a snapshot's last history entry is the program's last
    action, its own snapshot entry shows in the next snapshot."""
    torch.cuda.memory._record_memory_history(max_entries=100)
    try:
        t = torch.rand(311, 411, device="cuda")
        first = torch.cuda.memory._snapshot()["device_traces"][0]
        second = torch.cuda.memory._snapshot()["device_traces"][0]
        return {"first_last": [first[-1]["action"], first[-1]["size"]],
                "second_tail": [e["action"] for e in second[-2:]], "size": t.numel() * 4}
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def job_profiler(torch):
    """test_memory_profiler_viz: torch.profiler(profile_memory=True) sees CUDA allocations and
    frees, with the allocator's totals."""
    from torch.cuda._memory_viz import _profile_to_snapshot
    with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
        x = torch.rand(128, 128, device="cuda")
        y = x * x + x * x
        del y
    snap = _profile_to_snapshot(prof)
    actions = [e.get("action") for trace in snap.get("device_traces", []) for e in trace]
    text = json.dumps(snap, default=str)
    return {"allocs": actions.count("alloc"), "frees": actions.count("free_completed") + actions.count("free"),
            "names_test": "torch_hooks.py" in text, "segments": len(snap.get("segments", [])) > 0}


def job_settings(torch):
    """_snapshot()["allocator_settings"]: every field, and current after run-time changes."""
    first = torch.cuda.memory._snapshot()["allocator_settings"]
    torch.cuda.memory._set_allocator_settings(
        "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,"
        "release_lock_on_cudamalloc:True")
    second = torch.cuda.memory._snapshot()["allocator_settings"]
    # every key of the last string again: whether a string resets the keys it leaves out is the
    # settings' own business, not the snapshot's
    torch.cuda.memory._set_allocator_settings(
        "roundup_power2_divisions:4,garbage_collection_threshold:0.6,release_lock_on_cudamalloc:False")
    third = torch.cuda.memory._snapshot()["allocator_settings"]
    return {"first": first, "second": second, "third": third}


def job_alloc_conf(torch):
    """PYTORCH_ALLOC_CONF=expandable_segments:True and PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:False (set by the parent): PyTorch 2.11 runs without expandable
    segments (its CUDA allocator reads PYTORCH_CUDA_ALLOC_CONF where set)."""
    x = torch.empty(8 << 20, device="cuda")
    segs = torch.cuda.memory._snapshot()["segments"]
    del x
    return {"expandable": sorted({bool(s.get("is_expandable")) for s in segs})}


def job_gpu_trace(torch):
    """torch.cuda._gpu_trace's allocation and free callbacks (CSAN's source) see every
    allocation and free of tensors, caching_allocator_alloc, and the sanitizer runs."""
    from torch.cuda import _gpu_trace
    seen = {"alloc": [], "free": []}
    torch._C._activate_gpu_trace()
    _gpu_trace.register_callback_for_memory_allocation(seen["alloc"].append)
    _gpu_trace.register_callback_for_memory_deallocation(seen["free"].append)
    a = torch.empty(1000, device="cuda")
    b = torch.empty(1 << 20, device="cuda")
    pa, pb = a.data_ptr(), b.data_ptr()
    del a, b
    p = torch.cuda.caching_allocator_alloc(4096)
    torch.cuda.caching_allocator_delete(p)
    out = {"alloc_seen": [pa in seen["alloc"], pb in seen["alloc"], p in seen["alloc"]],
           "free_seen": [pa in seen["free"], pb in seen["free"], p in seen["free"]]}
    return out


def job_pool_id(torch):
    """TraceEntry::mempool_ as trackers see it (NCCL's tensor registration hook reads it):
    each action of a MemPool's blocks and segments names the pool, the default pool's (0, 0)."""
    from torch.utils.cpp_extension import load_inline
    ext = load_inline(name="cca_test_trace_tracker", cpp_sources=[TRACKER_SOURCE],
                      functions=["attach", "entries"], with_cuda=True)
    ext.attach()
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    del x, y
    torch.cuda.synchronize()
    pid = tuple(pool.id)
    del pool
    torch.cuda.empty_cache()
    seen = set()
    for action, first, second in ext.entries():
        tag = "pool" if (first, second) == pid else "default" if (first, second) == (0, 0) else "other"
        seen.add("%s:%s" % (ACTIONS[action] if 0 <= action < len(ACTIONS) else action, tag))
    return {"seen": sorted(seen)}


def child_env(mode, env_extra):
    """A new interpreter's environment, with cca installed at its start in mode "cca" (as
    scripts/pytorch_tests.py's test processes: tests/cuda/pytorch_site/sitecustomize.py)."""
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCA_ALLOC_CONF", "CCA_TORCH_INSTALL"):
        env.pop(k, None)
    paths = [os.path.join(ROOT, "python")]
    if mode == "cca":
        paths.insert(0, os.path.join(ROOT, "tests", "cuda", "pytorch_site"))
        env["CCA_TORCH_INSTALL"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(env_extra)
    return env


def children(mode, script, env_extras):
    """script run at once in one new interpreter per environment: (rc, stdout, stderr) each."""
    import subprocess
    procs = [subprocess.Popen([sys.executable, "-c", script], env=child_env(mode, extra), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for extra in env_extras]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        out.append((p.returncode, stdout, stderr))
    return out


def job_late_conf(mode):
    """test_allocator_backend: PYTORCH_ALLOC_CONF set by the program after the interpreter
    started (with cca: after install) and before CUDA starts chooses cudaMallocAsync, with a
    value PyTorch does not read while it starts under that backend
    (release_lock_on_cudamalloc:none). PyTorch's test's own script: natively, a later
    `float(x.sum())` in that program raised ValueError on that value, where cca warns and
    drops it (docs/torch.md), so the job stops where the test does."""
    script = ("import os\n"
              "os.environ['PYTORCH_ALLOC_CONF'] = 'max_split_size_mb:20,backend:cudaMallocAsync,"
              "release_lock_on_cudamalloc:none'\n"
              "import torch\n"
              "torch.cuda.init()\n"
              "x = torch.ones(1 << 20, device='cuda')\n"
              "print(torch.cuda.get_allocator_backend(), x.shape[0])\n")
    rc, out, err = children(mode, script, [{}])[0]
    return {"rc": rc, "out": out.strip(), "err": err[-600:] if rc else ""}


def job_fraction_conf(mode):
    """test_allocator_memory_fraction_setting: PYTORCH_CUDA_ALLOC_CONF=
    per_process_memory_fraction:X gives get_per_process_memory_fraction X (0.0: a zero
    limit); -0.1 and 1.1 stop the process with "per_process_memory_fraction is invalid"."""
    script = ("import torch\n"
              "device = torch._C._cuda_getDevice()\n"
              "print(torch.cuda.memory.get_per_process_memory_fraction(device), end='')\n")
    out = {}
    values = ("0.0", "0.5", "1.0", "-0.1", "1.1")
    runs = children(mode, script, [{"PYTORCH_CUDA_ALLOC_CONF": "per_process_memory_fraction:" + v} for v in values])
    for value, (rc, stdout, stderr) in zip(values, runs):
        if rc == 0:
            out[value] = stdout
        elif "per_process_memory_fraction is invalid" in stderr:
            out[value] = "refused"
        else:
            out[value] = "rc %d: %s" % (rc, stderr[-400:])
    return out


def worker(mode, job):
    if job in CHILD_JOBS:
        return globals()["job_" + job.replace("-", "_")](mode)
    torch = start(mode)
    return globals()["job_" + job.replace("-", "_")](torch)


def run(mode, job, lib, env_extra=None):
    env = dict(os.environ, CCA_LIBRARY=lib)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CCA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        env.pop(k, None)
    env.update(env_extra or {})
    r = run_json_worker(os.path.abspath(__file__), [mode, job], env, 300)
    if r is None:
        raise SystemExit("FAIL worker %s %s" % (mode, job))
    r.pop("seconds", None)
    return r


def main():
    if skipped():
        return 77
    args = sys.argv[1:]
    only = []
    while "--job" in args:
        i = args.index("--job")
        only.append(args[i + 1])
        del args[i:i + 2]
    unknown = [j for j in only if j not in JOBS]
    if unknown:
        print("FAIL torch hooks: unknown --job %s (one of %s)" % (unknown, ", ".join(JOBS)))
        return 2
    lib = os.path.abspath(args[0] if args else os.path.join(ROOT, "build", "libcca.so"))
    os.environ["CCA_LIBRARY"] = lib
    import cca.torch
    print("adapter:", cca.torch.build_adapter())
    failed = 0

    def report(ok, text):
        nonlocal failed
        print("%s %s" % ("PASS" if ok else "FAIL", text))
        failed += not ok

    envs = {"no-caching": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            "alloc-conf": {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}}
    for job in JOBS:
        if only and job not in only:
            continue
        n = run("native", job, lib, envs.get(job))
        c = run("cca", job, lib, envs.get(job))
        if job == "accelerator":
            ok = c == n and n["has_active"] and n["active_delta"] == 1024 and n["freed"] == 1024
        elif job == "disable":
            ok = (c == n and n["reserved_delta_off"] == 0 and n["allocated_delta_off"] == 0 and n["tensor_ok"]
                  and n["reserved_grows_on"])
        elif job == "no-caching":
            ok = c == n and n["reserved_after"] == 0 and n["value_ok"]
        elif job == "snapshot-entry":
            ok = c == n and n["first_last"] == ["alloc", n["size"]]
        elif job == "profiler":
            ok = c == n and n["allocs"] > 0
        elif job == "settings":
            diff = {k: (n[p].get(k), c[p].get(k)) for p in ("first", "second", "third")
                    for k in set(n[p]) | set(c[p]) if n[p].get(k) != c[p].get(k)}
            ok = not diff and n["second"] != n["first"]
            if diff:
                print("  differences (native, cca): %s" % diff)
        elif job == "pool-id":
            ok = c == n and "alloc:pool" in n["seen"] and "segment_alloc:pool" in n["seen"]
        elif job == "alloc-conf":
            ok = c == n == {"expandable": [False]}
        elif job == "late-conf":
            ok = c == n and n["rc"] == 0 and n["out"].split()[0] == "cudaMallocAsync"
        elif job == "fraction-conf":
            ok = c == n == {"0.0": "0.0", "0.5": "0.5", "1.0": "1.0", "-0.1": "refused", "1.1": "refused"}
        else:
            ok = c == n and all(n["alloc_seen"]) and all(n["free_seen"])
        report(ok, "%s: native %s; cca %s" % (job, json.dumps(n)[:900], json.dumps(c)[:900]))
    print("%s torch hooks: %d failed" % ("PASS" if not failed else "FAIL", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
