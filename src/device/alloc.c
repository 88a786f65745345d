/*
 * alloc.c - the device caching allocator: PyTorch's policy (rounding, pools,
 * best fit, splitting, merging, oversize blocks, record_stream events, the
 * out-of-memory sequence, garbage collection, memory fraction) on per-stream
 * pools.
 *
 * Invariants: every byte of a segment belongs to exactly one block; a block
 * is either allocated (and in the pointer map), waiting for its events
 * (event_count > 0), or free in exactly one bin of its own stream pool; two
 * free neighbours are always merged. Statistics change only under the
 * device's stats lock and follow PyTorch's update rules exactly.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "trace.h"

/* ---- rounding and sizing (PyTorch's rules) ----------------------------------- */

static size_t roundup_power2_next_division(size_t size, size_t divisions)
{
    if ((size & (size - 1)) == 0)
        return size;
    size_t floor2 = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
    size_t division = floor2 >> (63 - __builtin_clzll((unsigned long long)divisions));
    if (division == 0)
        return floor2 << 1;
    size_t round_floor = size & ~(division - 1);
    return round_floor == size ? size : round_floor + division;
}

/* The block size PyTorch uses for a request of size bytes. */
size_t alloc_round_size(const cca_settings_t *s, size_t size)
{
    if (size < CCA_MIN_BLOCK_SIZE)
        return CCA_MIN_BLOCK_SIZE;
    size_t divisions = settings_roundup_divisions(s, size);
    if (divisions > 1 && size > CCA_MIN_BLOCK_SIZE * divisions)
        return roundup_power2_next_division(size, divisions);
    return CCA_MIN_BLOCK_SIZE * ((size + CCA_MIN_BLOCK_SIZE - 1) / CCA_MIN_BLOCK_SIZE);
}

/* The segment size requested from the backend for a block of size bytes. */
size_t alloc_segment_size(const cca_settings_t *s, size_t size)
{
    if (size <= CCA_SMALL_SIZE)
        return CCA_SMALL_BUFFER;
    if (size < CCA_MIN_LARGE_ALLOC)
        return s->large_segment_size;
    return CCA_ROUND_LARGE * ((size + CCA_ROUND_LARGE - 1) / CCA_ROUND_LARGE);
}

static bool should_split(const cca_settings_t *s, const cca_block_t *block, size_t size)
{
    size_t remaining = block->size - size;
    if (block->pool->is_small)
        return remaining >= CCA_MIN_BLOCK_SIZE;
    return size < s->max_split_size && remaining > CCA_SMALL_SIZE;
}

/* ---- stats helpers (stats lock held by the caller) ------------------------ */

static inline int pool_stat_type(bool is_small)
{
    return is_small ? CCA_STAT_SMALL_POOL : CCA_STAT_LARGE_POOL;
}

static inline void stat2_inc(cca_stat_t *arr, int type, int64_t amount)
{
    stat_increase(&arr[CCA_STAT_ALL], amount);
    stat_increase(&arr[type], amount);
}

static inline void stat2_dec(cca_stat_t *arr, int type, int64_t amount)
{
    stat_decrease(&arr[CCA_STAT_ALL], amount);
    stat_decrease(&arr[type], amount);
}

static inline void stats_lock(cca_device_t *dev)
{
    cca_spin_lock(&dev->stats_lock);
}

static inline void stats_unlock(cca_device_t *dev)
{
    cca_spin_unlock(&dev->stats_lock);
}

/*
 * The statistics an allocation or free updates. With exact_peak_stats (the
 * default) they are the device's, under its stats lock, so every peak is
 * exact. Without it each stream pool keeps its own, under the pool lock it
 * already holds: no cache line is shared between streams on the fast path;
 * device values are summed on read and peaks sampled (stats_sample_locked).
 */
static inline cca_device_stats_t *op_stats_begin(cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (dev->exact_stats) {
        stats_lock(dev);
        return &dev->stats;
    }
    return &sp->stats;
}

static inline void op_stats_end(cca_stream_pool_t *sp)
{
    if (sp->device->exact_stats)
        stats_unlock(sp->device);
}

static void device_stats_read(cca_device_t *dev, cca_device_stats_t *out);
static void device_stats_read_held(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held);

/* ---- block structs ---------------------------------------------------------- */

/*
 * A block struct from the stream pool's spares, or a new one (pool lock
 * held). Every field is set here, explicitly (a memset of the whole struct
 * showed up as the top cost of the split path): a new field must be too.
 */
static cca_block_t *block_new(cca_pool_t *pool, cca_segment_t *seg, uintptr_t addr, size_t size)
{
    cca_stream_pool_t *sp = pool->owner;
    cca_block_t *b = sp->spare_blocks;
    if (b) {
        sp->spare_blocks = b->bin_next;
        sp->spare_count--;
    } else {
        b = malloc(sizeof(*b));
        if (!b)
            return NULL;
    }
    b->addr = addr;
    b->size = size;
    b->requested_size = 0;
    b->prev = b->next = NULL;
    b->bin_prev = b->bin_next = NULL;
    b->map_next = NULL;
    b->pool = pool;
    b->segment = seg;
    b->gc_count_base = 0;
    b->event_count = 0;
    b->bin = 0;
    b->device = 0;
    b->allocated = false;
    b->in_bin = false;
    b->oversize = false;
    b->stream_use_count = 0;
    b->stream_use_cap = CCA_INLINE_STREAMS;
    b->stream_uses = b->stream_uses_inline;
    return b;
}

/* Give a block struct back to its stream pool's spares (pool lock held). */
static void block_delete(cca_block_t *b)
{
    if (b->stream_uses != b->stream_uses_inline)
        free(b->stream_uses);
    cca_stream_pool_t *sp = b->pool->owner;
    if (sp->spare_count >= 4096) {
        free(b);
        return;
    }
    b->bin_next = sp->spare_blocks;
    sp->spare_blocks = b;
    sp->spare_count++;
}

static inline bool block_is_split(const cca_block_t *b)
{
    return b->prev || b->next;
}

/* ---- stream pools --------------------------------------------------------- */

static _Atomic uint64_t state_generation;
static _Thread_local struct {
    uint64_t generation;
    cca_device_t *device;
    cca_stream_t stream;
    cca_stream_pool_t *pool;
} pool_cache;

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

/* Create the pool of a stream (device lock held). */
static cca_stream_pool_t *pool_create_locked(cca_device_t *dev, cca_stream_t stream)
{
    if ((dev->pool_count + 1) * 2 > dev->pool_table_cap)
        return NULL; /* the table is sized generously at init; see stream_pool_get */
    cca_stream_pool_t *sp = calloc(1, sizeof(*sp));
    if (!sp)
        return NULL;
    cca_spin_init(&sp->lock);
    sp->stream = stream;
    sp->device = dev;
    sp->small.owner = sp;
    sp->small.is_small = true;
    sp->large.owner = sp;
    sp->large.is_small = false;
    size_t mask = dev->pool_table_cap - 1;
    size_t i = stream_hash(stream) & mask;
    while (atomic_load_explicit(&dev->pool_table[i], memory_order_relaxed))
        i = (i + 1) & mask;
    atomic_store_explicit(&dev->pool_table[i], sp, memory_order_release);
    dev->pool_count++;
    return sp;
}

/* The pool of (device, stream), created on first use. NULL: out of host memory or streams. */
static cca_stream_pool_t *stream_pool_get(cca_device_t *dev, cca_stream_t stream)
{
    uint64_t gen = atomic_load_explicit(&state_generation, memory_order_relaxed);
    if (pool_cache.generation == gen && pool_cache.device == dev && pool_cache.stream == stream)
        return pool_cache.pool;
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
    pool_cache.device = dev;
    pool_cache.stream = stream;
    pool_cache.pool = sp;
    return sp;
}

/* Stream pools of a device sorted by stream handle (device lock held); caller frees. */
static cca_stream_pool_t **pools_sorted_locked(cca_device_t *dev, size_t *count)
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
    cca_status_t st = cca_init();
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
    return callbacks_add(true, (void *)fn, arg, "OOM observer");
}

/* Run every free-memory callback (no allocator lock held). True if any freed memory. */
static bool trigger_free_memory_callbacks(void)
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

/* ---- freeing blocks into their pool ------------------------------------------ */

/* Merge src into dst if src is free; returns the bytes subsumed (pool lock held). */
static size_t try_merge_blocks(cca_block_t *dst, cca_block_t *src, cca_bins_t *bins)
{
    if (!src || !src->in_bin)
        return 0;
    bins_remove(bins, src);
    if (dst->prev == src) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev)
            dst->prev->next = dst;
    } else {
        dst->next = src->next;
        if (dst->next)
            dst->next->prev = dst;
    }
    size_t subsumed = src->size;
    dst->size += subsumed;
    if (!dst->prev)
        dst->segment->head = dst;
    block_delete(src);
    return subsumed;
}

/*
 * Return a block whose program use and events are over to its pool: merge
 * with free neighbours, put it in its bin, update the statistics (stream
 * pool lock held).
 */
static void free_block(cca_device_t *dev, cca_block_t *block, bool program_free)
{
    cca_pool_t *pool = block->pool;
    trace_record(dev->index, CCA_TRACE_FREE_COMPLETED, block->addr, block->requested_size,
                 pool->owner->stream);
    size_t original_size = block->size;
    size_t requested = block->requested_size;
    int64_t net_blocks = 0, net_bytes = 0;
    cca_block_t *candidates[2] = {block->prev, block->next};
    for (int i = 0; i < 2; i++) {
        size_t subsumed = try_merge_blocks(block, candidates[i], &pool->bins);
        if (subsumed) {
            net_blocks -= 1;
            net_bytes -= (int64_t)subsumed;
        }
    }
    block->gc_count_base = atomic_load_explicit(
        pool->is_small ? &dev->gc_calls_small : &dev->gc_calls_large, memory_order_relaxed);
    bins_insert(&pool->bins, block);
    if (block_is_split(block)) {
        net_blocks += 1;
        net_bytes += (int64_t)block->size;
    }
    int type = pool_stat_type(pool->is_small);
    cca_device_stats_t *st = op_stats_begin(pool->owner);
    if (program_free) {
        /* the program's free and the block's return in one statistics update */
        stat2_dec(st->allocation, type, 1);
        stat2_dec(st->allocated_bytes, type, (int64_t)original_size);
        if (block->oversize)
            stat_decrease(&st->oversize_allocations, 1);
    }
    if (net_blocks > 0)
        stat2_inc(st->inactive_split, type, net_blocks);
    else if (net_blocks < 0)
        stat2_dec(st->inactive_split, type, -net_blocks);
    if (net_bytes > 0)
        stat2_inc(st->inactive_split_bytes, type, net_bytes);
    else if (net_bytes < 0)
        stat2_dec(st->inactive_split_bytes, type, -net_bytes);
    stat2_dec(st->active, type, 1);
    stat2_dec(st->active_bytes, type, (int64_t)original_size);
    stat2_dec(st->requested_bytes, type, (int64_t)requested);
    op_stats_end(pool->owner);
}

/* ---- record_stream events ------------------------------------------------- */

/* An event from the device's pool, or a new one. */
static cca_status_t event_get(cca_device_t *dev, cca_event_t *event)
{
    pthread_mutex_lock(&dev->events_lock);
    if (dev->event_pool_count) {
        *event = dev->event_pool[--dev->event_pool_count];
        pthread_mutex_unlock(&dev->events_lock);
        return CCA_OK;
    }
    pthread_mutex_unlock(&dev->events_lock);
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = be->event_create(be->ctx, dev->index, event);
    if (st == CCA_OK) {
        pthread_mutex_lock(&dev->events_lock);
        dev->events_created++;
        pthread_mutex_unlock(&dev->events_lock);
    }
    return st;
}

/* Return an event to the device's pool (events_lock held). */
static void event_put_locked(cca_device_t *dev, cca_event_t event)
{
    if (dev->event_pool_count == dev->event_pool_cap) {
        size_t cap = dev->event_pool_cap ? dev->event_pool_cap * 2 : 16;
        cca_event_t *pool = realloc(dev->event_pool, cap * sizeof(*pool));
        if (!pool) {
            cca_backend_t *be = cca_state->backend;
            be->event_destroy(be->ctx, dev->index, event);
            dev->events_created--;
            return;
        }
        dev->event_pool = pool;
        dev->event_pool_cap = cap;
    }
    dev->event_pool[dev->event_pool_count++] = event;
}

static void event_put(cca_device_t *dev, cca_event_t event)
{
    pthread_mutex_lock(&dev->events_lock);
    event_put_locked(dev, event);
    pthread_mutex_unlock(&dev->events_lock);
}

/*
 * At free time: record one event per stream that used the block, so it is
 * reused only when their work is done (stream pool lock held). If an event
 * cannot be recorded, that stream is synchronized instead, so the block can
 * never be reused too early.
 */
static cca_status_t insert_events(cca_device_t *dev, cca_block_t *block)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    for (uint32_t i = 0; i < block->stream_use_count; i++) {
        cca_stream_t stream = block->stream_uses[i];
        cca_pending_event_t *pe = malloc(sizeof(*pe));
        cca_event_t event = NULL;
        cca_status_t st = pe ? event_get(dev, &event)
                             : cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a stream event");
        if (st == CCA_OK) {
            st = be->event_record(be->ctx, dev->index, event, stream);
            if (st != CCA_OK)
                event_put(dev, event);
        }
        if (st != CCA_OK) {
            free(pe);
            cca_status_t sync = be->stream_synchronize(be->ctx, dev->index, stream);
            if (sync != CCA_OK && result == CCA_OK)
                result = sync;
            continue;
        }
        pe->event = event;
        pe->block = block;
        pe->stream = stream;
        pe->next = NULL;
        block->event_count++;
        pthread_mutex_lock(&dev->events_lock);
        if (dev->events_tail)
            dev->events_tail->next = pe;
        else
            dev->events_head = pe;
        dev->events_tail = pe;
        atomic_fetch_add_explicit(&dev->pending_event_count, 1, memory_order_release);
        pthread_mutex_unlock(&dev->events_lock);
    }
    block->stream_use_count = 0;
    return result;
}

/* A block's event completed: give the block back once its last one did. */
static void event_done(cca_device_t *dev, cca_block_t *block, cca_stream_pool_t *held)
{
    cca_stream_pool_t *sp = block->pool->owner;
    if (sp != held)
        cca_spin_lock(&sp->lock);
    if (--block->event_count == 0)
        free_block(dev, block, false);
    if (sp != held)
        cca_spin_unlock(&sp->lock);
}

/*
 * Reclaim blocks whose events completed: per stream, in recording order, up
 * to the first event not yet complete (PyTorch's process_events). Called
 * with no stream pool lock held.
 */
static cca_status_t process_events(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    cca_pending_event_t *done = NULL, **done_tail = &done;
    cca_stream_t blocked[16];
    size_t nblocked = 0;
    bool overflow = false;
    pthread_mutex_lock(&dev->events_lock);
    cca_pending_event_t **link = &dev->events_head, *last = NULL;
    while (*link) {
        cca_pending_event_t *pe = *link;
        bool skip = overflow;
        for (size_t i = 0; i < nblocked && !skip; i++)
            skip = blocked[i] == pe->stream;
        cca_status_t st = skip ? CCA_ERR_NOT_READY : be->event_query(be->ctx, dev->index, pe->event);
        if (st != CCA_OK) {
            if (st != CCA_ERR_NOT_READY && result == CCA_OK)
                result = st;
            if (!skip) {
                if (nblocked < 16)
                    blocked[nblocked++] = pe->stream;
                else
                    overflow = true;
            }
            last = pe;
            link = &pe->next;
            continue;
        }
        *link = pe->next;
        atomic_fetch_sub_explicit(&dev->pending_event_count, 1, memory_order_relaxed);
        event_put_locked(dev, pe->event);
        pe->next = NULL;
        *done_tail = pe;
        done_tail = &pe->next;
    }
    dev->events_tail = last;
    pthread_mutex_unlock(&dev->events_lock);
    while (done) {
        cca_pending_event_t *pe = done;
        done = pe->next;
        event_done(dev, pe->block, NULL);
        free(pe);
    }
    return result;
}

/*
 * Wait for every pending event and reclaim the blocks (PyTorch's
 * synchronize_and_free_events). held: the stream pool lock the caller holds.
 */
static cca_status_t synchronize_and_free_events(cca_device_t *dev, cca_stream_pool_t *held)
{
    cca_backend_t *be = cca_state->backend;
    stats_lock(dev);
    dev->stats.num_sync_all_streams++;
    stats_unlock(dev);
    pthread_mutex_lock(&dev->events_lock);
    cca_pending_event_t *list = dev->events_head;
    dev->events_head = dev->events_tail = NULL;
    pthread_mutex_unlock(&dev->events_lock);
    cca_status_t result = CCA_OK;
    while (list) {
        cca_pending_event_t *pe = list;
        cca_status_t st = be->event_synchronize(be->ctx, dev->index, pe->event);
        if (st != CCA_OK) {
            /* put the rest back in front, in order */
            pthread_mutex_lock(&dev->events_lock);
            cca_pending_event_t *tail = list;
            while (tail->next)
                tail = tail->next;
            tail->next = dev->events_head;
            if (!dev->events_head)
                dev->events_tail = tail;
            dev->events_head = list;
            pthread_mutex_unlock(&dev->events_lock);
            result = st;
            break;
        }
        list = pe->next;
        atomic_fetch_sub_explicit(&dev->pending_event_count, 1, memory_order_relaxed);
        event_put(dev, pe->event);
        event_done(dev, pe->block, held);
        free(pe);
    }
    return result;
}

/* ---- segments --------------------------------------------------------------- */

/* Release one unsplit free block's segment to the backend (device + pool locks held). */
static cca_status_t release_block(cca_device_t *dev, cca_block_t *block)
{
    cca_backend_t *be = cca_state->backend;
    cca_segment_t *seg = block->segment;
    cca_status_t st = be->free(be->ctx, dev->index, (void *)block->addr);
    if (st != CCA_OK)
        return st;
    trace_record(dev->index, CCA_TRACE_SEGMENT_FREE, block->addr, block->size,
                 block->pool->owner->stream);
    dev->total_allocated_memory -= block->size;
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
    block_delete(block);
    return CCA_OK;
}

/* Release every unsplit free block of a pool (device lock held, pool lock taken). */
static cca_status_t release_pool_blocks(cca_device_t *dev, cca_pool_t *pool, cca_stream_pool_t *held)
{
    cca_status_t result = CCA_OK;
    if (pool->owner != held)
        cca_spin_lock(&pool->owner->lock);
    cca_block_t *b = bins_best_fit(&pool->bins, 0);
    while (b) {
        cca_block_t *next = bins_next(&pool->bins, b);
        if (!block_is_split(b)) {
            cca_status_t st = release_block(dev, b);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
        b = next;
    }
    if (pool->owner != held)
        cca_spin_unlock(&pool->owner->lock);
    return result;
}

/* PyTorch's release_cached_blocks: sync events, release every unsplit cached block. */
static cca_status_t release_cached_blocks_locked(cca_device_t *dev, cca_stream_pool_t *held)
{
    cca_status_t st = synchronize_and_free_events(dev, held);
    if (st != CCA_OK)
        return st;
    size_t n;
    cca_stream_pool_t **pools = pools_sorted_locked(dev, &n);
    if (!pools)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory releasing cached blocks");
    cca_status_t result = CCA_OK;
    for (int kind = 0; kind < 2; kind++)
        for (size_t i = 0; i < n; i++) {
            st = release_pool_blocks(dev, kind == 0 ? &pools[i]->large : &pools[i]->small, held);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
    free(pools);
    return result;
}

/*
 * Release oversize cached blocks of the request's pool, enough to cover the
 * request (PyTorch's release_available_cached_blocks). Device and pool locks
 * held. True if something suitable was released.
 */
static bool release_available_cached_blocks(cca_device_t *dev, cca_pool_t *pool, size_t size)
{
    const cca_settings_t *s = &cca_state->settings;
    if (s->max_split_size == SIZE_MAX)
        return false;
    size_t key = size < s->max_split_size ? s->max_split_size : size;
    cca_block_t *b = bins_best_fit(&pool->bins, key);
    if (!b) {
        size_t released = 0;
        b = bins_largest(&pool->bins);
        while (b && released < key && b->size >= s->max_split_size) {
            cca_block_t *prev = bins_prev(&pool->bins, b);
            size_t bsize = b->size;
            if (!block_is_split(b)) {
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
static void garbage_collect_cached_blocks(cca_device_t *dev, cca_stream_pool_t *held)
{
    const cca_settings_t *s = &cca_state->settings;
    size_t threshold = (size_t)(s->garbage_collection_threshold * (double)dev->allowed_memory_maximum);
    if (dev->total_allocated_memory <= threshold)
        return;
    size_t target = dev->total_allocated_memory - threshold;
    size_t reclaimed = 0;
    int64_t calls = atomic_load_explicit(&dev->gc_calls_large, memory_order_relaxed);
    size_t n;
    cca_stream_pool_t **pools = pools_sorted_locked(dev, &n);
    if (!pools)
        return;
    for (size_t i = 0; i < n; i++)
        if (pools[i] != held)
            cca_spin_lock(&pools[i]->lock);
    size_t total_age = 0;
    int64_t freeable = 0;
    for (size_t i = 0; i < n; i++)
        for (cca_block_t *b = bins_best_fit(&pools[i]->large.bins, 0); b;
             b = bins_next(&pools[i]->large.bins, b))
            if (!block_is_split(b)) {
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
                if (!block_is_split(b) && (double)age >= age_threshold) {
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
        if (pools[i] != held)
            cca_spin_unlock(&pools[i]->lock);
    free(pools);
}

/*
 * Ask the backend for a new segment for the request (device and pool locks
 * held). Returns CCA_OK with *out set, CCA_ERR_OUT_OF_MEMORY (nothing
 * changed: the fraction cap or the device is full), or another backend error.
 */
static cca_status_t alloc_block(cca_device_t *dev, cca_pool_t *pool, size_t alloc_size,
                                bool is_retry, cca_block_t **out)
{
    cca_backend_t *be = cca_state->backend;
    if (is_retry) {
        stats_lock(dev);
        dev->stats.num_alloc_retries++;
        stats_unlock(dev);
    }
    if (dev->set_fraction && dev->total_allocated_memory + alloc_size > dev->allowed_memory_maximum)
        return CCA_ERR_OUT_OF_MEMORY;
    cca_segment_t *seg = calloc(1, sizeof(*seg));
    cca_block_t *block = seg ? block_new(pool, seg, 0, alloc_size) : NULL;
    if (!block) {
        free(seg);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    void *ptr = NULL;
    cca_status_t st = be->malloc(be->ctx, dev->index, alloc_size, &ptr);
    if (st != CCA_OK) {
        block_delete(block);
        free(seg);
        return st;
    }
    block->addr = (uintptr_t)ptr;
    seg->head = block;
    seg->base = (uintptr_t)ptr;
    seg->size = alloc_size;
    seg->stream = pool->owner->stream;
    seg->is_small = pool->is_small;
    seg->next_seg = dev->segments;
    if (dev->segments)
        dev->segments->prev_seg = seg;
    dev->segments = seg;
    dev->segment_count++;
    dev->total_allocated_memory += alloc_size;
    int type = pool_stat_type(pool->is_small);
    stats_lock(dev);
    stat2_inc(dev->stats.segment, type, 1);
    stat2_inc(dev->stats.reserved_bytes, type, (int64_t)alloc_size);
    seg->oversize = alloc_size >= cca_state->settings.max_split_size;
    if (seg->oversize)
        stat_increase(&dev->stats.oversize_segments, 1);
    dev->stats.num_device_alloc++;
    stats_unlock(dev);
    trace_record(dev->index, CCA_TRACE_SEGMENT_ALLOC, block->addr, alloc_size, seg->stream);
    *out = block;
    return CCA_OK;
}

/* ---- allocation ---------------------------------------------------------- */

/* PyTorch's get_free_block: best fit in the pool with the oversize rules (pool lock held). */
static cca_block_t *get_free_block(cca_device_t *dev, cca_pool_t *pool, size_t size, bool count)
{
    const cca_settings_t *s = &cca_state->settings;
    if (count && dev->set_fraction && s->garbage_collection_threshold > 0.0)
        atomic_fetch_add_explicit(pool->is_small ? &dev->gc_calls_small : &dev->gc_calls_large, 1,
                                  memory_order_relaxed);
    cca_block_t *b = bins_best_fit(&pool->bins, size);
    if (!b)
        return NULL;
    if (size < s->max_split_size && b->size >= s->max_split_size)
        return NULL;
    if (size >= s->max_split_size && b->size >= size + s->max_non_split_rounding)
        return NULL;
    bins_remove(&pool->bins, b);
    return b;
}

/*
 * Hand out a block found free or fresh from a segment: split off the rest if
 * worth it, update statistics, enter it in the pointer map (pool lock held).
 */
static cca_status_t alloc_found_block(cca_device_t *dev, cca_pool_t *pool, cca_block_t **blockp,
                                      size_t size, size_t orig_size)
{
    cca_block_t *block = *blockp;
    const cca_settings_t *s = &cca_state->settings;
    int type = pool_stat_type(pool->is_small);
    bool already_split = block_is_split(block);
    cca_block_t *remaining = NULL;
    if (should_split(s, block, size)) {
        cca_block_t *front = block_new(pool, block->segment, block->addr, size);
        if (!front) {
            bins_insert(&pool->bins, block);
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
        }
        remaining = block;
        front->prev = remaining->prev;
        if (front->prev)
            front->prev->next = front;
        front->next = remaining;
        remaining->prev = front;
        remaining->addr += size;
        remaining->size -= size;
        if (!front->prev)
            front->segment->head = front;
        block = front;
    }
    block->allocated = true;
    block->requested_size = orig_size;
    if (!ptrmap_insert(cca_state->ptrmap, block)) {
        /* undo: rejoin the split and return the block to its bin */
        block->allocated = false;
        if (remaining) {
            remaining->addr = block->addr;
            remaining->size += block->size;
            remaining->prev = block->prev;
            if (remaining->prev)
                remaining->prev->next = remaining;
            else
                remaining->segment->head = remaining;
            block_delete(block);
            block = remaining;
        }
        bins_insert(&pool->bins, block);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pointer map");
    }
    if (remaining) {
        remaining->gc_count_base = atomic_load_explicit(
            pool->is_small ? &dev->gc_calls_small : &dev->gc_calls_large, memory_order_relaxed);
        bins_insert(&pool->bins, remaining);
    }
    cca_device_stats_t *st = op_stats_begin(pool->owner);
    if (remaining) {
        if (already_split) {
            stat2_dec(st->inactive_split_bytes, type, (int64_t)block->size);
        } else {
            stat2_inc(st->inactive_split_bytes, type, (int64_t)remaining->size);
            stat2_inc(st->inactive_split, type, 1);
        }
    } else if (already_split) {
        stat2_dec(st->inactive_split_bytes, type, (int64_t)block->size);
        stat2_dec(st->inactive_split, type, 1);
    }
    stat2_inc(st->allocation, type, 1);
    stat2_inc(st->allocated_bytes, type, (int64_t)block->size);
    stat2_inc(st->active, type, 1);
    stat2_inc(st->active_bytes, type, (int64_t)block->size);
    stat2_inc(st->requested_bytes, type, (int64_t)orig_size);
    block->oversize = block->size >= s->max_split_size;
    if (block->oversize)
        stat_increase(&st->oversize_allocations, 1);
    op_stats_end(pool->owner);
    trace_record(dev->index, CCA_TRACE_ALLOC, block->addr, orig_size, pool->owner->stream);
    *blockp = block;
    return CCA_OK;
}

/* Build PyTorch's out-of-memory message and notify observers (no lock held). */
static cca_status_t raise_oom(cca_device_t *dev, size_t size, size_t alloc_size,
                              cca_stream_t stream)
{
    cca_backend_t *be = cca_state->backend;
    size_t device_free = 0, device_total = dev->total_memory;
    be->mem_get_info(be->ctx, dev->index, &device_free, &device_total);
    stats_lock(dev);
    dev->stats.num_ooms++;
    stats_unlock(dev);
    cca_device_stats_t now;
    device_stats_read(dev, &now);
    int64_t allocated = now.allocated_bytes[CCA_STAT_ALL].current;
    int64_t reserved = now.reserved_bytes[CCA_STAT_ALL].current;
    trace_record_oom(dev->index, device_free, size, stream);

    char s_alloc[32], s_total[32], s_free[32], s_allowed[32], s_used[32], s_cached[32];
    stats_format_size(alloc_size, s_alloc, sizeof(s_alloc));
    stats_format_size(device_total, s_total, sizeof(s_total));
    stats_format_size(device_free, s_free, sizeof(s_free));
    stats_format_size(dev->allowed_memory_maximum, s_allowed, sizeof(s_allowed));
    stats_format_size((size_t)allocated, s_used, sizeof(s_used));
    stats_format_size((size_t)(reserved - allocated), s_cached, sizeof(s_cached));
    char allowed_info[64] = "";
    if (dev->set_fraction)
        snprintf(allowed_info, sizeof(allowed_info), "%s allowed; ", s_allowed);
    cca_strbuf_t proc;
    sb_init(&proc);
    alloc_process_memory_info(dev->index, &proc);
    notify_oom_observers(dev->index, alloc_size,
                         dev->set_fraction ? dev->allowed_memory_maximum : device_total, device_free);
    cca_status_t st = cca_raise(
        CCA_ERR_OUT_OF_MEMORY,
        "CUDA out of memory. Tried to allocate %s. GPU %d has a total capacity of %s of which %s "
        "is free. %s%sOf the allocated memory %s is allocated by cca, and %s is reserved by cca "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "CCA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
        s_alloc, dev->index, s_total, s_free, proc.data ? proc.data : "", allowed_info, s_used,
        s_cached);
    sb_free(&proc);
    return st;
}

/* The slow path: the stream pool had no fitting block. */
static cca_status_t malloc_slow(cca_device_t *dev, cca_stream_pool_t *sp, cca_pool_t *pool,
                                size_t size, size_t orig_size, cca_block_t **out)
{
    const cca_settings_t *s = &cca_state->settings;
    cca_block_t *block = NULL;
    cca_status_t st;

    if (cca_state->free_callback_count && trigger_free_memory_callbacks()) {
        cca_spin_lock(&sp->lock);
        block = get_free_block(dev, pool, size, true);
        if (block) {
            st = alloc_found_block(dev, pool, &block, size, orig_size);
            cca_spin_unlock(&sp->lock);
            *out = block;
            return st;
        }
        cca_spin_unlock(&sp->lock);
    }

    pthread_mutex_lock(&dev->lock);
    cca_spin_lock(&sp->lock);
    /* Another thread may have freed into this pool meanwhile. */
    block = get_free_block(dev, pool, size, false);
    if (!block) {
        size_t alloc_size = alloc_segment_size(s, size);
        if (dev->set_fraction && s->garbage_collection_threshold > 0.0)
            garbage_collect_cached_blocks(dev, sp);
        st = alloc_block(dev, pool, alloc_size, false, &block);
        if (st == CCA_ERR_OUT_OF_MEMORY && release_available_cached_blocks(dev, pool, size))
            st = alloc_block(dev, pool, alloc_size, false, &block);
        if (st == CCA_ERR_OUT_OF_MEMORY) {
            cca_status_t rs = release_cached_blocks_locked(dev, sp);
            st = rs == CCA_OK ? alloc_block(dev, pool, alloc_size, true, &block) : rs;
        }
        if (st != CCA_OK) {
            cca_spin_unlock(&sp->lock);
            pthread_mutex_unlock(&dev->lock);
            if (st == CCA_ERR_OUT_OF_MEMORY)
                return raise_oom(dev, size, alloc_size, sp->stream);
            return st;
        }
    }
    st = alloc_found_block(dev, pool, &block, size, orig_size);
    if (!dev->exact_stats && st == CCA_OK) {
        /* sample the peaks; other pools' locks may only be taken under the device lock */
        cca_device_stats_t sample;
        device_stats_read_held(dev, &sample, sp);
    }
    pthread_mutex_unlock(&dev->lock);
    cca_spin_unlock(&sp->lock);
    *out = block;
    return st;
}

static cca_status_t uncached_malloc(cca_device_t *dev, size_t size, cca_stream_t stream, void **ptr);
static cca_status_t uncached_free(cca_block_t *block);

cca_status_t cca_malloc_device(void **ptr, size_t size, int device, cca_stream_t stream)
{
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_malloc: ptr is NULL");
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    cca_state_t *S = cca_state;
    if (device < 0 || device >= S->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_malloc: device %d is out of range (%d devices)",
                         device, S->device_count);
    if (size == 0) {
        *ptr = NULL;
        return CCA_OK;
    }
    if (size >= CCA_MAX_REQUEST)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                         "CUDA out of memory. Tried to allocate more than 1EB memory.");
    cca_device_t *dev = &S->devices[device];
    if (S->no_caching)
        return uncached_malloc(dev, size, stream, ptr);
    if (atomic_load_explicit(&dev->pending_event_count, memory_order_acquire)) {
        st = process_events(dev);
        if (st != CCA_OK)
            return st;
    }
    cca_stream_pool_t *sp = stream_pool_get(dev, stream);
    if (!sp)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory (or streams) creating a stream pool");
    size_t rsize = alloc_round_size(&S->settings, size);
    cca_pool_t *pool = rsize <= CCA_SMALL_SIZE ? &sp->small : &sp->large;
    bool context = trace_context_gather(CCA_RECORD_CONTEXT_STATE); /* outside the locks */
    cca_spin_lock(&sp->lock);
    cca_block_t *block = get_free_block(dev, pool, rsize, true);
    if (block) {
        st = alloc_found_block(dev, pool, &block, rsize, size);
        cca_spin_unlock(&sp->lock);
    } else {
        cca_spin_unlock(&sp->lock);
        st = malloc_slow(dev, sp, pool, rsize, size, &block);
    }
    if (context)
        trace_context_release();
    if (st == CCA_OK)
        *ptr = (void *)block->addr;
    cca_assert_expensive(alloc_is_valid());
    return st;
}

cca_status_t cca_malloc(void **ptr, size_t size, cca_stream_t stream)
{
    int device = 0;
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    cca_backend_t *be = cca_state->backend;
    st = be->get_device(be->ctx, &device);
    if (st != CCA_OK)
        return st;
    return cca_malloc_device(ptr, size, device, stream);
}

static cca_status_t invalid_pointer(const char *what, const void *ptr)
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

cca_status_t cca_free(void *ptr)
{
    if (!ptr)
        return CCA_OK;
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_free: pointer %p: cca is not initialised", ptr);
    cca_state_t *S = cca_state;
    cca_block_t *block = ptrmap_find(S->ptrmap, (uintptr_t)ptr, true);
    if (!block)
        return invalid_pointer("cca_free", ptr);
    if (!block->pool)
        return uncached_free(block);
    cca_stream_pool_t *sp = block->pool->owner;
    cca_device_t *dev = sp->device;
    int type = pool_stat_type(block->pool->is_small);
    cca_status_t st = CCA_OK;
    bool context = trace_context_gather(CCA_RECORD_CONTEXT_ALL); /* outside the locks */
    cca_spin_lock(&sp->lock);
    block->allocated = false;
    trace_record(dev->index, CCA_TRACE_FREE_REQUESTED, block->addr, block->requested_size, sp->stream);
    if (!block->stream_use_count) {
        free_block(dev, block, true);
    } else {
        cca_device_stats_t *os = op_stats_begin(sp);
        stat2_dec(os->allocation, type, 1);
        stat2_dec(os->allocated_bytes, type, (int64_t)block->size);
        if (block->oversize)
            stat_decrease(&os->oversize_allocations, 1);
        op_stats_end(sp);
        st = insert_events(dev, block);
        if (block->event_count == 0)
            free_block(dev, block, false);
    }
    cca_spin_unlock(&sp->lock);
    if (context)
        trace_context_release();
    cca_assert_expensive(alloc_is_valid());
    return st;
}

cca_status_t cca_record_stream(void *ptr, cca_stream_t stream)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_record_stream: cca is not initialised");
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_record_stream: pointer is NULL");
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block)
        return invalid_pointer("cca_record_stream", ptr);
    if (!block->pool)
        return CCA_OK; /* uncached mode: memory is freed synchronously */
    cca_stream_pool_t *sp = block->pool->owner;
    if (stream == sp->stream)
        return CCA_OK;
    cca_status_t st = CCA_OK;
    cca_spin_lock(&sp->lock);
    bool present = false;
    for (uint32_t i = 0; i < block->stream_use_count && !present; i++)
        present = block->stream_uses[i] == stream;
    if (!present) {
        if (block->stream_use_count == block->stream_use_cap) {
            uint32_t cap = block->stream_use_cap * 2;
            cca_stream_t *uses = malloc(cap * sizeof(*uses));
            if (!uses) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_record_stream");
                goto out_unlock;
            }
            memcpy(uses, block->stream_uses, block->stream_use_count * sizeof(*uses));
            if (block->stream_uses != block->stream_uses_inline)
                free(block->stream_uses);
            block->stream_uses = uses;
            block->stream_use_cap = cap;
        }
        block->stream_uses[block->stream_use_count++] = stream;
    }
out_unlock:
    cca_spin_unlock(&sp->lock);
    cca_assert_expensive(alloc_is_valid());
    return st;
}

/* ---- uncached mode --------------------------------------------------------------- */

static cca_status_t uncached_malloc(cca_device_t *dev, size_t size, cca_stream_t stream, void **ptr)
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
            return raise_oom(dev, size, size, stream);
        return st;
    }
    stats_lock(dev);
    dev->stats.num_device_alloc++;
    stats_unlock(dev);
    block->addr = (uintptr_t)p;
    block->size = size;
    block->requested_size = size;
    block->allocated = true;
    block->stream_uses = block->stream_uses_inline;
    block->device = dev->index;
    if (!ptrmap_insert(cca_state->ptrmap, block)) {
        be->free(be->ctx, dev->index, p);
        free(block);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pointer map");
    }
    *ptr = p;
    return CCA_OK;
}

static cca_status_t uncached_free(cca_block_t *block)
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

/* ---- cache control and queries ------------------------------------------------- */

/*
 * Give the device's pooled (idle) events back to the backend, so an emptied
 * cache holds no backend resource. Returns CCA_OK or the backend's error (that
 * event stays pooled).
 */
static cca_status_t destroy_pooled_events(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&dev->events_lock);
    while (dev->event_pool_count) {
        st = be->event_destroy(be->ctx, dev->index, dev->event_pool[dev->event_pool_count - 1]);
        if (st != CCA_OK)
            break;
        dev->event_pool_count--;
        dev->events_created--;
    }
    pthread_mutex_unlock(&dev->events_lock);
    return st;
}

cca_status_t cca_empty_cache(void)
{
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    cca_status_t result = CCA_OK;
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_device_t *dev = &cca_state->devices[d];
        pthread_mutex_lock(&dev->lock);
        st = release_cached_blocks_locked(dev, NULL);
        if (st == CCA_OK)
            st = destroy_pooled_events(dev);
        pthread_mutex_unlock(&dev->lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    cca_assert_expensive(alloc_is_valid());
    return result;
}

/* Apply fn to each stream pool of a device, with its lock held (device lock held). */
static void for_each_pool_locked(cca_device_t *dev, void (*fn)(cca_stream_pool_t *, void *), void *arg)
{
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        cca_spin_lock(&sp->lock);
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

cca_status_t cca_cache_info(int device, size_t *total_cached, size_t *largest_block)
{
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_cache_info: device %d is out of range", device);
    cca_device_t *dev = &cca_state->devices[device];
    cache_info_acc_t acc = {0, 0};
    pthread_mutex_lock(&dev->lock);
    for_each_pool_locked(dev, cache_info_pool, &acc);
    pthread_mutex_unlock(&dev->lock);
    if (total_cached)
        *total_cached = acc.total;
    if (largest_block)
        *largest_block = acc.largest;
    return CCA_OK;
}

cca_status_t cca_get_base_allocation(void *ptr, void **base, size_t *size)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_get_base_allocation: cca is not initialised");
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block)
        block = ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)ptr);
    if (!block)
        return invalid_pointer("cca_get_base_allocation", ptr);
    if (!block->pool) {
        if (base)
            *base = (void *)block->addr;
        if (size)
            *size = block->size;
        return CCA_OK;
    }
    cca_stream_pool_t *sp = block->pool->owner;
    cca_spin_lock(&sp->lock);
    cca_block_t *b = block;
    while (b->prev)
        b = b->prev;
    uintptr_t b0 = b->addr;
    size_t total = 0;
    for (; b; b = b->next)
        total += b->size;
    cca_spin_unlock(&sp->lock);
    if (base)
        *base = (void *)b0;
    if (size)
        *size = total;
    return CCA_OK;
}

cca_status_t cca_set_memory_fraction(double fraction, int device)
{
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_set_memory_fraction: device %d is out of range",
                         device);
    if (!(fraction >= 0.0 && fraction <= 1.0))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_set_memory_fraction: invalid fraction %g, please set within [0, 1]",
                         fraction);
    cca_device_t *dev = &cca_state->devices[device];
    pthread_mutex_lock(&dev->lock);
    dev->allowed_memory_maximum = (size_t)(fraction * (double)dev->total_memory);
    dev->set_fraction = true;
    pthread_mutex_unlock(&dev->lock);
    cca_assert_expensive(alloc_is_valid());
    return CCA_OK;
}

cca_status_t cca_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    cca_status_t st = cca_init();
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

/* ---- statistics ------------------------------------------------------------------ */

static cca_status_t device_arg(int device, cca_device_t **dev)
{
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "device %d is out of range (%d devices)", device,
                         cca_state->device_count);
    *dev = &cca_state->devices[device];
    return CCA_OK;
}

/* Add the per-operation statistics of src into dst (current, allocated, freed). */
static void stats_add_ops(cca_device_stats_t *dst, cca_device_stats_t *src)
{
    cca_stat_t *d[CCA_OP_STAT_ARRAYS], *s[CCA_OP_STAT_ARRAYS];
    stats_op_arrays(dst, d);
    stats_op_arrays(src, s);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++) {
            d[k][t].current += s[k][t].current;
            d[k][t].allocated += s[k][t].allocated;
            d[k][t].freed += s[k][t].freed;
        }
    dst->oversize_allocations.current += src->oversize_allocations.current;
    dst->oversize_allocations.allocated += src->oversize_allocations.allocated;
    dst->oversize_allocations.freed += src->oversize_allocations.freed;
}

/*
 * The device's statistics: in exact mode a copy; otherwise the device's own
 * (segments, counters, sampled peaks) with the per-operation values summed
 * over the stream pools, the peaks first raised to those sums. held: a stream
 * pool lock the caller holds (that pool is read without locking it again).
 */
static void device_stats_read_held(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held)
{
    if (dev->exact_stats) {
        stats_lock(dev);
        *out = dev->stats;
        stats_unlock(dev);
        return;
    }
    cca_device_stats_t sum;
    memset(&sum, 0, sizeof(sum));
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        if (sp != held)
            cca_spin_lock(&sp->lock);
        stats_add_ops(&sum, &sp->stats);
        if (sp != held)
            cca_spin_unlock(&sp->lock);
    }
    cca_stat_t *d[CCA_OP_STAT_ARRAYS], *s[CCA_OP_STAT_ARRAYS];
    stats_lock(dev);
    stats_op_arrays(&dev->stats, d);
    stats_op_arrays(&sum, s);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++)
            if (s[k][t].current > d[k][t].peak)
                d[k][t].peak = s[k][t].current;
    if (sum.oversize_allocations.current > dev->stats.oversize_allocations.peak)
        dev->stats.oversize_allocations.peak = sum.oversize_allocations.current;
    *out = dev->stats;
    stats_unlock(dev);
    stats_op_arrays(out, d);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++) {
            d[k][t].current = s[k][t].current;
            d[k][t].allocated = s[k][t].allocated;
            d[k][t].freed = s[k][t].freed;
        }
    out->oversize_allocations.current = sum.oversize_allocations.current;
    out->oversize_allocations.allocated = sum.oversize_allocations.allocated;
    out->oversize_allocations.freed = sum.oversize_allocations.freed;
}

static void device_stats_read(cca_device_t *dev, cca_device_stats_t *out)
{
    device_stats_read_held(dev, out, NULL);
}

cca_status_t cca_get_device_stats(int device, cca_device_stats_t *stats)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    if (!stats)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_device_stats: stats is NULL");
    device_stats_read(dev, stats);
    size_t mss = cca_state->settings.max_split_size;
    stats->max_split_size = mss == SIZE_MAX ? -1 : (int64_t)mss;
    return CCA_OK;
}

static void reset_accumulated(cca_stat_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        s[i].allocated = s[i].freed = 0;
}

static void reset_peak(cca_stat_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        s[i].peak = s[i].current;
}

/* Visit every cca_stat_t of the struct (they are laid out first, contiguously). */
#define STATS_ARRAY_COUNT (9 * CCA_STAT_TYPES)

cca_status_t cca_reset_accumulated_stats(int device)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    pthread_mutex_lock(&dev->lock);
    for (size_t i = 0; i < dev->pool_table_cap && !dev->exact_stats; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        cca_spin_lock(&sp->lock);
        reset_accumulated(&sp->stats.allocation[0], STATS_ARRAY_COUNT);
        reset_accumulated(&sp->stats.oversize_allocations, 1);
        cca_spin_unlock(&sp->lock);
    }
    stats_lock(dev);
    cca_device_stats_t *s = &dev->stats;
    reset_accumulated(&s->allocation[0], STATS_ARRAY_COUNT);
    reset_accumulated(&s->oversize_allocations, 1);
    reset_accumulated(&s->oversize_segments, 1);
    s->num_alloc_retries = s->num_ooms = s->num_sync_all_streams = 0;
    s->num_device_alloc = s->num_device_free = 0;
    stats_unlock(dev);
    pthread_mutex_unlock(&dev->lock);
    return CCA_OK;
}

cca_status_t cca_reset_peak_stats(int device)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    cca_device_stats_t now;
    if (!dev->exact_stats)
        device_stats_read(dev, &now);
    stats_lock(dev);
    cca_device_stats_t *s = &dev->stats;
    reset_peak(&s->allocation[0], STATS_ARRAY_COUNT);
    reset_peak(&s->oversize_allocations, 1);
    reset_peak(&s->oversize_segments, 1);
    if (!dev->exact_stats) {
        /* sampled peaks restart from the current sums */
        cca_stat_t *d[CCA_OP_STAT_ARRAYS], *c[CCA_OP_STAT_ARRAYS];
        stats_op_arrays(s, d);
        stats_op_arrays(&now, c);
        for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
            for (int t = 0; t < CCA_STAT_TYPES; t++)
                d[k][t].peak = c[k][t].current;
        s->oversize_allocations.peak = now.oversize_allocations.current;
    }
    stats_unlock(dev);
    return CCA_OK;
}

cca_status_t cca_memory_stats(int device, cca_stat_entry_t *out, size_t count)
{
    cca_device_stats_t stats;
    cca_status_t st = cca_get_device_stats(device, &stats);
    if (st != CCA_OK)
        return st;
    if (!out || count < CCA_MEMORY_STATS_COUNT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memory_stats: out must hold %d entries",
                         CCA_MEMORY_STATS_COUNT);
    stats_flatten(&stats, out);
    return CCA_OK;
}

cca_status_t cca_memory_summary(int device, bool abbreviated, char **text)
{
    cca_device_stats_t stats;
    cca_status_t st = cca_get_device_stats(device, &stats);
    if (st != CCA_OK)
        return st;
    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memory_summary: text is NULL");
    cca_strbuf_t sb;
    sb_init(&sb);
    stats_format_summary(&stats, device, abbreviated, &sb);
    if (sb.failed || !sb.data) {
        sb_free(&sb);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory formatting the summary");
    }
    *text = sb.data;
    return CCA_OK;
}

/* ---- internal entry points for the rest of cca ------------------------------------ */

/* Reclaim blocks whose events completed on every device (replay, tests). */
cca_status_t alloc_process_events(void)
{
    if (!cca_is_initialized())
        return CCA_OK;
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_status_t st = process_events(&cca_state->devices[d]);
        if (st != CCA_OK)
            return st;
    }
    return CCA_OK;
}

/* Set up the per-device state (called by init). */
cca_status_t alloc_device_init(cca_device_t *dev, int index, size_t total_memory)
{
    memset(dev, 0, sizeof(*dev));
    dev->index = index;
    dev->total_memory = total_memory;
    dev->pool_table_cap = 8192;
    dev->pool_table = calloc(dev->pool_table_cap, sizeof(*dev->pool_table));
    if (!dev->pool_table)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory initialising device %d", index);
    pthread_mutex_init(&dev->lock, NULL);
    cca_spin_init(&dev->stats_lock);
    dev->exact_stats = cca_state->settings.exact_peak_stats;
    pthread_mutex_init(&dev->events_lock, NULL);
    double fraction = cca_state->settings.per_process_memory_fraction;
    if (fraction > 0.0) {
        dev->set_fraction = true;
        dev->allowed_memory_maximum = (size_t)(fraction * (double)total_memory);
    }
    atomic_fetch_add(&state_generation, 1);
    return CCA_OK;
}

static void free_uncached_block(cca_block_t *b, void *arg)
{
    cca_backend_t *be = cca_state->backend;
    (void)arg;
    if (!b->pool) {
        be->free(be->ctx, b->device, (void *)b->addr);
        free(b);
    }
}

/* Free every uncached allocation still live (shutdown; the map is destroyed next). */
void alloc_shutdown_uncached(void)
{
    ptrmap_for_each(cca_state->ptrmap, free_uncached_block, NULL);
}

/* Tear down a device: give every segment and event back to the backend. */
void alloc_device_shutdown(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    while (dev->events_head) {
        cca_pending_event_t *pe = dev->events_head;
        dev->events_head = pe->next;
        be->event_destroy(be->ctx, dev->index, pe->event);
        free(pe);
    }
    for (size_t i = 0; i < dev->event_pool_count; i++)
        be->event_destroy(be->ctx, dev->index, dev->event_pool[i]);
    free(dev->event_pool);
    cca_segment_t *seg = dev->segments;
    while (seg) {
        cca_segment_t *next = seg->next_seg;
        be->free(be->ctx, dev->index, (void *)seg->base);
        cca_block_t *b = seg->head;
        while (b) {
            cca_block_t *nb = b->next;
            if (b->stream_uses != b->stream_uses_inline)
                free(b->stream_uses);
            free(b);
            b = nb;
        }
        free(seg);
        seg = next;
    }
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load(&dev->pool_table[i]);
        if (sp) {
            while (sp->spare_blocks) {
                cca_block_t *b = sp->spare_blocks;
                sp->spare_blocks = b->bin_next;
                free(b);
            }
            free(sp);
        }
    }
    free(dev->pool_table);
    pthread_mutex_destroy(&dev->lock);
    pthread_mutex_destroy(&dev->events_lock);
    atomic_fetch_add(&state_generation, 1);
}
