"""The Python package without PyTorch: settings, replay, snapshot conversion and
the statistics of this process's allocator, on the simulated backend.

Run by ctest (python_package) with PYTHONPATH=python, CCA_LIBRARY=the built
libcca.so and CCA_CLI=the built cca command; by hand:
  CCA_BACKEND=sim PYTHONPATH=python python3 -m unittest discover -s tests/python
"""
import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("CCA_BACKEND", "sim")

import cca  # noqa: E402
from cca import _lib  # noqa: E402

TRACES = os.path.join(ROOT, "tests", "data", "traces")
TWO_STREAM = os.path.join(TRACES, "two_stream_pipeline_default.pickle.gz")
GPT2_SPLIT = os.path.join(TRACES, "gpt2_train_split64.pickle.gz")
MiB = 1 << 20


def cli():
    path = os.environ.get("CCA_CLI") or os.path.join(ROOT, "build", "cca")
    return path if os.path.exists(path) else None


class Exports(unittest.TestCase):
    def test_only_the_public_api_is_exported(self):
        """libcca.so exports the names of cca.h and cca_backend.h and nothing else."""
        import re
        import shutil
        lib = os.environ.get("CCA_LIBRARY")
        if not lib or not shutil.which("nm"):
            self.skipTest("needs CCA_LIBRARY and nm")
        out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True,
                             capture_output=True, text=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.split()}
        root = os.path.join(os.path.dirname(__file__), "..", "..", "include")
        public = set()
        for header in ("cca.h", "cca_backend.h"):
            with open(os.path.join(root, header)) as f:
                public |= set(re.findall(r"\b(cca_[A-Za-z0-9_]+)\s*\(", f.read()))
        ours = {name for name in exported if name.startswith("cca_")}
        self.assertIn("cca_malloc", ours)
        self.assertEqual(sorted(ours - public), [])
        foreign = {name for name in exported if not name.startswith("cca_")}
        self.assertEqual(sorted(foreign), [])


class Settings(unittest.TestCase):
    def test_defaults_and_argument(self):
        s = cca.settings("max_split_size_mb:64,roundup_power2_divisions:4")
        self.assertEqual(s["max_split_size_mb"], ("64", "argument"))
        self.assertEqual(s["roundup_power2_divisions"], ("4", "argument"))
        self.assertEqual(s["backend"][1], "default")
        self.assertIn("garbage_collection_threshold", s)

    def test_bad_string_names_the_key(self):
        with self.assertRaises(cca.CcaError) as cm:
            cca.settings("max_split_size_mb:3")
        self.assertEqual(cm.exception.status, "CCA_ERR_BAD_SETTINGS")
        self.assertIn("max_split_size_mb", str(cm.exception))
        with self.assertRaises(cca.CcaError):
            cca.settings("no_such_key:1")


class Replay(unittest.TestCase):
    def test_replay_matches_pytorch(self):
        r = cca.replay(TWO_STREAM)
        self.assertEqual(r["address_mismatches"], 0)
        self.assertIsNotNone(r["expected"])
        self.assertEqual(r["peak_reserved_bytes"], r["expected"]["peak_reserved_bytes"])
        self.assertEqual(r["segment_allocs"], r["expected"]["segment_allocs"])
        self.assertEqual(r["allocs"], r["expected"]["allocs"])
        self.assertEqual(r["expected"]["memory_stats_mismatches"], 0)
        self.assertTrue(r["expected"]["memory_summary_matches"])
        self.assertEqual(len(r["memory_stats"]), 122)
        self.assertEqual(r["memory_stats"]["num_device_alloc"], r["segment_allocs"])
        self.assertIn("CUDA memory summary", r["memory_summary"])

    @unittest.skipUnless(cli(), "the cca command is not built")
    def test_replay_equals_the_command_line(self):
        for settings in (None, "max_split_size_mb:64"):
            args = [cli(), "replay", GPT2_SPLIT, "--json"]
            if settings:
                args += ["--settings", settings]
            out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
            r = cca.replay(GPT2_SPLIT, settings=settings)
            for key in ("allocs", "segment_allocs", "segment_frees", "ooms", "peak_reserved_bytes",
                        "peak_allocated_bytes", "late_segment_allocs", "late_segment_frees",
                        "step_allocations", "last_step_segment_allocs", "last_step_segment_frees",
                        "cached_free_bytes", "largest_free_bytes"):
                self.assertEqual(r[key], out[key], (settings, key))
            if "address_mismatches" in out:
                self.assertEqual(r["address_mismatches"], out["address_mismatches"])
            self.assertEqual(r["memory_stats"], out["memory_stats"])

    @unittest.skipUnless(cli(), "the cca command is not built")
    def test_replay_keys_equal_the_command_lines(self):
        """cca.replay and `cca replay --json` give the same keys (address_mismatches only when
        addresses were compared)."""
        for settings, addresses in ((None, None), ("max_split_size_mb:64", None), ("", "trace")):
            args = [cli(), "replay", TWO_STREAM, "--json"]
            if settings is not None:
                args += ["--settings", settings]
            if addresses:
                args += ["--addresses", addresses]
            out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
            r = cca.replay(TWO_STREAM, settings=settings, addresses=addresses)
            self.assertEqual(set(r), set(out), (settings, addresses))
            self.assertEqual(set(r["expected"]), set(out["expected"]))
            compared = addresses == "trace" or settings is None
            self.assertEqual("address_mismatches" in r, compared, (settings, addresses))

    def test_fifo_refused_before_it_blocks(self):
        with tempfile.TemporaryDirectory() as d:
            fifo = os.path.join(d, "fifo")
            os.mkfifo(fifo)
            for call in (cca.replay, cca.snapshot_to_json, cca.explain,
                         lambda p: cca.snapshot_to_svg(p, os.path.join(d, "out.svg"))):
                with self.assertRaises(cca.CcaError) as cm:
                    call(fifo)
                self.assertIn("not a regular file", str(cm.exception))

    @unittest.skipUnless(cli(), "the cca command is not built")
    def test_explain_equals_the_command_line(self):
        out = json.loads(subprocess.run([cli(), "replay", TWO_STREAM, "--explain", "--json"], check=True,
                                        capture_output=True, text=True).stdout)
        x = cca.explain(TWO_STREAM)
        self.assertEqual(set(x), set(out))
        self.assertEqual(x["explain"], out["explain"])
        self.assertEqual(x["settings"], out["settings"])
        self.assertEqual(x["replay"]["peak_reserved_bytes"], x["explain"]["reserved_bytes"])

    @unittest.skipUnless(cli(), "the cca command is not built")
    def test_fit_equals_the_command_line(self):
        out = json.loads(subprocess.run([cli(), "replay", TWO_STREAM, "--fit", "", "expandable_segments:True",
                                         "--json"], check=True, capture_output=True, text=True).stdout)
        self.assertEqual(cca.fit(TWO_STREAM, ["", "expandable_segments:True"]), out)

    def test_sequential_gives_the_same_result(self):
        a = cca.replay(TWO_STREAM)
        b = cca.replay(TWO_STREAM, sequential=True)
        self.assertTrue(a["overlapped"])
        self.assertFalse(b["overlapped"])
        for d in (a, b):
            for key in ("replay_seconds", "load_seconds", "events_per_second", "overlapped"):
                del d[key]
        self.assertEqual(a, b)

    def test_settings_change_the_outcome(self):
        fresh = cca.replay(GPT2_SPLIT, settings="", addresses="fresh")
        split = cca.replay(GPT2_SPLIT, settings="max_split_size_mb:64", addresses="fresh")
        self.assertEqual(split["settings"], "max_split_size_mb:64")
        self.assertNotEqual(fresh["segment_allocs"], split["segment_allocs"])
        self.assertGreater(split["memory_stats"]["oversize_allocations.allocated"], 0)
        self.assertEqual(fresh["memory_stats"]["oversize_allocations.allocated"], 0)

    def test_compact_memory_reserves_less(self):
        ratio = {}
        for settings in ("expandable_segments:True", "compact_memory:True"):
            r = cca.replay(GPT2_SPLIT, settings=settings, addresses="fresh")
            ratio[settings] = r["peak_reserved_bytes"] / r["memory_stats"]["requested_bytes.all.peak"]
        self.assertLess(ratio["compact_memory:True"], ratio["expandable_segments:True"])
        self.assertLessEqual(ratio["compact_memory:True"], 1.02)

    def test_small_device_runs_out_of_memory(self):
        r = cca.replay(TWO_STREAM, cap=64 * MiB, addresses="fresh")
        self.assertGreater(r["ooms"], 0)
        self.assertLessEqual(r["peak_reserved_bytes"], 64 * MiB)

    def test_snapshot_and_svg_outputs(self):
        with tempfile.TemporaryDirectory() as tmp:
            snap = os.path.join(tmp, "end.pickle.gz")
            svg = os.path.join(tmp, "end.svg")
            r = cca.replay(TWO_STREAM, snapshot=snap, svg=svg)
            j = cca.snapshot_to_json(snap)
            self.assertEqual(sum(s["total_size"] for s in j["segments"]),
                             r["memory_stats"]["reserved_bytes.all.current"])
            actions = [e["action"] for e in j["device_traces"][0]]
            self.assertEqual(actions.count("alloc"), r["allocs"])
            with open(svg) as f:
                self.assertIn("<svg", f.read(200))
            svg2 = os.path.join(tmp, "again.svg")
            cca.snapshot_to_svg(snap, svg2)
            self.assertGreater(os.path.getsize(svg2), 1000)

    def test_errors(self):
        with self.assertRaises(cca.CcaError) as cm:
            cca.replay(os.path.join(ROOT, "no-such-trace.pickle"))
        self.assertEqual(cm.exception.status, "CCA_ERR_IO")
        with self.assertRaises(cca.CcaError) as cm:
            cca.snapshot_to_json(os.path.join(ROOT, "README.md"))
        self.assertEqual(cm.exception.status, "CCA_ERR_FORMAT")
        with self.assertRaises(cca.CcaError) as cm:
            cca.replay(TWO_STREAM, settings="roundup_power2_divisions:3")
        self.assertEqual(cm.exception.status, "CCA_ERR_BAD_SETTINGS")
        with self.assertRaises(ValueError):
            cca.replay(TWO_STREAM, addresses="somewhere")


class ThisProcess(unittest.TestCase):
    """The statistics of this process's allocator, driven through libcca."""

    def setUp(self):
        self.lib = _lib.load()
        self.ptrs = []

    def tearDown(self):
        for p in self.ptrs:
            self.lib.cca_free(p)
        self.lib.cca_shutdown()

    def malloc(self, size):
        p = ctypes.c_void_p()
        self.assertEqual(self.lib.cca_malloc_device(ctypes.byref(p), size, 0, None), 0)
        self.ptrs.append(p)
        return p

    def test_statistics(self):
        self.assertEqual(cca.backend(), "sim")
        self.assertTrue(cca.is_initialized())
        for _ in range(3):
            self.malloc(3 * MiB)
        self.malloc(512)
        s = cca.memory_stats()
        self.assertEqual(len(s), 122)
        self.assertEqual(s["allocation.all.current"], 4)
        self.assertEqual(s["allocation.small_pool.current"], 1)
        self.assertEqual(s["allocated_bytes.all.current"], 9 * MiB + 512)
        self.assertEqual(s["requested_bytes.all.current"], 9 * MiB + 512)
        raw = cca.device_stats()
        self.assertEqual(raw.allocation[0].current, 4)
        self.assertEqual(raw.reserved_bytes[0].current, s["reserved_bytes.all.current"])
        self.assertEqual(self.lib.cca_free(self.ptrs.pop()), 0)
        cca.reset_peak_stats()
        self.assertEqual(cca.memory_stats()["allocation.all.peak"], 3)
        cca.reset_accumulated_stats()
        self.assertEqual(cca.memory_stats()["allocation.all.allocated"], 0)
        text = cca.memory_summary()
        self.assertIn("cca CUDA memory summary", text)
        self.assertIn("Allocated memory", text)
        small = cca.memory_stats()["reserved_bytes.small_pool.current"]
        self.assertGreater(small, 0)
        cca.empty_cache()
        self.assertEqual(cca.memory_stats()["reserved_bytes.small_pool.current"], 0)

    def test_history_and_snapshot(self):
        cca.record_history(True, max_entries=1000)
        for _ in range(5):
            self.malloc(MiB)
        self.assertEqual(self.lib.cca_free(self.ptrs.pop()), 0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            cca.dump_snapshot(path)
            j = cca.snapshot_to_json(path)
        cca.record_history(False)
        actions = [e["action"] for e in j["device_traces"][0]]
        self.assertEqual(actions.count("alloc"), 5)
        self.assertEqual(actions.count("free_requested"), 1)
        live = [b for s in j["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        self.assertEqual(len(live), 4)

    def test_history_default_bound_is_not_allocated(self):
        # PyTorch's default max_entries is sys.maxsize: a bound, not a size
        cca.record_history(True)
        cca.record_history(True, max_entries=sys.maxsize)
        for _ in range(3):
            self.malloc(MiB)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "s.pickle")
            cca.dump_snapshot(path)
            j = cca.snapshot_to_json(path)
        cca.record_history(False)
        actions = [e["action"] for e in j["device_traces"][0]]
        self.assertEqual(actions.count("alloc"), 3)
        with self.assertRaises(ValueError):
            cca.record_history(True, max_entries=-1)

    def test_replay_refused_while_serving(self):
        self.malloc(MiB)
        with self.assertRaises(cca.CcaError) as cm:
            cca.replay(TWO_STREAM)
        self.assertEqual(cm.exception.status, "CCA_ERR_BUSY")
        self.assertEqual(cca.memory_stats()["allocation.all.current"], 1)

    def test_out_of_memory_error(self):
        cca.backend()
        p = ctypes.c_void_p()
        st = self.lib.cca_malloc_device(ctypes.byref(p), 1 << 59, 0, None)
        with self.assertRaises(cca.OutOfMemoryError) as cm:
            cca._check(self.lib, st, "malloc")
        self.assertIn("CUDA out of memory. Tried to allocate", str(cm.exception))
        self.assertIsInstance(cm.exception, MemoryError)


class Layout(unittest.TestCase):
    """The ctypes mirrors match cca.h (sizes and the offset of each last field)."""

    @unittest.skipUnless(os.environ.get("CCA_STRUCT_LAYOUT"), "struct_layout is not built")
    def test_mirrors_match_the_header(self):
        out = subprocess.run([os.environ["CCA_STRUCT_LAYOUT"]], check=True, capture_output=True,
                             text=True).stdout
        mirrors = {"cca_error_t": (_lib.Error, "backend_code"),
                   "cca_stat_entry_t": (_lib.StatEntry, "value"),
                   "cca_device_stats_t": (_lib.DeviceStats, "max_split_size"),
                   "cca_host_stats_t": (_lib.HostStats, "host_free_time"),
                   "cca_replay_options_t": (_lib.ReplayOptions, "peaks_from_event"),
                   "cca_replay_result_t": (_lib.ReplayResult, "ambiguous_blocks"),
                   "cca_explain_entry_t": (_lib.ExplainEntry, "count"),
                   "cca_replay_explain_t": (_lib.ReplayExplain, "free_segments")}
        seen = set()
        for line in out.splitlines():
            name, size, offset = line.split()
            cls, last = mirrors[name]
            self.assertEqual((ctypes.sizeof(cls), getattr(cls, last).offset), (int(size), int(offset)), name)
            seen.add(name)
        self.assertEqual(seen, set(mirrors))


class WithoutTorch(unittest.TestCase):
    def test_library_path(self):
        self.assertTrue(os.path.exists(cca.library_path()))

    def test_install_needs_torch(self):
        if importlib.util.find_spec("torch") is not None:
            self.skipTest("torch is installed here")
        import cca.torch
        self.assertIsNone(cca.torch.installed())
        with self.assertRaises(ImportError) as cm:
            cca.torch.install()
        self.assertIn("PyTorch", str(cm.exception))
        self.assertIsNone(cca.torch.installed())


class InstallLogic(unittest.TestCase):
    """cca.torch.install()'s decisions, with a stand-in torch module: the refusal after CUDA
    is initialised, settings validation, and the fallback to the pluggable path when the
    adapter cannot be built (here: no c10 headers)."""

    def setUp(self):
        import types
        self.calls = []
        self.cuda_initialised = False
        fake = types.ModuleType("torch")
        fake.__version__ = "0.0+stand-in"
        fake._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
        memory = types.SimpleNamespace(
            CUDAPluggableAllocator=lambda path, alloc, free: ("pluggable", path, alloc, free),
            change_current_allocator=self.calls.append)
        self.memory = memory
        fake.cuda = types.SimpleNamespace(is_initialized=lambda: self.cuda_initialised, memory=memory)
        ext = types.ModuleType("torch.utils.cpp_extension")
        ext.include_paths = lambda device_type="cpu": ["/nonexistent/torch/include"]
        ext.library_paths = lambda device_type="cpu": ["/nonexistent/torch/lib"]
        utils = types.ModuleType("torch.utils")
        utils.cpp_extension = ext
        fake.utils = utils
        self.saved = {k: sys.modules.get(k) for k in ("torch", "torch.utils", "torch.utils.cpp_extension")}
        sys.modules.update({"torch": fake, "torch.utils": utils, "torch.utils.cpp_extension": ext})
        self.tmp = tempfile.TemporaryDirectory()
        self.env = {k: os.environ.get(k) for k in ("CCA_TORCH_BUILD_DIR", "CCA_ALLOC_CONF",
                                                   "PYTORCH_CUDA_ALLOC_CONF")}
        os.environ["CCA_TORCH_BUILD_DIR"] = self.tmp.name
        os.environ.pop("CCA_ALLOC_CONF", None)
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        import cca.torch
        self.mod = cca.torch
        self.mod._mode = None
        self.mod._adapter = None
        self.mod._adapter_error = None
        self.mod._pinned = False

    def tearDown(self):
        for k, v in self.saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        for k, v in self.env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.mod._mode = None
        self.tmp.cleanup()

    def test_fallback_to_pluggable(self):
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(self.mod.install(), "pluggable")
        self.assertEqual(self.calls, [("pluggable", cca.library_path(), "cca_torch_malloc", "cca_torch_free")])
        self.assertTrue(any("memory_stats" in str(w.message) for w in caught))
        self.assertTrue(self.mod.adapter_error())
        self.assertEqual(self.mod.installed(), "pluggable")
        self.assertEqual(self.mod.install(), "pluggable")  # a second call changes nothing
        self.assertEqual(len(self.calls), 1)
        self.assertEqual(os.listdir(self.tmp.name), [])  # a failed build leaves nothing behind

    def test_no_fallback_raises(self):
        with self.assertRaises(RuntimeError):
            self.mod.install(fallback=False)
        self.assertEqual(self.calls, [])
        self.assertIsNone(self.mod.installed())

    def test_refused_after_cuda_init(self):
        self.cuda_initialised = True
        with self.assertRaises(RuntimeError) as cm:
            self.mod.install()
        self.assertIn("before the first CUDA call", str(cm.exception))
        self.assertEqual(self.calls, [])

    def test_settings(self):
        with self.assertRaises(cca.CcaError) as cm:
            self.mod.install(settings="max_split_size_mb:1")
        self.assertEqual(cm.exception.status, "CCA_ERR_BAD_SETTINGS")
        self.assertEqual(self.calls, [])
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:2"
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mod.install(fallback=True)
        self.assertEqual(os.environ.get("CCA_ALLOC_CONF"), "roundup_power2_divisions:2")

    def test_backend_key_leaves_pytorchs_variables(self):
        """PyTorch asserts that a backend key in its variables names the installed allocator
        when it reads them after install: install takes the key into cca's settings and
        removes it there, leaving every other setting as written."""
        w = self.mod._without_backend
        self.assertEqual(w("backend:cudaMallocAsync"), "")
        self.assertEqual(w("expandable_segments:True,backend:native"), "expandable_segments:True")
        self.assertEqual(w("roundup_power2_divisions:[256:1,512:2],backend:cudaMallocAsync,max_split_size_mb:128"),
                         "roundup_power2_divisions:[256:1,512:2],max_split_size_mb:128")
        self.assertEqual(w(" back end : native ,garbage_collection_threshold:0.6"),
                         "garbage_collection_threshold:0.6")
        for kept in ("", "expandable_segments:True", "backends:x", "max_split_size_mb:128,"):
            self.assertEqual(w(kept), kept)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync,release_lock_on_cudamalloc:True"
        saved = os.environ.get("PYTORCH_ALLOC_CONF")
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
        try:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.assertEqual(self.mod.install(fallback=True), "pluggable")
            # PyTorch 2.11 reads PYTORCH_CUDA_ALLOC_CONF where it is set: so does install
            self.assertEqual(os.environ["CCA_ALLOC_CONF"],
                             "backend:cudaMallocAsync,release_lock_on_cudamalloc:True")
            self.assertEqual(os.environ["PYTORCH_CUDA_ALLOC_CONF"], "release_lock_on_cudamalloc:True")
            self.assertEqual(os.environ["PYTORCH_ALLOC_CONF"], "expandable_segments:True")
        finally:
            if saved is None:
                os.environ.pop("PYTORCH_ALLOC_CONF", None)
            else:
                os.environ["PYTORCH_ALLOC_CONF"] = saved

    def test_pytorch_variables_in_pytorchs_order(self):
        """install()'s settings: its argument, else CCA_ALLOC_CONF (not empty), else
        PYTORCH_CUDA_ALLOC_CONF where set (even empty, as PyTorch 2.11's get_env), else
        PYTORCH_ALLOC_CONF: measured on PyTorch 2.11, PYTORCH_ALLOC_CONF=expandable_segments:True
        with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False runs without expandable
        segments, and a backend key in PYTORCH_ALLOC_CONF is not read then."""
        f = self.mod.install_settings
        self.assertEqual(f("max_split_size_mb:64", {"CCA_ALLOC_CONF": "x"}), "max_split_size_mb:64")
        self.assertEqual(f("", {"CCA_ALLOC_CONF": "x"}), "")
        env = {"CCA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2", "PYTORCH_CUDA_ALLOC_CONF": "c:3"}
        self.assertEqual(f(None, env), "a:1")
        env["CCA_ALLOC_CONF"] = ""
        self.assertEqual(f(None, env), "c:3")
        env["PYTORCH_CUDA_ALLOC_CONF"] = ""
        self.assertEqual(f(None, env), "")
        del env["PYTORCH_CUDA_ALLOC_CONF"]
        self.assertEqual(f(None, env), "b:2")
        self.assertEqual(f(None, {}), "")
        self.assertEqual(self.mod.pytorch_alloc_conf({"PYTORCH_ALLOC_CONF": "b:2"}), "b:2")
        self.assertEqual(self.mod.pytorch_alloc_conf({"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                                      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}),
                         "expandable_segments:False")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:4"
        saved = os.environ.get("PYTORCH_ALLOC_CONF")
        os.environ["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:1"  # would be refused
        try:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.assertEqual(self.mod.install(fallback=True), "pluggable")
            self.assertEqual(os.environ["CCA_ALLOC_CONF"], "roundup_power2_divisions:4")
        finally:
            if saved is None:
                os.environ.pop("PYTORCH_ALLOC_CONF", None)
            else:
                os.environ["PYTORCH_ALLOC_CONF"] = saved

    def _stand_in_adapter(self):
        """The adapter's exported calls, recorded (no torch to build it against here)."""
        import types
        rec = {"install": [], "defer": [], "note": []}
        adapter = types.SimpleNamespace(
            cca_torch_adapter_install=lambda text, err, n: rec["install"].append(text) or 0,
            cca_torch_adapter_force_uncached=lambda on: 0,
            cca_torch_adapter_install_pinned=lambda err, n: 0,
            cca_torch_adapter_defer_settings=lambda text, err, n: rec["defer"].append(text) or 0,
            cca_torch_adapter_note_settings=lambda text: rec["note"].append(text) or 0)

        def load(verbose):
            self.mod._adapter = adapter
            return adapter
        saved = self.mod._load_adapter
        self.mod._load_adapter = load
        self.addCleanup(setattr, self.mod, "_load_adapter", saved)
        self.addCleanup(setattr, self.mod, "_adapter", None)
        return rec

    def _set_env(self, name, value):
        saved = os.environ.get(name)
        self.addCleanup(lambda: os.environ.pop(name, None) if saved is None else os.environ.update({name: saved}))
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def test_adapter_reads_pytorchs_variables_when_cuda_starts(self):
        """With the adapter and no settings argument, install() leaves PyTorch's variables to
        the adapter, which reads them when PyTorch initialises its allocator (a program may set
        PYTORCH_ALLOC_CONF after install, before its first CUDA call, as PyTorch's own
        test_allocator_backend does): nothing goes into CCA_ALLOC_CONF (child processes would
        inherit it, and it would hide their own PyTorch variables), and a backend key stays
        in PyTorch's variables (the adapter runs that backend). An explicit string is applied
        at install, and the backend key then leaves PyTorch's variables."""
        rec = self._stand_in_adapter()
        _lib.load().cca_shutdown()
        self._set_env("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync,per_process_memory_fraction:0.0")
        self._set_env("PYTORCH_ALLOC_CONF", None)
        self.assertEqual(self.mod.install(), "adapter")
        self.assertEqual(rec["install"], [None])
        self.assertNotIn("CCA_ALLOC_CONF", os.environ)
        self.assertEqual(os.environ["PYTORCH_CUDA_ALLOC_CONF"], "backend:cudaMallocAsync,per_process_memory_fraction:0.0")
        # a run-time string before cca starts waits in the adapter, not in CCA_ALLOC_CONF
        self.memory._set_allocator_settings = lambda env: None
        self.mod._follow_runtime_settings(sys.modules["torch"])
        self.memory._set_allocator_settings("expandable_segments:True,backend:cudaMallocAsync")
        self.assertEqual(rec["defer"], [b"expandable_segments:True"])
        self.assertNotIn("CCA_ALLOC_CONF", os.environ)
        with self.assertRaises(cca.CcaError):
            self.memory._set_allocator_settings("expandable_segments:maybe")
        self.assertEqual(rec["defer"], [b"expandable_segments:True"])
        # explicit settings: applied now, passed on, backend key out of PyTorch's variables
        self.mod._mode = None
        self.assertEqual(self.mod.install(settings="roundup_power2_divisions:2"), "adapter")
        self.assertEqual(rec["install"], [None, b"roundup_power2_divisions:2"])
        self.assertEqual(os.environ.get("CCA_ALLOC_CONF"), "roundup_power2_divisions:2")
        self.assertEqual(os.environ["PYTORCH_CUDA_ALLOC_CONF"], "per_process_memory_fraction:0.0")

    def test_backend_decided_elsewhere(self):
        f = self.mod._backend_decided_elsewhere
        self.assertTrue(f(True, {}))
        self.assertTrue(f(False, {"CCA_ALLOC_CONF": "backend:native"}))
        self.assertFalse(f(False, {"CCA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}))

    def test_no_caching_variable(self):
        """PYTORCH_NO_CUDA_MEMORY_CACHING: set and not "0" asks for uncached allocations."""
        f = self.mod.no_caching_requested
        self.assertTrue(f({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}))
        self.assertTrue(f({"PYTORCH_NO_CUDA_MEMORY_CACHING": "yes"}))
        self.assertFalse(f({"PYTORCH_NO_CUDA_MEMORY_CACHING": "0"}))
        self.assertFalse(f({"PYTORCH_NO_CUDA_MEMORY_CACHING": ""}))
        self.assertFalse(f({}))

    def test_runtime_settings_follow(self):
        """After install, torch.cuda.memory._set_allocator_settings applies to PyTorch's settings
        (the stand-in records it) and then to cca's: merged into CCA_ALLOC_CONF before cca
        starts, applied at once after."""
        import warnings
        seen = []
        self.memory._set_allocator_settings = seen.append
        lib = _lib.load()
        lib.cca_shutdown()
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "roundup_power2_divisions:2,"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertEqual(self.mod.install(fallback=True), "pluggable")
        set_settings = self.memory._set_allocator_settings
        self.assertIsNot(set_settings, seen.append)
        set_settings("expandable_segments:True")
        self.assertEqual(seen, ["expandable_segments:True"])
        self.assertEqual(os.environ["CCA_ALLOC_CONF"], "roundup_power2_divisions:2,expandable_segments:True")
        with self.assertRaises(cca.CcaError):
            set_settings("expandable_segments:maybe")  # the stand-in took it; cca refuses it
        self.assertEqual(os.environ["CCA_ALLOC_CONF"], "roundup_power2_divisions:2,expandable_segments:True")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.mod._mode = None
            self.mod.install(fallback=True)  # again: wrapped once, not twice
        self.assertIs(self.memory._set_allocator_settings, set_settings)
        os.environ.pop("CCA_ALLOC_CONF")
        self.assertEqual(lib.cca_init(), 0)
        try:
            fraction = ctypes.c_double(0.0)
            set_settings("per_process_memory_fraction:0.5")
            self.assertEqual(lib.cca_get_memory_fraction(ctypes.c_int(0), ctypes.byref(fraction)), 0)
            self.assertEqual(fraction.value, 0.5)
            self.assertNotIn("CCA_ALLOC_CONF", os.environ)
        finally:
            lib.cca_shutdown()

    def test_runtime_settings_reach_the_adapters_snapshots(self):
        """With the adapter, each string given to _set_allocator_settings is passed on for the
        snapshots' allocator_settings (PYTORCH_CUDA_ALLOC_CONF there: the last one, as
        PyTorch's); the pluggable path has no adapter to tell."""
        import types
        import warnings
        seen, noted = [], []
        self.memory._set_allocator_settings = seen.append
        _lib.load().cca_shutdown()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.assertEqual(self.mod.install(fallback=True), "pluggable")
        set_settings = self.memory._set_allocator_settings
        set_settings("roundup_power2_divisions:4")
        self.assertEqual(noted, [])
        self.mod._mode = "adapter"
        deferred = []
        self.mod._adapter = types.SimpleNamespace(
            cca_torch_adapter_note_settings=noted.append,
            cca_torch_adapter_defer_settings=lambda text, err, n: deferred.append(text) or 0)
        set_settings("garbage_collection_threshold:0.5,max_split_size_mb:40")
        self.assertEqual(noted, [b"garbage_collection_threshold:0.5,max_split_size_mb:40"])
        self.assertEqual(deferred, noted)  # cca not started: waits in the adapter
        self.assertEqual(seen, ["roundup_power2_divisions:4", "garbage_collection_threshold:0.5,max_split_size_mb:40"])
        os.environ.pop("CCA_ALLOC_CONF", None)

    def test_measuring_calls(self):
        """time_allocator_pairs / expandable_segment_sizes: arguments and results through
        ctypes, and the adapter's error as RuntimeError (a stand-in adapter library)."""
        calls = []

        def time_pairs(size, n, kind, ns, err, err_size):
            calls.append((size.value, n.value, kind.value, err_size.value))
            ns._obj.value = 1234.5
            return 0

        def sizes(device, count, total, err, err_size):
            if device.value != 0:
                err.value = b"no device 3"
                return -1
            count._obj.value, total._obj.value = 2, 44 << 20
            return 0
        import types
        self.mod._adapter = types.SimpleNamespace(cca_torch_adapter_time_pairs=time_pairs,
                                                  cca_torch_adapter_expandable_sizes=sizes)
        self.assertEqual(self.mod.time_allocator_pairs(1 << 20, 50), 1234.5)
        self.assertEqual(self.mod.time_allocator_pairs(4096, direct=True), 1234.5)
        self.assertEqual(self.mod.time_allocator_pairs(512, 10, pinned=True), 1234.5)
        self.assertEqual(calls, [(1 << 20, 50, 0, 1024), (4096, 100000, 1, 1024), (512, 10, 2, 1024)])
        self.assertEqual(self.mod.expandable_segment_sizes(), (2, 44 << 20))
        with self.assertRaises(RuntimeError) as cm:
            self.mod.expandable_segment_sizes(3)
        self.assertIn("no device 3", str(cm.exception))
        self.assertIsNone(self.mod.installed())  # measuring installs nothing

    def test_pinned_memory_choice(self):
        """install() with the adapter makes cca's pinned host allocator PyTorch's unless
        pinned=False; where the adapter cannot, cca still serves the device memory and a
        warning says why (a stand-in adapter library)."""
        import types
        calls = []

        def install(settings, err, err_size):
            calls.append("install")
            return 0

        def install_pinned(err, err_size):
            calls.append("pinned")
            if refuse:
                err.value = b"kept its own"
                return -1
            return 0
        uncached = []
        self.mod._adapter = types.SimpleNamespace(cca_torch_adapter_install=install,
                                                  cca_torch_adapter_install_pinned=install_pinned,
                                                  cca_torch_adapter_force_uncached=uncached.append)
        import warnings
        refuse = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertEqual(self.mod.install(), "adapter")
        self.assertTrue(any("pinned host allocator stays in use: kept its own" in str(w.message) for w in caught))
        self.assertFalse(self.mod.pinned_installed())
        refuse = False
        self.mod._mode = None
        self.assertEqual(self.mod.install(pinned=False), "adapter")
        self.assertEqual(calls, ["install", "pinned", "install"])
        self.assertFalse(self.mod.pinned_installed())
        self.mod._mode = None
        self.assertEqual(self.mod.install(), "adapter")
        self.assertEqual(calls[3:], ["install", "pinned"])
        self.assertTrue(self.mod.pinned_installed())
        self.mod._pinned = False
        self.assertEqual(uncached, [0, 0, 0])  # PYTORCH_NO_CUDA_MEMORY_CACHING unset
        saved = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        try:
            self.mod._mode = None
            self.assertEqual(self.mod.install(pinned=False), "adapter")
            self.assertEqual(uncached[3:], [1])  # the adapter allocates uncached, as PyTorch
        finally:
            if saved is None:
                os.environ.pop("PYTORCH_NO_CUDA_MEMORY_CACHING", None)
            else:
                os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = saved

    def test_adapter_command(self):
        cmd = self.mod.adapter_command("/tmp/out.so")
        self.assertIn("-isystem/nonexistent/torch/include", cmd)
        self.assertIn("-I" + _lib.include_dir(), cmd)
        self.assertIn("-lcca", cmd)
        self.assertTrue(any(a.endswith("torch_adapter.cpp") for a in cmd))


if __name__ == "__main__":
    unittest.main()
