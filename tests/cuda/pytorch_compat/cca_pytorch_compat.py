"""A pytest plugin (`-p cca_pytorch_compat`) that lets test files (test_cuda.py...) of a PyTorch
revision a little newer than the installed torch import: every name its `from torch.testing._internal.X
import (...)` lines ask for and X lacks is taken from a sibling module of torch's test helpers
that has it (names move between common_cuda and common_utils), or from its new name (RENAMED:
an older test file's HAS_CUDA is inductor_utils' HAS_CUDA_AND_TRITON), else given a stand-in that
skips the test that uses it (a TEST_* or PLATFORM_SUPPORTS_* flag is False). The same for every
run, native and cca alike, so the comparison stays fair. The test files are found through the
CCA_PYTORCH_TEST_FILE environment variable (paths separated by os.pathsep).

With CCA_PYTEST_SHARD=K/N, only every N-th selected test from the K-th (0-based) runs, after -k
has chosen them: scripts/pytorch_tests.py splits a run over N processes so.

With CCA_PYTEST_HARD_EXIT=1 the process ends with pytest's exit status as soon as pytest has
printed its summary, without the interpreter's exit handlers: a test file that starts
compile workers or other threads can otherwise keep its process alive past its summary, and
the next file of the same process would never start."""
import ast
import functools
import importlib
import os
import unittest

SIBLINGS = ("common_utils", "common_cuda", "common_device_type", "common_dtype")
# names renamed since: an older test file's name -> the installed torch's
RENAMED = {"HAS_CUDA": "HAS_CUDA_AND_TRITON"}


def _stand_in(name):
    def missing(*args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            @functools.wraps(args[0])
            def skip(*a, **k):
                raise unittest.SkipTest("%s is not in this torch" % name)
            return skip
        raise unittest.SkipTest("%s is not in this torch" % name)
    return missing


def _wanted(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.testing._internal."):
            yield node.module, [a.name for a in node.names]


def _fill(path):
    filled = []
    for module_name, names in _wanted(path):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name in names:
            if hasattr(module, name):
                continue
            value = getattr(module, RENAMED[name], None) if name in RENAMED else None
            for sibling in SIBLINGS if value is None else ():
                try:
                    other = importlib.import_module("torch.testing._internal." + sibling)
                except ImportError:
                    continue
                if hasattr(other, name):
                    value = getattr(other, name)
                    break
            if value is None:
                value = False if name.isupper() else _stand_in(name)
            setattr(module, name, value)
            filled.append("%s.%s" % (module_name.rsplit(".", 1)[1], name))
    return filled


def pytest_configure(config):
    filled = []
    for path in os.environ.get("CCA_PYTORCH_TEST_FILE", "").split(os.pathsep):
        if path and os.path.isfile(path):
            filled += _fill(path)
    if filled:
        print("cca_pytorch_compat: filled in " + ", ".join(filled))


def shard_of(items, shard):
    """The items of shard "K/N": every N-th from the K-th; (kept, left out)."""
    k, n = (int(x) for x in shard.split("/"))
    if n < 1 or not 0 <= k < n:
        raise ValueError("CCA_PYTEST_SHARD=%s: expected K/N with 0 <= K < N" % shard)
    kept = [item for i, item in enumerate(items) if i % n == k]
    left = [item for i, item in enumerate(items) if i % n != k]
    return kept, left


_exit_status = [0]


def pytest_sessionfinish(session, exitstatus):
    _exit_status[0] = int(exitstatus)


def pytest_unconfigure(config):
    if os.environ.get("CCA_PYTEST_HARD_EXIT") == "1":
        import sys
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


try:
    import pytest

    @pytest.hookimpl(trylast=True)  # after -k has deselected
    def pytest_collection_modifyitems(config, items):
        shard = os.environ.get("CCA_PYTEST_SHARD")
        if not shard:
            return
        kept, left = shard_of(items, shard)
        if left:
            config.hook.pytest_deselected(items=left)
        items[:] = kept
except ImportError:  # imported outside pytest (its unit test)
    pass
