"""Installs cca in every Python process started with this folder on PYTHONPATH and
CCA_TORCH_INSTALL=1 (scripts/pytorch_tests.py runs PyTorch's own tests this way, child
processes included): cca.torch.install() before the program's first CUDA call. Any
sitecustomize found after this folder on the path runs too."""
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))


def _chain():
    """Run the next sitecustomize on sys.path (the interpreter's own), if any."""
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == _here:
            continue
        path = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_chain()
if os.environ.get("CCA_TORCH_INSTALL") == "1":
    # site.py reports an exception here and goes on, which would run the process on PyTorch's
    # own allocator unnoticed: a failure ends the process instead
    try:
        import cca.torch

        mode = cca.torch.install(fallback=False)
    except Exception as e:  # noqa: BLE001
        raise SystemExit("cca.torch.install() failed in sitecustomize: %s" % e)
    if mode != "adapter":
        raise SystemExit("cca.torch.install() did not install the adapter (%s)" % mode)
