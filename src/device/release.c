/*
 * release.c - giving memory back: release of cached segments (empty_cache,
 * the out-of-memory retry sequence, oversize releases), age-based garbage
 * collection, the out-of-memory error with its observers, free-memory
 * callbacks, cache_info, the memory fraction and mem_get_info.
 * Private pools give their segments back only once released to a use count
 * of 0 (freeable), and are dropped when they hold none.
 * Invariant: only unsplit free blocks (whole segments) go back to the
 * backend, under the device lock and their stream pool's lock.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "check.h"
#include "device.h"
#include "shared.h"
#include "nvml.h"
#include "state.h"
#include "trace.h"

/* ---- free-memory callbacks and OOM observers ------------------------------- */

/* The free-memory callbacks (oom false) or the OOM observers (oom true). */
static void callback_list(bool oom, cca_callback_t ***list, size_t **count)
{
    *list = oom ? &cca_state->oom_observers : &cca_state->free_callbacks;
    *count = oom ? &cca_state->oom_observer_count : &cca_state->free_callback_count;
}

/* Register (fn, arg) in a callback list. */
static cca_status_t callbacks_add(bool oom, void *fn, void *arg, const char *what)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!fn)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s is NULL", what);
    cca_callback_t **list;
    size_t *count;
    callback_list(oom, &list, &count);
    pthread_mutex_lock(&cca_state->callbacks_lock);
    cca_callback_t *grown = realloc(*list, (*count + 1) * sizeof(*grown));
    if (!grown) {
        pthread_mutex_unlock(&cca_state->callbacks_lock);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory registering a %s", what);
    }
    grown[(*count)++] = (cca_callback_t){fn, arg};
    *list = grown;
    pthread_mutex_unlock(&cca_state->callbacks_lock);
    return CCA_OK;
}

/*
 * Copy a callback list so it can be called with no lock held (callbacks may
 * call cca). Uses local (16 entries) when it fits; the caller frees any other
 * result. *n is 0 if out of host memory.
 */
static cca_callback_t *callbacks_copy(bool oom, cca_callback_t local[16], size_t *n)
{
    cca_callback_t **list;
    size_t *count;
    callback_list(oom, &list, &count);
    pthread_mutex_lock(&cca_state->callbacks_lock);
    *n = *count;
    cca_callback_t *copy = *n <= 16 ? local : malloc(*n * sizeof(*copy));
    if (!copy)
        *n = 0;
    else if (*n)
        memcpy(copy, *list, *n * sizeof(*copy));
    pthread_mutex_unlock(&cca_state->callbacks_lock);
    return copy;
}

cca_status_t cca_register_free_memory_callback(cca_free_memory_callback_fn fn, void *arg)
{
    return callbacks_add(false, (void *)fn, arg, "free-memory callback");
}

cca_status_t cca_attach_oom_observer(cca_oom_observer_fn fn, void *arg)
{
    if (async_enabled()) /* (its out-of-memory path calls none: PyTorch's error) */
        return cca_raise(CCA_ERR_NOT_SUPPORTED, "cudaMallocAsync does not yet support "
                         "attachOutOfMemoryObserver. If you need it, please file an issue "
                         "describing your use case.");
    return callbacks_add(true, (void *)fn, arg, "OOM observer");
}

/* Run every free-memory callback (no allocator lock held). True if any freed memory. */
bool release_free_memory_callbacks(void)
{
    cca_callback_t local[16];
    size_t n;
    cca_callback_t *list = callbacks_copy(false, local, &n);
    bool freed = false;
    for (size_t i = 0; i < n; i++)
        freed |= ((cca_free_memory_callback_fn)list[i].fn)(list[i].arg);
    if (list && list != local)
        free(list);
    return freed;
}

static void notify_oom_observers(int device, size_t alloc_size, size_t total, size_t device_free)
{
    cca_callback_t local[16];
    size_t n;
    cca_callback_t *list = callbacks_copy(true, local, &n);
    for (size_t i = 0; i < n; i++)
        ((cca_oom_observer_fn)list[i].fn)(device, alloc_size, total, device_free, list[i].arg);
    if (list && list != local)
        free(list);
}

/* ---- segments --------------------------------------------------------------- */

/* Release one unsplit free block's segment to the backend or its pool's allocator (device + pool locks held). */
static cca_status_t release_block(cca_device_t *dev, cca_block_t *block)
{
    cca_segment_t *seg = block->segment;
    cca_status_t st = pool_segment_give_back(dev, seg);
    if (st != CCA_OK)
        return st;
    trace_record_pool(dev->index, CCA_TRACE_SEGMENT_FREE, block->addr, block->size,
                      block->pool->owner->stream, pools_id_of(block->pool->owner));
    dev->total_allocated_memory -= block->size;
    if (block->pool->owner->private_pool)
        block->pool->owner->private_pool->segment_count--;
    int type = pool_stat_type(block->pool->is_small);
    stats_lock(dev);
    dev->stats.num_device_free++;
    stat2_dec(dev->stats.segment, type, 1);
    stat2_dec(dev->stats.reserved_bytes, type, (int64_t)block->size);
    if (seg->oversize)
        stat_decrease(&dev->stats.oversize_segments, 1);
    stats_unlock(dev);
    bins_remove(&block->pool->bins, block);
    if (seg->prev_seg)
        seg->prev_seg->next_seg = seg->next_seg;
    else
        dev->segments = seg->next_seg;
    if (seg->next_seg)
        seg->next_seg->prev_seg = seg->prev_seg;
    dev->segment_count--;
    free(seg);
    pool_block_delete(block);
    return CCA_OK;
}

/* Release every unsplit free block of a pool (device lock held, pool lock taken). */
cca_status_t release_pool_blocks(cca_device_t *dev, cca_pool_t *pool, cca_stream_pool_t *held)
{
    cca_status_t result = CCA_OK;
    pool_lock_unless_held(pool->owner, held); /* a held-back free merged, as PyTorch has it */
    cca_block_t *b = bins_best_fit(&pool->bins, 0);
    while (b) {
        cca_block_t *next = bins_next(&pool->bins, b);
        if (!block_is_split(b) && !b->segment->es) {
            cca_status_t st = release_block(dev, b);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
        b = next;
    }
    pool_unlock_unless_held(pool->owner, held);
    return result;
}

/* Unmap the whole free granules of a pool's expandable segments (device lock held, pool lock taken). */
static cca_status_t release_pool_expandable(cca_device_t *dev, cca_pool_t *pool, cca_stream_pool_t *held)
{
    if (!pool->expandable_segments)
        return CCA_OK;
    pool_lock_unless_held(pool->owner, held);
    cca_status_t st = expandable_release_pool(dev, pool);
    pool_unlock_unless_held(pool->owner, held);
    return st;
}

/*
 * The freeable pools' part of PyTorch's release_cached_blocks: return every
 * unsplit free block of each freeable pool (only of id, unless id is (0, 0)),
 * and drop the pools left with no segment (device lock held; held: a stream
 * pool lock the caller holds). With a specific id, that pool's pending
 * events are waited for first when no route is active.
 */
static cca_status_t release_private_pools_locked(cca_device_t *dev, cca_stream_pool_t *held,
                                           cca_mempool_id_t id)
{
    cca_status_t result = CCA_OK;
    cca_private_pool_t *pp = dev->private_pools;
    while (pp) {
        cca_private_pool_t *next = pp->next;
        if (pp->use_count != 0 || (!pools_id_is_default(id) && !pools_id_eq(pp->id, id))) {
            pp = next;
            continue;
        }
        if (!pools_id_is_default(id) && !atomic_load_explicit(&dev->route_count, memory_order_relaxed)) {
            cca_status_t st = events_insert_deferred_locked(dev, held);
            if (st == CCA_OK)
                st = events_synchronize_and_free(dev, held, pp);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
        for (int kind = 0; kind < 2; kind++)
            for (int expandable = 0; expandable < 2; expandable++)
                for (size_t i = 0; i < pp->stream_pool_count; i++) {
                    cca_stream_pool_t *sp = pp->stream_pools[i];
                    cca_pool_t *pool = kind == 0 ? &sp->small : &sp->large;
                    cca_status_t st = expandable ? release_pool_expandable(dev, pool, held)
                                                 : release_pool_blocks(dev, pool, held);
                    if (st != CCA_OK && result == CCA_OK)
                        result = st;
                }
        if (pp->segment_count == 0 && atomic_load_explicit(&pp->pins, memory_order_acquire) == 0)
            pool_private_destroy(dev, pp);
        pp = next;
    }
    return result;
}

cca_status_t cca_empty_cache_pool(cca_mempool_id_t id)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (pools_id_is_default(id) || async_enabled()) /* that backend's emptyCache ignores the id */
        return cca_empty_cache();
    cca_status_t result = CCA_OK;
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_device_t *dev = &cca_state->devices[d];
        pthread_mutex_lock(&dev->lock);
        st = release_private_pools_locked(dev, NULL, id);
        pthread_mutex_unlock(&dev->lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    cca_assert_expensive(device_is_valid());
    return result;
}

/*
 * PyTorch's release_cached_blocks: with no route active, sync events and
 * release every unsplit cached block of the default pools, per pool kind
 * (large, then small) the plain segments of every stream first, then the
 * expandable segments' free granules, as PyTorch's release_blocks orders
 * them; then those of the freeable private pools.
 */
cca_status_t release_cached_blocks_locked(cca_device_t *dev, cca_stream_pool_t *held)
{
    cca_mempool_id_t all = {0, 0};
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed))
        return release_private_pools_locked(dev, held, all);
    cca_status_t st = events_insert_deferred_locked(dev, held);
    if (st == CCA_OK)
        st = events_synchronize_and_free(dev, held, NULL);
    if (st == CCA_OK)
        st = compact_settle_aliases(dev, held, true);
    if (st != CCA_OK)
        return st;
    st = expandable_release_orphans(dev);
    if (st != CCA_OK)
        return st;
    size_t n;
    cca_stream_pool_t **pools = pool_sorted_locked(dev, &n);
    if (!pools)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory releasing cached blocks");
    cca_status_t result = CCA_OK;
    for (int kind = 0; kind < 2; kind++)
        for (int expandable = 0; expandable < 2; expandable++)
            for (size_t i = 0; i < n; i++) {
                cca_pool_t *pool = kind == 0 ? &pools[i]->large : &pools[i]->small;
                st = expandable ? release_pool_expandable(dev, pool, held)
                                : release_pool_blocks(dev, pool, held);
                if (st != CCA_OK && result == CCA_OK)
                    result = st;
            }
    free(pools);
    st = release_private_pools_locked(dev, held, all);
    return result != CCA_OK ? result : st;
}

/*
 * Release oversize cached blocks of the request's pool, enough to cover the
 * request (PyTorch's release_available_cached_blocks); expandable blocks are
 * never released here: the search for several passes over them. Device and
 * pool locks held. True if something suitable was released.
 */
bool release_available_cached_blocks(cca_device_t *dev, cca_pool_t *pool, size_t size)
{
    const cca_settings_t *s = &cca_state->settings;
    if (s->max_split_size == SIZE_MAX)
        return false;
    size_t key = size < s->max_split_size ? s->max_split_size : size;
    cca_block_t *b = bins_best_fit(&pool->bins, key);
    if (!b || b->segment->es) {
        size_t released = 0;
        b = b ? bins_prev(&pool->bins, b) : bins_largest(&pool->bins);
        while (b && released < key && b->size >= s->max_split_size) {
            cca_block_t *prev = bins_prev(&pool->bins, b);
            size_t bsize = b->size;
            if (!block_is_split(b) && !b->segment->es) {
                if (release_block(dev, b) != CCA_OK)
                    return false;
                released += bsize;
            }
            b = prev;
        }
        return released >= key;
    }
    if (block_is_split(b))
        return false; /* a split block is never a whole segment */
    return release_block(dev, b) == CCA_OK;
}

/* Age-based garbage collection of unsplit large cached blocks (device lock held). */
void release_garbage_collect(cca_device_t *dev, cca_stream_pool_t *held)
{
    const cca_settings_t *s = &cca_state->settings;
    size_t threshold = (size_t)(s->garbage_collection_threshold * (double)dev->allowed_memory_maximum);
    if (dev->total_allocated_memory <= threshold)
        return;
    size_t target = dev->total_allocated_memory - threshold;
    size_t reclaimed = 0;
    int64_t calls = atomic_load_explicit(&dev->gc_calls_large, memory_order_relaxed);
    size_t n;
    cca_stream_pool_t **pools = pool_sorted_locked(dev, &n);
    if (!pools)
        return;
    for (size_t i = 0; i < n; i++)
        pool_lock_unless_held(pools[i], held);
    size_t total_age = 0;
    int64_t freeable = 0;
    for (size_t i = 0; i < n; i++)
        for (cca_block_t *b = bins_best_fit(&pools[i]->large.bins, 0); b;
             b = bins_next(&pools[i]->large.bins, b))
            if (!block_is_split(b) && !b->segment->es) {
                total_age += (size_t)(calls - b->gc_count_base);
                freeable++;
            }
    bool block_freed = true;
    while (freeable > 0 && reclaimed < target && block_freed) {
        double age_threshold = (double)total_age / (double)freeable;
        block_freed = false;
        for (size_t i = 0; i < n; i++) {
            cca_bins_t *bins = &pools[i]->large.bins;
            cca_block_t *b = bins_best_fit(bins, 0);
            while (b) {
                cca_block_t *next = bins_next(bins, b);
                int64_t age = calls - b->gc_count_base;
                if (!block_is_split(b) && !b->segment->es && (double)age >= age_threshold) {
                    size_t bsize = b->size;
                    if (release_block(dev, b) == CCA_OK) {
                        block_freed = true;
                        reclaimed += bsize;
                        total_age -= (size_t)age;
                        freeable--;
                    }
                }
                b = next;
            }
        }
    }
    for (size_t i = 0; i < n; i++)
        pool_unlock_unless_held(pools[i], held);
    free(pools);
}

/* Build PyTorch's out-of-memory message and notify observers (no lock held). */
cca_status_t release_raise_oom(cca_device_t *dev, size_t size, size_t alloc_size,
                              cca_stream_t stream)
{
    cca_backend_t *be = cca_state->backend;
    size_t device_free = 0, device_total = dev->total_memory;
    be->mem_get_info(be->ctx, dev->index, &device_free, &device_total);
    stats_lock(dev);
    dev->stats.num_ooms++;
    stats_unlock(dev);
    pthread_mutex_lock(&dev->lock);
    size_t in_private = pools_cached_bytes_locked(dev);
    pthread_mutex_unlock(&dev->lock);
    size_t cached_free = 0, largest_free = 0;
    bool compact = cca_state->settings.compact_memory;
    if (compact)
        cca_cache_info(dev->index, &cached_free, &largest_free);
    cca_device_stats_t now;
    stats_read(dev, &now);
    int64_t allocated = now.allocated_bytes[CCA_STAT_ALL].current;
    int64_t reserved = now.reserved_bytes[CCA_STAT_ALL].current;
    trace_record_oom(dev->index, device_free, size, stream);

    char s_alloc[32], s_total[32], s_free[32], s_allowed[32], s_used[32], s_cached[32];
    stats_format_size(alloc_size, s_alloc, sizeof(s_alloc));
    stats_format_size(device_total, s_total, sizeof(s_total));
    stats_format_size(device_free, s_free, sizeof(s_free));
    stats_format_size(dev->allowed_memory_maximum, s_allowed, sizeof(s_allowed));
    stats_format_size((size_t)allocated + in_private, s_used, sizeof(s_used));
    stats_format_size((size_t)(reserved - allocated) - in_private, s_cached, sizeof(s_cached));
    char private_info[96] = "";
    if (in_private) {
        char s_private[32];
        stats_format_size(in_private, s_private, sizeof(s_private));
        snprintf(private_info, sizeof(private_info),
                 "with %s allocated in private pools (e.g., CUDA Graphs), ", s_private);
    }
    char allowed_info[64] = "";
    if (dev->set_fraction)
        snprintf(allowed_info, sizeof(allowed_info), "%s allowed; ", s_allowed);
    char frag_info[160] = "";
    if (compact) {
        char s_free_cached[32], s_largest[32];
        stats_format_size(cached_free, s_free_cached, sizeof(s_free_cached));
        stats_format_size(largest_free, s_largest, sizeof(s_largest));
        snprintf(frag_info, sizeof(frag_info),
                 " compact_memory: the cache holds %s free, the largest free piece is %s.",
                 s_free_cached, s_largest);
    }
    cca_strbuf_t proc;
    sb_init(&proc);
    if (!strcmp(cca_state->backend->name, "cuda"))
        nvml_process_usage(dev->index, &proc); /* only a real GPU has processes to list */
    notify_oom_observers(dev->index, alloc_size,
                         dev->set_fraction ? dev->allowed_memory_maximum : device_total, device_free);
    cca_status_t st = cca_raise(
        CCA_ERR_OUT_OF_MEMORY,
        "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s "
        "is free. %s%sOf the allocated memory %s is allocated by cca, %sand %s is reserved by cca "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "CCA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.%s",
        s_alloc, dev->index, s_total, s_free, proc.data ? proc.data : "", allowed_info, s_used,
        private_info, s_cached, frag_info);
    sb_free(&proc);
    return st;
}

static void for_each_pool_locked(cca_device_t *dev, void (*fn)(cca_stream_pool_t *, void *), void *arg);

static void plan_reset_pool(cca_stream_pool_t *sp, void *arg)
{
    (void)arg;
    plan_reset(&sp->large);
}

static void plan_count_pool(cca_stream_pool_t *sp, void *arg)
{
    uint64_t *n = arg;
    plan_count(&sp->large, &n[0], &n[1], &n[2]);
}

cca_status_t cca_empty_cache(void)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    shared_retry_releases();
    if (async_enabled())
        return async_empty_cache();
    cca_status_t result = CCA_OK;
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_device_t *dev = &cca_state->devices[d];
        pthread_mutex_lock(&dev->lock);
        st = release_cached_blocks_locked(dev, NULL);
        if (st == CCA_OK)
            compact_restart_limit(dev);
        if (st == CCA_OK)
            for_each_pool_locked(dev, plan_reset_pool, NULL); /* a new phase */
        if (st == CCA_OK)
            st = events_destroy_pooled(dev);
        if (st == CCA_OK)
            st = compact_destroy_ready_events(dev);
        pthread_mutex_unlock(&dev->lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    cca_assert_expensive(device_is_valid());
    return result;
}

/* Apply fn to each stream pool of a device, with its lock held (device lock held). */
static void for_each_pool_locked(cca_device_t *dev, void (*fn)(cca_stream_pool_t *, void *), void *arg)
{
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        pool_lock(sp);
        fn(sp, arg);
        cca_spin_unlock(&sp->lock);
    }
}

typedef struct cache_info_acc {
    size_t total;
    size_t largest;
} cache_info_acc_t;

static void cache_info_block(cca_block_t *b, void *arg)
{
    cache_info_acc_t *acc = arg;
    acc->total += b->size;
    if (b->size > acc->largest)
        acc->largest = b->size;
}

static void cache_info_pool(cca_stream_pool_t *sp, void *arg)
{
    bins_for_each(&sp->small.bins, cache_info_block, arg);
    bins_for_each(&sp->large.bins, cache_info_block, arg);
}

/* cache_info_pool for a private pool's stream pool (taking its lock). */
static void cache_info_private(cca_stream_pool_t *sp, void *arg)
{
    pool_lock(sp);
    cache_info_pool(sp, arg);
    cca_spin_unlock(&sp->lock);
}

cca_status_t cca_cache_info(int device, size_t *total_cached, size_t *largest_block)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_cache_info: device %d is out of range", device);
    if (async_enabled())
        return async_cache_info(device, total_cached, largest_block);
    cca_device_t *dev = &cca_state->devices[device];
    cache_info_acc_t acc = {0, 0};
    pthread_mutex_lock(&dev->lock);
    for_each_pool_locked(dev, cache_info_pool, &acc);
    pools_for_each_stream_pool(dev, cache_info_private, &acc);
    pthread_mutex_unlock(&dev->lock);
    if (total_cached)
        *total_cached = acc.total;
    if (largest_block)
        *largest_block = acc.largest;
    return CCA_OK;
}

cca_status_t cca_cache_info_largest(int device, size_t *largest)
{
    if (!largest)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_cache_info_largest: largest is NULL");
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_cache_info_largest: device %d is out of range",
                         device);
    if (async_enabled())
        return async_cache_info(device, NULL, largest);
    size_t guess = *largest;
    if (guess == 0) { /* PyTorch: the free memory as an optimistic first guess */
        cca_backend_t *be = cca_state->backend;
        size_t total = 0;
        st = be->mem_get_info(be->ctx, device, &guess, &total);
        if (st != CCA_OK)
            return st;
    }
    size_t cached_largest = 0;
    st = cca_cache_info(device, NULL, &cached_largest);
    if (st != CCA_OK)
        return st;
    *largest = cached_largest > guess ? cached_largest : guess;
    return CCA_OK;
}

cca_status_t cca_memory_stats_extra(int device, cca_stat_entry_t *out, size_t count)
{
    if (!out || count < CCA_MEMORY_STATS_EXTRA_COUNT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memory_stats_extra: out must hold %d entries",
                         CCA_MEMORY_STATS_EXTRA_COUNT);
    size_t cached = 0, largest = 0;
    cca_status_t st;
    if (async_enabled() && device >= 0 && device < cca_state->device_count) {
        /* the pool's figures, not cache_info's trial allocation, which would leave the pool
         * holding the device's free memory and raise the peaks; the pool does not say how
         * its free memory is split, so its largest free piece is taken as all of it */
        st = async_cached_bytes(device, &cached);
        largest = cached;
    } else {
        st = cca_cache_info(device, &cached, &largest);
    }
    if (st != CCA_OK)
        return st;
    uint64_t moves = 0, moved = 0, pending = 0, syncs = 0, aliased = 0;
    uint64_t plans[3] = {0, 0, 0}; /* plans made, requests placed, requests that missed */
    if (!async_enabled()) {
        cca_device_t *dev = &cca_state->devices[device];
        pthread_mutex_lock(&dev->lock);
        moves = dev->compact_moves;
        moved = dev->compact_moved_bytes;
        pending = dev->compact_pending_growths;
        syncs = dev->compact_syncs;
        aliased = dev->compact_aliased_bytes;
        for_each_pool_locked(dev, plan_count_pool, plans);
        pthread_mutex_unlock(&dev->lock);
    }
    out[0] = (cca_stat_entry_t){"cca.cached_free_bytes", (int64_t)cached};
    out[1] = (cca_stat_entry_t){"cca.compact_aliased_bytes", (int64_t)aliased};
    out[2] = (cca_stat_entry_t){"cca.compact_moved_bytes", (int64_t)moved};
    out[3] = (cca_stat_entry_t){"cca.compact_moves", (int64_t)moves};
    out[4] = (cca_stat_entry_t){"cca.compact_pending_growths", (int64_t)pending};
    out[5] = (cca_stat_entry_t){"cca.compact_plan_misses", (int64_t)plans[2]};
    out[6] = (cca_stat_entry_t){"cca.compact_planned_allocations", (int64_t)plans[1]};
    out[7] = (cca_stat_entry_t){"cca.compact_plans", (int64_t)plans[0]};
    out[8] = (cca_stat_entry_t){"cca.compact_syncs", (int64_t)syncs};
    out[9] = (cca_stat_entry_t){"cca.largest_free_bytes", (int64_t)largest};
    return CCA_OK;
}

cca_status_t cca_set_memory_fraction(double fraction, int device)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_set_memory_fraction: device %d is out of range",
                         device);
    if (!(fraction >= 0.0 && fraction <= 1.0))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_set_memory_fraction: invalid fraction %g, please set within [0, 1]",
                         fraction);
    if (async_enabled())
        return async_set_memory_fraction(fraction, device);
    cca_device_t *dev = &cca_state->devices[device];
    pthread_mutex_lock(&dev->lock);
    dev->allowed_memory_maximum = (size_t)(fraction * (double)dev->total_memory);
    dev->set_fraction = true;
    pthread_mutex_unlock(&dev->lock);
    cca_assert_expensive(device_is_valid());
    return CCA_OK;
}

/* The fraction in force: allowed_memory_maximum over the device's memory, 1.0 when none is set. */
cca_status_t cca_get_memory_fraction(int device, double *fraction)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (!fraction)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_memory_fraction: fraction is NULL");
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_memory_fraction: device %d is out of range",
                         device);
    if (async_enabled()) {
        *fraction = async_get_memory_fraction(device);
        return CCA_OK;
    }
    cca_device_t *dev = &cca_state->devices[device];
    pthread_mutex_lock(&dev->lock);
    double f = 1.0;
    if (dev->set_fraction && dev->total_memory > 0)
        f = (double)dev->allowed_memory_maximum / (double)dev->total_memory;
    pthread_mutex_unlock(&dev->lock);
    *fraction = f;
    return CCA_OK;
}

cca_status_t cca_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_mem_get_info: device %d is out of range", device);
    cca_backend_t *be = cca_state->backend;
    size_t f = 0, t = 0;
    st = be->mem_get_info(be->ctx, device, &f, &t);
    if (st != CCA_OK)
        return st;
    if (free_bytes)
        *free_bytes = f;
    if (total_bytes)
        *total_bytes = t;
    return CCA_OK;
}

