"""cca as CuPy's allocator, for device memory and pinned host memory.

    import cca.cupy
    cca.cupy.install()                 # every CuPy allocation of the process
    with cca.cupy.allocator():         # or: this thread's, within the block
        ...
    cca.memory_stats(), cca.memory_summary(), cca.dump_snapshot(path)

A device block comes from cca_malloc on the current device and on CuPy's
current stream (cupy.cuda.get_current_stream()), and goes back to cca when
CuPy drops the last reference to it (the array, its views, a DLPack capsule or
__cuda_array_interface__ consumer holding it). Freed blocks are reused on the
stream they were allocated on at once, on another stream only once the first
is done with them; a block used on another stream is marked with
record_stream(array, stream) (CuPy has no such call of its own).
"""
import contextlib
import ctypes
import gc

import cca
from . import _lib

__all__ = ["install", "uninstall", "installed", "allocator", "malloc", "malloc_pinned",
           "record_stream", "free_failures"]

_STATUS_OUT_OF_MEMORY = 3
_SIZE_MAX = ctypes.c_size_t(-1).value  # (ctypes would wrap a larger size around)

_module = None          # cupy, once imported
_bound = None           # what malloc calls (see _bind)
_previous = None        # CuPy's device allocator before install()
_pinned = False         # install() made cca CuPy's pinned memory allocator
_free_failures = []     # (pointer, message) of frees that failed in a finaliser (kept: 16)


def _cupy():
    global _module
    if _module is None:
        try:
            import cupy
        except ImportError as e:
            raise ImportError("cca.cupy needs CuPy (import cupy failed: %s); install cupy-cuda12x "
                              "or cupy-cuda13x" % e) from e
        _module = cupy
    return _module


def _note_free_failure(ptr, status):
    lib = _lib.load()
    msg = "%s: %s" % (lib.cca_status_str(status).decode(),
                      lib.cca_last_error().contents.message.decode("utf-8", "replace"))
    del _free_failures[:-15]
    _free_failures.append((ptr, msg))


class _DeviceBlock:
    """The owner of one cca device block: CuPy's UnownedMemory holds it, and
    when CuPy drops the memory the block goes back to cca."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __del__(self):
        lib = _lib._lib
        if lib is None:  # interpreter shutdown
            return
        st = lib.cca_free(self.ptr)
        if st != 0:
            _note_free_failure(self.ptr, st)


class _HostBlock:
    """One cca pinned host block, as CuPy's PinnedMemoryPointer wants its memory
    (ptr and size); freed through cca_host_free when CuPy drops it."""
    __slots__ = ("ptr", "size")

    def __init__(self, ptr, size):
        self.ptr = ptr
        self.size = size

    def __int__(self):
        return self.ptr

    def __del__(self):
        lib = _lib._lib
        if lib is None or not self.ptr:
            return
        st = lib.cca_host_free(self.ptr)
        if st != 0:
            _note_free_failure(self.ptr, st)


def _bind():
    """The calls malloc makes, looked up once: (getDevice, get_current_stream,
    UnownedMemory, MemoryPointer, cca_malloc_device)."""
    global _bound
    cupy = _cupy()
    _bound = (cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream, cupy.cuda.UnownedMemory,
              cupy.cuda.MemoryPointer, _lib.load().cca_malloc_device)
    return _bound


def _out_of_memory(cupy, lib, size, device, cause):
    """CuPy's OutOfMemoryError for a failed request of size bytes, its cause cca's error."""
    total = -1
    stats = _lib.DeviceStats()
    if lib.cca_get_device_stats(device, ctypes.byref(stats)) == 0:
        total = stats.allocated_bytes[0].current
    err = cupy.cuda.memory.OutOfMemoryError(size, total)
    err.__cause__ = cause
    return err


def malloc(size):
    """CuPy's allocator interface: size bytes on the current device and on
    CuPy's current stream, as a cupy.cuda.MemoryPointer. Raises
    cupy.cuda.memory.OutOfMemoryError (its cause cca's OutOfMemoryError, with
    PyTorch's message) when cca cannot find the memory even after Python's
    garbage collection has run, and cca.CcaError for any other failure."""
    get_device, current_stream, unowned, pointer, malloc_device = _bound or _bind()
    device = get_device()
    stream = current_stream().ptr
    out = ctypes.c_void_p()
    if 0 <= size <= _SIZE_MAX:
        st = malloc_device(ctypes.byref(out), size, device, stream)
        if st != 0:
            _retry(out, size, device, stream, st)
    else:
        _too_large(size, device, stream)
    ptr = out.value or 0
    return pointer(unowned(ptr, size, _DeviceBlock(ptr) if ptr else None, device), 0)


def _too_large(size, device, stream):
    """Raise for a size no size_t holds: ValueError below 0, else CuPy's
    OutOfMemoryError (cca's error for the largest size as its cause)."""
    if size < 0:
        raise ValueError("cca.cupy.malloc: size must not be negative (%d)" % size)
    out = ctypes.c_void_p()
    lib = _lib.load()
    st = lib.cca_malloc_device(ctypes.byref(out), _SIZE_MAX, device, stream)
    if st == 0:  # (cannot happen: cca refuses 1 EB and more)
        lib.cca_free(out)
    _retry(out, _SIZE_MAX, device, stream, st or _STATUS_OUT_OF_MEMORY, requested=size)


def _retry(out, size, device, stream, st, requested=None):
    """malloc's slow path: after an out-of-memory, one garbage collection (arrays
    held only by reference cycles, as CuPy's own pool does) and one more try;
    then the error, as CuPy's OutOfMemoryError or cca.CcaError."""
    lib = _lib.load()
    requested = size if requested is None else requested
    if st == _STATUS_OUT_OF_MEMORY:
        gc.collect()
        st = lib.cca_malloc_device(ctypes.byref(out), size, device, stream)
    if st != 0:
        try:
            cca._check(lib, st, "cca.cupy.malloc(%d) on device %d" % (requested, device))
        except cca.OutOfMemoryError as e:
            raise _out_of_memory(_cupy(), lib, requested, device, e) from e


def malloc_pinned(size):
    """CuPy's pinned allocator interface: size bytes of cca's pinned host
    memory as a cupy.cuda.PinnedMemoryPointer, freed through cca when CuPy
    drops it. Raises cca.OutOfMemoryError (a MemoryError) or cca.CcaError."""
    cupy = _cupy()
    lib = _lib.load()
    size = int(size)
    if size < 0:
        raise ValueError("cca.cupy.malloc_pinned: size must not be negative (%d)" % size)
    out = ctypes.c_void_p()
    csize = min(size, _SIZE_MAX)  # beyond it: cca's error for the largest size
    st = lib.cca_host_malloc(ctypes.byref(out), csize)
    if st == _STATUS_OUT_OF_MEMORY:
        gc.collect()
        st = lib.cca_host_malloc(ctypes.byref(out), csize)
    cca._check(lib, st, "cca.cupy.malloc_pinned(%d)" % size)
    return cupy.cuda.PinnedMemoryPointer(_HostBlock(out.value or 0, size), 0)


def install(settings=None, pinned=True):
    """Make cca CuPy's allocator for every thread of the process
    (cupy.cuda.set_allocator), and with pinned also its pinned host memory
    allocator (cupy.cuda.set_pinned_memory_allocator). settings: a cca
    settings string (e.g. "expandable_segments:True"), applied first (see
    cca.set_settings). CuPy's own pool gives its unused cached blocks back to
    the device. Arrays allocated before stay CuPy's. A second call applies
    settings and pinned again. Raises ImportError without CuPy, cca.CcaError
    for a bad settings string (nothing changes then)."""
    global _previous, _pinned
    cupy = _cupy()
    if settings is not None:
        cca.set_settings(settings)
    current = cupy.cuda.get_allocator()
    if current is not malloc:
        cupy.cuda.set_allocator(malloc)
        _previous = current
        cupy.get_default_memory_pool().free_all_blocks()
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(malloc_pinned)
        if not _pinned:
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        _pinned = True
    elif _pinned:
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        _pinned = False


def uninstall():
    """Give CuPy back the allocators install() replaced (its default pinned
    memory pool for pinned memory). Blocks already allocated stay cca's and
    return to it when freed. Does nothing when cca is not installed."""
    global _previous, _pinned
    if _previous is None and not _pinned:
        return
    cupy = _cupy()
    if _previous is not None:
        cupy.cuda.set_allocator(_previous)
        _previous = None
    if _pinned:
        cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)
        _pinned = False


def installed():
    """(device, pinned): whether install() made cca CuPy's device allocator and
    its pinned memory allocator."""
    return _previous is not None, _pinned


@contextlib.contextmanager
def allocator(settings=None):
    """Within the block, CuPy allocations of the calling thread come from cca
    (cupy.cuda.using_allocator); blocks allocated there return to cca whenever
    CuPy frees them, inside the block or after it. Pinned memory needs
    install(). settings: as install's."""
    cupy = _cupy()
    if settings is not None:
        cca.set_settings(settings)
    with cupy.cuda.using_allocator(malloc):
        yield


def _stream_pointer(stream):
    if stream is None:
        return 0
    ptr = getattr(stream, "ptr", stream)
    if not isinstance(ptr, int) or isinstance(ptr, bool) or not 0 <= ptr <= _SIZE_MAX:
        raise TypeError("stream must be a cupy.cuda.Stream (or its .ptr), not %s"
                        % type(stream).__name__)
    return ptr


def _block_of(obj, depth=0):
    """The cca block behind obj (see record_stream), or None."""
    if isinstance(obj, (_DeviceBlock, _HostBlock)):
        return obj
    target = obj
    data = getattr(obj, "data", None)  # cupy.ndarray.data: a MemoryPointer
    if data is not None and hasattr(data, "mem"):
        target = data
    mem = getattr(target, "mem", None)  # (Pinned)MemoryPointer.mem
    if mem is not None:
        target = mem
    target = getattr(target, "_owner", target)  # UnownedMemory's owner
    if isinstance(target, (_DeviceBlock, _HostBlock)):
        return target
    base = getattr(obj, "base", None)  # a numpy array over pinned memory, or a view
    if base is not None and base is not obj and depth < 8:
        return _block_of(base, depth + 1)
    return None


def record_stream(obj, stream):
    """Mark memory allocated through cca.cupy as used by work queued on stream
    (a cupy.cuda.Stream, ExternalStream or raw pointer), so that once freed it
    is not handed out again before that work is done, as
    torch.Tensor.record_stream. Needed when an array is used on a stream other
    than the one current at its allocation and dropped before that stream
    finishes. obj: a cupy.ndarray (or a view of one), a cupy.cuda.MemoryPointer,
    or pinned host memory (a cupy.cuda.PinnedMemoryPointer, or the numpy array
    cupyx.empty_pinned made over one). Raises ValueError for memory cca.cupy
    did not allocate, TypeError for a bad stream, cca.CcaError from cca."""
    lib = _lib.load()
    sptr = _stream_pointer(stream)
    block = _block_of(obj)
    if block is None:
        raise ValueError("cca.cupy.record_stream: %s is not memory allocated through cca.cupy "
                         "(install() cca before allocating it)" % type(obj).__name__)
    if isinstance(block, _DeviceBlock):
        cca._check(lib, lib.cca_record_stream(block.ptr, sptr), "cca.cupy.record_stream")
    elif block.ptr:
        cca._check(lib, lib.cca_host_record_event(block.ptr, sptr), "cca.cupy.record_stream")


def free_failures():
    """The last frees that failed when CuPy dropped memory (a finaliser cannot
    raise): a list of (pointer, message), oldest first; empty when all went well."""
    return list(_free_failures)
