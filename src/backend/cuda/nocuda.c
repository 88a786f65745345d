/*
 * nocuda.c - the CUDA backend's constructor in a build without the CUDA
 * toolkit: it reports that this cca cannot drive a GPU.
 */
#include "internal.h"

cca_status_t cca_cuda_create(cca_backend_t **backend)
{
    (void)backend;
    return cca_raise(CCA_ERR_NOT_SUPPORTED,
                     "this cca was built without the CUDA toolkit: only the simulated backend "
                     "is available (set CCA_BACKEND=sim)");
}
