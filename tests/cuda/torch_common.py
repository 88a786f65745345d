"""What the PyTorch checks in this folder share (each is run as a script, so this folder is
on sys.path)."""


def skip_reason(gpus=1, modules=()):
    """Why a check cannot run here (no torch, one of modules missing, fewer than gpus
    GPUs), or None; a check prints "SKIPPED: " and the reason and exits 77."""
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
