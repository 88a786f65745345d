/*
 * sim_multi.c - the simulated backend's operations for several devices and
 * the stream-ordered pool:
 *  - peer access: every pair of distinct devices can access each other
 *    (none with cca_sim_config_t.no_peer_access); copies between devices
 *    copy real bytes in backed mode;
 *  - events other processes wait for: handles of interprocess events; an
 *    opened one is a new, completed event (ordering between processes is not
 *    modelled);
 *  - streams made by the backend (handles from a counter, outside the range
 *    tests use) and waits on events (validated; events complete as the
 *    event mode says);
 *  - the stream-ordered pool of each device (cudaMallocAsync), modelled by
 *    its accounting: an allocation is served from the pool's reserved but
 *    unused bytes when they suffice, else the pool grows by whole 2 MiB
 *    granules (counted in the device's used memory, so the cap and
 *    mem_get_info see it); a free returns bytes to the pool; at every
 *    synchronisation point of the device the pool gives back what it holds
 *    above its release threshold (0 by default, as CUDA), and mempool_trim
 *    gives back down to what is asked, never below what is in use. High-
 *    water marks reset to the current values when set to 0, as CUDA's.
 *    Addresses of pool allocations come from the same rules as malloc.
 * Invariant: pool.used <= pool.reserved, reserved is a multiple of the
 * granule, and the device's used bytes include the pool's reserved bytes.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "simulator.h"

static uint64_t granule_up(uint64_t x)
{
    return (x + SIM_POOL_GRANULE - 1) & ~(SIM_POOL_GRANULE - 1);
}

static cca_status_t invalid(cca_backend_op_t op, const char *why)
{
    return cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE, "sim: %s: %s",
                             cca_backend_op_name(op), why);
}

/* Enter op on device: lock, count, fault, device check. Unlocks on failure. */
static cca_status_t enter(sim_ctx_t *c, cca_backend_op_t op, int device)
{
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, op);
    if (st == CCA_OK && (device < 0 || device >= c->device_count))
        st = sim_bad_device(c, op, device);
    if (st != CCA_OK)
        pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- peer access ------------------------------------------------------------------ */

static cca_status_t sim_can_access_peer(void *ctx, int device, int peer, int *can_access)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_CAN_ACCESS_PEER, device);
    if (st != CCA_OK)
        return st;
    if (peer < 0 || peer >= c->device_count)
        st = sim_bad_device(c, CCA_OP_CAN_ACCESS_PEER, peer);
    else
        *can_access = !c->no_peer_access && peer != device;
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_enable_peer_access(void *ctx, int device, int peer)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_ENABLE_PEER_ACCESS, device);
    if (st != CCA_OK)
        return st;
    if (peer < 0 || peer >= c->device_count || peer == device)
        st = sim_bad_device(c, CCA_OP_ENABLE_PEER_ACCESS, peer);
    else if (c->no_peer_access)
        st = cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                               "device %d cannot access device %d's memory (sim: no peer access)",
                               device, peer);
    else
        c->devices[device].peer_enabled[peer] = true; /* again: already enabled, success */
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_memcpy_peer_async(void *ctx, void *dst, int dst_device, const void *src,
                                          int src_device, size_t size, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    (void)stream;
    cca_status_t st = enter(c, CCA_OP_MEMCPY_PEER, dst_device);
    if (st != CCA_OK)
        return st;
    if (src_device < 0 || src_device >= c->device_count)
        st = sim_bad_device(c, CCA_OP_MEMCPY_PEER, src_device);
    else if ((!dst || !src) && size)
        st = invalid(CCA_OP_MEMCPY_PEER, "a NULL pointer");
    else if (c->backed && size)
        memmove(dst, src, size); /* stream order: the copy is done when the call returns */
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- events other processes wait for ----------------------------------------------------- */

/*
 * An IPC event handle: magic, the owner's process, the event, a check. Opening
 * one gives a new event of this process that is complete: the order of work
 * between processes is not modelled (events complete as the event mode says
 * within a process only).
 */
static const unsigned char ipc_event_magic[8] = {'c', 'c', 'a', 's', 'i', 'm', 'e', 'v'};

typedef struct sim_ipc_event_fields {
    int64_t pid;
    uint64_t event;
    uint64_t device;
} sim_ipc_event_fields_t;

static uint64_t event_check(const sim_ipc_event_fields_t *f)
{
    return simmap_hash((uint64_t)f->pid ^ simmap_hash(f->event ^ simmap_hash(f->device + 77)));
}

static cca_status_t sim_ipc_event_create(void *ctx, int device, cca_event_t *event)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_IPC_EVENT_CREATE, device);
    if (st != CCA_OK)
        return st;
    sim_event_t *e = NULL;
    st = sim_event_new_locked(c, CCA_OP_IPC_EVENT_CREATE, device, &e);
    if (st == CCA_OK) {
        e->interprocess = true;
        *event = e;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_ipc_event_get_handle(void *ctx, int device, cca_event_t event,
                                             cca_ipc_handle_t *handle)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_IPC_EVENT_GET, device);
    if (st != CCA_OK)
        return st;
    sim_event_t *e = sim_find_event(c, CCA_OP_IPC_EVENT_GET, device, event, &st);
    if (e && !e->interprocess) {
        st = invalid(CCA_OP_IPC_EVENT_GET, "the event was not made by ipc_event_create");
    } else if (e) {
        sim_ipc_event_fields_t f = {(int64_t)getpid(), (uint64_t)(uintptr_t)event, (uint64_t)device};
        uint64_t check = event_check(&f);
        memset(handle, 0, sizeof(*handle));
        memcpy(handle->bytes, ipc_event_magic, sizeof(ipc_event_magic));
        memcpy(handle->bytes + 8, &f, sizeof(f));
        memcpy(handle->bytes + 8 + sizeof(f), &check, sizeof(check));
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_ipc_event_open(void *ctx, int device, const cca_ipc_handle_t *handle,
                                       cca_event_t *event)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_IPC_EVENT_OPEN, device);
    if (st != CCA_OK)
        return st;
    sim_ipc_event_fields_t f;
    uint64_t check = 0;
    memcpy(&f, handle->bytes + 8, sizeof(f));
    memcpy(&check, handle->bytes + 8 + sizeof(f), sizeof(check));
    if (memcmp(handle->bytes, ipc_event_magic, sizeof(ipc_event_magic)) != 0 ||
        check != event_check(&f)) {
        st = invalid(CCA_OP_IPC_EVENT_OPEN, "corrupt IPC event handle");
    } else {
        sim_event_t *e = NULL;
        st = sim_event_new_locked(c, CCA_OP_IPC_EVENT_OPEN, device, &e);
        if (st == CCA_OK)
            *event = e;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- streams ------------------------------------------------------------------------ */

static cca_status_t sim_stream_create(void *ctx, int device, cca_stream_t *stream)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_STREAM_CREATE, device);
    if (st != CCA_OK)
        return st;
    if (!simmap_reserve(&c->created_streams)) {
        st = cca_backend_error(CCA_ERR_BACKEND, 0, "sim: stream_create: host out of memory");
    } else {
        uint64_t h = 0x5eed00000000ull + 0x100 * ++c->next_stream;
        simmap_put(&c->created_streams, h, (void *)(uintptr_t)(device + 1));
        *stream = (cca_stream_t)(uintptr_t)h;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_stream_destroy(void *ctx, int device, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_STREAM_DESTROY, device);
    if (st != CCA_OK)
        return st;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    if ((uintptr_t)simmap_get(&c->created_streams, key) != (uintptr_t)(device + 1))
        st = invalid(CCA_OP_STREAM_DESTROY, "not a stream this backend created on this device");
    else
        simmap_remove(&c->created_streams, key);
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_stream_wait_event(void *ctx, int device, cca_stream_t stream,
                                          cca_event_t event)
{
    sim_ctx_t *c = ctx;
    (void)stream;
    cca_status_t st = enter(c, CCA_OP_STREAM_WAIT_EVENT, device);
    if (st != CCA_OK)
        return st;
    /* any device's event may be waited for (cross-device dependencies) */
    sim_event_t *e = simmap_get(&c->events, (uint64_t)(uintptr_t)event);
    if (!e)
        st = invalid(CCA_OP_STREAM_WAIT_EVENT, "not a live event");
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* ---- the stream-ordered pool ----------------------------------------------------------- */

/* Give back reserved bytes down to max(keep, what is in use), in granules (lock held). */
static void pool_shrink_locked(sim_ctx_t *c, int device, uint64_t keep)
{
    sim_device_t *dev = &c->devices[device];
    sim_pool_t *p = &dev->pool;
    uint64_t floor = granule_up(p->used);
    uint64_t target = keep > floor ? granule_up(keep) : floor;
    if (p->reserved > target) {
        dev->used -= p->reserved - target;
        p->reserved = target;
    }
}

void sim_pool_sync_locked(sim_ctx_t *c, int device)
{
    sim_pool_t *p = &c->devices[device].pool;
    if (p->reserved > p->threshold)
        pool_shrink_locked(c, device, p->threshold);
}

static cca_status_t sim_malloc_async(void *ctx, int device, size_t size, cca_stream_t stream,
                                     void **ptr)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_MALLOC_ASYNC, device);
    if (st != CCA_OK)
        return st;
    sim_pool_t *p = &c->devices[device].pool;
    uint64_t grow = 0, capture_id = 0;
    sim_alloc_t *rec = NULL;
    if (!ptr || size == 0) {
        st = invalid(CCA_OP_MALLOC_ASYNC, "size 0 or ptr NULL");
        goto out_unlock;
    }
    /* on a capturing stream: a node of its capture (cudaMallocAsync node) */
    if (!sim_capture_node_locked(c, stream, true, &capture_id)) {
        st = sim_host_oom(CCA_OP_MALLOC_ASYNC);
        goto out_unlock;
    }
    if (p->used + size > p->reserved) {
        grow = granule_up(p->used + size - p->reserved);
        if (grow < size - (p->reserved - p->used)) { /* overflow */
            st = sim_check_capacity(c, CCA_OP_MALLOC_ASYNC, device, SIZE_MAX);
            goto out_unlock;
        }
        st = sim_check_capacity(c, CCA_OP_MALLOC_ASYNC, device, grow);
        if (st != CCA_OK)
            goto out_unlock;
    }
    st = sim_alloc_locked(c, CCA_OP_MALLOC_ASYNC, device, size, &rec);
    if (st != CCA_OK)
        goto out_unlock;
    rec->async = true;
    rec->capture_id = capture_id;
    p->reserved += grow;
    sim_use(&c->devices[device], grow);
    p->used += size;
    if (p->reserved > p->reserved_high)
        p->reserved_high = p->reserved;
    if (p->used > p->used_high)
        p->used_high = p->used;
    *ptr = (void *)(uintptr_t)rec->addr;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_free_async(void *ctx, int device, void *ptr, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_FREE_ASYNC, device);
    if (st != CCA_OK)
        return st;
    sim_alloc_t *rec = simmap_get(&c->allocs, (uint64_t)(uintptr_t)ptr);
    uint64_t capture_id = 0;
    (void)sim_capture_node_locked(c, stream, false, &capture_id);
    if (!rec || !rec->async || rec->device != device) {
        st = invalid(CCA_OP_FREE_ASYNC, "not a live allocation of malloc_async on this device");
    } else if (capture_id && rec->capture_id != capture_id) {
        /* CUDA refuses to free, inside a capture, what the capture did not allocate */
        st = cca_backend_error(CCA_ERR_BACKEND, 900 /* cudaErrorStreamCaptureUnsupported */,
                               "sim: free_async: operation not permitted when stream is capturing "
                               "(%p was not allocated in this capture)", ptr);
    } else if (capture_id && !sim_capture_node_locked(c, stream, true, &capture_id)) {
        st = sim_host_oom(CCA_OP_FREE_ASYNC);
    } else {
        c->devices[device].pool.used -= rec->size;
        sim_alloc_release_locked(c, rec);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_mempool_trim(void *ctx, int device, size_t keep_bytes)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_MEMPOOL_TRIM, device);
    if (st != CCA_OK)
        return st;
    pool_shrink_locked(c, device, keep_bytes);
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

static cca_status_t sim_mempool_get_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                         uint64_t *value)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_MEMPOOL_GET_ATTR, device);
    if (st != CCA_OK)
        return st;
    sim_pool_t *p = &c->devices[device].pool;
    switch (attr) {
    case CCA_MEMPOOL_RELEASE_THRESHOLD: *value = p->threshold; break;
    case CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES: *value = p->reuse[0]; break;
    case CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC: *value = p->reuse[1]; break;
    case CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES: *value = p->reuse[2]; break;
    case CCA_MEMPOOL_RESERVED_CURRENT: *value = p->reserved; break;
    case CCA_MEMPOOL_RESERVED_HIGH: *value = p->reserved_high; break;
    case CCA_MEMPOOL_USED_CURRENT: *value = p->used; break;
    case CCA_MEMPOOL_USED_HIGH: *value = p->used_high; break;
    default: st = invalid(CCA_OP_MEMPOOL_GET_ATTR, "unknown attribute"); break;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_mempool_set_attr(void *ctx, int device, cca_mempool_attr_t attr,
                                         uint64_t value)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_MEMPOOL_SET_ATTR, device);
    if (st != CCA_OK)
        return st;
    sim_pool_t *p = &c->devices[device].pool;
    switch (attr) {
    case CCA_MEMPOOL_RELEASE_THRESHOLD: p->threshold = value; break;
    case CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES:
    case CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC:
    case CCA_MEMPOOL_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
        if (value > 1)
            st = invalid(CCA_OP_MEMPOOL_SET_ATTR, "a reuse policy is 0 or 1");
        else
            p->reuse[attr - CCA_MEMPOOL_REUSE_FOLLOW_EVENT_DEPENDENCIES] = value;
        break;
    case CCA_MEMPOOL_RESERVED_HIGH:
    case CCA_MEMPOOL_USED_HIGH:
        if (value != 0)
            st = invalid(CCA_OP_MEMPOOL_SET_ATTR, "a high-water mark can only be reset (0)");
        else if (attr == CCA_MEMPOOL_RESERVED_HIGH)
            p->reserved_high = p->reserved;
        else
            p->used_high = p->used;
        break;
    default:
        st = invalid(CCA_OP_MEMPOOL_SET_ATTR, "attribute is read-only or unknown");
        break;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_mempool_set_access(void *ctx, int device, int peer)
{
    sim_ctx_t *c = ctx;
    cca_status_t st = enter(c, CCA_OP_MEMPOOL_SET_ACCESS, device);
    if (st != CCA_OK)
        return st;
    if (peer < 0 || peer >= c->device_count)
        st = sim_bad_device(c, CCA_OP_MEMPOOL_SET_ACCESS, peer);
    else if (c->no_peer_access && peer != device)
        st = cca_backend_error(CCA_ERR_NOT_SUPPORTED, 0,
                               "device %d cannot access device %d's pool (sim: no peer access)",
                               peer, device);
    else
        c->devices[device].pool.peer_access[peer] = true;
    pthread_mutex_unlock(&c->lock);
    return st;
}

void sim_multi_install(cca_backend_t *b)
{
    sim_ctx_t *c = b->ctx;
    for (int d = 0; d < c->device_count; d++)
        for (int i = 0; i < 3; i++)
            c->devices[d].pool.reuse[i] = 1; /* CUDA's defaults */
    b->ipc_event_create = sim_ipc_event_create;
    b->ipc_event_get_handle = sim_ipc_event_get_handle;
    b->ipc_event_open = sim_ipc_event_open;
    b->can_access_peer = sim_can_access_peer;
    b->enable_peer_access = sim_enable_peer_access;
    b->memcpy_peer_async = sim_memcpy_peer_async;
    b->stream_create = sim_stream_create;
    b->stream_destroy = sim_stream_destroy;
    b->stream_wait_event = sim_stream_wait_event;
    b->malloc_async = sim_malloc_async;
    b->free_async = sim_free_async;
    b->mempool_trim = sim_mempool_trim;
    b->mempool_get_attr = sim_mempool_get_attr;
    b->mempool_set_attr = sim_mempool_set_attr;
    b->mempool_set_access = sim_mempool_set_access;
}
