"""cca as Numba's memory manager (numba-cuda's External Memory Management plugin).

    import cca.numba
    cca.numba.install()     # = numba.cuda.set_memory_manager(cca.numba.CCAMemoryManager)
    # or, before Python starts:  NUMBA_CUDA_MEMORY_MANAGER=cca.numba

Device arrays (memalloc) come from cca on the context's device and on the
default stream (the EMM interface names no stream), pinned host arrays
(memhostalloc, mapped or not) from cca's pinned host allocator; both go back
to cca when Numba drops them, or, inside numba.cuda.defer_cleanup(), when the
outermost such block ends. IPC handles carry cca's handle bytes and open
through cca in the consumer (which also uses this plugin), so the producer's
block stays allocated while a consumer has it open. Memory from mempin
(pinning the caller's memory), write-combined host memory and managed memory
stay Numba's own (numba's HostOnlyCUDAMemoryManager).
"""
import contextlib
import ctypes
import gc
import threading
import weakref

import cca
from . import _lib

__all__ = ["CCAMemoryManager", "CCAIpcHandle", "install", "record_stream", "free_failures"]

_STATUS_OUT_OF_MEMORY = 3
_SIZE_MAX = ctypes.c_size_t(-1).value  # (ctypes would wrap a larger size around)
_free_failures = []  # (pointer, message) of frees that failed in a finaliser (kept: 16)

try:
    from numba.cuda.cudadrv import driver as _drv
    _numba_error = None
except ImportError as e:  # the module still imports: the error comes on use
    _drv = None
    _numba_error = e


def _need_numba():
    if _drv is None:
        raise ImportError("cca.numba needs numba-cuda (import numba.cuda failed: %s); install "
                          "numba-cuda[cu12] or numba-cuda[cu13]" % _numba_error)


def _nv_binding():
    return getattr(_drv, "USE_NV_BINDING", True) and getattr(_drv, "binding", None) is not None


def _devptr(ptr):
    """A device address as Numba's MemoryPointer holds it."""
    if _nv_binding():
        return _drv.binding.CUdeviceptr(ptr)
    return ctypes.c_size_t(ptr)


def _hostptr(ptr):
    """A host address as Numba's MappedMemory and PinnedMemory take it."""
    return ptr if _nv_binding() else ctypes.c_void_p(ptr)


def _address(value):
    """The integer address of a pointer object of Numba's (CUdeviceptr, ctypes or int)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes._SimpleCData):
        return value.value or 0
    return int(value)


def _oom_code():
    """CUDA_ERROR_OUT_OF_MEMORY as Numba's CudaAPIError carries it (what
    HostOnlyCUDAMemoryManager's retry and Numba's users test e.code against)."""
    if _nv_binding():
        return _drv.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    from numba.cuda.cudadrv import enums
    return enums.CUDA_ERROR_OUT_OF_MEMORY


def _note_free_failure(ptr, status):
    lib = _lib.load()
    msg = "%s: %s" % (lib.cca_status_str(status).decode(),
                      lib.cca_last_error().contents.message.decode("utf-8", "replace"))
    del _free_failures[:-15]
    _free_failures.append((ptr, msg))


def _release(name, ptr):
    """cca_free or cca_host_free of ptr from a finaliser: failures are noted, never raised."""
    lib = _lib._lib
    if lib is None:  # interpreter shutdown
        return
    st = getattr(lib, name)(ptr)
    if st != 0:
        _note_free_failure(ptr, st)


class _Frees:
    """The frees of one memory manager: at once, or held while defer_cleanup is
    active and done when its outermost block ends. A re-entrant lock: a
    finaliser can run (garbage collection) while the lock is held."""

    def __init__(self):
        self.lock = threading.RLock()
        self.depth = 0
        self.pending = []

    def free(self, name, ptr):
        with self.lock:
            if self.depth:
                self.pending.append((name, ptr))
                return
        _release(name, ptr)

    def enter(self):
        with self.lock:
            self.depth += 1

    def leave(self):
        with self.lock:
            self.depth -= 1
        self.flush()

    def flush(self, force=False):
        with self.lock:
            if self.depth and not force:
                return
            todo, self.pending = self.pending, []
        for name, ptr in todo:
            _release(name, ptr)


def _finalizer(allocations, frees, name, ptr):
    def core():
        if allocations:
            allocations.pop(ptr, None)
        frees.free(name, ptr)
    return core


def _check_or_oom(lib, st, what):
    """Raise for status st: Numba's CudaAPIError(CUDA_ERROR_OUT_OF_MEMORY) for
    cca's out-of-memory (its cause cca's error), cca.CcaError otherwise."""
    try:
        cca._check(lib, st, what)
    except cca.OutOfMemoryError as e:
        raise _drv.CudaAPIError(_oom_code(), "cca: %s" % e) from e


def _release_unsent(handle, sent):
    """An IPC handle object that was never pickled (so never sent) is gone: give
    back the reference its cca handle took, so the block's free is not held."""
    lib = _lib._lib
    if lib is not None and not sent[0]:
        lib.cca_ipc_release_handle_bytes(handle, len(handle))


def _rebuild_ipc_handle(cls, handle, size, source_info, offset):
    return cls(None, handle, size, source_info, offset)


if _drv is not None:
    class _CCAPointer(_drv.AutoFreePointer):
        """A device block of cca's (AutoFreePointer: freed when the last
        OwnedPointer of it, views included, is gone)."""

    class CCAIpcHandle(_drv.IpcHandle):
        """Numba's IpcHandle for a cca block: handle is cca's serialized IPC
        handle (bytes), opened and closed through cca in the consumer. Pickle it
        to send it; open each handle once, in one process (one handle per
        consumer). A handle object that dies without being pickled gives its
        reference back."""

        def __init__(self, base, handle, size, source_info=None, offset=0):
            super().__init__(base, bytes(handle), size, source_info, offset)
            self._opened = None
            self._sent = [False]
            if base is not None:
                weakref.finalize(self, _release_unsent, self.handle, self._sent)

        def __reduce__(self):
            self._sent[0] = True
            return (_rebuild_ipc_handle,
                    (self.__class__, self.handle, self.size, self.source_info, self.offset))

        def open(self, context):
            """Map the block in this process (through cca: its device is the
            handle's) and return a pointer to the shared memory; work queued on
            the default stream afterwards waits for the producer's."""
            if self.base is not None:
                raise ValueError("opening IpcHandle from original process")
            if self._opened is not None:
                raise ValueError("IpcHandle is already opened")
            lib = _lib.load()
            ptr = ctypes.c_void_p()
            cca._check(lib, lib.cca_ipc_open_bytes(self.handle, len(self.handle), None,
                                                   ctypes.byref(ptr), None), "cca.numba IPC open")
            mem = _drv.MemoryPointer(weakref.proxy(context), _devptr(ptr.value),
                                     self.offset + self.size)
            self._opened = mem
            return mem.own().view(self.offset)

        def open_direct(self, context):
            return self.open(context)

        def open_staged(self, context):
            return self.open(context)

        def close(self):
            """Unmap (after the work using the memory is done) and release the
            producer's block."""
            if self._opened is None:
                raise ValueError("IpcHandle not opened")
            ptr = _address(self._opened.device_pointer)
            self._opened = None
            lib = _lib.load()
            cca._check(lib, lib.cca_ipc_close(ptr), "cca.numba IPC close")

    class CCAMemoryManager(_drv.HostOnlyCUDAMemoryManager):
        """Numba's memory manager on cca (see the module's text)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._frees = _Frees()
            self._ready = False

        def initialize(self):
            if not self._ready:  # (Numba calls it at every push of the context)
                lib = _lib.load()
                cca._check(lib, lib.cca_init(), "cca.numba: init")
                self._ready = True

        def _device(self):
            return int(self.context.device.id)

        def memalloc(self, size):
            size = int(size)
            ctx = weakref.proxy(self.context)
            if size == 0:
                return _drv.MemoryPointer(ctx, _devptr(0), 0)
            if size < 0:
                raise ValueError("cca.numba: size must not be negative (%d)" % size)
            lib = _lib.load()
            device = self._device()
            out = ctypes.c_void_p()
            csize = min(size, _SIZE_MAX)  # beyond it: cca's out-of-memory for the largest size
            st = lib.cca_malloc_device(ctypes.byref(out), csize, device, None)
            if st == _STATUS_OUT_OF_MEMORY:
                gc.collect()                 # arrays held only by reference cycles
                self.deallocations.clear()   # Numba's own pending (host) frees
                st = lib.cca_malloc_device(ctypes.byref(out), csize, device, None)
            _check_or_oom(lib, st, "cca.numba: memalloc(%d) on device %d" % (size, device))
            ptr = out.value
            mem = _CCAPointer(ctx, _devptr(ptr), size,
                              finalizer=_finalizer(self.allocations, self._frees, "cca_free", ptr))
            self.allocations[ptr] = mem
            return mem.own()

        def memhostalloc(self, size, mapped=False, portable=False, wc=False):
            size = int(size)
            if wc or size <= 0:  # write-combined memory (and nothing at all) stay Numba's
                return super().memhostalloc(size, mapped, portable, wc)
            lib = _lib.load()
            out = ctypes.c_void_p()
            csize = min(size, _SIZE_MAX)
            st = lib.cca_host_malloc(ctypes.byref(out), csize)
            if st == _STATUS_OUT_OF_MEMORY:
                gc.collect()
                self.deallocations.clear()
                st = lib.cca_host_malloc(ctypes.byref(out), csize)
            _check_or_oom(lib, st, "cca.numba: memhostalloc(%d)" % size)
            ptr = out.value
            fin = _finalizer(self.allocations, self._frees, "cca_host_free", ptr)
            ctx = weakref.proxy(self.context)
            if not mapped:
                return _drv.PinnedMemory(ctx, _hostptr(ptr), size, finalizer=fin)
            try:  # cca's pinned memory is mapped wherever addressing is unified
                mem = _drv.MappedMemory(ctx, _hostptr(ptr), size, finalizer=fin)
            except _drv.CudaAPIError:
                lib.cca_host_free(ptr)
                return super().memhostalloc(size, mapped, portable, wc)
            self.allocations[ptr] = mem
            return mem.own()

        def get_memory_info(self):
            """(free, total) of the device as the driver counts them (blocks cca
            holds cached count as used; cca.memory_stats() has them)."""
            lib = _lib.load()
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            cca._check(lib, lib.cca_mem_get_info(self._device(), ctypes.byref(free),
                                                 ctypes.byref(total)), "cca.numba: get_memory_info")
            return _drv.MemoryInfo(free=free.value, total=total.value)

        def get_ipc_handle(self, memory):
            """A CCAIpcHandle for memory (an allocation of this manager, or a
            view into one): cca's handle of the block, and memory's offset in it."""
            base, offset = _block_of(memory)
            lib = _lib.load()
            n = ctypes.c_size_t()
            cca._check(lib, lib.cca_ipc_handle_size(base, ctypes.byref(n)), "cca.numba: IPC handle")
            buf = ctypes.create_string_buffer(max(n.value, 1))
            cca._check(lib, lib.cca_ipc_get_handle_bytes(base, None, buf, n.value, ctypes.byref(n)),
                       "cca.numba: IPC handle")
            source_info = self.context.device.get_device_identity()
            return CCAIpcHandle(memory, buf.raw[:n.value], memory.size, source_info, offset=offset)

        def reset(self):
            super().reset()  # drops this context's blocks: their finalisers free them
            self._frees.flush(force=True)

        @contextlib.contextmanager
        def defer_cleanup(self):
            """Frees of cca memory (and Numba's own host memory) wait until the
            outermost defer_cleanup block ends; allocations go on as usual."""
            with super().defer_cleanup():
                self._frees.enter()
                try:
                    yield
                finally:
                    self._frees.leave()

        @property
        def interface_version(self):
            return 1
else:
    class CCAIpcHandle:
        def __init__(self, *args, **kwargs):
            _need_numba()

    class CCAMemoryManager:
        """Numba's memory manager on cca: needs numba-cuda, which is missing here."""

        def __init__(self, *args, **kwargs):
            _need_numba()


def _block_of(memory):
    """(base, offset): the cca block behind memory (a Numba memory pointer,
    OwnedPointer or view) and memory's offset in it. ValueError when the memory
    is not an allocation of CCAMemoryManager."""
    owner = getattr(memory, "owner", None)
    if _drv is None or owner is None or not isinstance(owner, _CCAPointer):
        raise ValueError("cca.numba: this memory was not allocated by cca.numba's memory manager "
                         "(set it before the first CUDA call)")
    base = _address(owner.device_pointer)
    return base, _address(memory.device_pointer) - base


def _stream_address(stream):
    if stream is None or stream == 0:
        return 0
    handle = getattr(stream, "handle", stream)
    try:
        value = _address(handle)
    except (TypeError, ValueError):
        value = -1
    if not 0 <= value <= _SIZE_MAX:
        raise TypeError("stream must be a numba.cuda stream (or its handle), not %s"
                        % type(stream).__name__)
    return value


def record_stream(obj, stream):
    """Mark a device array (or memory pointer) allocated through
    CCAMemoryManager as used by work queued on stream (a numba.cuda stream), so
    that once freed its block is not handed out again before that work is
    done. Numba allocates on the default stream; call this for an array used
    on another stream and dropped before that stream finishes (or free inside
    numba.cuda.defer_cleanup() and synchronize before it ends). Raises
    ValueError for memory of another allocator, TypeError for a bad stream."""
    _need_numba()
    memory = getattr(obj, "gpu_data", obj)
    base, _ = _block_of(memory)
    lib = _lib.load()
    cca._check(lib, lib.cca_record_stream(base, _stream_address(stream)), "cca.numba.record_stream")


def install(settings=None):
    """Make cca Numba's memory manager (numba.cuda.set_memory_manager), before
    the first CUDA call: contexts made before keep their manager (numba.cuda.close()
    drops them, and with them their arrays). settings: a cca settings string,
    applied first (cca.set_settings)."""
    _need_numba()
    if settings is not None:
        cca.set_settings(settings)
    from numba import cuda
    cuda.set_memory_manager(CCAMemoryManager)


def free_failures():
    """The last frees that failed when Numba dropped memory (a finaliser cannot
    raise): a list of (pointer, message), oldest first."""
    return list(_free_failures)


# NUMBA_CUDA_MEMORY_MANAGER=cca.numba: Numba imports this module and uses this class.
_numba_memory_manager = CCAMemoryManager
