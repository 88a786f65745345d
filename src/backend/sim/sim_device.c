/*
 * sim_device.c - the simulated backend's device operations: device count and
 * properties, the calling thread's current device, mem_get_info, malloc and
 * free (on the memory records of sim.c; a free synchronises the device as
 * cudaFree does), and their entries in the operation table.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simulator.h"

/* Number of simulated devices. Returns CCA_OK. */
static cca_status_t sim_device_count(void *ctx, int *count)
{
    sim_ctx_t *c = ctx;
    *count = c->device_count;
    return CCA_OK;
}

/* Name and total memory of a device. Returns CCA_OK, CCA_ERR_BACKEND (bad device). */
static cca_status_t sim_device_props(void *ctx, int device, cca_device_props_t *props)
{
    sim_ctx_t *c = ctx;
    if (device < 0 || device >= c->device_count)
        return cca_backend_error(CCA_ERR_BACKEND, SIM_CUDA_INVALID_VALUE,
                                 "sim: device_props: invalid device ordinal %d", device);
    memset(props, 0, sizeof(*props));
    snprintf(props->name, sizeof(props->name), "cca simulated device %d", device);
    props->total_memory = c->devices[device].total;
    return CCA_OK;
}

/*
 * The calling thread's current device, cached with the backend instance it
 * was read from, as the CUDA backend caches it with the current context:
 * set_device (the only way to change it here) updates both, and a thread
 * meeting another instance reads the thread-local key again.
 */
static CCA_THREAD_HOT struct {
    uint64_t instance;
    int device;
} current_device_cache;

/* sim_get_device past the cache: the thread-local key read again (out of line, so that a
 * hit saves no register). Returns CCA_OK. */
static __attribute__((noinline)) cca_status_t sim_get_device_slow(sim_ctx_t *c, int *device)
{
    intptr_t v = (intptr_t)pthread_getspecific(c->current);
    *device = v > 0 ? (int)(v - 1) : 0;
    current_device_cache.instance = c->instance;
    current_device_cache.device = *device;
    return CCA_OK;
}

/* Current device of the calling thread for this backend (0 until set). Returns CCA_OK. */
static cca_status_t sim_get_device(void *ctx, int *device)
{
    sim_ctx_t *c = ctx;
    if (current_device_cache.instance == c->instance) {
        *device = current_device_cache.device;
        return CCA_OK;
    }
    return sim_get_device_slow(c, device);
}

/* Set the calling thread's current device. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_BACKEND (no thread-local storage). */
static cca_status_t sim_set_device(void *ctx, int device)
{
    sim_ctx_t *c = ctx;
    if (device < 0 || device >= c->device_count)
        return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                                 "sim: set_device: invalid device ordinal %d (the backend has "
                                 "%d devices)",
                                 device, c->device_count);
    if (pthread_setspecific(c->current, (void *)(intptr_t)(device + 1)) != 0)
        return cca_backend_error(CCA_ERR_BACKEND, 0, "sim: set_device: host out of memory");
    current_device_cache.instance = c->instance;
    current_device_cache.device = device;
    return CCA_OK;
}

/* Free = min(cap, total) - used, and the total. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, or an injected fault. */
static cca_status_t sim_mem_get_info(void *ctx, int device, size_t *free_bytes, size_t *total)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_MEM_GET_INFO);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_MEM_GET_INFO, device);
        goto out_unlock;
    }
    sim_device_t *dev = &c->devices[device];
    size_t limit = sim_device_limit(dev);
    *free_bytes = dev->used < limit ? limit - dev->used : 0;
    *total = dev->total;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Allocate size bytes of device memory (see the banner for the address). Returns
 * CCA_OK, CCA_ERR_OUT_OF_MEMORY (cap reached), CCA_ERR_INVALID_ARGUMENT,
 * CCA_ERR_BACKEND (list entry overlaps, host bookkeeping failed), or a fault. */
static cca_status_t sim_malloc(void *ctx, int device, size_t size, void **ptr)
{
    sim_ctx_t *c = ctx;
    sim_alloc_t *rec = NULL;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_MALLOC);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_MALLOC, device);
        goto out_unlock;
    }
    if (!ptr || size == 0) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: malloc: invalid argument (size %zu)", size);
        goto out_unlock;
    }
    st = sim_check_capacity(c, CCA_OP_MALLOC, device, size);
    if (st != CCA_OK)
        goto out_unlock;
    st = sim_alloc_locked(c, CCA_OP_MALLOC, device, size, &rec);
    if (st != CCA_OK)
        goto out_unlock;
    sim_use(&c->devices[device], size);
    *ptr = (void *)(uintptr_t)rec->addr;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Free a malloc'd block; completes the device's events first, as cudaFree
 * synchronizes. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT (unknown pointer), or a fault. */
static cca_status_t sim_free(void *ctx, int device, void *ptr)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_FREE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_FREE, device);
        goto out_unlock;
    }
    if (!ptr)
        goto out_unlock; /* cudaFree(NULL) does nothing */
    uint64_t addr = (uint64_t)(uintptr_t)ptr;
    sim_alloc_t *rec = simmap_get(&c->allocs, addr);
    if (!rec || rec->device != device || rec->async) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: free: invalid argument (%p is not a live allocation of "
                               "device %d%s)",
                               ptr, device, rec && rec->async ? " from malloc: it is from malloc_async" : "");
        goto out_unlock;
    }
    /* cudaFree synchronizes the device */
    sim_device_complete_locked(c, device);
    sim_pool_sync_locked(c, device);
    c->devices[device].used -= rec->size;
    sim_alloc_release_locked(c, rec);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Install the device and memory operations into the table. */
void sim_memory_install(cca_backend_t *b)
{
    b->device_count = sim_device_count;
    b->device_props = sim_device_props;
    b->get_device = sim_get_device;
    b->set_device = sim_set_device;
    b->mem_get_info = sim_mem_get_info;
    b->malloc = sim_malloc;
    b->free = sim_free;
}
