"""What the GPU checks in this folder share (each is run as a script, so this folder is on
sys.path; bench/python_ecosystem_bench.py adds it)."""


def skipped(gpus=1, modules=()):
    """Whether a check cannot run here, once "SKIPPED: " and the reason are printed (the
    check then exits 77)."""
    why = skip_reason(gpus, modules)
    if why:
        print("SKIPPED: " + why)
    return why is not None


def skip_reason(gpus=1, modules=()):
    """Why a check cannot run here (no torch, one of modules missing, fewer than gpus
    GPUs), or None."""
    try:
        import torch
    except ImportError:
        return "no torch"
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            return "no %s" % name
    if not torch.cuda.is_available():
        return "no GPU"
    if torch.cuda.device_count() < gpus:
        return "%d GPU, %d needed" % (torch.cuda.device_count(), gpus)
    return None


def build_library(source, name, command):
    """source (C++ or CUDA text) written to a temporary folder as name and compiled into a
    shared library there by command(source_path, library_path) (an argument list); the
    library's path. A failed build ends the check, with the compiler's output."""
    import os
    import subprocess
    import tempfile
    out_dir = tempfile.mkdtemp(prefix="cca-test-")
    src = os.path.join(out_dir, name)
    lib = os.path.join(out_dir, os.path.splitext(name)[0] + ".so")
    with open(src, "w") as f:
        f.write(source)
    cmd = command(src, lib)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit("FAIL building %s:\n%s\n%s" % (name, " ".join(cmd), (proc.stdout + proc.stderr)[-4000:]))
    return lib


def run_json_worker(script, args, env, timeout):
    """script run as `script --worker ARGS...` in a fresh process with env: the last line of
    its output that starts with "{", read as JSON, with "seconds" (the run's wall time)
    added; None, once its output's tail is printed, if it failed or printed no such line."""
    import json
    import subprocess
    import sys
    import time
    t0 = time.time()
    proc = subprocess.run([sys.executable, script, "--worker"] + list(args), capture_output=True,
                          text=True, env=env, timeout=timeout)
    line = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not line:
        print("worker %s exited %d" % (" ".join(args), proc.returncode))
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        return None
    r = json.loads(line[-1])
    r["seconds"] = time.time() - t0
    return r


def numba_cuda_numpy_compat():
    """The GPU image's numba-cuda registers an overload for numpy.row_stack, which its numpy
    (2.5) no longer has, so Numba's kernel machinery fails to import there with or without
    cca. Give numpy back the old name, an alias of vstack as it was, so that Numba's kernels
    can run at all. Changes nothing where numpy has the name."""
    try:
        import numpy
    except ImportError:
        return
    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
