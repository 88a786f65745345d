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
import sys

from . import _lib
from ._lib import library_path

__all__ = [
    "CcaError", "OutOfMemoryError", "library_path", "settings", "replay", "explain", "fit",
    "snapshot_to_json",
    "snapshot_to_svg", "memory_stats", "memory_summary", "device_stats", "reset_peak_stats",
    "reset_accumulated_stats", "empty_cache", "record_history", "dump_snapshot", "backend",
    "is_initialized", "set_settings", "set_memory_fraction", "host_stats", "host_empty_cache",
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


def set_settings(text):
    """Apply a settings string (PYTORCH_CUDA_ALLOC_CONF syntax, e.g.
    "expandable_segments:True,compact_memory:True") to this process's cca:
    at once when cca is serving allocations (only the keys named change),
    else merged into $CCA_ALLOC_CONF, which cca reads when it starts (later
    keys win). Raises CcaError naming the offending key:value; nothing
    changes then."""
    if not isinstance(text, str):
        raise TypeError("settings must be a string, not %s" % type(text).__name__)
    settings(text)  # validates
    lib = _lib.load()
    if lib.cca_is_initialized():
        _check(lib, lib.cca_set_settings(text.encode()), "settings")
        return
    text = text.strip(", \t\r\n")
    if text:
        old = (os.environ.get("CCA_ALLOC_CONF") or "").rstrip(", \t\r\n")
        os.environ["CCA_ALLOC_CONF"] = "%s,%s" % (old, text) if old else text


def set_memory_fraction(fraction, device=0):
    """Limit this process's cca to fraction (0..1] of a device's memory (as
    torch.cuda.set_per_process_memory_fraction): beyond it, allocations fail
    with the out-of-memory error."""
    lib = _lib.load()
    _check(lib, lib.cca_set_memory_fraction(float(fraction), int(device)), "set_memory_fraction")


def _result_dict(r, trace_addresses):
    stats = {r.memory_stats[i].key.decode(): r.memory_stats[i].value
             for i in range(_lib.MEMORY_STATS_COUNT) if r.memory_stats[i].key}
    out = {
        "settings": r.settings.decode(),
        "device": r.device, "device_count": r.device_count,
        "recorded_part_only": r.recorded_part_only, "inferred_segments": r.inferred_segments,
        "inferred_blocks": r.inferred_blocks, "inferred_reserved_bytes": r.inferred_reserved_bytes,
        "inferred_requested_bytes": r.inferred_requested_bytes, "ambiguous_blocks": r.ambiguous_blocks,
        "inconsistencies": r.inconsistencies,
        "first_inconsistency": r.first_inconsistency.decode("utf-8", "replace"),
        "events": r.events, "allocs": r.allocs, "frees": r.frees,
        "segment_allocs": r.segment_allocs, "segment_frees": r.segment_frees,
        "ooms": r.ooms, "pool_ops": r.pool_ops,
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
    }
    if trace_addresses:  # compared with PyTorch's addresses: `cca replay --json` says so too
        out["address_mismatches"] = r.address_mismatches
        out["first_address_mismatch"] = r.first_address_mismatch.decode()
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


def _regular_file(path, what):
    """Refuse what cca would not read as a file before opening it: a FIFO would block. A path
    that is not one (a NUL in it, the wrong type) is refused as an argument first."""
    _lib.path_arg(what, "path", path)
    if not os.path.exists(path):
        raise CcaError("CCA_ERR_IO", "%s: cannot open %s: no such file" % (what, path))
    if not os.path.isfile(path):
        raise CcaError("CCA_ERR_IO", "%s: %s is not a regular file" % (what, path))


def _options(path, settings, cap, total_memory, addresses, device, fraction, snapshot=None, svg=None,
             sequential=False, what="replay", strict=False):
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
    opts.strict = bool(strict)
    _lib.path_arg(what, "path", path)  # a NUL or the wrong type: ValueError / TypeError first
    if lib.cca_is_initialized():
        raise CcaError("CCA_ERR_BUSY", "%s: cca is initialised in this process and a replay "
                       "would reset it; replay in another process (e.g. `cca replay --json`)" % what)
    _regular_file(path, what)
    return lib, opts


def _replay_opts(lib, path, opts):
    cpath = _lib.path_arg("replay", "path", path)
    res = _lib.ReplayResult()
    st = lib.cca_replay_file(cpath, ctypes.byref(opts), ctypes.byref(res))
    try:
        _check(lib, st, "replay %s" % path)
        return _result_dict(res, opts.trace_addresses)
    finally:
        lib.cca_replay_result_free(ctypes.byref(res))


def replay(path, settings=None, cap=None, total_memory=None, addresses=None, device=0,
           fraction=True, snapshot=None, svg=None, sequential=False, strict=False):
    """Replay a PyTorch memory snapshot (torch.cuda.memory._dump_snapshot's
    file, pickle, gzip or not) through cca on a simulated device, as
    `cca replay --json` does, and return the result as a dict with the same
    keys: peaks, segment counts, OOMs, the 122 memory_stats, the summary
    text, address_mismatches when the addresses were compared, and under
    "expected" (when the trace carries it) what PyTorch did.

    settings: a settings string (None: the trace's own); cap: a smaller
    device in bytes; total_memory: the simulated device's size; addresses:
    "trace" (PyTorch's segment addresses, every allocation compared) or
    "fresh" (the simulated device chooses); None: "trace" without settings,
    else "fresh", as the command line; fraction: apply the trace's per-process memory fraction;
    snapshot / svg: write the end state there; sequential: read the whole
    file before replaying (by default the replay runs on a second thread
    while the file is read; the result is the same, "overlapped" says which);
    strict: stop at the first inconsistency of the input (CcaError
    CCA_ERR_FORMAT) instead of counting it. One device is replayed (device).

    The replay runs on cca's own state: it refuses (CcaError
    CCA_ERR_BUSY) in a process where cca is serving allocations (e.g. after
    cca.torch.install()); run it in another process there."""
    lib, opts = _options(path, settings, cap, total_memory, addresses, device, fraction, snapshot, svg,
                         sequential, strict=strict)
    return _replay_opts(lib, path, opts)


# PyTorch settings whose effect explain() shows, each added to the trace's own (as the CLI)
_WHAT_IF = ("expandable_segments:True", "max_split_size_mb:256", "roundup_power2_divisions:4",
            "garbage_collection_threshold:0.8")


def _sets_key(settings, extra):
    key = extra[:extra.index(":") + 1]
    return any(settings.startswith(key, i) and (i == 0 or settings[i - 1] in ", ")
               for i in range(len(settings)))


def _ranking(entries, n, count_key):
    return [{"name": e.name.decode("utf-8", "replace"), "bytes": e.bytes, count_key: e.count}
            for e in entries[:n]]


def explain(path, settings=None, cap=None, total_memory=None, addresses=None, device=0, fraction=True):
    """What a replay held at the peak of its reserved memory, as
    `cca replay --explain --json`: {"replay": replay()'s dict, "explain": the
    live bytes by call site, annotation and stream and the cached free bytes by
    segment at the peak, "settings": the peak reserved under other PyTorch
    settings}. Arguments as replay()."""
    lib, opts = _options(path, settings, cap, total_memory, addresses, device, fraction, what="explain")
    res, x = _lib.ReplayResult(), _lib.ReplayExplain()
    st = lib.cca_replay_explain(_lib.path_arg("explain", "path", path), ctypes.byref(opts), ctypes.byref(res), ctypes.byref(x))
    try:
        _check(lib, st, "explain %s" % path)
        r = _result_dict(res, opts.trace_addresses)
    finally:
        lib.cca_replay_result_free(ctypes.byref(res))
    ex = {k: getattr(x, k) for k in ("peak_event", "reserved_bytes", "live_bytes", "live_requested_bytes",
                                     "live_allocations", "cached_free_bytes", "largest_free_bytes",
                                     "segments", "segments_with_free")}
    ex["frames"] = _ranking(x.frames, x.frame_count, "allocations")
    ex["annotations"] = _ranking(x.annotations, x.annotation_count, "allocations")
    ex["streams"] = _ranking(x.streams, x.stream_count, "allocations")
    ex["free_segments"] = _ranking(x.free_segments, x.segment_count, "free_pieces")
    alternatives = []
    for extra in _WHAT_IF:
        if _sets_key(r["settings"], extra):
            continue
        alt = r["settings"] + ("," if r["settings"] else "") + extra
        try:
            a = replay(path, settings=alt, cap=cap, total_memory=total_memory, addresses="fresh",
                       device=device, fraction=fraction, sequential=True)
            alternatives.append({"settings": alt, "peak_reserved_bytes": a["peak_reserved_bytes"],
                                 "unexpected_ooms": a["unexpected_ooms"]})
        except CcaError:
            alternatives.append({"settings": alt, "error": True})
    return {"replay": r, "explain": ex, "settings": alternatives}


_FIT_GRAIN = 2 << 20  # caps tried are multiples of 2 MiB, as the command line's


def fit(path, settings=None, cap=None, total_memory=None, device=0, fraction=True):
    """The smallest device on which the trace runs without an out-of-memory
    error, found by replaying it under capped devices (bisection, 2 MiB
    steps), for each settings string (None in the list: the trace's own;
    settings None: the trace's own, expandable segments, compact memory), as
    `cca replay --fit --json`: a list of {"settings", "trace_settings",
    "peak_reserved_bytes", "fits", "fit_bytes", "reserved_at_fit_bytes",
    "replays"} (or "error")."""
    if settings is None:
        settings = [None, "expandable_segments:True", "compact_memory:True"]
    elif isinstance(settings, str):
        raise ValueError("fit: settings is a list of settings strings")
    rows = []
    for s in settings:
        row = {"settings": s or "", "trace_settings": s is None}

        def attempt(c):
            r = replay(path, settings=s, cap=c, total_memory=total_memory, addresses="fresh",
                       device=device, fraction=fraction)
            return r["unexpected_ooms"] == 0, r["peak_reserved_bytes"]
        try:
            fits, peak = attempt(cap)
            replays, hi, at_fit = 1, 0, 0
            if fits:
                hi, lo, at_fit = -(-peak // _FIT_GRAIN) * _FIT_GRAIN, 0, peak
                while hi - lo > _FIT_GRAIN:
                    mid = lo + (hi - lo) // 2 // _FIT_GRAIN * _FIT_GRAIN
                    ok, p = attempt(mid)
                    replays += 1
                    if ok:
                        hi, at_fit = mid, p
                    else:
                        lo = mid
            row.update({"peak_reserved_bytes": peak, "fits": fits, "fit_bytes": hi,
                        "reserved_at_fit_bytes": at_fit, "replays": replays})
        except CcaError as e:
            row["error"] = str(e)
        rows.append(row)
    return rows


def snapshot_to_json(path):
    """Read a snapshot pickle (PyTorch's or cca's, .gz or not) as a dict
    (segments, device_traces, allocator_settings, ...)."""
    _regular_file(path, "snapshot_to_json")
    lib = _lib.load()
    out = ctypes.c_void_p()
    _check(lib, lib.cca_snapshot_file_to_json(_lib.path_arg("snapshot_to_json", "path", path),
                                              ctypes.byref(out)),
           "snapshot_to_json %s" % path)
    return _json.loads(_lib.take_string(lib, out))


def snapshot_to_svg(path, svg_path):
    """Draw a snapshot pickle as a self-contained SVG file."""
    _regular_file(path, "snapshot_to_svg")
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


def host_stats():
    """The pinned host allocator's statistics (cca_host_stats_t: allocations,
    allocated_bytes, active_requests, active_bytes, each with current, peak,
    allocated and freed; num_host_alloc, num_host_free)."""
    lib = _lib.load()
    s = _lib.HostStats()
    _check(lib, lib.cca_host_get_stats(ctypes.byref(s)), "host_stats")
    return s


def host_empty_cache():
    """Give back to the system every cached pinned host block whose recorded work is done."""
    lib = _lib.load()
    _check(lib, lib.cca_host_empty_cache(), "host_empty_cache")


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


def record_history(enabled=True, max_entries=sys.maxsize):
    """Start (or stop, which clears it) recording the allocation history, without
    stacks (cca.torch's install records PyTorch's stacks through
    torch.cuda.memory._record_memory_history). max_entries bounds the history
    (the oldest entries go beyond it); it is not allocated up front, so the
    default, sys.maxsize as PyTorch's, keeps everything."""
    max_entries = _lib.size_arg("record_history", "max_entries", max_entries)
    lib = _lib.load()
    _check(lib, lib.cca_record_history(bool(enabled), None, None, max_entries, 0),
           "record_history")


def dump_snapshot(path):
    """Write this process's state and history as a PyTorch snapshot pickle
    (gzip when path ends in .gz), for torch.cuda._memory_viz and cca replay."""
    lib = _lib.load()
    _check(lib, lib.cca_dump_snapshot(_lib.path_arg("dump_snapshot", "path", path)), "dump_snapshot %s" % path)
