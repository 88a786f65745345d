"""Two ranks of torch.distributed (NCCL) with cca.torch.install() (the C++ adapter) in both,
against the same run on PyTorch's own allocator: DDP and FSDP2 (fully_shard) training with
TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1 (NCCL registers the allocator's segments as
they come and go, through a trace tracker), then a MemPool over NCCL's ncclMemAlloc
(ProcessGroupNCCL.mem_allocator) registered with the process group and an all-reduce of a
tensor allocated in it. The losses of every step and the all-reduce's result must equal the
native run's. Exits 77 without torch or with fewer than two GPUs.
Usage: python3 torch_nccl.py LIBCCA_SO"""
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    print("SKIPPED: no torch")
    sys.exit(77)

STEPS = 12


def model(rank):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10)).cuda(rank)


def train(rank, world, wrapped, params):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(128, 512, generator=gen).cuda(rank)
        y = torch.randint(0, 10, (128,), generator=gen).cuda(rank)
        loss = torch.nn.functional.cross_entropy(wrapped(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    return losses


def mem_pool_all_reduce(rank):
    """The documented pattern: a MemPool over the process group's ncclMemAlloc allocator,
    registered with the group, and a collective on a tensor allocated in it."""
    pg = dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cuda", rank))
    allocator = getattr(backend, "mem_allocator", None)
    if allocator is None:
        return "no mem_allocator in this torch"
    pool = torch.cuda.MemPool(allocator)
    with torch.cuda.use_mem_pool(pool):
        t = torch.arange(1 << 21, device="cuda", dtype=torch.float32) * (rank + 1)
    backend.register_mem_pool(pool)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    total = float(t.sum().item())
    segments = len(pool.snapshot())
    backend.deregister_mem_pool(pool)
    del t
    return {"sum": total, "segments": segments}


def rank_main(rank, world, lib_path, use_cca, out_path, port):
    os.environ["CCA_LIBRARY"] = lib_path
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "1"
    if use_cca:
        import cca.torch
        assert cca.torch.install() == "adapter", cca.torch.adapter_error()
    torch.cuda.set_device(rank)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {}
    m = model(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])
    result["ddp"] = train(rank, world, ddp, ddp.parameters())
    from torch.distributed.fsdp import fully_shard
    m = model(rank)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    result["fsdp2"] = train(rank, world, m, m.parameters())
    result["mempool"] = mem_pool_all_reduce(rank)
    result["backend"] = torch.cuda.get_allocator_backend()
    result["cca"] = use_cca
    dist.barrier()
    dist.destroy_process_group()
    with open("%s.%d" % (out_path, rank), "w") as f:
        json.dump(result, f)


def run(lib_path, use_cca, port):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result")
        mp.spawn(rank_main, args=(2, lib_path, use_cca, out, port), nprocs=2, join=True)
        return [json.load(open("%s.%d" % (out, r))) for r in range(2)]


def main():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("SKIPPED: fewer than two GPUs")
        return 77
    lib_path = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build", "libcca.so"))
    native = run(lib_path, False, 29521)
    ours = run(lib_path, True, 29522)
    failed = 0
    for key in ("ddp", "fsdp2"):
        n, c = native[0][key], ours[0][key]
        diff = max(abs(a - b) for a, b in zip(n, c))
        ok = diff <= 1e-6 and n[-1] < n[0]
        print("%s %s with the NCCL registration hook: losses native first %.6f last %.6f, cca first %.6f "
              "last %.6f; largest difference over %d steps %g" % (
                  "PASS" if ok else "FAIL", key, n[0], n[-1], c[0], c[-1], STEPS, diff))
        failed += not ok
    for r in range(2):
        n, c = native[r]["mempool"], ours[r]["mempool"]
        ok = n == c and isinstance(n, dict)
        print("%s rank %d: MemPool over ncclMemAlloc registered with the group, all-reduce: native %s, cca %s" % (
            "PASS" if ok else "FAIL", r, n, c))
        failed += not ok
    print("%s torch nccl: %d failed" % ("PASS" if not failed else "FAIL", failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
