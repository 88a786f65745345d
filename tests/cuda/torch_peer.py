"""Peer access between two GPUs through PyTorch with cca installed (the C++ adapter): a
tensor copied from one device to the other makes PyTorch ask the allocator for peer access
(enablePeerAccess) and copy through it (memcpyAsync); then a kernel on each device reads the
other device's tensor directly (CuPy), which with expandable segments works only where the
allocator gave the peer access to the mapping itself, and with backend:cudaMallocAsync only
where the device was given access to the peer's memory pool (cudaMemPoolSetAccess). Default,
expandable_segments:True and backend:cudaMallocAsync, cca and native PyTorch, each in a fresh
process. Exits 77 without torch, CuPy or two GPUs.

Usage: python3 tests/cuda/torch_peer.py [LIBCCA_SO]
  --worker native|cca SETTINGS prints one JSON line.
"""
import ctypes
import json
import os
import sys

from torch_common import run_json_worker, skipped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

N = 6 << 20  # floats: 24 MiB a tensor (past the small pool, several granules)
READ_KERNEL = r'''
extern "C" __global__ void read_peer(const float *src, float *dst, long long n)
{
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        dst[i] = src[i] * 2.0f + 1.0f;
}
'''


def cupy_view(cupy, tensor):
    """A CuPy array over tensor's memory, on tensor's device."""
    mem = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor,
                                  tensor.device.index)
    return cupy.ndarray((tensor.numel(),), dtype=cupy.float32, memptr=cupy.cuda.MemoryPointer(mem, 0))


def worker(mode, settings):
    import warnings
    warnings.simplefilter("ignore")  # CuPy's note that it enabled peer access itself
    import cca.torch
    if mode == "cca":
        assert cca.torch.install(settings) == "adapter", cca.torch.adapter_error()
    import torch
    import cupy
    checks = []

    def check(name, ok, detail=""):
        checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
    can = torch.cuda.can_device_access_peer(0, 1) and torch.cuda.can_device_access_peer(1, 0)
    check("the two devices can access each other", can)
    a = torch.arange(N, dtype=torch.float32, device="cuda:0") * 0.5
    b = torch.arange(N, dtype=torch.float32, device="cuda:1") * -0.25
    a_host, b_host = a.cpu(), b.cpu()
    # copies each way: PyTorch's peer access and the allocator's memcpyAsync
    a_on_1 = a.to("cuda:1")
    b_on_0 = torch.empty(N, device="cuda:0")
    b_on_0.copy_(b, non_blocking=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check("copy from device 0 to device 1", torch.equal(a_on_1.cpu(), a_host))
    check("copy from device 1 to device 0", torch.equal(b_on_0.cpu(), b_host))
    # kernels reading the other device's memory in place
    kernel = {}
    for dev in (0, 1):
        with cupy.cuda.Device(dev):
            kernel[dev] = cupy.RawKernel(READ_KERNEL, "read_peer")
    for src, dst_dev in ((a, 1), (b, 0)):
        out = torch.empty(N, device="cuda:%d" % dst_dev)
        with cupy.cuda.Device(dst_dev):
            kernel[dst_dev](((N + 255) // 256,), (256,),
                            (cupy_view(cupy, src), cupy_view(cupy, out), cupy.int64(N)))
            cupy.cuda.Device(dst_dev).synchronize()
        want = (a_host if src is a else b_host) * 2.0 + 1.0
        check("a kernel on device %d reads device %d's tensor" % (dst_dev, 1 - dst_dev),
              torch.equal(out.cpu(), want))
    result = {"checks": checks}
    if mode == "cca":
        lib = ctypes.CDLL(os.environ["CCA_LIBRARY"])
        lists = {}
        for dev in (0, 1):
            peers = (ctypes.c_int * 4)()
            count = ctypes.c_size_t(0)
            st = lib.cca_peer_access_list(dev, peers, 4, ctypes.byref(count))
            lists[dev] = sorted(peers[i] for i in range(min(count.value, 4))) if st == 0 else "status %d" % st
        # cca_peer_access_list(peer, ...) lists the devices that access peer's memory
        check("cca lists each device as accessing the other's memory", lists == {0: [1], 1: [0]}, lists)
        if "cudaMallocAsync" not in settings:  # (whose snapshot raises, natively too)
            segments = torch.cuda.memory_snapshot()
            expandable = [s.get("is_expandable", False) for s in segments]
            check("segments expandable as asked",
                  all(expandable) if "expandable" in settings else not any(expandable), expandable)
    return result


def run_worker(mode, lib, settings):
    env = dict(os.environ, CCA_LIBRARY=lib)
    env.pop("CCA_ALLOC_CONF", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if settings:  # native reads it; cca.torch.install is given it
        env["PYTORCH_CUDA_ALLOC_CONF"] = settings
    r = run_json_worker(os.path.abspath(__file__), [mode, settings], env, 300)
    if r is None:
        return {"checks": [{"name": "worker %s %r failed" % (mode, settings), "ok": False, "detail": ""}]}
    return r


def main():
    if skipped(gpus=2, modules=("cupy",)):
        return 77
    lib = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "libcca.so"))
    os.environ["CCA_LIBRARY"] = lib
    import cca.torch
    print("adapter:", cca.torch.build_adapter())
    failed = 0
    for settings in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
        for mode in ("native", "cca"):
            r = run_worker(mode, lib, settings)
            for c in r["checks"]:
                print("%s %s%s: %s%s" % ("PASS" if c["ok"] else "FAIL", mode, " (%s)" % settings if settings else "",
                                         c["name"], "" if c["ok"] else " (%s)" % c["detail"]))
                failed += not c["ok"]
    print("%s torch peer access: %d failed" % ("PASS" if not failed else "FAIL", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")))
        sys.exit(0)
    sys.exit(main())
