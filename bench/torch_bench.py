"""PyTorch step times on cca against PyTorch's own allocator, same run, same machine.

Usage: python3 bench/torch_bench.py [LIBCCA_SO] [--repeat N] [--pairs-only] [--generate-alone] [--ckpt] [--llama]
                                   [--short]
Allocators (one fresh process each, in turn, N rounds): PyTorch native,
PyTorch native with expandable_segments:True, cca (cca.torch.install()), and
cca with compact_memory:True (its moves of free granules and waits for a
stream's event counted over the whole run).
Workloads: ResNet-50 training (batch 64, SGD), then its inference on batches
drawn from 1 to 256 (in the same process, after the training's optimizer is
gone and the cache emptied), GPT-2 small training (8 x 512,
AdamW), GPT-2 generation (batch 1, 32-token prompt, 128 new tokens, greedy),
BERT base training at a sequence length drawn each step (16 x 64-512, AdamW)
and ViT-B/16 training at a batch drawn each step (8-128, SGD), the same
seeded draws for every allocator,
each model's peak reserved bytes and their ratio to its peak requested bytes
(the cache emptied and the peaks reset before each model; the whole run's
peak reserved is the largest model's; with --generate-alone, GPT-2 generation
alone in a process of its own, and nothing else; with --ckpt, GPT-2 small at 16 x 1024 in
bf16 with activation checkpointing, 16 steps in a process of its own, and nothing else: step
time, peak reserved / requested, the maps of its last 8 steps, compact_memory's plans; with
--llama, a Llama-style decoder generating and then training, in a process of its own, as
scripts/record-trace.py's llama_generate and llama_train_accum record them; with --short,
the models without BERT and ViT), and
torch.empty(1 MiB) + free from
Python (and with pin_memory=True: pinned host memory, also timed in C++ through
PyTorch's host allocator interface), broken down: torch.empty(0) + free
(PyTorch's own cost: the allocator is asked for nothing), the allocate + free
pair through PyTorch's CUDAAllocator interface timed in C++ (the allocator's
share), their difference (PyTorch's share of the 1 MiB pair) and, for cca,
cca_malloc_device + cca_free alone; each pair figure is the fastest of five timed
blocks. Every worker runs on the same four CPUs. Each round starts with a
different allocator. Prints each round's figures, one RESULT line per figure
(median over rounds) and a table. Random weights; needs torchvision and
transformers.
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import llama_decoder  # noqa: E402 (the decoder the bundled Llama traces recorded)

MODES = ("native", "native-expandable", "cca", "cca-compact")


def timed_steps(torch, step, warmup, steps):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def timed_late_steps(torch, step, warmup, steps):
    """ms a step over `steps` steps after `warmup`, and the backend maps (num_device_alloc)
    those later steps made."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    maps = torch.cuda.memory_stats().get("num_device_alloc", 0)
    ms = timed_steps(torch, step, 0, steps) * 1e3
    return ms, torch.cuda.memory_stats().get("num_device_alloc", 0) - maps


def best_pair_us(fn, n, blocks=5):
    """The fastest of `blocks` timed blocks of n / blocks calls, in us per call: a block that
    another process or an interrupt slowed is not the allocator's figure."""
    per = n // blocks
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        best = min(best, (time.perf_counter() - t0) / per * 1e6)
    return best


def worker(mode):
    # every allocator's process on the same CPUs: the Python pair moved by up to 70% between
    # processes left to the scheduler
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(cpus[:4]))
    import cca.torch
    if mode in ("cca", "cca-compact"):
        assert cca.torch.install() == "adapter", cca.torch.adapter_error()
    import torch
    import torchvision
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    out = {}

    # torch.empty + free of 1 MiB from Python
    torch.empty(1, device="cuda")
    for _ in range(2000):
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    n = 200000
    out["empty_free_1MiB_us"] = best_pair_us(
        lambda: torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), n)
    # where that time goes: torch.empty(0) asks the allocator for nothing (PyTorch's own cost,
    # plus a device lookup); the C++ pair is the allocator's share (allocate() and the
    # DataPtr's deleter through PyTorch's CUDAAllocator interface); cca's direct pair is
    # cca_malloc_device + cca_free alone
    for _ in range(2000):
        torch.empty(0, dtype=torch.uint8, device="cuda")
    out["empty_free_0B_us"] = best_pair_us(lambda: torch.empty(0, dtype=torch.uint8, device="cuda"), n)
    cca.torch.time_allocator_pairs(1 << 20, 2000)
    out["allocator_pair_1MiB_us"] = min(cca.torch.time_allocator_pairs(1 << 20, n // 5)
                                        for _ in range(5)) / 1e3
    out["torch_share_1MiB_us"] = out["empty_free_1MiB_us"] - out["allocator_pair_1MiB_us"]
    out["cca_direct_pair_1MiB_us"] = (cca.torch.time_allocator_pairs(1 << 20, n, direct=True) / 1e3
                                      if mode == "cca" else float("nan"))
    # pinned host memory from Python: torch.empty(1 MiB, pin_memory=True) + free (cca's pinned
    # host allocator under cca.torch.install(), PyTorch's own otherwise)
    for _ in range(2000):
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    out["pinned_empty_free_1MiB_us"] = best_pair_us(
        lambda: torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True), n)
    out["pinned_allocator_pair_1MiB_us"] = min(cca.torch.time_allocator_pairs(1 << 20, n // 5, pinned=True)
                                               for _ in range(5)) / 1e3
    if os.environ.get("CCA_BENCH_PAIRS_ONLY"):
        out["backend"] = cca.torch.installed() or "pytorch"
        return out
    if os.environ.get("CCA_BENCH_GENERATE_ALONE"):
        generate_alone(torch, transformers, mode, out)
        out["backend"] = cca.torch.installed() or "pytorch"
        return out
    if os.environ.get("CCA_BENCH_CKPT"):
        ckpt_loop(torch, transformers, mode, out)
        out["backend"] = cca.torch.installed() or "pytorch"
        return out
    if os.environ.get("CCA_BENCH_LLAMA"):
        llama_loops(torch, transformers, mode, out)
        out["backend"] = cca.torch.installed() or "pytorch"
        return out

    models(torch, torchvision, transformers, mode, out)
    out["peak_reserved_bytes"] = max(out[k] for k in out if k.endswith("_peak_reserved_bytes"))
    out["backend"] = cca.torch.installed() or "pytorch"
    if mode == "cca-compact":
        out.update(compact_counts())
    return out


# Set by scripts/record-trace.py (its torch_bench workload): called with "empty_cache" and
# "reset_peaks" just before fresh_peaks does each, so that a trace of the models' process
# records where they came.
MARK = None


def models(torch, torchvision, transformers, mode, out):
    """The models, one after the other in this process, each from fresh_peaks: ResNet-50
    training, then its inference on drawn batches, GPT-2 training, then generation, and the two
    loops whose shapes change at every step. Mode "record" runs the steps cca-compact runs (the
    steady steps included) without asking cca for anything. Each phase is a function of its
    own, so that what it made and did not hand on is gone before the next phase starts."""
    model = resnet50_train(torch, torchvision, mode, out)
    resnet50_infer(torch, model, mode, out)
    del model
    gpt, ids = gpt2_train(torch, transformers, mode, out)
    gpt2_generate(torch, gpt, ids, mode, out)
    del gpt, ids
    if not os.environ.get("CCA_BENCH_SHORT"):
        varying_models(torch, torchvision, transformers, mode, out)


def resnet50_train(torch, torchvision, mode, out):
    """ResNet-50 training (batch 64, SGD with momentum); the model, for its inference."""
    start = fresh_peaks(torch, mode)
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (64,), device="cuda")

    def resnet_step():
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    out["resnet50_train_ms"] = timed_steps(torch, resnet_step, 5, 30) * 1e3
    if mode in ("cca-compact", "record"):  # the loop's own moves: after warm-up, none
        steady_moves(torch, resnet_step, 10, "resnet50", out)
    model_peaks(torch, "resnet50_train", out, start)
    return model


def resnet50_infer(torch, model, mode, out):
    """The trained ResNet-50's inference on 8 batches drawn from 1 to 256 (its optimizer gone)."""
    start = fresh_peaks(torch, mode)
    model.eval()
    draws = torch.Generator().manual_seed(1)
    batches = [int(torch.randint(1, 257, (1,), generator=draws)) for _ in range(8)]

    def infer(b):
        with torch.no_grad():
            model(torch.randn(b, 3, 224, 224, device="cuda")).argmax(1)
    out["resnet50_infer_ms"] = drawn_steps(torch, infer, batches, 2) * 1e3
    model_peaks(torch, "resnet50_infer", out, start)


def gpt2_train(torch, transformers, mode, out):
    """GPT-2 small training (8 x 512, AdamW); the model and its tokens, for generation."""
    start = fresh_peaks(torch, mode)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
    gopt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 512), device="cuda")

    def gpt_step():
        gopt.zero_grad(set_to_none=True)
        gpt(input_ids=ids, labels=ids).loss.backward()
        gopt.step()
    out["gpt2_train_ms"] = timed_steps(torch, gpt_step, 3, 15) * 1e3
    if mode in ("cca-compact", "record"):
        steady_moves(torch, gpt_step, 5, "gpt2_train", out)
    model_peaks(torch, "gpt2_train", out, start)
    return gpt, ids


def gpt2_generate(torch, gpt, ids, mode, out):
    """The trained GPT-2's greedy generation (batch 1, a 32-token prompt, 128 new tokens; its
    optimizer gone), and the allocations of one call."""
    start = fresh_peaks(torch, mode)
    gpt.eval()
    prompt = ids[:1, :32]

    def gen():
        with torch.no_grad():
            gpt.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
    out["gpt2_generate_ms"] = timed_steps(torch, gen, 1, 5) * 1e3
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    gen()
    out["gpt2_generate_allocs"] = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    model_peaks(torch, "gpt2_generate", out, start)


def generate_alone(torch, transformers, mode, out):
    """GPT-2 generation in a process of its own (no training before it): the same calls as the
    main run's, from an untrained model, its peaks from the model's load on."""
    start = fresh_peaks(torch, mode)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda().eval()
    prompt = torch.randint(0, 50257, (1, 32), device="cuda")

    def gen():
        with torch.no_grad():
            gpt.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
    out["gpt2_generate_alone_ms"] = timed_steps(torch, gen, 1, 5) * 1e3
    model_peaks(torch, "gpt2_generate_alone", out, start)


def ckpt_loop(torch, transformers, mode, out):
    """GPT-2 small at 16 x 1024 under bf16 autocast with activation checkpointing (AdamW), 16
    steps in a process of its own, as scripts/record-trace.py's gpt2_train_ckpt_bf16 records
    it: its step time over steps 9 to 16, peak reserved / requested from the model's load on,
    the backend maps (num_device_alloc) in steps 9 to 16, and under compact mode the plans."""
    start = fresh_peaks(torch, mode)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        ids = torch.randint(0, 50257, (16, 1024), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["gpt2_ckpt_train_ms"], out["gpt2_ckpt_late_maps"] = timed_late_steps(torch, step, 8, 8)
    model_peaks(torch, "gpt2_ckpt_train", out, start)
    if mode == "cca-compact":
        now = compact_counts()
        out["gpt2_ckpt_plans"] = now.get("compact_plans", 0)
        out["gpt2_ckpt_planned_allocations"] = now.get("compact_planned_allocations", 0)


def llama_loops(torch, transformers, mode, out):
    """A Llama-style decoder (scripts/llama_decoder.py: 8 layers, hidden 1024, grouped-query
    attention, random weights) as scripts/record-trace.py's llama_generate and
    llama_train_accum record it, in a process of its own: first 8 greedy generations in bf16 (a
    batch drawn from 1 to 16, a prompt from 32 to 512 tokens, 64 new tokens; the same draws as
    the recording), timed per call; then, that model gone, the cache emptied and the peaks
    reset, 6 training steps under bf16 autocast with gradients accumulated over 4 micro-batches
    of 4 x 1024, timed over steps 3 to 6. Each phase's peaks, and the maps (num_device_alloc)
    of the last 4 calls and steps."""
    llama_generate_calls(torch, transformers, mode, out)
    llama_train(torch, transformers, mode, out)


def llama_generate_calls(torch, transformers, mode, out):
    start = fresh_peaks(torch, mode)
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = transformers.LlamaForCausalLM(llama_decoder.config(transformers)).to(
        device="cuda", dtype=torch.bfloat16).eval()
    calls = [llama_decoder.prompt(torch, draws) for _ in range(8)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    maps = None
    with torch.no_grad():
        for i, ids in enumerate(calls):
            if i == 4:
                torch.cuda.synchronize()
                maps = torch.cuda.memory_stats().get("num_device_alloc", 0)
            model.generate(ids, attention_mask=torch.ones_like(ids), **llama_decoder.GENERATE_KWARGS)
    torch.cuda.synchronize()
    out["llama_generate_ms"] = (time.perf_counter() - t0) / len(calls) * 1e3
    out["llama_generate_late_maps"] = torch.cuda.memory_stats().get("num_device_alloc", 0) - maps
    model_peaks(torch, "llama_generate", out, start)


def llama_train(torch, transformers, mode, out):
    start = fresh_peaks(torch, mode)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_decoder.config(transformers)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out["llama_train_ms"], out["llama_train_late_maps"] = timed_late_steps(
        torch, lambda: llama_decoder.train_step(torch, model, opt), 2, 4)
    model_peaks(torch, "llama_train", out, start)


def varying_models(torch, torchvision, transformers, mode, out):
    """Two loops whose shapes change at every step, the same seeded draws in every allocator's
    process: BERT base (masked LM, batch 16, AdamW) at a sequence length drawn from 64 to 512
    in steps of 8, and ViT-B/16 (SGD with momentum) at a batch drawn from 8 to 128. Each model's
    time a step over its drawn steps after three warm-up steps, and its peaks."""
    draws = torch.Generator().manual_seed(1)
    lengths = [8 * int(torch.randint(8, 65, (1,), generator=draws)) for _ in range(18)]
    batches = [int(torch.randint(8, 129, (1,), generator=draws)) for _ in range(18)]
    bert_varlen_train(torch, transformers, lengths, mode, out)
    vit_varbatch_train(torch, torchvision, batches, mode, out)


def bert_varlen_train(torch, transformers, lengths, mode, out):
    start = fresh_peaks(torch, mode)
    bert = transformers.BertForMaskedLM(transformers.BertConfig()).cuda()
    bopt = torch.optim.AdamW(bert.parameters(), lr=1e-4)

    def bert_step(n):
        ids = torch.randint(0, 30522, (16, n), device="cuda")
        bert(input_ids=ids, labels=ids).loss.backward()
        bopt.step()
        bopt.zero_grad(set_to_none=True)
    out["bert_varlen_train_ms"] = drawn_steps(torch, bert_step, lengths, 3) * 1e3
    model_peaks(torch, "bert_varlen_train", out, start)


def vit_varbatch_train(torch, torchvision, batches, mode, out):
    start = fresh_peaks(torch, mode)
    vit = torchvision.models.vit_b_16().cuda()
    vopt = torch.optim.SGD(vit.parameters(), lr=0.01, momentum=0.9)

    def vit_step(b):
        x = torch.randn(b, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (b,), device="cuda")
        torch.nn.functional.cross_entropy(vit(x), y).backward()
        vopt.step()
        vopt.zero_grad(set_to_none=True)
    out["vit_varbatch_train_ms"] = drawn_steps(torch, vit_step, batches, 3) * 1e3
    model_peaks(torch, "vit_varbatch_train", out, start)


def drawn_steps(torch, step, shapes, warmup):
    """Seconds a step over shapes[warmup:], after steps at shapes[:warmup]."""
    for s in shapes[:warmup]:
        step(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in shapes[warmup:]:
        step(s)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (len(shapes) - warmup)


def fresh_peaks(torch, mode):
    """Before a model: the cache emptied and the peaks reset, so that its figures are its own.
    Returns what the model starts from: the bytes still reserved and allocated (the previous
    model's live tensors, in the granules or segments they keep mapped), and under cca's
    compact mode its move counts so far."""
    torch.cuda.synchronize()
    if MARK:
        MARK("empty_cache")
    torch.cuda.empty_cache()
    if MARK:
        MARK("reset_peaks")
    torch.cuda.reset_peak_memory_stats()
    stats = torch.cuda.memory_stats()
    start = {"reserved": stats["reserved_bytes.all.current"], "allocated": stats["allocated_bytes.all.current"]}
    if mode == "cca-compact":
        start["counts"] = compact_counts()
    return start


def model_peaks(torch, name, out, start):
    """A model's peak reserved bytes and peak requested bytes (since fresh_peaks), and their ratio;
    the reserved bytes it started from that no tensor used (start: fresh_peaks' return), and under
    compact mode the moves it made and the bytes it aliased."""
    stats = torch.cuda.memory_stats()
    out[name + "_peak_reserved_bytes"] = stats["reserved_bytes.all.peak"]
    out[name + "_reserved_over_requested"] = (stats["reserved_bytes.all.peak"]
                                              / max(1, stats["requested_bytes.all.peak"]))
    out[name + "_start_unused_bytes"] = start["reserved"] - start["allocated"]
    if "counts" in start:
        now = compact_counts()
        out[name + "_moves"] = now["compact_moves"] - start["counts"]["compact_moves"]
        out[name + "_aliased_mib"] = (now["compact_aliased_bytes"]
                                      - start["counts"]["compact_aliased_bytes"]) / 2**20


def steady_moves(torch, step, steps, name, out):
    """cca's moves (and the bytes aliased) over steps more steps of a warmed-up loop."""
    before = compact_counts() if MARK is None else {}
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    if MARK is not None:
        return
    after = compact_counts()
    out[name + "_steady_moves"] = after["compact_moves"] - before["compact_moves"]
    out[name + "_steady_aliased_mib"] = (after["compact_aliased_bytes"]
                                         - before["compact_aliased_bytes"]) / 2**20


def compact_counts():
    """cca's moves of free granules in this process (cca_memory_stats_extra)."""
    import ctypes

    class Entry(ctypes.Structure):
        _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_int64)]
    lib = ctypes.CDLL(os.environ["CCA_LIBRARY"])
    entries = (Entry * 16)()
    if lib.cca_memory_stats_extra(0, entries, 16) != 0:
        return {}
    keys = {b"cca.compact_moves": "compact_moves", b"cca.compact_moved_bytes": "compact_moved_bytes",
            b"cca.compact_aliased_bytes": "compact_aliased_bytes",
            b"cca.compact_pending_growths": "compact_pending_growths",
            b"cca.compact_syncs": "compact_syncs", b"cca.compact_plans": "compact_plans",
            b"cca.compact_planned_allocations": "compact_planned_allocations"}
    return {keys[e.key]: e.value for e in entries if e.key in keys}


def print_last_round(title, keys, results):
    """A table of the last round's figures under keys, a column per mode (bytes in MiB)."""
    print("| %s | %s |" % (title, " | ".join(MODES)))
    print("|---|%s" % ("---|" * len(MODES)))
    for k in keys:
        div = 2**20 if k.endswith("_bytes") else 1
        print("| %s | %s |" % (k, " | ".join("%.3f" % (results[m][-1][k] / div) for m in MODES)))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    repeat = 2
    if "--repeat" in sys.argv:
        repeat = int(sys.argv[sys.argv.index("--repeat") + 1])
        args = [a for a in args if a != str(repeat)]
    if "--pairs-only" in sys.argv:  # the allocation pairs and their breakdown, no models
        os.environ["CCA_BENCH_PAIRS_ONLY"] = "1"
    if "--generate-alone" in sys.argv:  # GPT-2 generation in a process of its own, no training
        os.environ["CCA_BENCH_GENERATE_ALONE"] = "1"
    if "--ckpt" in sys.argv:  # GPT-2 in bf16 with activation checkpointing, in a process of its own
        os.environ["CCA_BENCH_CKPT"] = "1"
    if "--llama" in sys.argv:  # a Llama-style decoder generating, then training, in a process of its own
        os.environ["CCA_BENCH_LLAMA"] = "1"
    if "--short" in sys.argv:  # the models without the two whose shapes change at every step
        os.environ["CCA_BENCH_SHORT"] = "1"
    lib = os.path.abspath(args[0] if args else os.path.join(ROOT, "build", "libcca.so"))
    os.environ["CCA_LIBRARY"] = lib
    import cca.torch
    cca.torch.build_adapter()  # not timed
    results = {m: [] for m in MODES}
    for r in range(repeat):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # each allocator first in turn
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            env.pop("CCA_ALLOC_CONF", None)
            if mode == "native-expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            if mode == "cca-compact":
                env["CCA_ALLOC_CONF"] = "compact_memory:True"
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode],
                                  capture_output=True, text=True, env=env, timeout=300)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit("worker %s failed" % mode)
            results[mode].append(json.loads(lines[-1]))
            print("round %d %s: %s" % (r, mode, " ".join("%s=%.4g" % (k, v) for k, v in
                                                          results[mode][-1].items() if k != "backend")))
    if os.environ.get("CCA_BENCH_CKPT"):
        keys = ["gpt2_ckpt_train_ms", "gpt2_ckpt_train_reserved_over_requested", "gpt2_ckpt_late_maps",
                "gpt2_ckpt_train_peak_reserved_bytes"]
        print_last_round("GPT-2 bf16, activation checkpointing", keys, results)
        last = results["cca-compact"][-1]
        print("cca compact: %s plans, %s requests served at their place, %s moves in the model's run"
              % (last.get("gpt2_ckpt_plans", "?"), last.get("gpt2_ckpt_planned_allocations", "?"),
                 last.get("gpt2_ckpt_train_moves", "?")))
        return
    if os.environ.get("CCA_BENCH_LLAMA"):
        keys = ["llama_generate_ms", "llama_generate_reserved_over_requested", "llama_generate_late_maps",
                "llama_generate_peak_reserved_bytes", "llama_train_ms", "llama_train_reserved_over_requested",
                "llama_train_late_maps", "llama_train_peak_reserved_bytes"]
        print_last_round("Llama-style decoder", keys, results)
        last = results["cca-compact"][-1]
        print("cca compact: %s moves in generation, %s in training"
              % (last.get("llama_generate_moves", "?"), last.get("llama_train_moves", "?")))
        return
    if os.environ.get("CCA_BENCH_GENERATE_ALONE"):
        for m in MODES:
            r = results[m][-1]
            print("RESULT torch-%s gpt2_generate_alone_reserved_over_requested value=%g" % (
                m, r["gpt2_generate_alone_reserved_over_requested"]))
        print("| GPT-2 generation alone | PyTorch native | PyTorch expandable | cca | cca compact |")
        print("|---|---|---|---|---|")
        for k, unit in (("gpt2_generate_alone_ms", "ms/call"),
                        ("gpt2_generate_alone_reserved_over_requested", "ratio")):
            print("| %s (%s) | %s |" % (k, unit, " | ".join("%.3f" % results[m][-1][k] for m in MODES)))
        return
    keys = ("resnet50_train_ms", "gpt2_train_ms", "gpt2_generate_ms", "empty_free_1MiB_us",
            "empty_free_0B_us", "allocator_pair_1MiB_us", "torch_share_1MiB_us", "cca_direct_pair_1MiB_us",
            "pinned_empty_free_1MiB_us", "pinned_allocator_pair_1MiB_us",
            "peak_reserved_bytes", "resnet50_train_peak_reserved_bytes", "resnet50_train_reserved_over_requested",
            "resnet50_infer_ms", "resnet50_infer_peak_reserved_bytes", "resnet50_infer_reserved_over_requested",
            "gpt2_train_peak_reserved_bytes", "gpt2_train_reserved_over_requested",
            "gpt2_generate_peak_reserved_bytes", "gpt2_generate_reserved_over_requested",
            "gpt2_generate_start_unused_bytes", "bert_varlen_train_ms", "bert_varlen_train_peak_reserved_bytes",
            "bert_varlen_train_reserved_over_requested", "vit_varbatch_train_ms",
            "vit_varbatch_train_peak_reserved_bytes", "vit_varbatch_train_reserved_over_requested")
    keys = tuple(k for k in keys if k in results["cca"][0])
    med = {m: {k: statistics.median(r[k] for r in results[m]) for k in keys} for m in MODES}
    for m in MODES:
        for k in keys:
            if not math.isnan(med[m][k]):  # cca's direct pair has no native figure
                print("RESULT torch-%s %s value=%g" % (m, k, med[m][k]))
    print("| workload | unit | PyTorch native | PyTorch expandable | cca | cca compact | cca / native |")
    print("|---|---|---|---|---|---|---|")
    units = {"resnet50_train_ms": "ms/step", "resnet50_infer_ms": "ms/batch", "gpt2_train_ms": "ms/step",
             "gpt2_generate_ms": "ms/call",
             "bert_varlen_train_ms": "ms/step", "vit_varbatch_train_ms": "ms/step",
             "empty_free_1MiB_us": "us/pair", "empty_free_0B_us": "us/pair", "allocator_pair_1MiB_us": "us/pair",
             "torch_share_1MiB_us": "us/pair", "cca_direct_pair_1MiB_us": "us/pair",
             "pinned_empty_free_1MiB_us": "us/pair", "pinned_allocator_pair_1MiB_us": "us/pair",
             "peak_reserved_bytes": "MiB"}
    for k in keys:
        units.setdefault(k, "MiB" if k.endswith("_bytes") else "ratio")
    def cell(v):
        return "-" if math.isnan(v) else "%.3f" % v
    for k in keys:
        div = (1 << 20) if k.endswith("_bytes") else 1
        vals = [med[m][k] / div for m in MODES]
        print("| %s | %s | %s | %s | %s | %s | %s |" % (k, units[k], cell(vals[0]), cell(vals[1]), cell(vals[2]),
                                                         cell(vals[3]), cell(vals[2] / vals[0])))
    print("rounds:", repeat, "backend of the cca runs:", results["cca"][0]["backend"])
    last = results["cca-compact"][-1]
    print("cca compact, last round: %s moves of free granules (%.0f MiB), %s growths took new memory "
          "past granules still pending, %s stream synchronisations after a failed event call, "
          "%s planned placements (%s requests served at their place)"
          % (last.get("compact_moves", "?"), last.get("compact_moved_bytes", 0) / 2**20,
             last.get("compact_pending_growths", "?"), last.get("compact_syncs", "?"),
             last.get("compact_plans", "?"), last.get("compact_planned_allocations", "?")))
    print("cca compact, last round, after warm-up: ResNet-50 %s moves in 10 steps (%.0f MiB aliased), "
          "GPT-2 training %s moves in 5 steps (%.0f MiB aliased)"
          % (last.get("resnet50_steady_moves", "?"), last.get("resnet50_steady_aliased_mib", 0),
             last.get("gpt2_train_steady_moves", "?"), last.get("gpt2_train_steady_aliased_mib", 0)))
    print("cca compact, last round, each model from its start: "
          + ", ".join("%s %s moves (%.0f MiB aliased), started with %.0f MiB reserved unused"
                      % (m, last.get(m + "_moves", "?"), last.get(m + "_aliased_mib", 0),
                         last.get(m + "_start_unused_bytes", 0) / 2**20)
                      for m in ("resnet50_train", "resnet50_infer", "gpt2_train", "gpt2_generate",
                                "bert_varlen_train", "vit_varbatch_train")))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
        sys.exit(0)
    main()
