#!/usr/bin/env python3
"""Record a PyTorch memory trace of a training loop, in the bundled traces' format.

    PYTORCH_CUDA_ALLOC_CONF=... python3 scripts/record-trace.py WORKLOAD STEPS OUT.pickle.gz

WORKLOAD is gpt2_train (GPT-2 small, batch 8 x 512, AdamW), resnet50_train
(torchvision ResNet-50, batch 64, SGD with momentum), bert_train_varlen (BERT
base, masked LM, batch 16, a sequence length drawn each step from 64 to 512 in
steps of 8, AdamW) or vit_train_varbatch (torchvision ViT-B/16, a batch drawn
each step from 8 to 128, SGD with momentum) or gpt2_train_generate (GPT-2
small trained STEPS steps, then the cache emptied, the peaks reset and 3
generations of 128 tokens in the same process; the two operations are noted in
`cca_meta["pool_events"]`) or resnet50_train_infer (ResNet-50 trained STEPS
steps, then the same two operations and inference on 8 batches drawn from 1 to
256), resnet50_train_eval / gpt2_train_eval (training with an evaluation pass
without gradients at a larger batch after every third step: ResNet-50 at 64 and
256, GPT-2 at 8 x 512 and 32 x 512), gpt2_train_ckpt_bf16 (GPT-2 small at 16 x
1024 under bf16 autocast with activation checkpointing, AdamW), llama_train_accum (a
Llama-style decoder under bf16 autocast, gradients accumulated over 4 micro-batches),
t5_train_varlen (T5 with drawn encoder and decoder lengths), llama_generate (batched greedy
generation with a growing key-value cache, drawn batches and prompt lengths),
deeplab_train_amp_varsize (DeepLabV3 under fp16 autocast and a gradient scaler, drawn image
sizes), or torch_bench (the models of
bench/torch_bench.py in one process, as its
cca-compact worker runs them, with each model's two operations; STEPS unused);
the draws are seeded, so a recording repeats. Runs on device 0 with
PyTorch's own allocator, recording from before the first allocation
(`torch.cuda.memory._record_memory_history(enabled="all", context=None)`),
and writes the snapshot with `cca_meta` (the settings string, the device's
memory, `memory_stats()` and `memory_summary()` at the end), which is what
`cca replay` checks its replay against.
"""
import gzip
import os
import pickle
import sys

import torch

import llama_decoder  # (this script's folder)


def gpt2_train(steps):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, 50257, (8, 512), device="cuda")
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, ids


def resnet50_train(steps):
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, x, y


def bert_train_varlen(steps):
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = BertForMaskedLM(BertConfig()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        n = 8 * int(torch.randint(8, 65, (1,), generator=draws))
        ids = torch.randint(0, 30522, (16, n), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, ids


def vit_train_varbatch(steps):
    import torchvision
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = torchvision.models.vit_b_16().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        b = int(torch.randint(8, 129, (1,), generator=draws))
        x = torch.randn(b, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (b,), device="cuda")
        loss = lossf(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, x, y


POOL_EVENTS = []


def marker(op):
    """Note a program operation for the replay (cca_meta["pool_events"]): taking a snapshot
    records a `snapshot` event, and `at` counts the events up to it."""
    # the snapshot records its own `snapshot` event after the list it returns: event at - 1
    POOL_EVENTS.append({"at": len(torch.cuda.memory._snapshot()["device_traces"][0]) + 1, "op": op})


def next_phase():
    """Between a model's training and its use: the cache emptied and the peaks reset, both
    noted, so that a replay's figures are the second phase's."""
    torch.cuda.synchronize()
    marker("empty_cache")
    torch.cuda.empty_cache()
    marker("reset_peaks")
    torch.cuda.reset_peak_memory_stats()


def gpt2_train_generate(steps):
    """GPT-2 small trained (batch 8 x 512, AdamW, gradients kept after the last step), then,
    the optimizer deleted, the cache emptied and the peaks reset, 3 greedy generations of
    128 tokens from a 32-token prompt in the same process: what a model's memory looks like
    when one program trains and then serves it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (8, 512), device="cuda")
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    del opt
    next_phase()
    model.eval()
    prompt = ids[:1, :32]
    with torch.no_grad():
        for _ in range(3):
            model.generate(prompt, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)


def resnet50_train_infer(steps):
    """ResNet-50 trained (batch 64, SGD with momentum, gradients kept after the last step),
    then, the optimizer deleted, the cache emptied and the peaks reset, inference without
    gradients on 8 batches drawn from 1 to 256 in the same process."""
    import torchvision
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        lossf(model(x), y).backward()
        opt.step()
        del x, y
    del opt
    next_phase()
    model.eval()
    with torch.no_grad():
        for _ in range(8):
            b = int(torch.randint(1, 257, (1,), generator=draws))
            model(torch.randn(b, 3, 224, 224, device="cuda")).argmax(1)


def resnet50_train_eval(steps):
    """ResNet-50 trained at batch 64 (SGD with momentum), with an evaluation pass without
    gradients at batch 256 after every third step: a loop that switches between two memory
    layouts, with no empty_cache between them."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        model.train()
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")
        lossf(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                model(torch.randn(256, 3, 224, 224, device="cuda")).argmax(1)


def gpt2_train_eval(steps):
    """GPT-2 small trained at 8 x 512 (AdamW), with an evaluation loss without gradients at
    32 x 512 after every third step."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(steps):
        model.train()
        ids = torch.randint(0, 50257, (8, 512), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del ids
        if step % 3 == 2:
            model.eval()
            with torch.no_grad():
                ids = torch.randint(0, 50257, (32, 512), device="cuda")
                float(model(input_ids=ids, labels=ids).loss)
                del ids


def gpt2_train_ckpt_bf16(steps):
    """GPT-2 small trained at 16 x 1024 under bf16 autocast with activation checkpointing
    (transformers' gradient_checkpointing_enable, AdamW): the blocks' activations recomputed
    in the backward pass, in the mixed precision large models train with."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        ids = torch.randint(0, 50257, (16, 1024), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, ids


def llama_train_accum(steps):
    """A Llama-style decoder (scripts/llama_decoder.py: 8 layers, hidden 1024, grouped-query
    attention with 4 key-value heads, vocabulary 32000; random weights) trained under bf16
    autocast at 4 x 1024 tokens a micro-batch, gradients accumulated over 4 micro-batches a
    step, AdamW."""
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_decoder.config(transformers)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        llama_decoder.train_step(torch, model, opt)


def t5_train_varlen(steps):
    """A T5 encoder-decoder (t5-small's shape, random weights) trained at batch 16 with an
    encoder length drawn each step from 64 to 512 and a decoder length from 16 to 128 (in
    steps of 8), AdamW."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = T5ForConditionalGeneration(T5Config(decoder_start_token_id=0)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        n = 8 * int(torch.randint(8, 65, (1,), generator=draws))
        m = 8 * int(torch.randint(2, 17, (1,), generator=draws))
        src = torch.randint(0, 32128, (16, n), device="cuda")
        tgt = torch.randint(0, 32128, (16, m), device="cuda")
        loss = model(input_ids=src, labels=tgt).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, src, tgt


def llama_generate(steps):
    """The Llama-style decoder of llama_train_accum in bf16 serving STEPS batched greedy
    generations: a batch drawn from 1 to 16 prompts, a prompt length from 32 to 512, 64 new
    tokens each (the key-value cache growing token by token)."""
    import transformers
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = transformers.LlamaForCausalLM(llama_decoder.config(transformers)).to(
        device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for _ in range(steps):
            ids = llama_decoder.prompt(torch, draws)
            model.generate(ids, attention_mask=torch.ones_like(ids), **llama_decoder.GENERATE_KWARGS)
            del ids


def deeplab_train_amp_varsize(steps):
    """torchvision's DeepLabV3 (ResNet-50 backbone, 21 classes) trained under fp16 autocast
    with a gradient scaler, batch 8, a square image side drawn each step from 320 to 512 in
    steps of 32, SGD with momentum."""
    import torchvision
    torch.manual_seed(0)
    draws = torch.Generator().manual_seed(1)
    model = torchvision.models.segmentation.deeplabv3_resnet50(
        weights=None, weights_backbone=None, num_classes=21, aux_loss=False).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    lossf = torch.nn.CrossEntropyLoss()
    for _ in range(steps):
        side = 32 * int(torch.randint(10, 17, (1,), generator=draws))
        x = torch.randn(8, 3, side, side, device="cuda")
        y = torch.randint(0, 21, (8, side, side), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = lossf(model(x)["out"], y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        del loss, x, y


def torch_bench(steps):
    """The models of bench/torch_bench.py, in one process as its cca-compact worker runs them
    (STEPS is not used), with each model's empty_cache and reset of the peaks noted: a trace
    of the benchmark's own process, to replay what it measured on the GPU."""
    import importlib.util
    import torchvision
    import transformers
    transformers.logging.set_verbosity_error()
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "torch_bench", os.path.join(here, "..", "bench", "torch_bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.MARK = marker
    torch.manual_seed(0)
    bench.models(torch, torchvision, transformers, "record", {})


WORKLOADS = {"gpt2_train": gpt2_train, "resnet50_train": resnet50_train,
             "bert_train_varlen": bert_train_varlen, "vit_train_varbatch": vit_train_varbatch,
             "gpt2_train_generate": gpt2_train_generate, "resnet50_train_infer": resnet50_train_infer,
             "resnet50_train_eval": resnet50_train_eval, "gpt2_train_eval": gpt2_train_eval,
             "gpt2_train_ckpt_bf16": gpt2_train_ckpt_bf16,
             "llama_train_accum": llama_train_accum, "t5_train_varlen": t5_train_varlen,
             "llama_generate": llama_generate, "deeplab_train_amp_varsize": deeplab_train_amp_varsize,
             "torch_bench": torch_bench}


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in WORKLOADS:
        sys.exit("usage: record-trace.py {%s} STEPS OUT.pickle.gz" % ",".join(WORKLOADS))
    work, steps, out = WORKLOADS[sys.argv[1]], int(sys.argv[2]), sys.argv[3]
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, max_entries=10**7)
    work(steps)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    props = torch.cuda.get_device_properties(0)
    snap["cca_meta"] = {
        "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "fraction": 0.0,
        "total_memory": props.total_memory,
        "mem_get_info": torch.cuda.mem_get_info(0),
        "final_memory_stats": dict(torch.cuda.memory_stats(0)),
        "final_memory_summary": torch.cuda.memory_summary(0),
        "device_name": props.name,
        "torch": str(torch.__version__),
    }
    if POOL_EVENTS:
        snap["cca_meta"]["pool_events"] = POOL_EVENTS
    with gzip.open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    ev = snap["device_traces"][0]
    print("%s: %d steps, %d events, %d allocations" % (
        out, steps, len(ev), sum(e["action"] == "alloc" for e in ev)))


if __name__ == "__main__":
    main()
