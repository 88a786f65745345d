"""CUDA tensors shared between processes (torch.multiprocessing, spawn) with
cca installed in both, through the adapter's shareIpcHandle / getIpcDevPtr
over cca_ipc_get_handle_bytes / cca_ipc_open_bytes / cca_ipc_close, and the
same checks run natively (PyTorch's own allocator in both processes). Exits
77 when torch or a GPU is missing.

Usage: python3 tests/cuda/torch_ipc.py [LIBCCA_SO] [--cca-only]
  (python/ is put on sys.path; LIBCCA_SO defaults to build/libcca.so). For
  each allocator (cca, then native unless --cca-only) and setting (default,
  expandable_segments:True) a fresh producer process (--worker MODE
  SETTINGS) spawns a consumer; with cca both install it. Tensors go both
  ways through Queues; each side checks the data it receives (a 420 MiB
  tensor among them: 21 granules of an expandable segment), that the
  sender's block is kept while the receiver uses it (the sender frees and
  reallocates the same size first), that the same handle opened twice maps
  once, and that every block is freed once both sides are done. Each check
  prints PASS or FAIL.

Each _new_shared_cuda of a handle consumes one of PyTorch's references to
the sent block (its deleter decrements the sender's counter once): opening
one handle twice takes two references, so the producer shares the storage
twice and the second opening uses the second share's counter. With cca each
share is a handle of its own holding one reference of cca's; the handle not
opened is given back (cca_ipc_release_handle_bytes). Natively both shares
give the same handle (of the block's segment), which holds no reference.
"""
import ctypes
import json
import os
import subprocess
import sys

from torch_common import skipped

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

MiB = 1 << 20
BIG = 420 * MiB  # more granules (21 of 20 MiB) than cca's fixed-size handle names
TIMEOUT = 40  # seconds a queue waits for the other side before the test fails


def allow_ptrace_by_children():
    """IPC of expandable segments takes the sender's descriptors with pidfd_getfd,
    which needs ptrace access to the sender; Yama's ptrace_scope 1 allows it only
    to ancestors, so the producer lets its consumer in (as PyTorch needs too)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(0x59616d61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER_ANY
    except (OSError, AttributeError):
        pass


def expected(torch, n, scale):
    return torch.arange(n, dtype=torch.float32, device="cuda") * scale


def release_cca_handle(handle):
    """Give back the reference of a cca handle this process will not open."""
    import cca._lib
    lib = ctypes.CDLL(cca._lib.library_path())
    lib.cca_ipc_release_handle_bytes.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.cca_ipc_release_handle_bytes.restype = ctypes.c_int
    return lib.cca_ipc_release_handle_bytes(handle, len(handle))


def consumer(mode, settings, to_consumer, to_producer):
    import cca.torch
    results = []

    def check(name, ok, detail=""):
        results.append({"name": "consumer: " + name, "ok": bool(ok), "detail": str(detail)[:400]})
    try:
        if mode == "cca":
            check("install uses the adapter", cca.torch.install(settings=settings) == "adapter",
                  cca.torch.adapter_error())
        elif settings:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
        import torch
        allow_ptrace_by_children()
        torch.cuda.init()
        base = torch.cuda.memory_allocated()
        # 1. the producer's tensors: 1 MiB and a view of it at an offset
        msg = to_consumer.get(timeout=TIMEOUT)
        a, view, n_a, big = msg.pop("a"), msg.pop("view"), msg["n_a"], msg.pop("big")
        check("received tensor's data", torch.equal(a, expected(torch, n_a, 2)))
        check("received view's data and offset", torch.equal(view, expected(torch, n_a, 2)[100:]),
              view.storage_offset())
        check("received 420 MiB tensor's data", big.numel() == BIG // 4 and bool((big == 3.0).all()),
              big.numel())
        del big
        to_producer.put({"step": "got-a"})
        # 2. a 3 MiB tensor the producer frees (and reallocates the size of) while it is open here
        msg = to_consumer.get(timeout=TIMEOUT)
        e, n_e, args, args2, n_s = msg.pop("e"), msg["n_e"], msg["shared_args"], msg["shared_args2"], msg["n_s"]
        to_producer.put({"step": "got-e"})
        go = to_consumer.get(timeout=TIMEOUT)
        check("producer freed and reallocated", go.get("step") == "go", go)
        check("a block its producer freed is kept while open here", torch.equal(e, expected(torch, n_e, 5)))
        # 3. the same handle opened twice maps once (as PyTorch's getIpcDevPtr caches); the
        # second opening takes the second share's reference (see the module's notes)
        new_shared = (getattr(torch.UntypedStorage, "_new_shared_cuda", None)
                      or torch.UntypedStorage._new_shared_device)  # the name in later versions
        if mode == "cca":  # natively the two shares' handles are the same and hold nothing
            st = release_cca_handle(args2[1])
            check("the second share's handle, not opened, given back", st == 0, st)
        s1 = new_shared(*args)
        s2 = new_shared(*(tuple(args[:4]) + tuple(args2[4:])))
        check("the same handle opened twice maps once", s1.data_ptr() == s2.data_ptr() and s1.data_ptr() != 0,
              (hex(s1.data_ptr()), hex(s2.data_ptr())))
        t1 = torch.empty(0, dtype=torch.float32, device="cuda").set_(s1, 0, (n_s,), (1,))
        check("the twice-opened storage's data", torch.equal(t1, expected(torch, n_s, 7)))
        del t1, s1, s2
        # 4. the consumer's own tensors, the other way
        c = a * 3  # 1 MiB, allocated here
        d = torch.full((MiB,), 11.0, device="cuda")  # 4 MiB
        torch.cuda.synchronize()
        check("memory_allocated counts this process's own blocks only",
              torch.cuda.memory_allocated() == base + 5 * MiB, (base, torch.cuda.memory_allocated()))
        del a, view, e, msg
        torch.cuda.synchronize()
        to_producer.put({"step": "consumer-done", "c": c, "d": d, "n_c": n_a})
        released = to_consumer.get(timeout=TIMEOUT)
        check("producer done with our tensors", released.get("step") == "released", released)
        del c, d
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        check("own blocks freed once the producer is done", torch.cuda.memory_allocated() == base,
              (base, torch.cuda.memory_allocated()))
    except Exception as ex:  # report, do not leave the producer waiting
        check("no exception", False, "%s: %s" % (type(ex).__name__, ex))
    to_producer.put({"step": "results", "results": results})


def producer(mode, settings):
    import cca.torch
    results = []

    def check(name, ok, detail=""):
        results.append({"name": name, "ok": bool(ok), "detail": str(detail)[:400]})
    if mode == "cca":
        check("install uses the adapter", cca.torch.install(settings=settings) == "adapter",
              cca.torch.adapter_error())
    elif settings:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = settings
    import torch
    import torch.multiprocessing as mp
    allow_ptrace_by_children()
    torch.cuda.init()
    ctx = mp.get_context("spawn")
    to_consumer, to_producer = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(mode, settings, to_consumer, to_producer))
    proc.start()

    def expect(step):
        msg = to_producer.get(timeout=TIMEOUT)
        if msg.get("step") != step:
            results.extend(msg.get("results", []))
            raise RuntimeError("the consumer sent %s, not %s" % (msg.get("step"), step))
        return msg
    try:
        torch.ones(1, device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        n_a = MiB // 4  # 1 MiB of float32
        a = expected(torch, n_a, 2)
        view = a[100:]
        big = torch.full((BIG // 4,), 3.0, device="cuda")  # 21 granules of 20 MiB when expandable
        torch.cuda.synchronize()
        to_consumer.put({"a": a, "view": view, "n_a": n_a, "big": big})
        expect("got-a")
        # freed here while the consumer has it open: PyTorch's reference counter and cca's keep it
        n_e = 3 * MiB // 4
        e = expected(torch, n_e, 5)
        e_ptr = e.data_ptr()
        n_s = MiB // 4
        s = expected(torch, n_s, 7)
        torch.cuda.synchronize()
        storage = s.untyped_storage()
        share = getattr(storage, "_share_cuda_", None) or storage._share_device_  # later versions' name
        shared_args = share()
        shared_args2 = share()  # a second reference, for the second opening of the first handle
        del storage, share
        to_consumer.put({"e": e, "n_e": n_e, "shared_args": shared_args, "shared_args2": shared_args2,
                         "n_s": n_s})
        expect("got-e")
        del e
        other = torch.full((n_e,), -1.0, device="cuda")  # would take e's block were it freed
        torch.cuda.synchronize()
        check("a block sent and freed is not reused while open elsewhere", other.data_ptr() != e_ptr,
              (hex(other.data_ptr()), hex(e_ptr)))
        to_consumer.put({"step": "go"})
        done = expect("consumer-done")
        c, d = done.pop("c"), done.pop("d")
        check("consumer's tensors received here", torch.equal(c, expected(torch, done["n_c"], 6))
              and torch.equal(d, torch.full((MiB,), 11.0, device="cuda")))
        if "expandable_segments:True" in settings:
            segs = torch.cuda.memory._snapshot()["segments"]
            check("the shared blocks are in expandable segments",
                  any(sg["is_expandable"] and sg["address"] <= a.data_ptr() < sg["address"] + sg["total_size"]
                      for sg in segs), [(hex(sg["address"]), sg["is_expandable"]) for sg in segs])
        del c, d, done
        torch.cuda.synchronize()
        to_consumer.put({"step": "released"})
        results.extend(expect("results")["results"])
        proc.join(TIMEOUT)
        check("consumer exited cleanly", proc.exitcode == 0, proc.exitcode)
        del a, view, s, other, big
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        check("every shared block freed once the consumer is done", torch.cuda.memory_allocated() == base,
              (base, torch.cuda.memory_allocated()))
    except Exception as ex:
        check("no exception", False, "%s: %s" % (type(ex).__name__, ex))
    finally:
        if proc.is_alive():
            proc.terminate()
    return results


def main():
    if skipped():
        return 77
    args = [a for a in sys.argv[1:] if a != "--cca-only"]
    lib = os.path.abspath(args[0] if args else os.path.join(ROOT, "build", "libcca.so"))
    env = dict(os.environ, CCA_LIBRARY=lib)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("CCA_ALLOC_CONF", None)
    failed = 0
    modes = ("cca",) if "--cca-only" in sys.argv else ("cca", "native")
    for mode in modes:
        for settings in ("", "expandable_segments:True"):
            label = "%s, %s" % (mode, settings or "default")
            try:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode, settings],
                                      capture_output=True, text=True, env=env, timeout=100)
            except subprocess.TimeoutExpired as e:
                print((e.stdout or b"")[-3000:], (e.stderr or b"")[-5000:])
                print("FAIL torch ipc (%s): the producer did not finish in 100 s" % label)
                failed += 1
                continue
            lines = [l for l in proc.stdout.splitlines() if l.startswith("[")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-3000:], proc.stderr[-5000:])
                print("FAIL torch ipc (%s): worker exited %d" % (label, proc.returncode))
                failed += 1
                continue
            for c in json.loads(lines[-1]):
                print("%s [%s] %s%s" % ("PASS" if c["ok"] else "FAIL", label, c["name"],
                                        "" if c["ok"] else ": " + c["detail"]))
                failed += not c["ok"]
    print("%s torch ipc: %d failed" % ("PASS" if not failed else "FAIL", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        print(json.dumps(producer(sys.argv[2], sys.argv[3])))
        sys.exit(0)
    sys.exit(main())
