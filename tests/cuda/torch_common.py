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
