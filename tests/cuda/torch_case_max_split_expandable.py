"""PyTorch 2.11's test_max_split_expandable, step by step, natively and on cca, each in a
fresh process, with what each step leaves: reserved bytes, the fraction's allowed bytes,
the device's total memory as cudaGetDeviceProperties and cudaMemGetInfo give it, and the
error of a step that fails. The same steps pass on the simulated backend
(tests/unit/test_torch_cases.c, max_split_expandable); this says where a GPU differs.
Exits 77 when torch or a GPU is missing, 1 when cca fails a step native PyTorch passes.

Usage: python3 tests/cuda/torch_case_max_split_expandable.py [LIBCCA_SO] [--expandable] [--default-stream]
  --expandable: both processes start with expandable_segments:True (test_cuda_expandable_segments).
  --default-stream: the steps on the default stream; without it on a stream of their own, made
  before and destroyed after an earlier use (PyTorch's TestCase runs each test of TestCuda on
  a fresh non-default stream: _do_cuda_non_default_stream).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch_common import skipped  # noqa: E402


def worker(use_cca, side_stream):
    import torch
    if use_cca:
        import cca.torch
        cca.torch.install()
    torch.ones(1, device="cuda")  # as an earlier test leaves the process: CUDA up
    if not side_stream:
        return steps_of(torch)
    earlier = torch.cuda.Stream()  # an earlier test's stream, gone since, its blocks cached
    with torch.cuda.stream(earlier):
        x = torch.ones(30 * 1024 * 1024, dtype=torch.int8, device="cuda")
        del x
    earlier.synchronize()
    del earlier
    with torch.cuda.stream(torch.cuda.Stream()):
        return steps_of(torch)


def steps_of(torch):
    mb = 1024 * 1024
    steps = []

    def note(name, err=None):
        steps.append({"step": name, "reserved": torch.cuda.memory_reserved(),
                      "allocated": torch.cuda.memory_allocated(),
                      "error": None if err is None else str(err).splitlines()[0][:300]})

    orig = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.memory.empty_cache()
    _, all_memory = torch.cuda.memory.mem_get_info()
    pre_reserved = torch.cuda.memory_reserved()
    total_allowed = 120 * mb + pre_reserved
    fraction = total_allowed / all_memory
    torch.cuda.memory.set_per_process_memory_fraction(fraction)
    info = {"props_total": torch.cuda.get_device_properties(0).total_memory, "mem_get_info_total": all_memory,
            "pre_reserved": pre_reserved, "fraction": fraction, "total_allowed": total_allowed,
            "fraction_read_back": torch.cuda.get_per_process_memory_fraction()}

    def alloc(n):
        return torch.ones(n * mb, dtype=torch.int8, device="cuda")

    held = []
    plan = [("expandable_segments:False,max_split_size_mb:40", "a"),
            ("expandable_segments:True,max_split_size_mb:40", "b"),
            ("expandable_segments:False,max_split_size_mb:40", "c")]
    for settings, name in plan:
        torch.cuda.memory._set_allocator_settings(settings)
        try:
            held.append(alloc(40))
            note(name)
        except torch.OutOfMemoryError as e:
            note(name, e)
    try:
        alloc(40)
        note("d (must fail)")
    except torch.OutOfMemoryError as e:
        note("d (must fail)", e)
    del held[:]
    try:
        alloc(120)
        note("e 120 MiB")
    except torch.OutOfMemoryError as e:
        note("e 120 MiB", e)
    torch.cuda.memory.set_per_process_memory_fraction(orig)
    ok = [s["error"] is None for s in steps] == [True, True, True, False, True]
    print(json.dumps({"info": info, "steps": steps, "as_pytorch_expects": ok}))


def run(use_cca, lib, expandable, default_stream):
    env = dict(os.environ)
    if lib:
        env["CCA_LIBRARY"] = lib
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        env["CCA_ALLOC_CONF"] = "expandable_segments:True"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "cca" if use_cca else "native"]
    out = subprocess.run(cmd + (["--default-stream"] if default_stream else []),
                         env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode or not lines:
        print(out.stdout[-2000:], out.stderr[-4000:])
        return None
    return json.loads(lines[-1])


def main():
    if "--worker" in sys.argv:
        worker(sys.argv[sys.argv.index("--worker") + 1] == "cca", "--default-stream" not in sys.argv)
        return 0
    if skipped():
        return 77
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    expandable = "--expandable" in sys.argv
    results = {}
    for use_cca in (False, True):
        results["cca" if use_cca else "native"] = r = run(use_cca, args[0] if args else None, expandable,
                                                          "--default-stream" in sys.argv)
        print("%s: %s" % ("cca" if use_cca else "native", json.dumps(r, indent=1)))
    native, mine = results["native"], results["cca"]
    if native and native["as_pytorch_expects"] and not (mine and mine["as_pytorch_expects"]):
        print("FAIL: cca differs from native PyTorch in test_max_split_expandable")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
