"""Two-GPU data-parallel training (torch.distributed, NCCL) with cca as PyTorch's
CUDA allocator in both ranks (the pluggable path), against the same run on
PyTorch's own allocator: the losses of every step must be equal, and cca must
have served the ranks' memory. Run twice on cca: its caching allocator, and
backend:cudaMallocAsync. Exits 77 without torch or with fewer than two GPUs.
Usage: python3 torch_ddp.py LIBCCA_SO"""
import ctypes
import json
import os
import sys
import tempfile

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:
    print("SKIPPED: no torch")
    sys.exit(77)

STEPS = 30


def rank_main(rank, world, lib_path, use_cca, out_path, port, conf):
    if conf:
        os.environ["CCA_ALLOC_CONF"] = conf
    if use_cca:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "cca_torch_malloc", "cca_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    torch.cuda.set_device(rank)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10)).cuda(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(128, 512, generator=gen).cuda(rank)
        y = torch.randint(0, 10, (128,), generator=gen).cuda(rank)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    served = None
    if use_cca:
        lib = ctypes.CDLL(lib_path)
        stats = (ctypes.c_int64 * 122)()
        assert lib.cca_get_device_stats(rank, stats) == 0
        served = stats[49]  # allocated_bytes[ALL].peak (both backends report it)
    dist.barrier()
    dist.destroy_process_group()
    with open("%s.%d" % (out_path, rank), "w") as f:
        json.dump({"losses": losses, "served": served}, f)


def run(lib_path, use_cca, port, conf=""):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result")
        mp.spawn(rank_main, args=(2, lib_path, use_cca, out, port, conf), nprocs=2, join=True)
        return [json.load(open("%s.%d" % (out, r))) for r in range(2)]


def main():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("SKIPPED: fewer than two GPUs")
        return 77
    lib_path = os.path.abspath(sys.argv[1])
    native = run(lib_path, False, 29511)
    print("native losses: first %.6f last %.6f" % (native[0]["losses"][0], native[0]["losses"][-1]))
    assert native[0]["losses"][-1] < native[0]["losses"][0], "training did not reduce the loss"
    for label, port, conf in (("cca", 29512, ""), ("cca cudaMallocAsync", 29513, "backend:cudaMallocAsync")):
        cca = run(lib_path, True, port, conf)
        diff = max(abs(a - b) for a, b in zip(native[0]["losses"], cca[0]["losses"]))
        print("%s losses: first %.6f last %.6f; largest difference over %d steps: %g (bitwise "
              "equal: %s)" % (label, cca[0]["losses"][0], cca[0]["losses"][-1], STEPS, diff,
                              native[0]["losses"] == cca[0]["losses"]))
        for r in range(2):
            print("  rank %d: peak %d bytes allocated through cca" % (r, cca[r]["served"]))
            assert cca[r]["served"] > 0, "cca served nothing on rank %d" % r
        assert diff <= 1e-6, "%s: losses differ from the native run" % label
    print("PASS two-GPU NCCL data-parallel training on cca (both backends): losses equal to native")
    return 0


if __name__ == "__main__":
    sys.exit(main())
