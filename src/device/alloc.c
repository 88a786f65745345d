/*
 * alloc.c - the device caching allocator's entry points and hot path:
 * cca_malloc / cca_free, PyTorch's rounding, best fit in the stream's pool,
 * splitting and merging, new segments from the backend, the stream pools and
 * the per-device set-up. The record_stream events (events.c), the release /
 * garbage-collection / out-of-memory sequence (release.c), the statistics
 * entry points (stats.c) and the uncached mode (uncached.c) have files of
 * their own.
 *
 * Invariants: every byte of a segment belongs to exactly one block; a block
 * is either allocated (and in the pointer map), waiting for its events
 * (event_count > 0), or free in exactly one bin of its own stream pool; two
 * free neighbours are always merged. Statistics change only under the
 * device's stats lock (or the stream pool's, without exact_peak_stats) and
 * follow PyTorch's update rules exactly.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "state.h"
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

/* ---- block structs ---------------------------------------------------------- */

/*
 * A block struct from the stream pool's spares, or a new one (pool lock
 * held). Every field is set here, explicitly (a memset of the whole struct
 * showed up as the top cost of the split path): a new field must be too.
 */
cca_block_t *alloc_block_new(cca_pool_t *pool, cca_segment_t *seg, uintptr_t addr, size_t size)
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
void alloc_block_delete(cca_block_t *b)
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
cca_stream_pool_t **alloc_pools_sorted_locked(cca_device_t *dev, size_t *count)
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
    alloc_block_delete(src);
    return subsumed;
}

/*
 * Return a block whose program use and events are over to its pool: merge
 * with free neighbours, put it in its bin, update the statistics (stream
 * pool lock held).
 */
void alloc_free_block(cca_device_t *dev, cca_block_t *block, bool program_free)
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
    cca_block_t *block = seg ? alloc_block_new(pool, seg, 0, alloc_size) : NULL;
    if (!block) {
        free(seg);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    void *ptr = NULL;
    cca_status_t st = be->malloc(be->ctx, dev->index, alloc_size, &ptr);
    if (st != CCA_OK) {
        alloc_block_delete(block);
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
        cca_block_t *front = alloc_block_new(pool, block->segment, block->addr, size);
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
            alloc_block_delete(block);
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

/* The slow path: the stream pool had no fitting block. */
static cca_status_t malloc_slow(cca_device_t *dev, cca_stream_pool_t *sp, cca_pool_t *pool,
                                size_t size, size_t orig_size, cca_block_t **out)
{
    const cca_settings_t *s = &cca_state->settings;
    cca_block_t *block = NULL;
    cca_status_t st;

    if (cca_state->free_callback_count && release_free_memory_callbacks()) {
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
            release_garbage_collect(dev, sp);
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
                return release_raise_oom(dev, size, alloc_size, sp->stream);
            return st;
        }
    }
    st = alloc_found_block(dev, pool, &block, size, orig_size);
    if (!dev->exact_stats && st == CCA_OK) {
        /* sample the peaks; other pools' locks may only be taken under the device lock */
        cca_device_stats_t sample;
        stats_read_held(dev, &sample, sp);
    }
    pthread_mutex_unlock(&dev->lock);
    cca_spin_unlock(&sp->lock);
    *out = block;
    return st;
}

cca_status_t cca_malloc_device(void **ptr, size_t size, int device, cca_stream_t stream)
{
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_malloc: ptr is NULL");
    cca_status_t st = state_ensure();
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
        st = events_process(dev);
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
    cca_assert_expensive(device_is_valid());
    return st;
}

cca_status_t cca_malloc(void **ptr, size_t size, cca_stream_t stream)
{
    int device = 0;
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    cca_backend_t *be = cca_state->backend;
    st = be->get_device(be->ctx, &device);
    if (st != CCA_OK)
        return st;
    return cca_malloc_device(ptr, size, device, stream);
}

cca_status_t alloc_invalid_pointer(const char *what, const void *ptr)
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
        return alloc_invalid_pointer("cca_free", ptr);
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
        alloc_free_block(dev, block, true);
    } else {
        cca_device_stats_t *os = op_stats_begin(sp);
        stat2_dec(os->allocation, type, 1);
        stat2_dec(os->allocated_bytes, type, (int64_t)block->size);
        if (block->oversize)
            stat_decrease(&os->oversize_allocations, 1);
        op_stats_end(sp);
        st = events_insert(dev, block);
        if (block->event_count == 0)
            alloc_free_block(dev, block, false);
    }
    cca_spin_unlock(&sp->lock);
    if (context)
        trace_context_release();
    cca_assert_expensive(device_is_valid());
    return st;
}

cca_status_t cca_get_base_allocation(void *ptr, void **base, size_t *size)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_get_base_allocation: cca is not initialised");
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block)
        block = ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)ptr);
    if (!block)
        return alloc_invalid_pointer("cca_get_base_allocation", ptr);
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

