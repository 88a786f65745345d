"""cca as PyTorch's CUDA allocator.

    import cca.torch
    cca.torch.install()            # first thing, before any CUDA tensor
    import torch
    ...                            # torch.cuda.memory_stats() etc. now report cca

install() compiles a small C++ adapter (src/bindings/torch_adapter.cpp)
against the installed torch the first time (about half a minute; the result is
cached under $CCA_TORCH_BUILD_DIR, else ~/.cache/cca), and makes it PyTorch's
CUDA allocator the way torch.cuda.memory.change_current_allocator does. Where
the adapter cannot be built (no C++ compiler, no CUDA headers), it falls back
to PyTorch's pluggable-allocator path and warns about what is lost.
"""
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings

import cca
from . import _lib

PLUGGABLE_LOSSES = (
    "torch.cuda.memory_stats, memory_summary, memory_allocated/reserved and their max_ forms, "
    "reset_peak_memory_stats, _record_memory_history and _snapshot see nothing (read cca's "
    "figures with cca.memory_stats() and cca.memory_summary() instead); CUDA graphs and "
    "MemPool do not work; Tensor.record_stream does nothing; an allocation costs more")

_mode = None      # None, "adapter" or "pluggable"
_adapter = None   # the loaded adapter library
_adapter_error = None
_pinned = False   # cca serves PyTorch's pinned host memory (install(pinned=True) with the adapter)


def installed():
    """How cca serves PyTorch in this process: "adapter", "pluggable" or None."""
    return _mode


def pinned_installed():
    """Whether cca's pinned host allocator serves PyTorch's pinned memory here."""
    return _pinned


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("cca.torch needs PyTorch (import torch failed: %s)" % e) from e
    return torch


def _paths(torch):
    """Include and library folders of torch and CUDA, as torch's own extension builder sees them."""
    from torch.utils import cpp_extension
    try:
        incs = cpp_extension.include_paths(device_type="cuda")
        libs = cpp_extension.library_paths(device_type="cuda")
    except TypeError:  # older signature: include_paths(cuda=True)
        incs = cpp_extension.include_paths(cuda=True)
        libs = cpp_extension.library_paths(cuda=True)
    return incs, libs


def _compiler():
    for cxx in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cxx and shutil.which(cxx):
            return cxx
    raise RuntimeError("no C++ compiler found (set CXX)")


def _build_dir():
    base = os.environ.get("CCA_TORCH_BUILD_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cca")
    os.makedirs(base, exist_ok=True)
    return base


def adapter_command(output):
    """The compiler command that builds the adapter into output (a list)."""
    torch = _torch()
    src = os.path.join(_lib.source_dir(), "torch_adapter.cpp")
    incs, libs = _paths(torch)
    libdir = os.path.dirname(_lib.library_path())
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    cmd = [_compiler(), "-O2", "-shared", "-fPIC", "-std=" + os.environ.get("CCA_TORCH_CXX_STD", "c++17"),
           "-fvisibility=hidden", "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
           '-DTORCH_ADAPTER_TORCH_VERSION="%s"' % torch.__version__,
           "-I" + _lib.include_dir()]
    cmd += ["-isystem" + d for d in incs]
    cmd += os.environ.get("CCA_TORCH_CXXFLAGS", "").split()
    cmd += [src, "-o", output, "-L" + libdir, "-lcca", "-Wl,-rpath," + libdir]
    for d in libs:
        cmd += ["-L" + d, "-Wl,-rpath," + d]
    cmd += ["-ltorch_cpu", "-lc10", "-lc10_cuda", "-lcudart"]
    return cmd


def build_adapter(verbose=False):
    """Compile the adapter for this torch and this libcca (or find it already
    built) and return its path. Raises RuntimeError with the compiler's output."""
    torch = _torch()
    src = os.path.join(_lib.source_dir(), "torch_adapter.cpp")
    with open(src, "rb") as f:
        key = hashlib.sha256(f.read())
    with open(os.path.join(_lib.include_dir(), "cca.h"), "rb") as f:
        key.update(f.read())
    key.update(torch.__version__.encode())
    key.update(_lib.library_path().encode())
    key.update(os.environ.get("CCA_TORCH_CXX_STD", "").encode())
    key.update(os.environ.get("CCA_TORCH_CXXFLAGS", "").encode())
    path = os.path.join(_build_dir(), "cca_torch_adapter-%s.so" % key.hexdigest()[:16])
    if os.path.exists(path):
        return path
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = adapter_command(tmp)
    if verbose:
        print(" ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError("building the cca PyTorch adapter failed:\n%s\n%s"
                           % (" ".join(cmd), proc.stdout[-6000:]))
    os.replace(tmp, path)
    return path


def _load_adapter(verbose):
    global _adapter
    if _adapter is None:
        lib = ctypes.CDLL(build_adapter(verbose))
        lib.cca_torch_adapter_install.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.cca_torch_adapter_install.restype = ctypes.c_int
        lib.cca_torch_adapter_install_pinned.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.cca_torch_adapter_install_pinned.restype = ctypes.c_int
        lib.cca_torch_adapter_note_settings.argtypes = [ctypes.c_char_p]
        lib.cca_torch_adapter_note_settings.restype = ctypes.c_int
        lib.cca_torch_adapter_defer_settings.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.cca_torch_adapter_defer_settings.restype = ctypes.c_int
        lib.cca_torch_adapter_force_uncached.argtypes = [ctypes.c_int]
        lib.cca_torch_adapter_force_uncached.restype = ctypes.c_int
        _adapter = lib
    return _adapter


def pytorch_alloc_conf(environ=None):
    """PyTorch's allocator settings string from the environment, as PyTorch 2.11's CUDA
    allocator reads it: PYTORCH_CUDA_ALLOC_CONF where it is set (even empty), else
    PYTORCH_ALLOC_CONF, else "" (measured: with both set, the first decides, backend and
    expandable_segments included). The adapter reads the same, in C++, when PyTorch
    initialises its allocator."""
    environ = os.environ if environ is None else environ
    if "PYTORCH_CUDA_ALLOC_CONF" in environ:
        return environ["PYTORCH_CUDA_ALLOC_CONF"]
    return environ.get("PYTORCH_ALLOC_CONF", "")


def install_settings(settings=None, environ=None):
    """The settings string cca runs with: settings when given, else $CCA_ALLOC_CONF (when not
    empty), else PyTorch's (pytorch_alloc_conf). install() applies it at once on the
    pluggable path; the adapter makes the same choice when PyTorch initialises its
    allocator (startup_settings in torch_adapter.cpp)."""
    if settings is not None:
        return settings
    environ = os.environ if environ is None else environ
    return environ.get("CCA_ALLOC_CONF") or pytorch_alloc_conf(environ)


def no_caching_requested(environ=None):
    """Whether PYTORCH_NO_CUDA_MEMORY_CACHING asks for uncached allocations (set and not
    "0"): the adapter then allocates with cudaMalloc / cudaFree on each call, as PyTorch."""
    value = (os.environ if environ is None else environ).get("PYTORCH_NO_CUDA_MEMORY_CACHING")
    return bool(value) and value != "0"


def _apply_settings(text):
    cca.settings(text)  # validates; raises CcaError naming the bad key:value
    lib = _lib.load()
    if lib.cca_is_initialized():
        cca._check(lib, lib.cca_set_settings(text.encode()), "settings")
    else:
        os.environ["CCA_ALLOC_CONF"] = text


def _without_backend(text):
    """text (PYTORCH_CUDA_ALLOC_CONF syntax) without its backend:VALUE settings; the rest as
    written. Whitespace is not part of a key (PyTorch drops it), and commas inside [...] do not
    end a setting."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    kept = [p for p in parts if "".join(p.split(":", 1)[0].split()) != "backend"]
    return ",".join(kept) if len(kept) < len(parts) else text


def _backend_decided_elsewhere(explicit, environ=None):
    """Whether cca's backend is chosen by something other than PyTorch's variables: install()'s
    settings or a non-empty CCA_ALLOC_CONF. Only then (or on the pluggable path) does a
    backend key leave PyTorch's variables at install; else the adapter reads it from them."""
    environ = os.environ if environ is None else environ
    return explicit or bool(environ.get("CCA_ALLOC_CONF"))


def _forget_backend_in_environment():
    """PyTorch reads PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF again when its allocator
    settings are first used, after install, and a backend key there must then be the name of
    the installed allocator (it asserts "Allocator backend parsed at runtime != allocator
    backend parsed at load time"). The adapter answers with the backend cca runs, which
    install's settings or CCA_ALLOC_CONF may have chosen otherwise. cca has taken the backend
    into its own settings, so the key leaves PyTorch's variables; every other setting stays."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        text = os.environ.get(name)
        kept = _without_backend(text) if text is not None else None
        if kept != text:
            os.environ[name] = kept


def _follow_runtime_settings(torch):
    """torch.cuda.memory._set_allocator_settings(text) changes PyTorch's settings at run time
    (programs use it to turn expandable segments on and off between phases); PyTorch's own
    allocator reads them as it goes, cca keeps its own. After install, the function applies
    text to PyTorch's settings as before and then to cca's (cca_set_settings, or merged into
    CCA_ALLOC_CONF before cca starts), so both follow."""
    memory = torch.cuda.memory
    original = getattr(memory, "_set_allocator_settings", None)
    if original is None or getattr(original, "_cca_follows", False):
        return

    def _set_allocator_settings(env):
        result = original(env)
        text = _without_backend(env)  # PyTorch has checked a backend key against cca's name
        lib = _lib.load()
        if lib.cca_is_initialized():
            _apply_settings(text)
        elif _mode == "adapter" and _adapter is not None:
            # cca reads PyTorch's variables when it starts: the string waits for that (as
            # CCA_ALLOC_CONF it would hide them), then applies over them
            cca.settings(text)  # validates
            err = ctypes.create_string_buffer(1024)
            if _adapter.cca_torch_adapter_defer_settings(text.encode(), err, len(err)) != 0:
                raise RuntimeError("cca.torch: " + err.value.decode("utf-8", "replace"))
        elif text:
            cca.settings(text)  # validates
            old = os.environ.get("CCA_ALLOC_CONF")
            old = (old or "").rstrip(", \t\r\n")  # (a trailing comma, allowed alone)
            os.environ["CCA_ALLOC_CONF"] = "%s,%s" % (old, text) if old else text  # later keys win
        if _mode == "adapter" and _adapter is not None:  # snapshots report it, as PyTorch's
            _adapter.cca_torch_adapter_note_settings(env.encode())
        return result
    _set_allocator_settings._cca_follows = True
    _set_allocator_settings.__doc__ = original.__doc__
    memory._set_allocator_settings = _set_allocator_settings


def install(settings=None, fallback=True, verbose=False, pinned=True):
    """Make cca PyTorch's CUDA allocator in this process. Call it before the
    first CUDA allocation (before any tensor goes to the GPU); after it,
    RuntimeError. settings: cca's settings string (PYTORCH_CUDA_ALLOC_CONF
    syntax); None takes $CCA_ALLOC_CONF, else PyTorch's variable
    ($PYTORCH_CUDA_ALLOC_CONF where set, else $PYTORCH_ALLOC_CONF), read as
    PyTorch reads it: when CUDA initialises (with the adapter; a program may
    set them after install()), at install on the pluggable path.
    PYTORCH_NO_CUDA_MEMORY_CACHING (set, not "0") makes every allocation
    uncached (cudaMalloc / cudaFree), as in PyTorch.
    fallback: when the adapter cannot be built, use PyTorch's pluggable
    allocator path (with a warning saying what is lost) instead of raising.
    pinned: with the adapter, cca's pinned host allocator also serves
    PyTorch's pinned memory (pin_memory(), DataLoader's pinning,
    torch.cuda.host_memory_stats); False keeps PyTorch's own (as does a
    refusal, with a warning).
    Returns "adapter" or "pluggable". A second call does nothing."""
    global _mode, _adapter_error, _pinned
    if _mode:
        return _mode
    torch = _torch()
    if torch.cuda.is_initialized():
        raise RuntimeError("cca.torch.install() must run before the first CUDA call of the process: "
                           "PyTorch's CUDA allocator is already in use here. Call it at the start of "
                           "the program, before any tensor is put on the GPU.")
    explicit = settings is not None
    if explicit:
        _apply_settings(settings)
    try:
        adapter = _load_adapter(verbose)
    except (RuntimeError, OSError) as e:
        _adapter_error = str(e)
        if not fallback:
            raise
        if not explicit:  # no adapter to read them when CUDA initialises: read now
            _apply_settings(install_settings(None))
        torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
            _lib.library_path(), "cca_torch_malloc", "cca_torch_free"))
        _mode = "pluggable"
        _forget_backend_in_environment()
        _follow_runtime_settings(torch)
        warnings.warn("cca.torch: the C++ adapter could not be built, so cca runs as PyTorch's "
                      "pluggable allocator; lost: %s. Reason: %s"
                      % (PLUGGABLE_LOSSES, _adapter_error.splitlines()[0]), RuntimeWarning, stacklevel=2)
        return _mode
    err = ctypes.create_string_buffer(1024)
    if adapter.cca_torch_adapter_install(settings.encode() if explicit else None, err, len(err)) != 0:
        raise RuntimeError("cca.torch.install(): " + err.value.decode("utf-8", "replace"))
    _mode = "adapter"
    adapter.cca_torch_adapter_force_uncached(int(no_caching_requested()))
    _pinned = bool(pinned) and adapter.cca_torch_adapter_install_pinned(err, len(err)) == 0
    if pinned and not _pinned:  # the device allocator is cca's already: go on, and say so
        warnings.warn("cca.torch: PyTorch's pinned host allocator stays in use: "
                      + err.value.decode("utf-8", "replace"), RuntimeWarning, stacklevel=2)
    if _backend_decided_elsewhere(explicit):
        _forget_backend_in_environment()
    _follow_runtime_settings(torch)
    return _mode


def _adapter_call(name, *args):
    """Call one of the adapter's measuring functions (name(args..., err, err_size) -> 0 or -1),
    loading the adapter without installing it (it reads PyTorch's current allocator)."""
    lib = _load_adapter(False)
    fn = getattr(lib, name)
    err = ctypes.create_string_buffer(1024)
    if fn(*args, err, ctypes.c_size_t(len(err))) != 0:
        raise RuntimeError("cca.torch: %s: %s" % (name, err.value.decode("utf-8", "replace")))


def time_allocator_pairs(size, n=100000, direct=False, pinned=False):
    """Nanoseconds per allocate + free pair of size bytes, timed in C++ on the
    current device and stream: through PyTorch's current CUDA allocator
    (allocate() and the DataPtr's deleter: what a tensor costs the allocator,
    native or cca), with direct=True straight through cca_malloc_device /
    cca_free, or with pinned=True through PyTorch's current pinned host
    allocator (cca's after install(), else PyTorch's). CUDA must be
    initialised (a tensor on the GPU) first."""
    ns = ctypes.c_double(0.0)
    _adapter_call("cca_torch_adapter_time_pairs", ctypes.c_size_t(size), ctypes.c_size_t(n),
                  ctypes.c_int(2 if pinned else 1 if direct else 0), ctypes.byref(ns))
    return ns.value


def expandable_segment_sizes(device=0):
    """(segments, bytes) from PyTorch's CUDAAllocator::getExpandableSegmentSizes of
    the current allocator (native or cca), which has no Python binding."""
    count, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _adapter_call("cca_torch_adapter_expandable_sizes", ctypes.c_int(device), ctypes.byref(count),
                  ctypes.byref(total))
    return count.value, total.value


def adapter_error():
    """Why the adapter could not be built (after a fallback), or None."""
    return _adapter_error
