"""cca.cupy and cca.numba without a GPU: on the simulated backend, against
small stand-ins for the parts of CuPy's and numba-cuda's APIs the two modules
use (the same names, signatures and ownership rules: UnownedMemory keeps its
owner, Numba's AutoFreePointer frees when its last OwnedPointer goes). The
GPU check (tests/cuda/cupy_numba.py) runs the real libraries.

Run by ctest (python_package); by hand:
  CCA_BACKEND=sim PYTHONPATH=python python3 -m unittest tests/python/test_python_ecosystem.py
"""
import collections
import contextlib
import ctypes
import gc
import os
import pickle
import subprocess
import sys
import threading
import types
import unittest
import weakref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("CCA_BACKEND", "sim")

import cca  # noqa: E402
from cca import _lib  # noqa: E402

MiB = 1 << 20
CAP = 64 * MiB


# ---- the simulated device, made through cca_backend.h ------------------------------------

class SimConfig(ctypes.Structure):  # cca_sim_config_t
    _fields_ = [("devices", ctypes.c_int), ("total_memory", ctypes.c_size_t),
                ("memory_cap", ctypes.c_size_t), ("backed", ctypes.c_bool),
                ("manual_events", ctypes.c_bool), ("granularity", ctypes.c_size_t),
                ("addresses", ctypes.c_void_p), ("address_count", ctypes.c_size_t),
                ("ipc_shared", ctypes.c_bool), ("no_peer_access", ctypes.c_bool)]


def start_sim(manual_events=True):
    """cca on a fresh simulated device of 1 GiB capped at CAP, its events completing only
    when the test says so; returns the backend handle."""
    lib = _lib.load()
    lib.cca_shutdown()
    cfg = SimConfig(devices=1, total_memory=1 << 30, memory_cap=CAP, manual_events=manual_events)
    be = ctypes.c_void_p()
    lib.cca_sim_create.argtypes = [ctypes.POINTER(SimConfig), ctypes.POINTER(ctypes.c_void_p)]
    lib.cca_init_with_backend.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.cca_sim_complete_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_bool]
    assert lib.cca_sim_create(ctypes.byref(cfg), ctypes.byref(be)) == 0
    assert lib.cca_init_with_backend(be, b"") == 0
    return be


def backend_op(name):
    """The value of CCA_OP_<name> in cca_backend.h's enum (from the header itself)."""
    with open(os.path.join(ROOT, "include", "cca_backend.h")) as f:
        text = f.read()
    ops = []
    for line in text[text.index("CCA_OP_MALLOC = 0"):].splitlines():
        word = line.strip().split("=")[0].strip(" ,")
        if not word.startswith("CCA_OP_"):
            break
        ops.append(word)
    return ops.index("CCA_OP_" + name)


def inject_fault(backend, op, nth=1):
    lib = _lib.load()
    lib.cca_sim_inject_fault.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_bool,
                                         ctypes.c_int]
    assert lib.cca_sim_inject_fault(backend, backend_op(op), nth, False, 4) == 0  # CCA_ERR_BACKEND


def allocations():
    return cca.memory_stats()["allocation.all.current"]


# ---- a stand-in for CuPy 14's allocator API -----------------------------------------------

def fake_cupy():
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    memory = types.ModuleType("cupy.cuda.memory")
    runtime = types.ModuleType("cupy.cuda.runtime")
    cupy.cuda, cuda.memory, cuda.runtime = cuda, memory, runtime
    local = threading.local()
    state = {"allocator": None, "pinned": None, "device": 0}

    class OutOfMemoryError(MemoryError):
        def __init__(self, size, total, limit=0):
            super().__init__("Out of memory allocating {:,} bytes (allocated so far: {:,} bytes)."
                             .format(size, total))
            self.size, self.total = size, total

    class UnownedMemory:
        def __init__(self, ptr, size, owner, device_id=-1):
            if device_id < 0:
                raise RuntimeError("the stand-in wants an explicit device")
            self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

    class PinnedMemoryPointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def __enter__(self):
            local.__dict__.setdefault("streams", []).append(self)
            return self

        def __exit__(self, *exc):
            local.streams.pop()

    class Pool:
        def __init__(self):
            self.freed_all = 0

        def free_all_blocks(self):
            self.freed_all += 1

        def malloc(self, size):
            return "own-pool-%d" % size

    def _own_malloc(size):
        return "cupy-own-%d" % size

    def get_current_stream():
        streams = getattr(local, "streams", None)
        return streams[-1] if streams else Stream(0)

    def set_allocator(allocator=None):
        if getattr(local, "allocator", None) is not None:
            raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
        state["allocator"] = allocator or _own_malloc

    def get_allocator():
        return getattr(local, "allocator", None) or state["allocator"]

    @contextlib.contextmanager
    def using_allocator(allocator=None):
        previous = getattr(local, "allocator", None)
        local.allocator = allocator or _own_malloc
        try:
            yield
        finally:
            local.allocator = previous

    def set_pinned_memory_allocator(allocator=None):
        state["pinned"] = allocator or _own_malloc

    memory.OutOfMemoryError = OutOfMemoryError
    cuda.UnownedMemory, cuda.MemoryPointer = UnownedMemory, MemoryPointer
    cuda.PinnedMemoryPointer, cuda.Stream = PinnedMemoryPointer, Stream
    cuda.get_current_stream, cuda.set_allocator, cuda.get_allocator = get_current_stream, set_allocator, get_allocator
    cuda.using_allocator, cuda.set_pinned_memory_allocator = using_allocator, set_pinned_memory_allocator
    cuda.alloc = lambda size: get_allocator()(size)
    cuda.alloc_pinned_memory = lambda size: state["pinned"](size)
    runtime.getDevice = lambda: state["device"]
    pool, pinned_pool = Pool(), Pool()
    cupy.get_default_memory_pool = lambda: pool
    cupy.get_default_pinned_memory_pool = lambda: pinned_pool
    state["allocator"], state["pinned"] = pool.malloc, pinned_pool.malloc
    cupy._state = state
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.memory": memory, "cupy.cuda.runtime": runtime}


# ---- a stand-in for numba-cuda's EMM interface (numba/cuda/cudadrv/driver.py) ---------------

def fake_numba():
    numba = types.ModuleType("numba")
    ncuda = types.ModuleType("numba.cuda")
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    drv = types.ModuleType("numba.cuda.cudadrv.driver")
    numba.cuda, ncuda.cudadrv, cudadrv.driver = ncuda, cudadrv, drv

    class CUdeviceptr:
        def __init__(self, value=0):
            self.value = value

        def __int__(self):
            return self.value

    class CUresult:
        CUDA_ERROR_OUT_OF_MEMORY = 2

    drv.binding = types.SimpleNamespace(CUdeviceptr=CUdeviceptr, CUresult=CUresult)

    class CudaAPIError(Exception):
        def __init__(self, code, msg):
            super().__init__(code, msg)
            self.code, self.msg = code, msg

    class UniqueDict(dict):
        def __setitem__(self, key, value):
            if key in self:
                raise AssertionError("key already in dictionary: %r" % (key,))
            super().__setitem__(key, value)

    class PendingDeallocs:
        def __init__(self):
            self.cleared = 0

        def clear(self):
            self.cleared += 1

        @contextlib.contextmanager
        def disable(self):
            yield

    class BaseCUDAMemoryManager:
        def __init__(self, *args, **kwargs):
            if "context" not in kwargs:
                raise RuntimeError("Memory manager requires a context")
            self.context = kwargs.pop("context")

    class HostOnlyCUDAMemoryManager(BaseCUDAMemoryManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.allocations = UniqueDict()
            self.deallocations = PendingDeallocs()

        def memhostalloc(self, size, mapped=False, portable=False, wc=False):
            return ("numba's own", size, mapped, wc)

        def reset(self):
            self.allocations.clear()
            self.deallocations.clear()

        @contextlib.contextmanager
        def defer_cleanup(self):
            with self.deallocations.disable():
                yield

    class MemoryPointer:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.context, self.device_pointer, self.size = context, pointer, size
            self.is_managed = finalizer is not None
            self.refct = 1
            self.handle = self.device_pointer
            self._owner = owner
            if finalizer is not None:
                self._finalizer = weakref.finalize(self, finalizer)

        @property
        def owner(self):
            return self if self._owner is None else self._owner

        def own(self):
            return OwnedPointer(weakref.proxy(self))

        def free(self):
            if self.is_managed:
                self._finalizer()

        def view(self, start, stop=None):
            size = self.size - start if stop is None else stop - start
            view = MemoryPointer(self.context, CUdeviceptr(int(self.device_pointer) + start), size,
                                 owner=self.owner)
            if isinstance(self.owner, (MemoryPointer, OwnedPointer)):
                return OwnedPointer(weakref.proxy(self.owner), view)
            return view

    class AutoFreePointer(MemoryPointer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.refct -= 1

    class MappedMemory(AutoFreePointer):
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.owned, self.host_pointer = owner, pointer
            super().__init__(context, CUdeviceptr(pointer), size, finalizer=finalizer)
            self.handle = self.host_pointer

    class PinnedMemory:
        def __init__(self, context, pointer, size, owner=None, finalizer=None):
            self.context, self.owned, self.size, self.host_pointer = context, owner, size, pointer
            self.handle = pointer
            if finalizer is not None:
                weakref.finalize(self, finalizer)

    class OwnedPointer:
        def __init__(self, memptr, view=None):
            self._mem = memptr
            self._view = self._mem if view is None else view
            mem = self._mem

            def deref():
                try:
                    mem.refct -= 1
                    if mem.refct == 0:
                        mem.free()
                except ReferenceError:
                    pass
            self._mem.refct += 1
            weakref.finalize(self, deref)

        def __getattr__(self, name):
            return getattr(self._view, name)

    class IpcHandle:
        def __init__(self, base, handle, size, source_info=None, offset=0):
            self.base, self.handle, self.size = base, handle, size
            self.source_info, self.offset, self._impl = source_info, offset, None

    for cls in (CudaAPIError, BaseCUDAMemoryManager, HostOnlyCUDAMemoryManager, MemoryPointer,
                AutoFreePointer, MappedMemory, PinnedMemory, OwnedPointer, IpcHandle):
        setattr(drv, cls.__name__, cls)
    drv.MemoryInfo = collections.namedtuple("MemoryInfo", "free,total")

    def set_memory_manager(mm_plugin):
        if mm_plugin(context=None).interface_version != 1:
            raise RuntimeError("EMM Plugin interface has the wrong version")
        ncuda.memory_manager = mm_plugin
    ncuda.set_memory_manager = set_memory_manager
    return {"numba": numba, "numba.cuda": ncuda, "numba.cuda.cudadrv": cudadrv,
            "numba.cuda.cudadrv.driver": drv}


class FakeDevice:
    id = 0

    def get_device_identity(self):
        return {"pci_domain_id": 0, "pci_bus_id": 1, "pci_device_id": 0}


class FakeContext:
    device = FakeDevice()


# ---- the tests ---------------------------------------------------------------------------

class WithoutTheLibraries(unittest.TestCase):
    def test_import_and_clear_errors(self):
        """Both modules import without CuPy and Numba; using them says what is missing, and
        Numba's entry point (NUMBA_CUDA_MEMORY_MANAGER=cca.numba) is there."""
        code = ("import sys; sys.modules['cupy'] = None; sys.modules['numba'] = None\n"
                "import cca.cupy, cca.numba\n"
                "assert cca.numba._numba_memory_manager is cca.numba.CCAMemoryManager\n"
                "for f in (cca.cupy.install, cca.cupy.uninstall, cca.numba.install,\n"
                "          lambda: cca.numba.CCAMemoryManager(context=None)):\n"
                "    try:\n"
                "        f(); print('no error')\n"
                "    except ImportError as e:\n"
                "        print(e)\n")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        lines = out.stdout.splitlines()
        self.assertEqual(lines[0][:34], "cca.cupy needs CuPy (import cupy f")
        self.assertEqual(lines[1], "no error")  # nothing to uninstall
        self.assertTrue(lines[2].startswith("cca.numba needs numba-cuda"), lines[2])
        self.assertTrue(lines[3].startswith("cca.numba needs numba-cuda"), lines[3])


class Fakes(unittest.TestCase):
    """Shared set-up: the stand-ins in sys.modules, cca on a fresh simulated device."""
    modules = {}

    @classmethod
    def setUpClass(cls):
        cls.saved = {name: sys.modules.get(name) for name in cls.modules}
        sys.modules.update(cls.modules)

    @classmethod
    def tearDownClass(cls):
        for name, mod in cls.saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod

    def setUp(self):
        self.lib = _lib.load()
        self.backend = start_sim()
        self.conf = os.environ.get("CCA_ALLOC_CONF")

    def tearDown(self):
        gc.collect()
        if self.conf is None:
            os.environ.pop("CCA_ALLOC_CONF", None)
        else:
            os.environ["CCA_ALLOC_CONF"] = self.conf
        self.assertEqual(allocations(), 0, "a test left a block allocated")
        self.lib.cca_shutdown()

    def complete(self, stream):
        self.assertEqual(self.lib.cca_sim_complete_stream(self.backend, 0, stream, False), 0)


class CuPy(Fakes):
    modules = fake_cupy()

    def setUp(self):
        super().setUp()
        import cca.cupy
        cca.cupy._module = cca.cupy._bound = None
        self.cc = cca.cupy
        self.cupy = sys.modules["cupy"]
        self.cupy.cuda.set_allocator(self.cupy.get_default_memory_pool().malloc)

    def tearDown(self):
        self.cc.uninstall()
        self.assertEqual(self.cc.free_failures(), [])
        super().tearDown()

    def test_install_and_uninstall(self):
        cupy = self.cupy
        pool = cupy.get_default_memory_pool()
        before = pool.freed_all
        self.cc.install()
        self.assertIs(cupy.cuda.get_allocator(), self.cc.malloc)
        self.assertEqual(self.cc.installed(), (True, True))
        self.assertEqual(pool.freed_all, before + 1)  # CuPy's cached blocks go back to the device
        self.cc.install(pinned=False)  # a second call: pinned memory goes back to CuPy's pool
        self.assertEqual(self.cc.installed(), (True, False))
        self.assertEqual(cupy.cuda.alloc_pinned_memory(8), "own-pool-8")
        self.cc.uninstall()
        self.assertEqual(cupy.cuda.alloc(8), "own-pool-8")
        self.assertEqual(self.cc.installed(), (False, False))

    def test_blocks_come_from_cca_and_go_back_when_cupy_drops_them(self):
        self.cc.install()
        p = self.cupy.cuda.alloc(3 * MiB)
        self.assertEqual(allocations(), 1)
        self.assertEqual(cca.memory_stats()["allocated_bytes.all.current"], 3 * MiB)
        view = self.cupy.cuda.MemoryPointer(p.mem, 4096)  # an offset pointer keeps the block
        del p
        self.assertEqual(allocations(), 1)
        del view
        self.assertEqual(allocations(), 0)
        empty = self.cupy.cuda.alloc(0)
        self.assertEqual((empty.ptr, empty.mem._owner, allocations()), (0, None, 0))

    def test_the_current_device_and_stream(self):
        self.cc.install()
        cupy = self.cupy
        s1, s2 = cupy.cuda.Stream(0x1000), cupy.cuda.Stream(0x2000)
        with s1:
            a = cupy.cuda.alloc(MiB)
            first = a.ptr
            del a
            b = cupy.cuda.alloc(MiB)  # the same stream reuses the block at once
            self.assertEqual(b.ptr, first)
            del b
        with s2:
            c = cupy.cuda.alloc(MiB)  # another stream does not get it
            self.assertNotEqual(c.ptr, first)
            self.assertEqual(c.device_id, 0)
            del c
        cupy._state["device"] = 5  # no such device on the simulator: cca's error, not CuPy's
        with self.assertRaises(cca.CcaError) as cm:
            cupy.cuda.alloc(MiB)
        self.assertNotIsInstance(cm.exception, MemoryError)
        self.assertIn("device 5", str(cm.exception))
        cupy._state["device"] = 0

    def test_record_stream_holds_the_block_until_that_stream_is_done(self):
        self.cc.install()
        cupy = self.cupy
        s1, s2 = cupy.cuda.Stream(0x1000), 0x2000
        with s1:
            a = cupy.cuda.alloc(MiB)
            first = a.ptr
            arr = types.SimpleNamespace(data=a)  # as a cupy.ndarray: .data is its MemoryPointer
            self.cc.record_stream(arr, s2)
            del a, arr
            b = cupy.cuda.alloc(MiB)
            self.assertNotEqual(b.ptr, first)  # s2's work may still use the first block
            self.complete(s2)
            c = cupy.cuda.alloc(MiB)
            self.assertEqual(c.ptr, first)  # s2 done: the block is back
            del b, c
        with self.assertRaises(ValueError):
            self.cc.record_stream(types.SimpleNamespace(data=cupy.cuda.MemoryPointer(
                cupy.cuda.UnownedMemory(1234, 8, object(), 0), 0)), s2)
        with self.assertRaises(TypeError):
            self.cc.record_stream(types.SimpleNamespace(), "stream")

    def test_out_of_memory_is_cupys_error_then_recovers(self):
        self.cc.install()
        keep = self.cupy.cuda.alloc(32 * MiB)
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as cm:
            self.cupy.cuda.alloc(48 * MiB)
        self.assertEqual(cm.exception.size, 48 * MiB)
        self.assertEqual(cm.exception.total, 32 * MiB)  # allocated so far
        self.assertIsInstance(cm.exception.__cause__, cca.OutOfMemoryError)
        self.assertIn("CUDA out of memory", str(cm.exception.__cause__))
        self.assertEqual(allocations(), 1)  # nothing lost
        del keep
        again = self.cupy.cuda.alloc(48 * MiB)
        self.assertEqual(allocations(), 1)
        del again
        with self.assertRaises(ValueError):
            self.cc.malloc(-1)
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as cm:
            self.cupy.cuda.alloc((1 << 64) + 512)  # not 512 bytes, as a wrapped size_t would be
        self.assertEqual(cm.exception.size, (1 << 64) + 512)
        with self.assertRaises(cca.CcaError) as cm:  # cca's host allocator: 1 EB or more is invalid
            self.cupy.cuda.alloc_pinned_memory((1 << 64) + 512)
        self.assertEqual(cm.exception.status, "CCA_ERR_INVALID_ARGUMENT")
        self.assertEqual((allocations(), cca.host_stats().active_requests.current), (0, 0))

    def test_pinned_memory(self):
        self.cc.install()
        p = self.cupy.cuda.alloc_pinned_memory(5000)
        self.assertNotEqual(p.ptr, 0)
        self.assertEqual(p.mem.size, 5000)
        self.assertEqual(cca.host_stats().active_requests.current, 1)
        self.cc.record_stream(p, 0x3000)
        arr = types.SimpleNamespace(base=p)  # as cupyx.empty_pinned's numpy array
        self.cc.record_stream(arr, 0x3000)
        del p, arr
        self.assertEqual(cca.host_stats().active_requests.current, 1)  # 0x3000 may still use it
        self.complete(0x3000)
        self.assertEqual(self.lib.cca_host_empty_cache(), 0)
        self.assertEqual(cca.host_stats().active_requests.current, 0)
        q = self.cupy.cuda.alloc_pinned_memory(100)
        del q  # no stream named: back at once
        self.assertEqual(cca.host_stats().active_requests.current, 0)

    def test_a_failing_backend_is_ccas_error_and_loses_nothing(self):
        self.cc.install()
        inject_fault(self.backend, "MALLOC")
        with self.assertRaises(cca.CcaError) as cm:
            self.cupy.cuda.alloc(MiB)
        self.assertEqual(cm.exception.status, "CCA_ERR_BACKEND")
        self.assertNotIsInstance(cm.exception, MemoryError)
        self.assertEqual(allocations(), 0)
        p = self.cupy.cuda.alloc(MiB)
        self.assertEqual(allocations(), 1)
        inject_fault(self.backend, "HOST_ALLOC")
        with self.assertRaises(cca.CcaError):
            self.cupy.cuda.alloc_pinned_memory(4096)
        h = self.cupy.cuda.alloc_pinned_memory(4096)
        self.assertEqual(cca.host_stats().active_requests.current, 1)
        del p, h

    def test_threads(self):
        """Four threads allocate and free through CuPy's allocator on two streams each, one
        of them marking blocks used on the other; nothing is left and no free fails."""
        import random
        self.cc.install()
        cupy = self.cupy
        errors = []

        def work(seed):
            rng = random.Random(seed)
            live = []
            try:
                for _ in range(400):
                    stream = cupy.cuda.Stream(0x100 * (1 + seed * 2 + rng.randrange(2)))
                    with stream:
                        if live and rng.random() < 0.5:
                            live.pop(rng.randrange(len(live)))
                        else:
                            p = cupy.cuda.alloc(rng.choice((512, 4096, 65536)))
                            if rng.random() < 0.2:
                                self.cc.record_stream(p, 0x9000 + seed)
                            live.append(p)
            except Exception as e:  # reported below
                errors.append(e)
            live.clear()

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(errors, [])
        for k in range(4):
            self.complete(0x9000 + k)
        gc.collect()
        self.assertEqual(allocations(), 0)

    def test_scope_is_this_threads(self):
        cupy = self.cupy
        with self.cc.allocator():
            p = cupy.cuda.alloc(MiB)
            seen = []
            t = threading.Thread(target=lambda: seen.append(cupy.cuda.alloc(8)))
            t.start()
            t.join()
            self.assertEqual(seen, ["own-pool-8"])
        self.assertEqual(cupy.cuda.alloc(8), "own-pool-8")
        self.assertEqual(allocations(), 1)  # freed whenever CuPy drops it
        del p
        self.assertEqual(allocations(), 0)

    def test_settings(self):
        self.lib.cca_shutdown()  # settings before cca starts go to its environment
        os.environ.pop("CCA_ALLOC_CONF", None)
        with self.assertRaises(cca.CcaError):
            self.cc.install(settings="expandable_segments:maybe")
        self.assertNotIn("CCA_ALLOC_CONF", os.environ)
        self.assertIsNot(self.cupy.cuda.get_allocator(), self.cc.malloc)  # nothing changed
        self.cc.install(settings="expandable_segments:True")
        self.assertEqual(os.environ["CCA_ALLOC_CONF"], "expandable_segments:True")
        cca.set_settings("roundup_power2_divisions:4")
        self.assertEqual(os.environ["CCA_ALLOC_CONF"], "expandable_segments:True,roundup_power2_divisions:4")
        self.backend = start_sim()


class Numba(Fakes):
    modules = fake_numba()

    def setUp(self):
        super().setUp()
        sys.modules.pop("cca.numba", None)
        import cca.numba
        self.cn = cca.numba
        self.drv = sys.modules["numba.cuda.cudadrv.driver"]
        self.mm = cca.numba.CCAMemoryManager(context=FakeContext())
        self.mm.initialize()

    def tearDown(self):
        self.mm.reset()
        self.assertEqual(self.cn.free_failures(), [])
        super().tearDown()

    def test_entry_point(self):
        import importlib
        module = importlib.import_module("cca.numba")
        self.assertIs(module._numba_memory_manager, self.cn.CCAMemoryManager)
        self.assertTrue(issubclass(self.cn.CCAMemoryManager, self.drv.HostOnlyCUDAMemoryManager))
        self.assertEqual(self.cn.CCAMemoryManager(context=None).interface_version, 1)
        self.cn.install()
        self.assertIs(sys.modules["numba.cuda"].memory_manager, self.cn.CCAMemoryManager)

    def test_device_arrays_live_while_any_view_does(self):
        mem = self.mm.memalloc(2 * MiB)
        self.assertIsInstance(mem, self.drv.OwnedPointer)
        self.assertEqual(allocations(), 1)
        base = int(mem.device_pointer)
        view = mem.view(1024)
        self.assertEqual(int(view.device_pointer), base + 1024)
        del mem
        gc.collect()
        self.assertEqual(allocations(), 1)
        del view
        self.assertEqual(allocations(), 0)
        self.assertEqual(len(self.mm.allocations), 0)
        zero = self.mm.memalloc(0)
        self.assertEqual((int(zero.device_pointer), allocations()), (0, 0))

    def test_defer_cleanup_holds_frees_until_the_outermost_block_ends(self):
        with self.mm.defer_cleanup():
            a = self.mm.memalloc(MiB)
            with self.mm.defer_cleanup():
                del a
            self.assertEqual(allocations(), 1)
            b = self.mm.memalloc(MiB)  # allocations go on
            self.assertEqual(allocations(), 2)
            del b
        self.assertEqual(allocations(), 0)

    def test_out_of_memory_is_numbas_error_then_recovers(self):
        keep = self.mm.memalloc(40 * MiB)
        cleared = self.mm.deallocations.cleared
        with self.assertRaises(self.drv.CudaAPIError) as cm:
            self.mm.memalloc(40 * MiB)
        self.assertEqual(cm.exception.code, self.drv.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        self.assertIsInstance(cm.exception.__cause__, cca.OutOfMemoryError)
        self.assertEqual(self.mm.deallocations.cleared, cleared + 1)  # Numba's pending frees first
        del keep
        again = self.mm.memalloc(40 * MiB)
        self.assertEqual(allocations(), 1)
        del again
        with self.assertRaises(self.drv.CudaAPIError):  # not 512 bytes, as a wrapped size_t would be
            self.mm.memalloc((1 << 64) + 512)
        with self.assertRaises(cca.CcaError) as cm:  # cca's host allocator: 1 EB or more is invalid
            self.mm.memhostalloc((1 << 64) + 512)
        self.assertEqual(cm.exception.status, "CCA_ERR_INVALID_ARGUMENT")
        self.assertEqual((allocations(), cca.host_stats().active_requests.current), (0, 0))

    def test_a_failing_backend_is_ccas_error_and_loses_nothing(self):
        inject_fault(self.backend, "MALLOC")
        with self.assertRaises(cca.CcaError) as cm:
            self.mm.memalloc(MiB)
        self.assertEqual(cm.exception.status, "CCA_ERR_BACKEND")
        self.assertEqual((len(self.mm.allocations), allocations()), (0, 0))
        inject_fault(self.backend, "HOST_ALLOC")
        with self.assertRaises(cca.CcaError):
            self.mm.memhostalloc(4096)
        mem, host = self.mm.memalloc(MiB), self.mm.memhostalloc(4096)
        self.assertEqual((allocations(), cca.host_stats().active_requests.current), (1, 1))
        del mem, host

    def test_pinned_host_arrays(self):
        pinned = self.mm.memhostalloc(10000)
        self.assertIsInstance(pinned, self.drv.PinnedMemory)
        mapped = self.mm.memhostalloc(20000, mapped=True)
        self.assertEqual(int(mapped.device_pointer), mapped.host_pointer)
        self.assertEqual(cca.host_stats().active_requests.current, 2)
        self.assertEqual(self.mm.memhostalloc(64, wc=True), ("numba's own", 64, False, True))
        with self.mm.defer_cleanup():
            del pinned, mapped
            gc.collect()
            self.assertEqual(cca.host_stats().active_requests.current, 2)
        self.assertEqual(cca.host_stats().active_requests.current, 0)

    def test_memory_info(self):
        info = self.mm.get_memory_info()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.assertEqual(self.lib.cca_mem_get_info(0, ctypes.byref(free), ctypes.byref(total)), 0)
        self.assertEqual((info.free, info.total), (free.value, total.value))
        self.assertEqual(info.total, 1 << 30)

    def test_ipc_handles_carry_ccas_handle(self):
        mem = self.mm.memalloc(MiB)
        view = mem.view(4096)
        h = self.mm.get_ipc_handle(view)
        self.assertIsInstance(h, self.drv.IpcHandle)
        self.assertEqual((h.offset, h.size), (4096, MiB - 4096))
        self.assertGreaterEqual(len(h.handle), 224)
        with self.assertRaises(ValueError):
            h.open(FakeContext())  # the producer's own handle
        copy = pickle.loads(pickle.dumps(h))
        self.assertIs(type(copy), self.cn.CCAIpcHandle)
        self.assertEqual((copy.base, copy.handle, copy.offset, copy.size),
                         (None, h.handle, 4096, MiB - 4096))
        with self.assertRaises(cca.CcaError):  # cca refuses a handle of this very process
            copy.open(FakeContext())
        pending = ctypes.c_size_t()
        handle = h.handle
        del mem, view, h, copy
        gc.collect()
        self.assertEqual(self.lib.cca_ipc_collect(ctypes.byref(pending)), 0)
        self.assertEqual(pending.value, 1)  # the sent handle's reference holds the free
        self.assertEqual(self.lib.cca_ipc_release_handle_bytes(handle, len(handle)), 0)
        self.assertEqual(self.lib.cca_ipc_collect(ctypes.byref(pending)), 0)
        self.assertEqual(pending.value, 0)
        with self.assertRaises(ValueError):
            self.cn._block_of(self.drv.MemoryPointer(FakeContext(), 0, 8))

    def test_an_ipc_handle_never_sent_gives_its_reference_back(self):
        mem = self.mm.memalloc(MiB)
        h = self.mm.get_ipc_handle(mem)
        del h, mem
        gc.collect()
        pending = ctypes.c_size_t()
        self.assertEqual(self.lib.cca_ipc_collect(ctypes.byref(pending)), 0)
        self.assertEqual(pending.value, 0)
        self.assertEqual(allocations(), 0)

    def test_record_stream(self):
        mem = self.mm.memalloc(MiB)
        first = int(mem.device_pointer)
        devary = types.SimpleNamespace(gpu_data=mem)  # as a DeviceNDArray
        stream = types.SimpleNamespace(handle=self.drv.binding.CUdeviceptr(0x5000))
        self.cn.record_stream(devary, stream)
        del mem, devary
        b = self.mm.memalloc(MiB)
        self.assertNotEqual(int(b.device_pointer), first)
        self.complete(0x5000)
        c = self.mm.memalloc(MiB)
        self.assertEqual(int(c.device_pointer), first)
        with self.assertRaises(TypeError):
            self.cn.record_stream(c, "stream")
        del b, c


if __name__ == "__main__":
    unittest.main()
