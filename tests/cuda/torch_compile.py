"""torch.compile(mode="reduce-overhead") on cca: PyTorch's CUDA graph trees record their
graphs into cca's private pools, take a checkpoint of the pool after each recording
(getCheckpointState), return the pool to one (setCheckpointPoolState) when a new graph is
recorded after a replayed one, and, with their slow-path checks on, compare the pool's live
blocks with their own (checkPoolLiveAllocations). Native PyTorch and cca run the same
program in fresh processes, their kernels compiled once beforehand into a cache of the
test's own: the same outputs, the same allocations and peaks, and each of the three calls
made on both sides (so the program does reach them). Exits 77 when torch or a GPU is missing.

Usage: python3 tests/cuda/torch_compile.py [LIBCCA_SO] [--checked LIBCCA_SO] [--expandable]
  --expandable: both sides with expandable_segments:True (checkpoints of expandable segments).
  --checked: also run the cca side on this library (one built with -DCCA_DEBUG_LEVEL=3,
  whose invariant checker runs after every call) and require the same results.
  --trace DIR: each side writes its allocation history (torch.cuda.memory._dump_snapshot) to
  DIR/native[-expandable].pickle and DIR/cca[-expandable].pickle.
  --worker native|cca prints one JSON line (one process per allocator).
"""
import json
import os
import shutil
import sys
import tempfile
import time

from torch_common import run_json_worker, skipped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

EXPANDABLE = False  # --expandable: both sides with expandable_segments:True

CALLS = ("_cuda_getCheckpointState", "_cuda_setCheckpointPoolState", "_cuda_checkPoolLiveAllocations")


def count_calls(torch):
    """Wrap the allocator entry points the graph trees call (in torch._C and wherever the
    trees' module holds them by name); the counts are read at the end."""
    import torch._inductor.cudagraph_trees as trees
    counts = {name: 0 for name in CALLS}
    for name in CALLS:
        original = getattr(torch._C, name, None)
        if original is None:
            continue

        def wrapper(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        setattr(torch._C, name, wrapper)
        if getattr(trees, name, None) is original:
            setattr(trees, name, wrapper)
    return counts


def program(torch):
    """Two scenarios whose graph trees fork after a replay; returns the outputs' sums."""
    torch.manual_seed(0)
    out = {}
    # 1. inference: foo recorded and replayed alone, then bar after it (a child recorded
    #    after foo's graph replayed: the pool goes back to foo's checkpoint first)
    lin1 = torch.nn.Linear(256, 256).cuda()
    lin2 = torch.nn.Linear(256, 256).cuda()

    def foo(x):
        return torch.relu(lin1(x)) * 2.0

    def bar(y):
        return torch.sigmoid(lin2(y)) + y

    cfoo = torch.compile(foo, mode="reduce-overhead")
    cbar = torch.compile(bar, mode="reduce-overhead")
    x = torch.randn(64, 256, device="cuda")
    sums = []
    with torch.no_grad():
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            sums.append(float(cfoo(x).double().sum()))
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            a = cfoo(x)
            b = cbar(a)
            sums.append(float(b.double().sum()))
            sums.append(float(a.double().sum()))
    out["inference"] = sums
    out["phase_peaks"] = [torch.cuda.max_memory_allocated()]
    # 2. training: forward and backward graphs, then an evaluation forward (another graph)
    #    recorded after the backward replayed, every step
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cmodel = torch.compile(model, mode="reduce-overhead")
    xt = torch.randn(128, 256, device="cuda")
    xe = torch.randn(32, 256, device="cuda")
    losses, evals = [], []
    for step in range(8):
        torch.compiler.cudagraph_mark_step_begin()
        loss = cmodel(xt).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        if step >= 2:
            with torch.no_grad():
                evals.append(float(cmodel(xe).double().sum()))
        out["phase_peaks"].append(torch.cuda.max_memory_allocated())
    out["train_losses"] = losses
    out["train_evals"] = evals
    return out


def worker(mode):
    import cca.torch
    if mode == "cca":
        assert cca.torch.install() == "adapter", cca.torch.adapter_error()
    import torch
    import torch._inductor.config as inductor_config
    # the trees' own checks of the pool against their live tensors, before every
    # invocation (checkPoolLiveAllocations, then PyTorch's slow path if that says no)
    inductor_config.triton.slow_path_cudagraph_asserts = True
    counts = count_calls(torch)
    from torch._dynamo.utils import counters
    trace = os.environ.get("CCA_COMPILE_TRACE")  # --trace DIR: each side's allocation history
    if trace:
        torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=1 << 20)
    out = program(torch)
    torch.cuda.synchronize()
    if trace:
        torch.cuda.memory._dump_snapshot(os.path.join(trace, "%s%s.pickle" % (
            mode, "-expandable" if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
            else "")))
    stats = torch.cuda.memory_stats()
    out["calls"] = counts
    out["cudagraph_skips"] = int(counters["inductor"].get("cudagraph_skips", 0))
    out["peak_allocated"] = stats["allocated_bytes.all.peak"]
    out["peak_reserved"] = stats["reserved_bytes.all.peak"]
    out["allocations"] = stats["allocation.all.allocated"]
    if mode == "cca":
        import cca
        own = cca.memory_stats()
        out["stats_agree"] = bool(own) and all(k in stats and stats[k] == v for k, v in own.items())
    return out


def run_worker(mode, lib, cache):
    env = dict(os.environ, CCA_LIBRARY=lib, TORCHINDUCTOR_CACHE_DIR=cache,
               TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CCA_ALLOC_CONF", None)
    if EXPANDABLE:  # both sides: the graph trees' pools in expandable segments
        env["PYTORCH_CUDA_ALLOC_CONF"] = env["CCA_ALLOC_CONF"] = "expandable_segments:True"
    r = run_json_worker(os.path.abspath(__file__), [mode], env, 500)
    if r is None:
        raise SystemExit("FAIL worker %s (%s)" % (mode, lib))
    return r


def close(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(x)) for x, y in zip(a, b))


def compare(label, native, ours):
    failed = 0

    def check(name, ok, detail=""):
        nonlocal failed
        print("%s %s: %s%s" % ("PASS" if ok else "FAIL", label, name, "" if ok and not detail else " (%s)" % detail))
        failed += not ok
    for key in ("inference", "train_losses", "train_evals"):
        same = native[key] == ours[key]
        check("%s outputs %s" % (key, "identical" if same else "close" if close(native[key], ours[key])
                                 else "differ"), close(native[key], ours[key]),
              "" if same else "native %s, cca %s" % (native[key][:4], ours[key][:4]))
    for name in CALLS:
        n, c = native["calls"][name], ours["calls"][name]
        check("%s called (native %d, cca %d)" % (name, n, c), n > 0 and c > 0)
    check("no graph skipped", native["cudagraph_skips"] == 0 and ours["cudagraph_skips"] == 0,
          "native %d, cca %d" % (native["cudagraph_skips"], ours["cudagraph_skips"]))
    check("allocations (native %d, cca %d)" % (native["allocations"], ours["allocations"]),
          native["allocations"] == ours["allocations"])
    check("peak allocated (native %d, cca %d)" % (native["peak_allocated"], ours["peak_allocated"]),
          native["peak_allocated"] == ours["peak_allocated"],
          "" if native["phase_peaks"] == ours["phase_peaks"] else
          "after inference, then each training step: native %s, cca %s" % (native["phase_peaks"], ours["phase_peaks"]))
    check("peak reserved (native %d, cca %d)" % (native["peak_reserved"], ours["peak_reserved"]),
          native["peak_reserved"] == ours["peak_reserved"])
    check("torch.cuda.memory_stats equal to cca's own", ours.get("stats_agree") is True)
    return failed


def main():
    if skipped():
        return 77
    global EXPANDABLE
    args = sys.argv[1:]
    if "--expandable" in args:
        args.remove("--expandable")
        EXPANDABLE = True
    checked = None
    if "--trace" in args:
        i = args.index("--trace")
        os.makedirs(args[i + 1], exist_ok=True)
        os.environ["CCA_COMPILE_TRACE"] = os.path.abspath(args[i + 1])
        del args[i:i + 2]
    if "--checked" in args:
        i = args.index("--checked")
        checked = os.path.abspath(args[i + 1])
        del args[i:i + 2]
    lib = os.path.abspath(args[0] if args else os.path.join(ROOT, "build", "libcca.so"))
    os.environ["CCA_LIBRARY"] = lib
    import cca.torch
    t0 = time.time()
    print("adapter:", cca.torch.build_adapter(), "(%.1f s)" % (time.time() - t0))
    # A first compile benchmarks the generated kernels (allocating a buffer the size of the
    # L2 cache, among others); later processes find them in the compile caches. A first
    # native run fills a cache of this test's own, so that the runs compared all find
    # their kernels there and allocate only what the program itself does.
    cache = tempfile.mkdtemp(prefix="cca-torch-compile-")
    try:
        first = run_worker("native", lib, cache)
        native = run_worker("native", lib, cache)
        ours = run_worker("cca", lib, cache)
        print("native, compiling: %.1f s (%d allocations); native %.1f s, cca %.1f s" % (
            first["seconds"], first["allocations"], native["seconds"], ours["seconds"]))
        failed = compare("cca", native, ours)
        if checked:
            os.environ["CCA_LIBRARY"] = checked
            print("adapter (checked library):", cca.torch.build_adapter())
            ours_checked = run_worker("cca", checked, cache)
            print("cca with the checker after every call: %.1f s" % ours_checked["seconds"])
            failed += compare("cca checked", native, ours_checked)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    print("%s torch compile (CUDA graph trees): %d failed" % ("PASS" if not failed else "FAIL", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
        sys.exit(0)
    sys.exit(main())
