"""PyTorch on cca: load libcca as PyTorch's pluggable allocator, run real tensor
work, and check that cca served the memory (its statistics, read through ctypes).
Exits 77 when torch or a GPU is missing. Usage: python3 torch_pluggable.py LIBCCA_SO"""
import ctypes
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: no torch")
    sys.exit(77)
if not torch.cuda.is_available():
    print("SKIPPED: no GPU")
    sys.exit(77)

lib_path = sys.argv[1]
alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "cca_torch_malloc", "cca_torch_free")
torch.cuda.memory.change_current_allocator(alloc)
lib = ctypes.CDLL(lib_path)

# cca_device_stats_t is 122 int64 values; allocation[ALL] comes first.
stats = (ctypes.c_int64 * 122)()
def allocation_stats():
    assert lib.cca_get_device_stats(0, stats) == 0
    return stats[0], stats[1], stats[2]   # current, peak, allocated

a = torch.randn(1024, 1024, device="cuda")
b = torch.randn(1024, 1024, device="cuda")
c = a @ b
ref = (a.cpu() @ b.cpu())
assert torch.allclose(c.cpu(), ref, rtol=1e-3, atol=1e-3), "matmul result differs"
cur, peak, total = allocation_stats()
assert cur >= 3 and total >= 3, (cur, peak, total)

s = torch.cuda.Stream()
with torch.cuda.stream(s):
    xs = [torch.full((4096,), float(i), device="cuda") for i in range(100)]
    total_sum = sum(float(x.sum()) for x in xs)
torch.cuda.synchronize()
assert total_sum == sum(4096.0 * i for i in range(100)), total_sum
del xs, a, b, c
torch.cuda.synchronize()
cur2, peak2, total2 = allocation_stats()
assert total2 >= total + 100, (total, total2)
assert peak2 >= 100, peak2
# Kernels writing and reading 128 MiB: several 20 MiB granules with expandable segments
# (CCA_ALLOC_CONF=expandable_segments:True), one segment otherwise.
n = 16 * 1024 * 1024
big = torch.arange(n, device="cuda", dtype=torch.int64)
assert int(big.sum()) == n * (n - 1) // 2, "sum over 128 MiB differs"
assert int(big[-1]) == n - 1 and int(big[20 * 1024 * 1024 // 8]) == 20 * 1024 * 1024 // 8
del big
torch.cuda.synchronize()

summary = ctypes.c_char_p()
assert lib.cca_memory_summary(0, False, ctypes.byref(summary)) == 0
text = summary.value.decode()
assert "cca CUDA memory summary" in text
print(text)
print("PASS torch on cca: %d allocations served, peak %d live" % (total2, peak2))
