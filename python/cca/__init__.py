"""cca from Python: replay PyTorch memory snapshots, check settings, convert
snapshots, and read the statistics of this process's cca allocator.

Standard library only (ctypes over libcca.so). PyTorch integration is in
`cca.torch` (imported on demand: `import cca.torch; cca.torch.install()`).

    import cca
    r = cca.replay("trace.pickle.gz", settings="max_split_size_mb:64")
    print(r["peak_reserved_bytes"], r["address_mismatches"])
    print(cca.settings("roundup_power2_divisions:4")["roundup_power2_divisions"])
"""
import ctypes
import json as _json
import os

from . import _lib
from ._lib import library_path

__all__ = [
    "CcaError", "OutOfMemoryError", "library_path", "settings", "replay", "snapshot_to_json",
    "snapshot_to_svg", "memory_stats", "memory_summary", "device_stats", "reset_peak_stats",
    "reset_accumulated_stats", "empty_cache", "record_history", "dump_snapshot", "backend",
    "is_initialized",
]

_STATUS_OUT_OF_MEMORY = 3


class CcaError(RuntimeError):
    """A cca call failed: `status` is the status name (e.g. "CCA_ERR_BAD_SETTINGS"),
    the text is cca's message."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class OutOfMemoryError(CcaError, MemoryError):
    """cca ran out of device memory (the message is PyTorch's)."""


def _check(lib, status, what):
    if status == 0:
        return
    name = lib.cca_status_str(status).decode()
    msg = lib.cca_last_error().contents.message.decode("utf-8", "replace")
    cls = OutOfMemoryError if status == _STATUS_OUT_OF_MEMORY else CcaError
    raise cls(name, "%s: %s: %s" % (what, name, msg))


def settings(text=None):
    """The effective settings from the defaults, then $CCA_ALLOC_CONF, then text
    (PYTORCH_CUDA_ALLOC_CONF syntax): {key: (value, source)} in cca's order,
    source one of "default", "environment", "argument". Raises CcaError for
    an invalid string (the message names the offending key:value)."""
    lib = _lib.load()
    out = ctypes.c_void_p()
    arg = _lib.text_arg("settings", "text", text)
    _check(lib, lib.cca_settings_describe(arg, ctypes.byref(out)), "settings")
    result = {}
    for line in _lib.take_string(lib, out).splitlines():
        parts = line.split(" ")
        if len(parts) < 3 or not parts[-1].startswith("("):
            continue
        result[parts[0]] = (" ".join(parts[1:-1]), parts[-1].strip("()"))
    return result


def _result_dict(r):
    stats = {r.memory_stats[i].key.decode(): r.memory_stats[i].value
             for i in range(_lib.MEMORY_STATS_COUNT) if r.memory_stats[i].key}
    out = {
        "settings": r.settings.decode(),
        "events": r.events, "allocs": r.allocs, "frees": r.frees,
        "segment_allocs": r.segment_allocs, "segment_frees": r.segment_frees,
        "ooms": r.ooms, "pool_ops": r.pool_ops, "address_mismatches": r.address_mismatches,
        "late_segment_allocs": r.late_segment_allocs, "late_segment_frees": r.late_segment_frees,
        "step_allocations": r.step_allocations,
        "last_step_segment_allocs": r.last_step_segment_allocs,
        "last_step_segment_frees": r.last_step_segment_frees,
        "cached_free_bytes": r.cached_free_bytes, "largest_free_bytes": r.largest_free_bytes,
        "compact_moves": r.compact_moves, "compact_pending_growths": r.compact_pending_growths,
        "unexpected_ooms": r.unexpected_ooms,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_requested_bytes": r.peak_requested_bytes,
        "peak_active_bytes": r.peak_active_bytes,
        "replay_seconds": r.seconds, "load_seconds": r.load_seconds, "overlapped": r.overlapped,
        "events_per_second": r.events_per_second,
        "memory_stats": stats,
        "memory_summary": ctypes.string_at(r.memory_summary).decode() if r.memory_summary else "",
        "first_address_mismatch": r.first_address_mismatch.decode(),
        "expected": None,
    }
    if r.has_expected:
        out["expected"] = {
            "allocs": r.expected_allocs, "segment_allocs": r.expected_segment_allocs,
            "segment_frees": r.expected_segment_frees, "ooms": r.expected_ooms,
            "peak_reserved_bytes": r.expected_peak_reserved_bytes,
            "memory_stats_mismatches": r.stats_mismatches,
            "first_memory_stats_mismatch": r.first_stats_mismatch.decode(),
            "memory_summary_matches": r.summary_matches,
        }
    return out


def replay(path, settings=None, cap=None, total_memory=None, addresses=None, device=0,
           fraction=True, snapshot=None, svg=None, sequential=False):
    """Replay a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot's
    file, pickle, gzip or not) through cca on a simulated device, as
    `cca replay --json` does, and return the result as a dict: peaks, segment
    counts, OOMs, address mismatches against PyTorch, the 122 memory_stats,
    the summary text, and under "expected" what the trace says PyTorch did.

    settings: a settings string (None: the trace's own); cap: a smaller
    device in bytes; total_memory: the simulated device's size; addresses:
    "trace" (PyTorch's segment addresses, every allocation compared) or
    "fresh" (the simulated device chooses); None: "trace" without settings,
    else "fresh", as the command line; fraction: apply the trace's per-process memory fraction;
    snapshot / svg: write the end state there; sequential: read the whole
    file before replaying (by default the replay runs on a second thread
    while the file is read; the result is the same, "overlapped" says which).

    The replay runs on cca's own state: it refuses (CcaError
    CCA_ERR_BUSY) in a process where cca is serving allocations (e.g. after
    cca.torch.install()); run it in another process there."""
    lib = _lib.load()
    if addresses is None:
        addresses = "trace" if settings is None else "fresh"
    if addresses not in ("trace", "fresh"):
        raise ValueError("addresses must be 'trace' or 'fresh', not %r" % (addresses,))
    opts = _lib.ReplayOptions()
    opts.settings = _lib.text_arg("replay", "settings", settings)
    opts.cap = _lib.size_arg("replay", "cap", 0 if cap is None else cap)
    opts.total_memory = _lib.size_arg("replay", "total_memory",
                                      0 if total_memory is None else total_memory)
    opts.trace_addresses = addresses == "trace"
    opts.ignore_fraction = not fraction
    opts.device = _lib.device_arg("replay", device)
    opts.snapshot_path = _lib.path_arg("replay", "snapshot", snapshot) if snapshot else None
    opts.svg_path = _lib.path_arg("replay", "svg", svg) if svg else None
    opts.sequential = bool(sequential)
    cpath = _lib.path_arg("replay", "path", path)
    if lib.cca_is_initialized():
        raise CcaError("CCA_ERR_BUSY", "replay: cca is initialised in this process and a replay "
                       "would reset it; replay in another process (e.g. `cca replay --json`)")
    res = _lib.ReplayResult()
    st = lib.cca_replay_file(cpath, ctypes.byref(opts), ctypes.byref(res))
    try:
        _check(lib, st, "replay %s" % path)
        return _result_dict(res)
    finally:
        lib.cca_replay_result_free(ctypes.byref(res))


def snapshot_to_json(path):
    """Read a snapshot pickle (PyTorch's or cca's, .gz or not) as a dict
    (segments, device_traces, allocator_settings, ...)."""
    lib = _lib.load()
    out = ctypes.c_void_p()
    _check(lib, lib.cca_snapshot_file_to_json(_lib.path_arg("snapshot_to_json", "path", path),
                                              ctypes.byref(out)),
           "snapshot_to_json %s" % path)
    return _json.loads(_lib.take_string(lib, out))


def snapshot_to_svg(path, svg_path):
    """Draw a snapshot pickle as a self-contained SVG file."""
    lib = _lib.load()
    _check(lib, lib.cca_snapshot_file_to_svg(_lib.path_arg("snapshot_to_svg", "path", path),
                                             _lib.path_arg("snapshot_to_svg", "svg_path", svg_path)),
           "snapshot_to_svg %s" % path)


# ---- the allocator of this process -------------------------------------------

def is_initialized():
    """True once cca is initialised in this process."""
    return bool(_lib.load().cca_is_initialized())


def backend():
    """The active backend ("cuda", "sim", ...), initialising cca from the environment."""
    lib = _lib.load()
    _check(lib, lib.cca_init(), "init")
    return lib.cca_backend_name().decode()


def memory_stats(device=0):
    """This process's cca statistics of a device: torch.cuda.memory_stats()'s
    122 keys, sorted, with cca's values."""
    lib = _lib.load()
    entries = (_lib.StatEntry * _lib.MEMORY_STATS_COUNT)()
    device = _lib.device_arg("memory_stats", device)
    _check(lib, lib.cca_memory_stats(device, entries, _lib.MEMORY_STATS_COUNT), "memory_stats")
    return {e.key.decode(): e.value for e in entries}


def device_stats(device=0):
    """The raw statistics structure (cca_device_stats_t) of a device."""
    lib = _lib.load()
    s = _lib.DeviceStats()
    device = _lib.device_arg("device_stats", device)
    _check(lib, lib.cca_get_device_stats(device, ctypes.byref(s)), "device_stats")
    return s


def memory_summary(device=0, abbreviated=False):
    """The text of torch.cuda.memory_summary() for cca's statistics of a device."""
    lib = _lib.load()
    out = ctypes.c_void_p()
    device = _lib.device_arg("memory_summary", device)
    _check(lib, lib.cca_memory_summary(device, bool(abbreviated), ctypes.byref(out)),
           "memory_summary")
    return _lib.take_string(lib, out)


def reset_peak_stats(device=0):
    lib = _lib.load()
    _check(lib, lib.cca_reset_peak_stats(_lib.device_arg("reset_peak_stats", device)), "reset_peak_stats")


def reset_accumulated_stats(device=0):
    lib = _lib.load()
    _check(lib, lib.cca_reset_accumulated_stats(
        _lib.device_arg("reset_accumulated_stats", device)), "reset_accumulated_stats")


def empty_cache():
    """Return every unused cached segment to the device."""
    lib = _lib.load()
    _check(lib, lib.cca_empty_cache(), "empty_cache")


def record_history(enabled=True, max_entries=100000):
    """Start (or stop, which clears it) recording the allocation history, without
    stacks (cca.torch's install records PyTorch's stacks through
    torch.cuda.memory._record_memory_history)."""
    lib = _lib.load()
    max_entries = _lib.size_arg("record_history", "max_entries", max_entries)
    _check(lib, lib.cca_record_history(bool(enabled), None, None, max_entries, 0),
           "record_history")


def dump_snapshot(path):
    """Write this process's state and history as a PyTorch snapshot pickle
    (gzip when path ends in .gz), for torch.cuda._memory_viz and cca replay."""
    lib = _lib.load()
    _check(lib, lib.cca_dump_snapshot(_lib.path_arg("dump_snapshot", "path", path)), "dump_snapshot %s" % path)
