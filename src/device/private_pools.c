/*
 * private_pools.c - private pools (PyTorch's PrivatePool): the memory of CUDA
 * graph captures and of MemPool. A private pool owns its own stream pools, so
 * its blocks never mix with the default pools' or another pool's; routes
 * (PyTorch's captures_underway) send the allocations matching a stream
 * filter, a stream or a thread to a pool. While any route is active on a
 * device no event is queried or synchronised there, and a freed block used on
 * other streams is set aside (PyTorch's deferred blocks) until none is. A
 * pool's use count (graphs, MemPools, active routes) falling to 0 makes it
 * freeable: empty_cache then returns its unused segments, and the pool is
 * dropped once it holds none. Checkpoints save and restore a pool's blocks
 * (cudagraph trees). A pool may take its segments from an allocator of its
 * own (MemPool(allocator=)): alloc_block asks it instead of the backend, and
 * each such segment keeps the free function it goes back to. With
 * backend:cudaMallocAsync, routes are that backend's graph capture
 * (device_async/async.c) and the pools' own calls give PyTorch's errors.
 *
 * This file holds the pools and routes themselves: ids, creation and use
 * counts, MemPool's options and allocator, routes and their lookup. The
 * allocation path (alloc.c), the set-aside frees (events.c), releasing
 * freeable pools (release.c), the structures' teardown and segments' return
 * (pool.c) and checkpoints (pool_checkpoint.c) use it.
 *
 * Invariants: pools, routes and stream pool lists change only under the
 * device lock; route_count mirrors the route list for the lock-free check on
 * the allocation hot path; a pool is freed only when freeable, holding no
 * segment and pinned by no allocation in flight.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "device.h"
#include "state.h"

/* ---- ids and lookup ------------------------------------------------------------ */

static _Atomic uint64_t next_graph_id = 1; /* PyTorch's uuid_ */
static _Atomic uint64_t next_user_id = 1;  /* PyTorch's uid_ */

cca_mempool_id_t cca_mempool_id_new(bool user_created)
{
    cca_mempool_id_t id = {0, 0};
    if (user_created)
        id.second = atomic_fetch_add(&next_user_id, 1);
    else
        id.first = atomic_fetch_add(&next_graph_id, 1);
    return id;
}

/* The pool with id, or NULL (device lock held). */
cca_private_pool_t *pools_find_locked(cca_device_t *dev, cca_mempool_id_t id)
{
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next)
        if (pools_id_eq(pp->id, id))
            return pp;
    return NULL;
}

/* PyTorch's error of backend:cudaMallocAsync for the entry point what (its CUDAAllocator call). */
static cca_status_t async_unsupported(const char *what)
{
    static const struct {
        const char *cca, *torch;
    } names[] = {
        {"cca_pool_create", "createOrIncrefPool"},
        {"cca_pool_set_allocator", "createOrIncrefPool"}, /* MemPool(allocator=) creates the pool */
        {"cca_pool_set_use_on_oom", "setUseOnOOM"},
        {"cca_pool_set_no_split", "setNoSplit"},
        {"cca_pool_use_count", "getPoolUseCount"},
        {"cca_pool_check_live_allocations", "checkPoolLiveAllocations"},
        {"cca_pool_get_checkpoint", "getCheckpointState"},
        {"cca_pool_set_checkpoint", "setCheckpointPoolState"},
    };
    const char *torch = what;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!strcmp(names[i].cca, what))
            torch = names[i].torch;
    return cca_raise(CCA_ERR_NOT_SUPPORTED, "cudaMallocAsync does not yet support %s. If you need "
                     "it, please file an issue describing your use case.", torch);
}

/* Validate the device; what names the entry point. */
static cca_status_t pools_device(const char *what, int device)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: device %d is out of range (%d devices)", what,
                         device, cca_state->device_count);
    return CCA_OK;
}

/* Validate device and id; *dev on CCA_OK. what names the entry point. */
cca_status_t pools_args(const char *what, int device, cca_mempool_id_t id, cca_device_t **dev)
{
    cca_status_t st = pools_device(what, device);
    if (st != CCA_OK)
        return st;
    if (async_enabled())
        return async_unsupported(what);
    if (pools_id_is_default(id))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "%s: pool id (0, 0) names the default pools, not a private pool", what);
    *dev = &cca_state->devices[device];
    return CCA_OK;
}

cca_status_t pools_unknown(const char *what, int device, cca_mempool_id_t id)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: device %d has no private pool (%" PRIu64
                     ", %" PRIu64 ")", what, device, id.first, id.second);
}

/* ---- pools and their stream pools ------------------------------------------------ */

/* The stream pool of (pool, stream), created on first use (device lock held). NULL: no host memory. */
static cca_stream_pool_t *pools_stream_locked(cca_device_t *dev, cca_private_pool_t *pp,
                                             cca_stream_t stream)
{
    size_t i = 0;
    while (i < pp->stream_pool_count && (uintptr_t)pp->stream_pools[i]->stream < (uintptr_t)stream)
        i++;
    if (i < pp->stream_pool_count && pp->stream_pools[i]->stream == stream)
        return pp->stream_pools[i];
    if (pp->stream_pool_count == pp->stream_pool_cap) {
        size_t cap = pp->stream_pool_cap ? pp->stream_pool_cap * 2 : 4;
        cca_stream_pool_t **grown = realloc(pp->stream_pools, cap * sizeof(*grown));
        if (!grown)
            return NULL;
        pp->stream_pools = grown;
        pp->stream_pool_cap = cap;
    }
    cca_stream_pool_t *sp = pool_stream_pool_new(dev, stream);
    if (!sp)
        return NULL;
    dev->stats_solo_done = true; /* (a private pool's is never the only one's) */
    ptrmap_pool_made(cca_state->ptrmap, NULL); /* nor does it guard the map */
    sp->private_pool = pp;
    memmove(&pp->stream_pools[i + 1], &pp->stream_pools[i],
            (pp->stream_pool_count - i) * sizeof(*pp->stream_pools));
    pp->stream_pools[i] = sp;
    pp->stream_pool_count++;
    return sp;
}

/* PyTorch's create_or_incref_pool (device lock held). */
static cca_status_t pool_create_or_incref_locked(cca_device_t *dev, cca_mempool_id_t id,
                                                 const char *what, cca_private_pool_t **out)
{
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (pp) {
        if (pp->use_count == 0)
            return cca_raise(CCA_ERR_BUSY,
                             "%s: private pool (%" PRIu64 ", %" PRIu64 ") was released and awaits "
                             "freeing; it cannot be used again",
                             what, id.first, id.second);
        pp->use_count++;
        *out = pp;
        return CCA_OK;
    }
    pp = calloc(1, sizeof(*pp));
    if (!pp)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory creating a private pool", what);
    pp->id = id;
    pp->use_count = 1;
    cca_private_pool_t **link = &dev->private_pools;
    while (*link)
        link = &(*link)->next;
    *link = pp;
    *out = pp;
    return CCA_OK;
}

cca_status_t cca_pool_create(int device, cca_mempool_id_t id)
{
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args("cca_pool_create", device, id, &dev);
    if (st != CCA_OK)
        return st;
    cca_private_pool_t *pp;
    pthread_mutex_lock(&dev->lock);
    st = pool_create_or_incref_locked(dev, id, "cca_pool_create", &pp);
    pthread_mutex_unlock(&dev->lock);
    return st;
}

/* Set a flag of an existing pool. */
static cca_status_t pool_set_flag(const char *what, int device, cca_mempool_id_t id, bool use_on_oom,
                                  bool value)
{
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args(what, device, id, &dev);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (!pp)
        st = pools_unknown(what, device, id);
    else if (use_on_oom)
        pp->use_on_oom = value;
    else
        pp->no_split = value;
    pthread_mutex_unlock(&dev->lock);
    return st;
}

cca_status_t cca_pool_set_use_on_oom(int device, cca_mempool_id_t id, bool use_on_oom)
{
    return pool_set_flag("cca_pool_set_use_on_oom", device, id, true, use_on_oom);
}

cca_status_t cca_pool_set_no_split(int device, cca_mempool_id_t id)
{
    return pool_set_flag("cca_pool_set_no_split", device, id, false, true);
}

cca_status_t cca_pool_set_allocator(int device, cca_mempool_id_t id, cca_pool_alloc_fn alloc_fn,
                                    cca_pool_free_fn free_fn, void *ctx)
{
    static const char what[] = "cca_pool_set_allocator";
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args(what, device, id, &dev);
    if (st != CCA_OK)
        return st;
    if (!alloc_fn != !free_fn)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: give both an alloc and a free function, or "
                         "neither", what);
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (!pp)
        st = pools_unknown(what, device, id);
    else if (pp->use_count == 0)
        st = cca_raise(CCA_ERR_BUSY, "%s: private pool (%" PRIu64 ", %" PRIu64 ") was released and "
                       "awaits freeing", what, id.first, id.second);
    else if (pp->segment_count != 0)
        st = cca_raise(CCA_ERR_BUSY, "%s: private pool (%" PRIu64 ", %" PRIu64 ") already holds %zu "
                       "segment(s); set its allocator before it holds memory", what, id.first,
                       id.second, pp->segment_count);
    else {
        pp->user_alloc = alloc_fn;
        pp->user_free = free_fn;
        pp->user_ctx = alloc_fn ? ctx : NULL;
    }
    pthread_mutex_unlock(&dev->lock);
    return st;
}

cca_status_t cca_pool_use_count(int device, cca_mempool_id_t id, int *count)
{
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args("cca_pool_use_count", device, id, &dev);
    if (st != CCA_OK)
        return st;
    if (!count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_pool_use_count: count is NULL");
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (!pp)
        st = pools_unknown("cca_pool_use_count", device, id);
    else
        *count = pp->use_count;
    pthread_mutex_unlock(&dev->lock);
    return st;
}

/* The stream pool of (pp, stream) if it exists (device lock held). */
cca_stream_pool_t *pools_find_stream_pool(cca_private_pool_t *pp, cca_stream_t stream)
{
    for (size_t i = 0; i < pp->stream_pool_count; i++)
        if (pp->stream_pools[i]->stream == stream)
            return pp->stream_pools[i];
    return NULL;
}

/* ---- routes ------------------------------------------------------------------------ */

/* Whether a route takes an allocation on stream from the calling thread (device lock held). */
static bool route_matches(const cca_route_t *r, cca_stream_t stream)
{
    switch (r->kind) {
    case CCA_ROUTE_STREAM: return r->stream == stream;
    case CCA_ROUTE_THREAD: return pthread_equal(r->thread, pthread_self()) != 0;
    default: return r->filter(stream, r->arg);
    }
}

/*
 * Add a route to id (PyTorch's beginAllocateToPool). Nothing changes on error.
 * With backend:cudaMallocAsync: a capture begins (the pool and filter are not
 * used; a stream route's stream is the capture stream).
 */
static cca_status_t route_begin(const char *what, int device, cca_mempool_id_t id, cca_route_t route)
{
    cca_device_t *dev = NULL;
    if (async_enabled()) {
        cca_status_t st = pools_device(what, device);
        if (st != CCA_OK)
            return st;
        return async_begin_capture(device, route.kind == CCA_ROUTE_STREAM ? route.stream : NULL);
    }
    cca_status_t st = pools_args(what, device, id, &dev);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&dev->lock);
    size_t n = atomic_load_explicit(&dev->route_count, memory_order_relaxed);
    for (size_t i = 0; i < n; i++)
        if (pools_id_eq(dev->routes[i].id, id)) {
            st = cca_raise(CCA_ERR_BUSY, "%s: already routing allocations to private pool (%" PRIu64
                           ", %" PRIu64 ")", what, id.first, id.second);
            goto out_unlock;
        }
    if (n == dev->route_cap) {
        size_t cap = dev->route_cap ? dev->route_cap * 2 : 4;
        cca_route_t *grown = realloc(dev->routes, cap * sizeof(*grown));
        if (!grown) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory adding a route", what);
            goto out_unlock;
        }
        dev->routes = grown;
        dev->route_cap = cap;
    }
    cca_private_pool_t *pp;
    st = pool_create_or_incref_locked(dev, id, what, &pp);
    if (st != CCA_OK)
        goto out_unlock;
    route.id = id;
    route.pool = pp;
    dev->routes[n] = route;
    atomic_store_explicit(&dev->route_count, (uint32_t)(n + 1), memory_order_seq_cst);
    /* the frees and event processing of other threads that read no route before this store
     * finish their event calls first: the caller may begin a capture once this returns */
    events_wait_callers(dev);
out_unlock:
    pthread_mutex_unlock(&dev->lock);
    return st;
}

cca_status_t cca_begin_allocate_to_pool(int device, cca_mempool_id_t id, cca_stream_filter_fn filter,
                                        void *arg)
{
    if (!filter)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_begin_allocate_to_pool: filter is NULL");
    cca_route_t r = {.kind = CCA_ROUTE_FILTER, .filter = filter, .arg = arg};
    return route_begin("cca_begin_allocate_to_pool", device, id, r);
}

cca_status_t cca_begin_allocate_stream_to_pool(int device, cca_mempool_id_t id, cca_stream_t stream)
{
    cca_route_t r = {.kind = CCA_ROUTE_STREAM, .stream = stream};
    return route_begin("cca_begin_allocate_stream_to_pool", device, id, r);
}

cca_status_t cca_begin_allocate_thread_to_pool(int device, cca_mempool_id_t id)
{
    cca_route_t r = {.kind = CCA_ROUTE_THREAD, .thread = pthread_self()};
    return route_begin("cca_begin_allocate_thread_to_pool", device, id, r);
}

cca_status_t cca_end_allocate_to_pool(int device, cca_mempool_id_t id)
{
    cca_device_t *dev = NULL;
    if (async_enabled()) {
        cca_status_t st = pools_device("cca_end_allocate_to_pool", device);
        return st != CCA_OK ? st : async_end_capture(device);
    }
    cca_status_t st = pools_args("cca_end_allocate_to_pool", device, id, &dev);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&dev->lock);
    size_t n = atomic_load_explicit(&dev->route_count, memory_order_relaxed);
    size_t i = 0;
    while (i < n && !pools_id_eq(dev->routes[i].id, id))
        i++;
    if (i == n) {
        st = cca_raise(CCA_ERR_BUSY, "cca_end_allocate_to_pool: not routing allocations to private "
                       "pool (%" PRIu64 ", %" PRIu64 ") on device %d", id.first, id.second, device);
    } else {
        memmove(&dev->routes[i], &dev->routes[i + 1], (n - i - 1) * sizeof(*dev->routes));
        atomic_store_explicit(&dev->route_count, (uint32_t)(n - 1), memory_order_release);
    }
    pthread_mutex_unlock(&dev->lock);
    return st;
}

cca_status_t cca_release_pool(int device, cca_mempool_id_t id)
{
    cca_device_t *dev = NULL;
    if (async_enabled()) /* PyTorch's releasePool of this backend does nothing */
        return pools_device("cca_release_pool", device);
    cca_status_t st = pools_args("cca_release_pool", device, id, &dev);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    bool routed = false;
    for (size_t i = 0; pp && i < atomic_load_explicit(&dev->route_count, memory_order_relaxed); i++)
        routed |= dev->routes[i].pool == pp;
    if (!pp)
        st = pools_unknown("cca_release_pool", device, id);
    else if (pp->use_count == 0)
        st = cca_raise(CCA_ERR_BUSY, "cca_release_pool: private pool (%" PRIu64 ", %" PRIu64
                       ") was already released by every user", id.first, id.second);
    else if (pp->use_count == 1 && routed)
        st = cca_raise(CCA_ERR_BUSY, "cca_release_pool: allocations are still routed to private "
                       "pool (%" PRIu64 ", %" PRIu64 "); end the route first", id.first, id.second);
    else
        pp->use_count--; /* at 0 the pool is freeable */
    pthread_mutex_unlock(&dev->lock);
    return st;
}

/* ---- the allocation and free paths -------------------------------------------------- */

/* ---- release ------------------------------------------------------------------------ */

/*
 * The stream pool an allocation on stream goes to under the active routes
 * (device lock held): the newest matching route's pool's (PyTorch 2.11's get_pool
 * walks captures_underway from its end, so nested use_mem_pool contexts route to
 * the innermost pool), created on first use and pinned (pools_unpin after the
 * allocation), or NULL for the default.
 */
cca_status_t pools_route_locked(cca_device_t *dev, cca_stream_t stream, cca_stream_pool_t **out)
{
    *out = NULL;
    size_t n = atomic_load_explicit(&dev->route_count, memory_order_relaxed);
    for (size_t i = n; i-- > 0;) {
        const cca_route_t *r = &dev->routes[i];
        if (!route_matches(r, stream))
            continue;
        cca_stream_pool_t *sp = pools_stream_locked(dev, r->pool, stream);
        if (!sp)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                             "out of host memory creating a private pool's stream pool");
        atomic_fetch_add_explicit(&r->pool->pins, 1, memory_order_relaxed);
        *out = sp;
        break;
    }
    return CCA_OK;
}

/* The allocation pools_route_locked routed to sp's pool is over (no lock needed). */
void pools_unpin(cca_stream_pool_t *sp)
{
    atomic_fetch_sub_explicit(&sp->private_pool->pins, 1, memory_order_release);
}

/* Free bytes cached in private pools (device lock held), for the OOM message. */
size_t pools_cached_bytes_locked(cca_device_t *dev)
{
    size_t total = 0;
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next)
        for (size_t i = 0; i < pp->stream_pool_count; i++) {
            cca_stream_pool_t *sp = pp->stream_pools[i];
            pool_lock(sp);
            for (int kind = 0; kind < 2; kind++) {
                cca_bins_t *bins = kind ? &sp->large.bins : &sp->small.bins;
                for (cca_block_t *b = bins_best_fit(bins, 0); b; b = bins_next(bins, b))
                    total += b->size;
            }
            cca_spin_unlock(&sp->lock);
        }
    return total;
}

/* Number of private stream pools of dev (device lock held). */
size_t pools_stream_pool_count(cca_device_t *dev)
{
    size_t n = 0;
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next)
        n += pp->stream_pool_count;
    return n;
}

