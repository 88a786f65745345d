/*
 * cuda_host.c - the CUDA backend's pinned host memory: cudaHostAlloc,
 * cudaFreeHost, cudaHostRegister and cudaHostUnregister for src/host/.
 */
#include "cuda_internal.h"

/* ---- host memory ------------------------------------------------------------------------ */

cca_status_t cuda_host_alloc(void *ctx, size_t size, void **ptr)
{
    (void)ctx;
    void *p = NULL;
    cudaError_t err = cudaHostAlloc(&p, size, cudaHostAllocDefault);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaHostAlloc");
    *ptr = p;
    return CCA_OK;
}

cca_status_t cuda_host_free(void *ctx, void *ptr)
{
    (void)ctx;
    cudaError_t err = cudaFreeHost(ptr);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaFreeHost");
}

cca_status_t cuda_host_register(void *ctx, void *ptr, size_t size, void **device_ptr)
{
    (void)ctx;
    cudaError_t err = cudaHostRegister(ptr, size, cudaHostRegisterDefault);
    if (err != cudaSuccess)
        return cuda_fail(err, "cudaHostRegister");
    void *dptr = NULL;
    err = cudaHostGetDevicePointer(&dptr, ptr, 0);
    if (err != cudaSuccess) {
        cca_status_t st = cuda_fail(err, "cudaHostGetDevicePointer");
        if (cudaHostUnregister(ptr) != cudaSuccess)
            (void)cudaGetLastError();
        return st;
    }
    *device_ptr = dptr;
    return CCA_OK;
}

cca_status_t cuda_host_unregister(void *ctx, void *ptr)
{
    (void)ctx;
    cudaError_t err = cudaHostUnregister(ptr);
    return err == cudaSuccess ? CCA_OK : cuda_fail(err, "cudaHostUnregister");
}
