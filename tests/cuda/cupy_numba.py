"""CuPy and Numba on cca, on a GPU: cca.cupy (CuPy's allocator) and cca.numba
(Numba's external memory manager), kernels on cca memory with their results
checked, several streams, record_stream, pinned memory, out-of-memory raised as
each library's own error and then recovery, expandable segments and
compact_memory, IPC between processes through Numba, and arrays handed between
CuPy, Numba and PyTorch (DLPack, __cuda_array_interface__) with cca owning the
memory once, whichever library frees it last.

Usage: python3 tests/cuda/cupy_numba.py [LIBCCA] [--part NAME]...
  LIBCCA: the libcca.so to use (sets CCA_LIBRARY); without it the cca package
  on PYTHONPATH finds its own (the installed one, or the build tree's).
  Parts: cupy, cupy-expandable, cupy-compact, numba, numba-ipc, numba-ipc-expandable,
  interop, smoke
  (smoke: one CuPy and one Numba kernel, for the installed package); default:
  all but smoke. Each part runs in its own process.
Prints one "PASS part.check" or "FAIL part.check" line per check (a failure
with its traceback); exit status 0 when all pass, 1 when one fails, 77 when
nothing can run here (no CuPy and no Numba, or no GPU).
"""
import gc
import os
import subprocess
import sys
import tempfile
import time
import traceback

from torch_common import numba_cuda_numpy_compat

numba_cuda_numpy_compat()

HERE = os.path.abspath(__file__)
N = 1 << 20
PARTS = ["cupy", "cupy-expandable", "cupy-compact", "numba", "numba-ipc", "numba-ipc-expandable",
         "interop"]
results = []


def check(name):
    """Decorator: run the check now, print PASS or FAIL (with the traceback) and go on."""
    def run(fn):
        t0 = time.time()
        try:
            fn()
            results.append(True)
            print("PASS %s (%.2f s)" % (name, time.time() - t0), flush=True)
        except Exception:
            results.append(False)
            print("FAIL %s\n%s" % (name, traceback.format_exc()), flush=True)
        gc.collect()
        return fn
    return run


def expect(cond, what):
    if not cond:
        raise AssertionError(what)


def allocations():
    import cca
    return cca.memory_stats()["allocation.all.current"]


# ---- CuPy ---------------------------------------------------------------------------------

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float *x, float *y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void spin(long long cycles, float *out) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] += 1.0f;
}
"""


def cupy_kernels():
    import cupy
    mod = cupy.RawModule(code=SAXPY)
    return mod.get_function("saxpy"), mod.get_function("spin")


def spin_cycles(cupy, seconds):
    khz = cupy.cuda.Device().attributes.get("ClockRate") or 2000000
    return int(khz * 1000 * seconds)


def part_cupy():
    import numpy as np
    import cupy
    import cupyx
    import cca
    import cca.cupy
    cca.cupy.install()
    saxpy, spin = cupy_kernels()

    @check("cupy.allocations_come_from_cca")
    def _():
        w = cupy.ones(256, dtype=cupy.float32)  # warm-up: whatever CuPy keeps after its first kernels
        float(cupy.sum(w * 2 + 1))
        del w
        gc.collect()
        base = allocations()
        x = cupy.arange(N, dtype=cupy.float32)
        expect(isinstance(x.data.mem._owner, cca.cupy._DeviceBlock), "the array's memory is not cca's")
        expect(allocations() == base + 1, "cca counts %d blocks, expected %d" % (allocations(), base + 1))
        y = x * 2 + 1                                   # an elementwise kernel
        s = float(cupy.sum(y, dtype=cupy.float64))      # a reduction (its temporaries too)
        expect(s == float(N) * N, "sum %r" % s)         # the sum of 2i + 1 below N
        z = cupy.ones(N, dtype=cupy.float32)
        saxpy(((N + 255) // 256,), (256,), (cupy.float32(3.0), x, z, cupy.int64(N)))
        expect(np.array_equal(cupy.asnumpy(z), 3 * np.arange(N, dtype=np.float32) + 1), "saxpy result")
        del x, y, z
        expect(allocations() == base, "blocks left after the arrays went: %d" % (allocations() - base))

    @check("cupy.streams_keep_blocks_apart")
    def _():
        n = N + 1111  # a size no other check uses: the best fit on s1 is the block freed there
        s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with s1:
            a = cupy.empty(n, dtype=cupy.float32)
            p = a.data.ptr
            del a
        with s2:
            b = cupy.empty(n, dtype=cupy.float32)
            expect(b.data.ptr != p, "a block freed on one stream went to another at once")
        with s1:
            c = cupy.empty(n, dtype=cupy.float32)
            expect(c.data.ptr == p, "the same stream did not reuse its block")
        del b, c

    @check("cupy.kernels_on_four_streams")
    def _():
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
        outs = []
        for k, s in enumerate(streams):
            with s:
                x = cupy.full(N, k + 1, dtype=cupy.float32)
                y = cupy.arange(N, dtype=cupy.float32)
                saxpy(((N + 255) // 256,), (256,), (cupy.float32(2.0), x, y, cupy.int64(N)))
                outs.append((k, y))
                del x  # freed while its stream may still run: reused on that stream only
        for k, y in outs:
            expect(np.array_equal(cupy.asnumpy(y, stream=streams[k]),
                                  np.arange(N, dtype=np.float32) + 2 * (k + 1)), "stream %d result" % k)
        for s in streams:
            s.synchronize()

    @check("cupy.record_stream_holds_the_block")
    def _():
        n = N + 2222  # a size no other check uses
        s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with s1:
            a = cupy.zeros(n, dtype=cupy.float32)
            p = a.data.ptr
        s1.synchronize()
        with s2:
            spin((1,), (1,), (cupy.int64(spin_cycles(cupy, 0.3)), a))
        cca.cupy.record_stream(a, s2)
        del a
        with s1:
            b = cupy.empty(n, dtype=cupy.float32)
            expect(b.data.ptr != p, "a block still in use on another stream was handed out")
        s2.synchronize()
        with s1:
            c = cupy.empty(n, dtype=cupy.float32)
            expect(c.data.ptr == p, "the block did not come back once its other stream was done")
        del b, c

    @check("cupy.pinned_memory")
    def _():
        before = cca.host_stats().active_requests.current  # (CuPy's staging buffers may be in it)
        h = cupyx.empty_pinned((N,), dtype=np.float32)
        expect(isinstance(cca.cupy._block_of(h), cca.cupy._HostBlock), "pinned array not cca's")
        expect(cca.host_stats().active_requests.current >= 1, "cca does not count the pinned array")
        h[:] = np.arange(N, dtype=np.float32)
        s = cupy.cuda.Stream(non_blocking=True)
        d = cupy.empty(N, dtype=cupy.float32)
        d.set(h, stream=s)
        with s:
            d *= 3
        out = cupyx.empty_pinned((N,), dtype=np.float32)
        d.get(stream=s, out=out)
        cca.cupy.record_stream(h, s)
        s.synchronize()
        expect(np.array_equal(out, 3 * np.arange(N, dtype=np.float32)), "pinned round trip")
        del h, out, d
        gc.collect()
        cca.host_empty_cache()
        expect(cca.host_stats().active_requests.current <= before, "pinned blocks left")

    @check("cupy.out_of_memory_then_recovery")
    def _():
        with_error = None
        try:
            cupy.empty(1 << 50, dtype=cupy.uint8)
        except cupy.cuda.memory.OutOfMemoryError as e:
            with_error = e
        expect(with_error is not None, "1 PiB did not raise CuPy's OutOfMemoryError")
        expect(isinstance(with_error.__cause__, cca.OutOfMemoryError), "cause %r" % (with_error.__cause__,))
        total = cupy.cuda.Device().mem_info[1]
        cca.set_memory_fraction(min(1.0, (4 << 30) / total))  # a 4 GiB device
        chunks, raised = [], False
        try:
            for _ in range(8):
                chunks.append(cupy.ones(1 << 28, dtype=cupy.float32))  # 1 GiB each
        except cupy.cuda.memory.OutOfMemoryError:
            raised = True
        expect(raised and 1 <= len(chunks) < 8, "no OutOfMemoryError under a 4 GiB limit (%d GiB)"
               % len(chunks))
        chunks.pop()  # (room for the sum's result)
        expect(float(chunks[0][:10].sum()) == 10.0, "memory before the error")
        del chunks
        again = cupy.ones(1 << 28, dtype=cupy.float32)
        expect(float(again.sum(dtype=cupy.float64)) == float(1 << 28), "after recovery")
        del again
        cca.set_memory_fraction(1.0)
        cca.empty_cache()

    @check("cupy.statistics_and_snapshot")
    def _():
        cca.record_history(True, max_entries=10000)
        x = cupy.arange(N, dtype=cupy.float32)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            cca.dump_snapshot(path)
            snap = cca.snapshot_to_json(path)
        cca.record_history(False)
        live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        expect(any(b["address"] == x.data.ptr for b in live), "the array is not in cca's snapshot")
        expect(any(e["action"] == "alloc" and e["addr"] == x.data.ptr
                   for e in snap["device_traces"][x.device.id]), "no alloc event for the array")
        expect("Allocated memory" in cca.memory_summary(x.device.id), "summary")
        expect(cca.memory_stats()["allocated_bytes.all.current"] >= 4 * N, "statistics")
        del x

    @check("cupy.scope_and_uninstall")
    def _():
        cca.cupy.uninstall()
        own = cupy.ones(16)
        expect(not isinstance(getattr(own.data.mem, "_owner", None), cca.cupy._DeviceBlock),
               "uninstall left cca in place")
        with cca.cupy.allocator():
            ours = cupy.ones(16)
        expect(isinstance(ours.data.mem._owner, cca.cupy._DeviceBlock), "the scope's array is not cca's")
        expect(float((ours + own).sum()) == 32.0, "mixed arrays")
        del own, ours
        cca.cupy.install()

    @check("cupy.no_failed_frees")
    def _():
        expect(cca.cupy.free_failures() == [], "frees failed: %r" % cca.cupy.free_failures())


def part_cupy_settings(settings):
    import numpy as np
    import cupy
    import cca
    import cca.cupy
    name = "cupy-" + settings.split(":")[0].split("_")[0]
    cca.cupy.install(settings=settings + ":True")
    saxpy, _ = cupy_kernels()

    @check(name + ".kernels_and_reuse")
    def _():
        rng = np.random.default_rng(7)
        live = {}
        for i in range(300):  # a random mix: sizes from 1 KiB to 64 MiB, half freed as we go
            if live and rng.random() < 0.45:
                k = list(live)[int(rng.integers(len(live)))]
                arr, value = live.pop(k)
                expect(bool((arr == value).all()), "block %d changed under us" % k)
            else:
                n = int(2 ** rng.uniform(8, 24))
                live[i] = (cupy.full(n, float(i), dtype=cupy.float32), float(i))
        x = cupy.arange(N, dtype=cupy.float32)
        y = cupy.zeros(N, dtype=cupy.float32)
        saxpy(((N + 255) // 256,), (256,), (cupy.float32(1.0), x, y, cupy.int64(N)))
        expect(np.array_equal(cupy.asnumpy(y), np.arange(N, dtype=np.float32)), "saxpy")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            cca.dump_snapshot(path)
            snap = cca.snapshot_to_json(path)
        expect(snap["segments"] and all(s.get("is_expandable") for s in snap["segments"]),
               "segments are not expandable under %s" % settings)
        del x, y, live
        gc.collect()
        before = cca.memory_stats()["reserved_bytes.all.current"]
        cca.empty_cache()
        after = cca.memory_stats()
        expect(after["reserved_bytes.all.current"] < before, "empty_cache gave nothing back")
        expect(after["reserved_bytes.all.current"] <= after["allocated_bytes.all.current"] + (64 << 20),
               "empty_cache kept %d bytes beyond the live ones" % (after["reserved_bytes.all.current"]
                                                                  - after["allocated_bytes.all.current"]))


# ---- Numba --------------------------------------------------------------------------------

def numba_kernels():
    from numba import cuda

    @cuda.jit
    def add(a, b, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = a[i] + b[i]

    @cuda.jit
    def scale(a, factor):
        i = cuda.grid(1)
        if i < a.size:
            a[i] *= factor

    @cuda.jit
    def sleepy(out, rounds):
        if cuda.grid(1) == 0:
            for _ in range(rounds):
                cuda.nanosleep(1000000)
            out[0] += 1.0

    return add, scale, sleepy


def device_address(arr):
    return arr.__cuda_array_interface__["data"][0]


def part_numba():
    import numpy as np
    from numba import cuda
    import cca
    import cca.numba
    add, scale, sleepy = numba_kernels()
    blocks = (N + 255) // 256

    @check("numba.entry_point")
    def _():
        expect(os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") == "cca.numba", "run with the variable")
        mm = cuda.current_context().memory_manager
        expect(isinstance(mm, cca.numba.CCAMemoryManager), "Numba's manager is %r" % type(mm))

    @check("numba.kernels_on_cca_memory")
    def _():
        w = cuda.to_device(np.ones(256, dtype=np.float32))  # warm-up: the first launch
        add[1, 256](w, w, w)
        cuda.synchronize()
        del w
        gc.collect()
        base = allocations()
        a = cuda.to_device(np.arange(N, dtype=np.float32))
        b = cuda.to_device(np.ones(N, dtype=np.float32))
        out = cuda.device_array(N, dtype=np.float32)
        expect(allocations() == base + 3, "cca counts %d blocks, expected %d" % (allocations(), base + 3))
        add[blocks, 256](a, b, out)
        expect(np.array_equal(out.copy_to_host(), np.arange(N, dtype=np.float32) + 1), "add result")
        view = out[N // 2:]                              # a view keeps the block
        del out
        gc.collect()
        expect(allocations() == base + 3, "the view's block went")
        expect(view.copy_to_host()[0] == N // 2 + 1, "the view's data")
        del a, b, view
        gc.collect()
        expect(allocations() == base, "blocks left: %d" % (allocations() - base))

    @check("numba.kernels_on_four_streams")
    def _():
        streams = [cuda.stream() for _ in range(4)]
        outs = []
        for k, s in enumerate(streams):
            a = cuda.to_device(np.full(N, k, dtype=np.float32), stream=s)
            b = cuda.to_device(np.arange(N, dtype=np.float32), stream=s)
            out = cuda.device_array(N, dtype=np.float32, stream=s)
            add[blocks, 256, s](a, b, out)
            outs.append((k, s, out.copy_to_host(stream=s), (a, b, out)))
        for k, s, host, keep in outs:
            s.synchronize()
            expect(np.array_equal(host, np.arange(N, dtype=np.float32) + k), "stream %d" % k)

    @check("numba.pinned_and_mapped")
    def _():
        before = cca.host_stats().active_requests.current
        pinned = cuda.pinned_array(N, dtype=np.float32)
        mapped = cuda.mapped_array(N, dtype=np.float32)
        expect(cca.host_stats().active_requests.current == before + 2, "host arrays are not cca's")
        pinned[:] = np.arange(N, dtype=np.float32)
        d = cuda.to_device(pinned)
        mapped[:] = 1.0
        add[blocks, 256](d, d, mapped)                 # the GPU writes host memory
        cuda.synchronize()
        expect(np.array_equal(mapped, 2 * np.arange(N, dtype=np.float32)), "mapped result")
        del pinned, mapped, d
        gc.collect()
        expect(cca.host_stats().active_requests.current == before, "host blocks left")

    @check("numba.memory_info")
    def _():
        info = cuda.current_context().get_memory_info()
        drv = cuda.cudadrv.driver.driver
        if cca.numba._nv_binding():
            free, total = drv.cuMemGetInfo()
        else:  # Numba's ctypes binding
            import ctypes
            f, t = ctypes.c_size_t(), ctypes.c_size_t()
            drv.cuMemGetInfo(ctypes.byref(f), ctypes.byref(t))
            free, total = f.value, t.value
        expect(info.total == total and 0 < info.free <= info.total, "%r vs %r" % (info, (free, total)))

    @check("numba.defer_cleanup")
    def _():
        base = allocations()
        with cuda.defer_cleanup():
            a = cuda.device_array(N, dtype=np.float32)
            del a
            gc.collect()
            expect(allocations() == base + 1, "freed inside defer_cleanup")
        expect(allocations() == base, "not freed after defer_cleanup")

    @check("numba.record_stream_holds_the_block")
    def _():
        n = N + 3333  # a size no other check uses
        s = cuda.stream()
        a = cuda.device_array(n, dtype=np.float32)
        p = device_address(a)
        cuda.synchronize()
        sleepy[1, 1, s](a, 300)                         # about 0.3 s on s
        cca.numba.record_stream(a, s)
        del a
        gc.collect()
        b = cuda.device_array(n, dtype=np.float32)
        expect(device_address(b) != p, "a block still in use on another stream was handed out")
        s.synchronize()
        c = cuda.device_array(n, dtype=np.float32)
        expect(device_address(c) == p, "the block did not come back once its stream was done")
        del b, c

    @check("numba.out_of_memory_then_recovery")
    def _():
        oom = cca.numba._oom_code()
        try:
            cuda.device_array(1 << 48, dtype=np.uint8)
            raise AssertionError("256 TiB did not raise")
        except cuda.cudadrv.driver.CudaAPIError as e:
            expect(e.code == oom, "code %r" % (e.code,))
            expect(isinstance(e.__cause__, cca.OutOfMemoryError), "cause %r" % (e.__cause__,))
        total = cuda.current_context().get_memory_info().total
        cca.set_memory_fraction(min(1.0, (4 << 30) / total))
        chunks, raised = [], False
        try:
            for _ in range(8):
                chunks.append(cuda.device_array(1 << 28, dtype=np.float32))
        except cuda.cudadrv.driver.CudaAPIError as e:
            raised = e.code == oom
        expect(raised and 1 <= len(chunks) < 8, "no out-of-memory under a 4 GiB limit")
        del chunks
        gc.collect()
        again = cuda.to_device(np.ones(1 << 26, dtype=np.float32))
        scale[(1 << 26) // 256, 256](again, 2.0)
        expect(float(again.copy_to_host().sum(dtype=np.float64)) == float(2 << 26), "after recovery")
        del again
        cca.set_memory_fraction(1.0)
        cca.empty_cache()

    @check("numba.no_failed_frees")
    def _():
        expect(cca.numba.free_failures() == [], "frees failed: %r" % cca.numba.free_failures())


def ipc_consumer(queue, answers):
    """The child of numba.ipc: open the parent's array through cca, read it, double it."""
    try:
        import numpy as np
        from numba import cuda
        import cca.numba
        handle = queue.get()
        kind = type(handle._ipc_handle).__name__
        _, scale, _ = numba_kernels()
        with handle as arr:
            seen = arr.copy_to_host()
            scale[(arr.size + 255) // 256, 256](arr, 2.0)
            cuda.synchronize()
        expected = np.arange(1024, 1024 + seen.size, dtype=np.float32)
        answers.put((kind, float(seen.sum()), seen.size, np.array_equal(seen, expected)))
    except Exception:
        answers.put(("error", traceback.format_exc(), 0, False))


def part_numba_ipc(name):
    import multiprocessing
    import numpy as np
    from numba import cuda
    import cca
    import cca.numba

    @check(name + ".between_processes")
    def _():
        ctx = multiprocessing.get_context("spawn")
        queue, answers = ctx.Queue(), ctx.Queue()
        arr = cuda.to_device(np.arange(N, dtype=np.float32))
        cuda.synchronize()
        view = arr[1024:]
        try:
            handle = view.get_ipc_handle()
        except cca.CcaError as e:
            if "expandable" in name and e.status == "CCA_ERR_NOT_SUPPORTED":
                print("   SKIPPED: this driver cannot share expandable segments here: %s" % e)
                return
            raise
        child = ctx.Process(target=ipc_consumer, args=(queue, answers))
        child.start()
        queue.put(handle)
        del handle
        kind, total, size, same = answers.get(timeout=120)
        child.join(60)
        expect(kind == "CCAIpcHandle", "child: %s" % total)
        expect(size == N - 1024 and same, "the child saw other data (size %d)" % size)
        host = arr.copy_to_host()
        expect(np.array_equal(host[1024:], 2 * np.arange(1024, N, dtype=np.float32)), "child's writes")
        expect(np.array_equal(host[:1024], np.arange(1024, dtype=np.float32)), "outside the view")
        if "expandable" in name:
            with tempfile.TemporaryDirectory() as tmp:
                cca.dump_snapshot(os.path.join(tmp, "s.pickle"))
                snap = cca.snapshot_to_json(os.path.join(tmp, "s.pickle"))
            expect(all(s.get("is_expandable") for s in snap["segments"]), "not expandable segments")
        del arr, view
        gc.collect()
        lib = cca._lib.load()
        import ctypes
        pending = ctypes.c_size_t()
        cca._check(lib, lib.cca_ipc_collect(ctypes.byref(pending)), "ipc_collect")
        expect(pending.value == 0, "%d frees still wait for other processes" % pending.value)


# ---- between the libraries ----------------------------------------------------------------

def part_interop():
    import numpy as np
    import cupy
    from numba import cuda
    import cca
    import cca.cupy
    import cca.numba
    cca.cupy.install()
    cuda.set_memory_manager(cca.numba.CCAMemoryManager)
    try:
        import torch
        have_torch = torch.cuda.is_available()
    except ImportError:
        have_torch = False
    _, scale, _ = numba_kernels()
    ref = np.arange(N, dtype=np.float32)

    def torch_check(name, make, consume_first):
        @check(name)
        def _():
            if not have_torch:
                print("   (no PyTorch with CUDA here: skipped)")
                return
            base = allocations()
            src = make()
            expect(allocations() == base + 1, "the source is not one cca block")
            t = torch.from_dlpack(src) if hasattr(src, "__dlpack__") else torch.as_tensor(src, device="cuda")
            if consume_first:
                del src
                gc.collect()
                expect(allocations() == base + 1, "the block went with the first owner")
                t.mul_(2)
                torch.cuda.synchronize()
                expect(np.array_equal(t.cpu().numpy(), 2 * ref), "torch's view of the memory")
                del t
            else:
                t.add_(1)
                torch.cuda.synchronize()
                del t
                gc.collect()
                expect(allocations() == base + 1, "the block went with torch")
                host = src.get() if hasattr(src, "get") else src.copy_to_host()
                expect(np.array_equal(host, ref + 1), "torch's writes")
                del src
            gc.collect()
            expect(allocations() == base, "the block outlived both owners")

    torch_check("interop.cupy_to_torch_cupy_freed_first", lambda: cupy.arange(N, dtype=cupy.float32), True)
    torch_check("interop.cupy_to_torch_torch_freed_first", lambda: cupy.arange(N, dtype=cupy.float32), False)
    torch_check("interop.numba_to_torch_numba_freed_first", lambda: cuda.to_device(ref), True)

    @check("interop.numba_to_cupy_numba_freed_first")
    def _():
        base = allocations()
        d = cuda.to_device(ref)
        c = cupy.asarray(d)                               # __cuda_array_interface__
        expect(c.data.ptr == device_address(d), "CuPy copied instead of sharing")
        del d
        gc.collect()
        expect(allocations() == base + 1, "the block went with Numba's array")
        expect(float((c * 2).sum(dtype=cupy.float64)) == 2 * float(ref.sum(dtype=np.float64)), "CuPy's view")
        del c
        gc.collect()
        expect(allocations() == base, "the block outlived both owners")

    @check("interop.cupy_to_numba_cupy_freed_first")
    def _():
        base = allocations()
        x = cupy.arange(N, dtype=cupy.float32)
        d = cuda.as_cuda_array(x)
        del x
        gc.collect()
        expect(allocations() == base + 1, "the block went with CuPy's array")
        scale[(N + 255) // 256, 256](d, 3.0)
        expect(np.array_equal(d.copy_to_host(), 3 * ref), "Numba's kernel on CuPy's block")
        del d
        gc.collect()
        expect(allocations() == base, "the block outlived both owners")

    @check("interop.cupy_dlpack_to_cupy")
    def _():
        base = allocations()
        x = cupy.arange(N, dtype=cupy.float32)
        y = cupy.from_dlpack(x)
        del x
        gc.collect()
        expect(float(y.sum(dtype=cupy.float64)) == float(ref.sum(dtype=np.float64))
               and allocations() == base + 1, "DLPack round trip")
        del y
        gc.collect()
        expect(allocations() == base, "the block outlived both owners")


def part_smoke():
    import cca
    print("cca package: %s, library: %s" % (os.path.dirname(cca.__file__), cca.library_path()))
    prefix = os.environ.get("CCA_EXPECT_PREFIX")
    if prefix:
        @check("smoke.installed_package")
        def _():
            prefix_real = os.path.realpath(prefix)
            expect(os.path.realpath(cca.__file__).startswith(prefix_real + os.sep),
                   "cca comes from %s, not from %s" % (cca.__file__, prefix))
            expect(cca.library_path().startswith(prefix_real + os.sep),
                   "libcca comes from %s, not from %s" % (cca.library_path(), prefix))
    try:
        import cupy
        import cca.cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        @check("smoke.cupy")
        def _():
            import numpy as np
            cca.cupy.install()
            x = cupy.arange(N, dtype=cupy.float32)
            expect(isinstance(x.data.mem._owner, cca.cupy._DeviceBlock), "not cca's")
            expect(float((x * 2).sum(dtype=cupy.float64)) == float(N) * (N - 1), "result")
    try:
        from numba import cuda
        import cca.numba
    except ImportError:
        cuda = None
    if cuda is not None:
        @check("smoke.numba")
        def _():
            import numpy as np
            cuda.set_memory_manager(cca.numba.CCAMemoryManager)
            _, scale, _ = numba_kernels()
            d = cuda.to_device(np.ones(N, dtype=np.float32))
            expect(isinstance(cuda.current_context().memory_manager, cca.numba.CCAMemoryManager), "manager")
            scale[(N + 255) // 256, 256](d, 5.0)
            expect(float(d.copy_to_host().sum(dtype=np.float64)) == 5.0 * N, "result")


def worker(part):
    if part == "cupy":
        part_cupy()
    elif part == "cupy-expandable":
        part_cupy_settings("expandable_segments")
    elif part == "cupy-compact":
        part_cupy_settings("compact_memory")
    elif part == "numba":
        part_numba()
    elif part in ("numba-ipc", "numba-ipc-expandable"):
        part_numba_ipc(part)
    elif part == "interop":
        part_interop()
    elif part == "smoke":
        part_smoke()
    else:
        raise SystemExit("unknown part %s" % part)
    return 0 if all(results) else 1


def have(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def main(argv):
    if "--worker" in argv:
        return worker(argv[argv.index("--worker") + 1])
    parts, args = [], list(argv)
    while "--part" in args:
        i = args.index("--part")
        parts.append(args[i + 1])
        del args[i:i + 2]
    env = dict(os.environ)
    if args:
        env["CCA_LIBRARY"] = os.path.abspath(args[0])
    parts = parts or PARTS
    cupy_ok, numba_ok = have("cupy"), have("numba.cuda")
    print("CuPy: %s, Numba: %s" % (cupy_ok, numba_ok))
    if not cupy_ok and not numba_ok:
        print("SKIPPED: neither CuPy nor Numba is installed")
        return 77
    needs = {"cupy": ["cupy"], "cupy-expandable": ["cupy"], "cupy-compact": ["cupy"],
             "numba": ["numba"], "numba-ipc": ["numba"], "numba-ipc-expandable": ["numba"],
             "interop": ["cupy", "numba"], "smoke": []}
    failed = []
    for part in parts:
        missing = [m for m in needs.get(part, []) if not {"cupy": cupy_ok, "numba": numba_ok}[m]]
        if missing:
            print("SKIPPED %s: no %s" % (part, ", ".join(missing)))
            continue
        penv = dict(env)
        if part.startswith("numba"):
            penv["NUMBA_CUDA_MEMORY_MANAGER"] = "cca.numba"
        if part.endswith("-expandable") and part.startswith("numba"):
            penv["CCA_ALLOC_CONF"] = "expandable_segments:True"  # both processes
        t0 = time.time()
        try:
            rc = subprocess.run([sys.executable, HERE, "--worker", part], env=penv, timeout=300).returncode
        except subprocess.TimeoutExpired:
            rc = "timed out after 300 s"
        if rc != 0:
            failed.append(part)
            print("FAIL %s (exit %s, %.1f s)" % (part, rc, time.time() - t0), flush=True)
        else:
            print("part %s passed (%.1f s)" % (part, time.time() - t0), flush=True)
    print("python-ecosystem: %s" % ("FAILED parts: " + " ".join(failed) if failed else "all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
