/*
 * pool.c - the structures the device allocator is made of: block structs
 * (recycled per stream pool), the stream pools of a device (an
 * open-addressing table read without locks, a per-thread cache of the last
 * one used), the return of a block to its pool (merging with free
 * neighbours), and setting a device's pools up and down.
 * Invariant: a stream pool, once created, lives until its device is shut
 * down; a free block is merged with every free neighbour before it is binned.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "state.h"
#include "trace.h"

/* ---- block structs ---------------------------------------------------------- */

static _Atomic long host_alloc_countdown; /* tests (pool_test_fail_host_alloc) */

void pool_test_fail_host_alloc(long n)
{
    atomic_store_explicit(&host_alloc_countdown, n, memory_order_relaxed);
}

bool pool_host_alloc_fails(void)
{
    return cca_countdown_hit(&host_alloc_countdown);
}

/* A block struct of the heap, for pool_block_new when the stream pool has no spare: on a
 * cache line of its own, so that its hot fields take one line. */
cca_block_t *pool_block_struct(void)
{
    return pool_host_alloc_fails() ? NULL : aligned_alloc(64, sizeof(cca_block_t));
}

bool pool_spares_reserve(cca_stream_pool_t *sp, size_t n)
{
    while (sp->spare_count < n) {
        cca_block_t *b = pool_block_struct();
        if (!b)
            return false;
        b->bin_next = sp->spare_blocks;
        sp->spare_blocks = b;
        sp->spare_count++;
    }
    return true;
}

/* ---- stream pools --------------------------------------------------------- */

_Atomic uint64_t state_generation;
CCA_THREAD_HOT pool_cache_t pool_cache;

static inline size_t stream_hash(cca_stream_t stream)
{
    uint64_t x = (uint64_t)(uintptr_t)stream;
    x ^= x >> 31;
    x *= 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> 17);
}

static cca_stream_pool_t *pool_table_find(cca_device_t *dev, cca_stream_t stream)
{
    size_t mask = dev->pool_table_cap - 1;
    for (size_t i = stream_hash(stream) & mask;; i = (i + 1) & mask) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp || sp->stream == stream)
            return sp;
    }
}

/* A stream pool of dev for stream, in no table; NULL: no host memory. */
cca_stream_pool_t *pool_stream_pool_new(cca_device_t *dev, cca_stream_t stream)
{
    /* whole cache lines of its own: its lock and statistics share none with another pool's */
    size_t bytes = (sizeof(cca_stream_pool_t) + 63) & ~(size_t)63;
    cca_stream_pool_t *sp = aligned_alloc(64, bytes);
    if (!sp)
        return NULL;
    memset(sp, 0, bytes);
    /* a second stream pool: the first one's lock alone no longer guards the statistics */
    cca_stream_pool_t *solo = atomic_load_explicit(&dev->stats_solo, memory_order_relaxed);
    if (solo) {
        pool_lock(solo); /* its operation in flight ends first; its held-back statistics applied */
        /* release: a reader that then finds no solo pool (stats_solo_lock, acquire) and so
         * takes only the stats lock sees every statistic the solo pool wrote under its own */
        atomic_store_explicit(&dev->stats_solo, NULL, memory_order_release);
        cca_spin_unlock(&solo->lock);
    }
    cca_spin_init(&sp->lock);
    sp->stream = stream;
    sp->device = dev;
    sp->small.owner = sp;
    sp->small.is_small = true;
    sp->small.gc_calls = &dev->gc_calls_small;
    sp->large.owner = sp;
    sp->large.is_small = false;
    sp->large.gc_calls = &dev->gc_calls_large;
    for (int kind = 0; kind < 2; kind++) { /* (ops_apply's rows: the table lives as long) */
        cca_pool_t *pool = kind ? &sp->large : &sp->small;
        int type = pool_stat_type(pool->is_small);
        pool->ops_cur = dev->ops->cur[type];
        pool->ops_peak = dev->ops->peak[type];
        pool->ops_n = dev->ops->n[type];
        pool->ops_other = dev->ops->cur[CCA_STAT_SMALL_POOL + CCA_STAT_LARGE_POOL - type];
    }
    sp->log_slot = -1;
    return sp;
}

/* Free a stream pool and its spare block structs (its blocks are gone). */
void pool_stream_pool_delete(cca_stream_pool_t *sp)
{
    if (sp->ready_event) {
        cca_backend_t *be = cca_state->backend;
        be->event_destroy(be->ctx, sp->device->index, sp->ready_event);
    }
    while (sp->spare_blocks) {
        cca_block_t *b = sp->spare_blocks;
        sp->spare_blocks = b->bin_next;
        free(b);
    }
    if (cca_state->ptrmap)
        ptrmap_pool_gone(cca_state->ptrmap, &sp->lock);
    stats_log_release(sp);
    plan_delete(&sp->large);
    free(sp);
}

/* Unlink and free a private pool holding no segment (device lock held). */
void pool_private_destroy(cca_device_t *dev, cca_private_pool_t *pp)
{
    cca_private_pool_t **link = &dev->private_pools;
    while (*link != pp)
        link = &(*link)->next;
    *link = pp->next;
    for (size_t i = 0; i < pp->stream_pool_count; i++)
        pool_stream_pool_delete(pp->stream_pools[i]);
    free(pp->stream_pools);
    free(pp);
}

/* Create the pool of a stream (device lock held). */
static cca_stream_pool_t *pool_create_locked(cca_device_t *dev, cca_stream_t stream)
{
    if ((dev->pool_count + 1) * 2 > dev->pool_table_cap)
        return NULL; /* the table is sized generously at init; see pool_stream_get */
    bool first = !dev->stats_solo_done;
    cca_stream_pool_t *sp = pool_stream_pool_new(dev, stream);
    if (!sp)
        return NULL;
    cca_spin_bias(&sp->lock); /* the creating thread's, until another one takes it */
    dev->stats_solo_done = true;
    ptrmap_pool_made(cca_state->ptrmap, &sp->lock); /* the first guards the map, a second ends it */
    if (first && dev->exact_stats) /* before it is published: its operations see it */
        atomic_store_explicit(&dev->stats_solo, sp, memory_order_release);
    size_t mask = dev->pool_table_cap - 1;
    size_t i = stream_hash(stream) & mask;
    while (atomic_load_explicit(&dev->pool_table[i], memory_order_relaxed))
        i = (i + 1) & mask;
    atomic_store_explicit(&dev->pool_table[i], sp, memory_order_release);
    dev->pool_count++;
    return sp;
}

/* pool_stream_get past the thread's cache: the table, else a new pool. */
cca_stream_pool_t *pool_stream_get_slow(cca_device_t *dev, cca_stream_t stream)
{
    uint64_t gen = atomic_load_explicit(&state_generation, memory_order_relaxed);
    cca_stream_pool_t *sp = pool_table_find(dev, stream);
    if (!sp) {
        pthread_mutex_lock(&dev->lock);
        sp = pool_table_find(dev, stream);
        if (!sp)
            sp = pool_create_locked(dev, stream);
        pthread_mutex_unlock(&dev->lock);
        if (!sp)
            return NULL;
    }
    pool_cache.generation = gen;
    pool_cache.device_index = dev->index;
    pool_cache.device = dev;
    pool_cache.stream = stream;
    pool_cache.pool = sp;
    return sp;
}

/* Stream pools of a device sorted by stream handle (device lock held); caller frees. */
cca_stream_pool_t **pool_sorted_locked(cca_device_t *dev, size_t *count)
{
    cca_stream_pool_t **list = malloc((dev->pool_count + 1) * sizeof(*list));
    size_t n = 0;
    if (!list) {
        *count = 0;
        return NULL;
    }
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        size_t j = n++;
        while (j > 0 && (uintptr_t)list[j - 1]->stream > (uintptr_t)sp->stream) {
            list[j] = list[j - 1];
            j--;
        }
        list[j] = sp;
    }
    *count = n;
    return list;
}

/* ---- freeing blocks into their pool ------------------------------------------ */

size_t pool_try_merge_blocks(cca_block_t *dst, cca_block_t *src, cca_bins_t *bins)
{
    return pool_merge_blocks(dst, src, bins);
}

/* The pointer map's solo mode ends (the solo pool's lock, held): its held blocks out of it. */
void pool_solo_end(cca_spinlock_t *solo)
{
    cca_stream_pool_t *sp = pool_of_lock(solo);
    if (sp->small.held_in_map || sp->large.held_in_map)
        pool_flush(sp); /* the shards' mode keeps only allocated blocks in the map */
}

/* The statistics of the program's free of held block h, merged with its upper neighbour
 * (inactive_split unchanged for a block of an expandable segment, as pool_free_block). */
static void held_free_deltas(const cca_block_t *h, int64_t d[OPS_COUNT])
{
    const cca_block_t *up = h->next;
    bool split = h->prev || up->next, inactive = !h->segment->es; /* as pool_free_block */
    d[OPS_ALLOCATION] = -1;
    d[OPS_ALLOCATED_BYTES] = -(int64_t)h->size;
    d[OPS_ACTIVE] = -1;
    d[OPS_ACTIVE_BYTES] = -(int64_t)h->size;
    d[OPS_REQUESTED_BYTES] = -(int64_t)h->requested_size;
    d[OPS_INACTIVE_SPLIT] = !inactive || split ? 0 : -1;
    d[OPS_INACTIVE_SPLIT_BYTES] = !inactive ? 0 : split ? (int64_t)h->size : -(int64_t)up->size;
    d[OPS_OVERSIZE] = -(int64_t)h->oversize;
}

void ops_again_counts(cca_stream_pool_t *sp, int type, uint64_t n, int64_t size, int64_t up,
                      bool split, int64_t req)
{
    cca_device_t *dev = sp->device;
    int64_t k = (int64_t)n, add[OPS_COUNT];
    add[OPS_ALLOCATION] = add[OPS_ACTIVE] = k;
    add[OPS_ALLOCATED_BYTES] = add[OPS_ACTIVE_BYTES] = k * size;
    add[OPS_REQUESTED_BYTES] = k * req;
    add[OPS_INACTIVE_SPLIT] = split ? 0 : k;
    add[OPS_INACTIVE_SPLIT_BYTES] = k * (split ? size : up);
    for (int i = 0; i < OPS_COUNT; i++) {
        if (i == OPS_OVERSIZE) /* a held block never is (held_fit: below max_split_size) */
            continue;
        /* each moved up and down by add[i]: the relaxed mode's in the pool's own ALL and type
         * entries, the exact mode's in the table's type entry */
        if (!dev->exact_stats) {
            cca_stat_t *all = &ops_array(&sp->stats, i)[CCA_STAT_ALL];
            cca_stat_t *own = &ops_array(&sp->stats, i)[type];
            all->allocated += add[i];
            all->freed += add[i];
            own->allocated += add[i];
            own->freed += add[i];
        } else {
            dev->ops->n[type][i].allocated += add[i];
            dev->ops->n[type][i].freed += add[i];
        }
    }
}

void pool_flush_agains(cca_pool_t *pool)
{
    ops_again_counts(pool->owner, pool_stat_type(pool->is_small), pool->again_n,
                     (int64_t)pool->again_size, (int64_t)pool->again_up, pool->again_split,
                     (int64_t)pool->again_req);
    pool->again_n = 0;
}

void pool_flush(cca_stream_pool_t *sp)
{
    sp->again_pool = NULL; /* a reader may reset peaks next: the next repeat counts in full */
    for (int kind = 0; kind < 2; kind++) {
        cca_pool_t *pool = kind ? &sp->large : &sp->small;
        if (pool->again_n)
            pool_flush_agains(pool);
        cca_block_t *h = pool->held;
        if (!h)
            continue;
        pool->held = NULL;
        if (pool->held_in_map) { /* solo mode kept it in the pointer map */
            pool->held_in_map = false;
            ptrmap_remove_block(cca_state->ptrmap, h, &sp->lock);
        }
        if (pool->held_stats) {
            pool->held_stats = false;
            int64_t d[OPS_COUNT];
            held_free_deltas(h, d);
            ops_apply(pool, d, pool_free_sign);
        }
        pool_try_merge_blocks(h, h->next, &pool->bins); /* its gc_count_base: the free's */
        bins_insert(&pool->bins, h);
    }
}


void pool_hold_stats(cca_block_t *block, bool program_free)
{
    int64_t d[OPS_COUNT];
    held_free_deltas(block, d);
    if (!program_free) /* returned by its last event: the program's free was counted then */
        d[OPS_ALLOCATION] = d[OPS_ALLOCATED_BYTES] = d[OPS_OVERSIZE] = 0;
    ops_apply(block->pool, d, pool_free_sign);
}

void pool_free_block(cca_device_t *dev, cca_block_t *block, bool program_free)
{
    cca_pool_t *pool = block->pool;
    cca_stream_pool_t *sp = pool->owner;
    if (sp->small.held || sp->large.held)
        pool_flush(sp);
    if (pool_may_hold(pool, block)) {
        pool_hold_block(dev, block, program_free);
        return;
    }
    pool_return_block(dev, block, program_free);
}

cca_status_t pool_invalid_pointer(const char *what, const void *ptr)
{
    cca_block_t *inside = cca_state ? ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)ptr) : NULL;
    if (inside)
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "%s: pointer %p is inside the block at 0x%" PRIxPTR
                         " (%zu bytes); pass the pointer cca_malloc returned",
                         what, ptr, inside->addr, inside->size);
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "%s: pointer %p was not allocated by cca, or was already freed", what, ptr);
}

/* Set up the per-device state (called by init). */
cca_status_t pool_device_init(cca_device_t *dev, int index, size_t total_memory)
{
    memset(dev, 0, sizeof(*dev));
    dev->index = index;
    dev->ops = aligned_alloc(64, sizeof(*dev->ops));
    if (!dev->ops)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising device %d", index);
    memset(dev->ops, 0, sizeof(*dev->ops));
    dev->total_memory = total_memory;
    dev->pool_table_cap = 8192;
    dev->pool_table = calloc(dev->pool_table_cap, sizeof(*dev->pool_table));
    if (!dev->pool_table) {
        free(dev->ops);
        dev->ops = NULL;
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising device %d", index);
    }
    pthread_mutex_init(&dev->lock, NULL);
    cca_spin_init(&dev->ops->lock);
    dev->exact_stats = cca_state->settings->exact_peak_stats;
    pthread_mutex_init(&dev->events_lock, NULL);
    double fraction = cca_state->settings->per_process_memory_fraction;
    if (fraction > 0.0) {
        dev->set_fraction = true;
        dev->allowed_memory_maximum = (size_t)(fraction * (double)total_memory);
    }
    atomic_fetch_add(&state_generation, 1);
    return CCA_OK;
}

cca_status_t pool_segment_give_back(cca_device_t *dev, cca_segment_t *seg)
{
    if (seg->user_free) {
        cca_status_t st = seg->user_free((void *)seg->base, seg->size, dev->index, seg->stream,
                                         seg->user_ctx);
        if (st != CCA_OK)
            return cca_raise(CCA_ERR_BACKEND, "a private pool's allocator could not free segment %p "
                             "(%zu bytes; %s); it stays cached", (void *)seg->base, seg->size,
                             cca_status_str(st));
        return CCA_OK;
    }
    cca_backend_t *be = cca_state->backend;
    return be->free(be->ctx, dev->index, (void *)seg->base);
}

/* Tear down a device: give every segment and event back to the backend (or its pool's allocator). */
void pool_device_shutdown(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    while (dev->events_head) {
        cca_pending_event_t *pe = dev->events_head;
        dev->events_head = pe->next;
        if (pe->event)
            be->event_destroy(be->ctx, dev->index, pe->event);
        free(pe);
    }
    for (size_t i = 0; i < dev->event_pool_count; i++)
        be->event_destroy(be->ctx, dev->index, dev->event_pool[i]);
    free(dev->event_pool);
    cca_segment_t *seg = dev->segments;
    while (seg) {
        cca_segment_t *next = seg->next_seg;
        (void)pool_segment_give_back(dev, seg); /* expandable ones went first (setup.c) */
        cca_block_t *b = seg->head;
        while (b) {
            cca_block_t *nb = b->next;
            free(b->stream_uses);
            free(b);
            b = nb;
        }
        free(seg);
        seg = next;
    }
    while (dev->private_pools)
        pool_private_destroy(dev, dev->private_pools);
    free(dev->routes);
    free(dev->capture_uses);
    for (size_t i = 0; i < dev->marker_count; i++)
        free(dev->markers[i].nodes);
    free(dev->markers);
    for (size_t i = 0; i < dev->reuse_count; i++)
        free(dev->reuse[i].visited);
    free(dev->reuse);
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load(&dev->pool_table[i]);
        if (sp)
            pool_stream_pool_delete(sp);
    }
    free(dev->pool_table);
    free(dev->ops);
    dev->ops = NULL;
    free(dev->orphans);
    free(dev->lent);
    pthread_mutex_destroy(&dev->lock);
    pthread_mutex_destroy(&dev->events_lock);
    atomic_fetch_add(&state_generation, 1);
}

