"""Finding and loading libcca, and the ctypes mirror of the structures of cca.h."""
import ctypes
import ctypes.util
import operator
import os

_here = os.path.dirname(os.path.abspath(__file__))


def _candidates():
    env = os.environ.get("CCA_LIBRARY")
    if env:
        yield env
        return
    try:
        from . import _install_paths  # written by `make install`
        yield os.path.join(_install_paths.LIBDIR, "libcca.so")
    except ImportError:
        pass
    # the build tree: python/cca/ beside build/
    yield os.path.join(_here, "..", "..", "build", "libcca.so")
    found = ctypes.util.find_library("cca")
    if found:
        yield found


def library_path():
    """The libcca.so this package uses: $CCA_LIBRARY, the installed one, the
    build tree's (build/libcca.so), or one the system linker finds."""
    for path in _candidates():
        if os.path.sep not in path or os.path.exists(path):
            return os.path.realpath(path) if os.path.exists(path) else path
    raise OSError("libcca.so not found: build cca (make), install it (make install), "
                  "or set CCA_LIBRARY to its path")


def include_dir():
    """The folder holding cca.h (installed or in the source tree)."""
    try:
        from . import _install_paths
        if os.path.exists(os.path.join(_install_paths.INCLUDEDIR, "cca.h")):
            return _install_paths.INCLUDEDIR
    except ImportError:
        pass
    src = os.path.realpath(os.path.join(_here, "..", "..", "include"))
    if os.path.exists(os.path.join(src, "cca.h")):
        return src
    raise OSError("cca.h not found: install cca (make install) or use the source tree")


def source_dir():
    """The folder holding the C++ PyTorch adapter source (installed or source tree)."""
    inst = os.path.join(_here, "torch_adapter.cpp")
    if os.path.exists(inst):
        return _here
    src = os.path.realpath(os.path.join(_here, "..", "..", "src", "bindings"))
    if os.path.exists(os.path.join(src, "torch_adapter.cpp")):
        return src
    raise OSError("torch_adapter.cpp not found: install cca (make install) or use the source tree")


# ---- arguments checked before they reach C ---------------------------------------
# ctypes converts a Python int to a C integer by wrapping it (2**40 as an int is 0, -1 as a
# size_t is SIZE_MAX) and a bytes string to a char * that ends at its first NUL: every
# argument goes through one of these first, which raise ValueError (TypeError for the
# wrong type) naming the function and the argument instead.

INT_MIN = -(1 << (8 * ctypes.sizeof(ctypes.c_int) - 1))
INT_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)) - 1
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1


def int_arg(what, name, value, lo, hi):
    """value as an int within [lo, hi] (the C type's range, or narrower); an integral
    float is taken as its int."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError("%s: %s must be an integer, not %r" % (what, name, value)) from None
    if not lo <= v <= hi:
        raise ValueError("%s: %s=%d is out of range (%d to %d)" % (what, name, v, lo, hi))
    return v


def device_arg(what, device):
    """A device index as a C int (its range against the devices is cca's to check)."""
    return int_arg(what, "device", device, INT_MIN, INT_MAX)


def size_arg(what, name, value):
    """A size_t (bytes, counts)."""
    return int_arg(what, name, value, 0, SIZE_MAX)


def _no_nul(what, name, b):
    if b"\0" in b:
        raise ValueError("%s: %s holds a NUL character at %d (C would read it cut there)"
                         % (what, name, b.index(b"\0")))
    return b


def text_arg(what, name, text):
    """A str (or bytes) as a C string, or None."""
    if text is None:
        return None
    if isinstance(text, str):
        b = text.encode()
    elif isinstance(text, (bytes, bytearray)):
        b = bytes(text)
    else:
        raise TypeError("%s: %s must be a string, not %r" % (what, name, text))
    return _no_nul(what, name, b)


def path_arg(what, name, path):
    """A file name (str, bytes or path-like) as a C string."""
    try:
        b = os.fsencode(path)
    except TypeError:
        raise TypeError("%s: %s must be a path, not %r" % (what, name, path)) from None
    return _no_nul(what, name, b)


class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("allocated", ctypes.c_int64), ("freed", ctypes.c_int64)]


STAT_TYPES = 3
_StatArray = Stat * STAT_TYPES


class DeviceStats(ctypes.Structure):
    _fields_ = [("allocation", _StatArray), ("segment", _StatArray), ("active", _StatArray),
                ("inactive_split", _StatArray), ("allocated_bytes", _StatArray),
                ("reserved_bytes", _StatArray), ("active_bytes", _StatArray),
                ("inactive_split_bytes", _StatArray), ("requested_bytes", _StatArray),
                ("num_alloc_retries", ctypes.c_int64), ("num_ooms", ctypes.c_int64),
                ("num_sync_all_streams", ctypes.c_int64), ("num_device_alloc", ctypes.c_int64),
                ("num_device_free", ctypes.c_int64), ("oversize_allocations", Stat),
                ("oversize_segments", Stat), ("max_split_size", ctypes.c_int64)]


class DurationStat(ctypes.Structure):
    _fields_ = [("total", ctypes.c_int64), ("max", ctypes.c_int64), ("min", ctypes.c_int64),
                ("count", ctypes.c_int64)]


class HostStats(ctypes.Structure):
    _fields_ = [("allocations", Stat), ("allocated_bytes", Stat), ("active_requests", Stat),
                ("active_bytes", Stat), ("num_host_alloc", ctypes.c_int64),
                ("num_host_free", ctypes.c_int64), ("host_alloc_time", DurationStat),
                ("host_free_time", DurationStat)]


class StatEntry(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_int64)]


MEMORY_STATS_COUNT = 122


class ReplayOptions(ctypes.Structure):
    _fields_ = [("settings", ctypes.c_char_p), ("cap", ctypes.c_size_t),
                ("total_memory", ctypes.c_size_t), ("trace_addresses", ctypes.c_bool),
                ("ignore_fraction", ctypes.c_bool), ("device", ctypes.c_int),
                ("snapshot_path", ctypes.c_char_p), ("svg_path", ctypes.c_char_p),
                ("event_lag", ctypes.c_uint64), ("sequential", ctypes.c_bool),
                ("strict", ctypes.c_bool), ("first_event", ctypes.c_uint64),
                ("peaks_from_event", ctypes.c_uint64)]


class ReplayResult(ctypes.Structure):
    _fields_ = [("events", ctypes.c_uint64), ("allocs", ctypes.c_uint64),
                ("frees", ctypes.c_uint64), ("segment_allocs", ctypes.c_uint64),
                ("segment_frees", ctypes.c_uint64), ("ooms", ctypes.c_uint64),
                ("pool_ops", ctypes.c_uint64), ("address_mismatches", ctypes.c_uint64), ("unexpected_ooms", ctypes.c_uint64),
                ("peak_reserved_bytes", ctypes.c_int64), ("peak_allocated_bytes", ctypes.c_int64),
                ("peak_requested_bytes", ctypes.c_int64), ("peak_active_bytes", ctypes.c_int64),
                ("seconds", ctypes.c_double), ("load_seconds", ctypes.c_double),
                ("events_per_second", ctypes.c_double),
                ("memory_stats", StatEntry * MEMORY_STATS_COUNT),
                ("memory_summary", ctypes.c_void_p), ("settings", ctypes.c_char * 1024),
                ("has_expected", ctypes.c_bool), ("expected_allocs", ctypes.c_uint64),
                ("expected_segment_allocs", ctypes.c_uint64),
                ("expected_segment_frees", ctypes.c_uint64), ("expected_ooms", ctypes.c_uint64),
                ("expected_peak_reserved_bytes", ctypes.c_int64),
                ("stats_mismatches", ctypes.c_uint64), ("first_stats_mismatch", ctypes.c_char * 160),
                ("summary_matches", ctypes.c_bool), ("first_address_mismatch", ctypes.c_char * 160),
                ("late_segment_allocs", ctypes.c_uint64), ("late_segment_frees", ctypes.c_uint64),
                ("step_allocations", ctypes.c_uint64), ("last_step_segment_allocs", ctypes.c_uint64),
                ("last_step_segment_frees", ctypes.c_uint64),
                ("cached_free_bytes", ctypes.c_uint64), ("largest_free_bytes", ctypes.c_uint64),
                ("compact_moves", ctypes.c_uint64), ("compact_pending_growths", ctypes.c_uint64),
                ("overlapped", ctypes.c_bool), ("device", ctypes.c_int),
                ("device_count", ctypes.c_size_t), ("inferred_segments", ctypes.c_uint64),
                ("inferred_blocks", ctypes.c_uint64), ("inferred_reserved_bytes", ctypes.c_uint64),
                ("inferred_requested_bytes", ctypes.c_uint64), ("recorded_part_only", ctypes.c_bool),
                ("inconsistencies", ctypes.c_uint64), ("first_inconsistency", ctypes.c_char * 200),
                ("first_inconsistency_event", ctypes.c_uint64), ("ambiguous_blocks", ctypes.c_uint64)]


EXPLAIN_TOP = 8


class ExplainEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 160), ("bytes", ctypes.c_uint64), ("count", ctypes.c_uint64)]


class ReplayExplain(ctypes.Structure):
    _fields_ = [("peak_event", ctypes.c_uint64), ("reserved_bytes", ctypes.c_uint64),
                ("live_bytes", ctypes.c_uint64), ("live_requested_bytes", ctypes.c_uint64),
                ("live_allocations", ctypes.c_uint64), ("cached_free_bytes", ctypes.c_uint64),
                ("largest_free_bytes", ctypes.c_uint64), ("segments", ctypes.c_uint64),
                ("segments_with_free", ctypes.c_uint64), ("frames_distinct", ctypes.c_uint64),
                ("annotations_distinct", ctypes.c_uint64), ("streams_distinct", ctypes.c_uint64),
                ("frame_count", ctypes.c_size_t), ("annotation_count", ctypes.c_size_t),
                ("stream_count", ctypes.c_size_t), ("segment_count", ctypes.c_size_t),
                ("frames", ExplainEntry * EXPLAIN_TOP), ("annotations", ExplainEntry * EXPLAIN_TOP),
                ("streams", ExplainEntry * EXPLAIN_TOP), ("free_segments", ExplainEntry * EXPLAIN_TOP)]


class Error(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int), ("message", ctypes.c_char * 2048),
                ("file", ctypes.c_char_p), ("line", ctypes.c_int), ("backend_code", ctypes.c_long)]


_lib = None


def load():
    """Load libcca once and declare the functions the package calls."""
    global _lib
    if _lib is not None:
        return _lib
    lib = ctypes.CDLL(library_path())
    st = ctypes.c_int
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    decl = {
        "cca_status_str": (cp, [st]),
        "cca_last_error": (ctypes.POINTER(Error), []),
        "cca_init": (st, []),
        "cca_is_initialized": (ctypes.c_bool, []),
        "cca_shutdown": (None, []),
        "cca_backend_name": (cp, []),
        "cca_device_count": (st, [ctypes.POINTER(ctypes.c_int)]),
        "cca_set_settings": (st, [cp]),
        "cca_settings_describe": (st, [cp, ctypes.POINTER(vp)]),
        "cca_malloc_device": (st, [ctypes.POINTER(vp), sz, ctypes.c_int, vp]),
        "cca_free": (st, [vp]),
        "cca_record_stream": (st, [vp, vp]),
        "cca_get_device": (st, [ctypes.POINTER(ctypes.c_int)]),
        "cca_mem_get_info": (st, [ctypes.c_int, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        "cca_set_memory_fraction": (st, [ctypes.c_double, ctypes.c_int]),
        "cca_host_malloc": (st, [ctypes.POINTER(vp), sz]),
        "cca_host_free": (st, [vp]),
        "cca_host_record_event": (st, [vp, vp]),
        "cca_host_empty_cache": (st, []),
        "cca_host_get_stats": (st, [ctypes.POINTER(HostStats)]),
        "cca_ipc_handle_size": (st, [vp, ctypes.POINTER(sz)]),
        "cca_ipc_get_handle_bytes": (st, [vp, vp, vp, sz, ctypes.POINTER(sz)]),
        "cca_ipc_open_bytes": (st, [cp, sz, vp, ctypes.POINTER(vp), ctypes.POINTER(sz)]),
        "cca_ipc_close": (st, [vp]),
        "cca_ipc_release_handle_bytes": (st, [cp, sz]),
        "cca_ipc_collect": (st, [ctypes.POINTER(sz)]),
        "cca_empty_cache": (st, []),
        "cca_get_device_stats": (st, [ctypes.c_int, ctypes.POINTER(DeviceStats)]),
        "cca_memory_stats": (st, [ctypes.c_int, ctypes.POINTER(StatEntry), sz]),
        "cca_memory_summary": (st, [ctypes.c_int, ctypes.c_bool, ctypes.POINTER(vp)]),
        "cca_reset_peak_stats": (st, [ctypes.c_int]),
        "cca_reset_accumulated_stats": (st, [ctypes.c_int]),
        "cca_record_history": (st, [ctypes.c_bool, vp, vp, sz, ctypes.c_int]),
        "cca_dump_snapshot": (st, [cp]),
        "cca_snapshot_file_to_json": (st, [cp, ctypes.POINTER(vp)]),
        "cca_snapshot_file_to_svg": (st, [cp, cp]),
        "cca_replay_file": (st, [cp, ctypes.POINTER(ReplayOptions), ctypes.POINTER(ReplayResult)]),
        "cca_replay_result_free": (None, [ctypes.POINTER(ReplayResult)]),
        "cca_replay_explain": (st, [cp, ctypes.POINTER(ReplayOptions), ctypes.POINTER(ReplayResult),
                                    ctypes.POINTER(ReplayExplain)]),
    }
    for name, (res, args) in decl.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [vp]
    libc.free.restype = None
    lib.c_free = libc.free
    _lib = lib
    return lib


def take_string(lib, ptr):
    """The text of a malloc'd C string from cca, freed."""
    try:
        return ctypes.string_at(ptr.value).decode("utf-8", "replace") if ptr.value else ""
    finally:
        if ptr.value:
            lib.c_free(ptr)
