/*
 * uncached.c - CCA_NO_CACHING: every allocation goes straight to the
 * backend and every free straight back (for debugging with tools that watch
 * device allocations). Uncached blocks sit in the pointer map with no pool.
 */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "state.h"
#include "trace.h"

/* ---- uncached mode --------------------------------------------------------------- */

cca_status_t uncached_malloc(cca_device_t *dev, size_t size, cca_stream_t stream, void **ptr)
{
    cca_backend_t *be = cca_state->backend;
    cca_block_t *block = calloc(1, sizeof(*block));
    if (!block)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    void *p = NULL;
    cca_status_t st = be->malloc(be->ctx, dev->index, size, &p);
    if (st != CCA_OK) {
        free(block);
        if (st == CCA_ERR_OUT_OF_MEMORY)
            return release_raise_oom(dev, size, size, stream);
        return st;
    }
    stats_lock(dev);
    dev->stats.num_device_alloc++;
    stats_unlock(dev);
    block->addr = (uintptr_t)p;
    block->size = size;
    block->requested_size = size;
    block->allocated = true;
    block->device = dev->index;
    if (!ptrmap_insert(cca_state->ptrmap, block)) {
        be->free(be->ctx, dev->index, p);
        free(block);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pointer map");
    }
    *ptr = p;
    return CCA_OK;
}

cca_status_t uncached_free(cca_block_t *block)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = be->free(be->ctx, block->device, (void *)block->addr);
    if (st != CCA_OK) {
        ptrmap_insert(cca_state->ptrmap, block);
        return st;
    }
    cca_device_t *dev = &cca_state->devices[block->device];
    stats_lock(dev);
    dev->stats.num_device_free++;
    stats_unlock(dev);
    free(block);
    return CCA_OK;
}
