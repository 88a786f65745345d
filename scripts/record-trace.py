#!/usr/bin/env python3
"""Record a PyTorch memory trace of a training loop, in the bundled traces' format.

    PYTORCH_CUDA_ALLOC_CONF=... python3 scripts/record-trace.py WORKLOAD STEPS OUT.pickle.gz

WORKLOAD is gpt2_train (GPT-2 small, batch 8 x 512, AdamW), resnet50_train
(torchvision ResNet-50, batch 64, SGD with momentum), bert_train_varlen (BERT
base, masked LM, batch 16, a sequence length drawn each step from 64 to 512 in
steps of 8, AdamW) or vit_train_varbatch (torchvision ViT-B/16, a batch drawn
each step from 8 to 128, SGD with momentum); the draws are seeded, so a
recording repeats. Runs on device 0 with
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


WORKLOADS = {"gpt2_train": gpt2_train, "resnet50_train": resnet50_train,
             "bert_train_varlen": bert_train_varlen, "vit_train_varbatch": vit_train_varbatch}


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
    with gzip.open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    ev = snap["device_traces"][0]
    print("%s: %d steps, %d events, %d allocations" % (
        out, steps, len(ev), sum(e["action"] == "alloc" for e in ev)))


if __name__ == "__main__":
    main()
