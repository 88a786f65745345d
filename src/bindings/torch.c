/*
 * torch.c - the two C functions PyTorch's CUDAPluggableAllocator loads from
 * a shared library, so a PyTorch program can run on cca:
 *
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator("libcca.so",
 *                                                    "cca_torch_malloc", "cca_torch_free")
 *   torch.cuda.memory.change_current_allocator(alloc)
 *
 * PyTorch has no error channel through these functions: a failure returns
 * NULL (PyTorch raises) and cca's message goes to the output sink.
 */
#include "internal.h"

void *cca_torch_malloc(ptrdiff_t size, int device, cca_stream_t stream)
{
    void *ptr = NULL;
    if (size <= 0)
        return NULL;
    cca_status_t st = cca_malloc_device(&ptr, (size_t)size, device, stream);
    if (st != CCA_OK) {
        cca_outputf("cca: %s: %s\n", cca_status_str(st), cca_last_error()->message);
        return NULL;
    }
    return ptr;
}

void cca_torch_free(void *ptr, ptrdiff_t size, int device, cca_stream_t stream)
{
    (void)size;
    (void)device;
    (void)stream;
    cca_status_t st = cca_free(ptr);
    if (st != CCA_OK)
        cca_outputf("cca: %s: %s\n", cca_status_str(st), cca_last_error()->message);
}
