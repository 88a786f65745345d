/*
 * alloc.c - the device caching allocator's entry points and hot path:
 * cca_malloc / cca_free, PyTorch's rounding, best fit in the stream's pool,
 * splitting, new segments from the backend. Blocks, stream pools and merging
 * live in pool.c; the record_stream events (events.c), the release /
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

#include "async.h"
#include "check.h"
#include "device.h"
#include "ptrmap.h"
#include "shared.h"
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
static inline size_t round_size(const cca_settings_t *s, size_t size)
{
    if (size < CCA_MIN_BLOCK_SIZE)
        return CCA_MIN_BLOCK_SIZE;
    size_t divisions = settings_roundup_divisions(s, size);
    if (divisions > 1 && size > CCA_MIN_BLOCK_SIZE * divisions)
        return roundup_power2_next_division(size, divisions);
    return CCA_MIN_BLOCK_SIZE * ((size + CCA_MIN_BLOCK_SIZE - 1) / CCA_MIN_BLOCK_SIZE);
}

size_t alloc_round_size(const cca_settings_t *s, size_t size)
{
    return round_size(s, size);
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

/* PyTorch's should_split, for a free block of total bytes of pool serving size bytes. */
static bool should_split(const cca_settings_t *s, const cca_pool_t *pool, size_t total, size_t size)
{
    const cca_private_pool_t *pp = pool->owner->private_pool;
    if (pp && pp->no_split)
        return false;
    size_t remaining = total - size;
    if (pool->is_small || s->expandable_segments)
        return remaining >= CCA_MIN_BLOCK_SIZE;
    return size < s->max_split_size && remaining > CCA_SMALL_SIZE;
}

/*
 * Ask the backend (or the private pool's own allocator) for a new segment
 * for the request of size bytes (device and pool locks held), or, with
 * expandable segments, grow the pool's expandable segment. Returns CCA_OK with *out set, CCA_ERR_OUT_OF_MEMORY
 * (the fraction cap or the device is full), or another backend error.
 */
static cca_status_t alloc_block(cca_device_t *dev, cca_pool_t *pool, size_t size,
                                size_t alloc_size, bool is_retry, cca_block_t **out)
{
    cca_backend_t *be = cca_state->backend;
    if (is_retry) {
        stats_lock(dev);
        dev->stats.num_alloc_retries++;
        stats_unlock(dev);
    }
    const cca_private_pool_t *pp = pool->owner->private_pool;
    bool own = pp && pp->user_alloc; /* PyTorch: no expandable segment for a pool with its allocator */
    bool expandable = cca_state->settings->expandable_segments && !own;
    /* compact_memory checks the fraction in the growth itself, against the granules it maps
     * (2 MiB ones, some moved from elsewhere), not against PyTorch's 20 MiB alloc_size */
    bool exact_check = expandable && cca_state->settings->compact_memory;
    if (dev->set_fraction && !exact_check &&
        dev->total_allocated_memory + alloc_size > dev->allowed_memory_maximum)
        return CCA_ERR_OUT_OF_MEMORY;
    if (expandable)
        return expandable_alloc(dev, pool, size, out);
    cca_segment_t *seg = calloc(1, sizeof(*seg));
    cca_block_t *block = seg ? pool_block_new(pool, seg, 0, alloc_size) : NULL;
    if (!block) {
        free(seg);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    void *ptr = NULL;
    cca_status_t st;
    if (own) {
        ptr = pp->user_alloc(alloc_size, dev->index, pool->owner->stream, pp->user_ctx);
        st = ptr ? CCA_OK : CCA_ERR_OUT_OF_MEMORY; /* as PyTorch: no memory from it is an OOM */
        seg->user_free = pp->user_free;
        seg->user_ctx = pp->user_ctx;
    } else {
        st = be->malloc(be->ctx, dev->index, alloc_size, &ptr);
    }
    if (st != CCA_OK) {
        pool_block_delete(block);
        free(seg);
        return st;
    }
    block->addr = (uintptr_t)ptr;
    seg->head = block;
    seg->base = (uintptr_t)ptr;
    seg->size = alloc_size;
    seg->stream = pool->owner->stream;
    seg->is_small = pool->is_small;
    seg->private_pool = pool->owner->private_pool;
    if (pool->owner->private_pool)
        pool->owner->private_pool->segment_count++;
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
    seg->oversize = alloc_size >= cca_state->settings->max_split_size;
    if (seg->oversize)
        stat_increase(&dev->stats.oversize_segments, 1);
    dev->stats.num_device_alloc++;
    stats_unlock(dev);
    trace_record_pool(dev->index, CCA_TRACE_SEGMENT_ALLOC, block->addr, alloc_size, seg->stream,
                      pools_id_of(pool->owner));
    *out = block;
    return CCA_OK;
}

/* ---- allocation ---------------------------------------------------------- */

/* PyTorch's get_free_block: best fit in the pool with the oversize rules (pool lock held). */
static inline __attribute__((always_inline)) cca_block_t *get_free_block(cca_device_t *dev, cca_pool_t *pool,
                                                                        size_t size, bool count)
{
    const cca_settings_t *s = cca_state->settings;
    if (count && dev->set_fraction && s->garbage_collection_threshold > 0.0 && !pool->owner->private_pool)
        atomic_fetch_add_explicit(pool->gc_calls, 1, memory_order_relaxed);
    cca_block_t *b = bins_best_fit(&pool->bins, size);
    if (!b)
        return NULL;
    if (pool->expandable_segments && b->segment->es) {
        b = expandable_fit(pool, b);
        if (!b)
            return NULL;
    }
    if (size < s->max_split_size && b->size >= s->max_split_size)
        return NULL;
    if (size >= s->max_split_size && b->size >= size + s->max_non_split_rounding)
        return NULL;
    bins_remove(&pool->bins, b);
    return b;
}

/*
 * The request's statistics and trace: block handed out, remaining the free
 * rest split off it (or NULL), already_split whether the block it came from
 * was a piece of a split segment (pool lock held).
 */
static inline __attribute__((always_inline)) void alloc_account(cca_device_t *dev, cca_pool_t *pool,
                                                                cca_block_t *block,
                                                                const cca_block_t *remaining,
                                                                bool already_split, size_t orig_size)
{
    const cca_settings_t *s = cca_state->settings;
    int64_t d[OPS_COUNT] = {0};
    if (pool->expandable_segments && block->segment->es) {
        /* PyTorch keeps expandable blocks out of inactive_split */
    } else if (remaining) {
        if (already_split) {
            d[OPS_INACTIVE_SPLIT_BYTES] = -(int64_t)block->size;
        } else {
            d[OPS_INACTIVE_SPLIT_BYTES] = (int64_t)remaining->size;
            d[OPS_INACTIVE_SPLIT] = 1;
        }
    } else if (already_split) {
        d[OPS_INACTIVE_SPLIT_BYTES] = -(int64_t)block->size;
        d[OPS_INACTIVE_SPLIT] = -1;
    }
    d[OPS_ALLOCATION] = 1;
    d[OPS_ALLOCATED_BYTES] = (int64_t)block->size;
    d[OPS_ACTIVE] = 1;
    d[OPS_ACTIVE_BYTES] = (int64_t)block->size;
    d[OPS_REQUESTED_BYTES] = (int64_t)orig_size;
    block->oversize = block->size >= s->max_split_size;
    d[OPS_OVERSIZE] = block->oversize;
    static const int8_t sign[OPS_COUNT] = {1, 1, 1, 1, 1, 0, 0, 0};
    ops_apply(pool, d, sign);
    pool->last_alloc = block;
    atomic_store_explicit(&pool->owner->last_addr, block->addr, memory_order_relaxed);
    trace_record_pool(dev->index, CCA_TRACE_ALLOC, block->addr, orig_size, pool->owner->stream,
                      pools_id_of(pool->owner));
}

/* Granules of g bytes (counted from base) that [addr, addr + size) touches. */
static inline size_t granules_touched(uintptr_t base, size_t g, uintptr_t addr, size_t size)
{
    return (addr + size - base + g - 1) / g - (addr - base) / g;
}

/*
 * compact_memory: where a block of size bytes at the start of the free
 * block b (out of its bin) would take one granule more than it needs, it
 * starts at b's next granule instead, so that it does not keep a granule
 * mapped for a sliver of itself once its neighbours are gone (the gradients
 * a model keeps after training, placed among the activations: GPT-2's held
 * 44 MiB of such rests). Only where that costs little: the bytes skipped
 * are at most a quarter granule and b is at least twice what the block and
 * they take, so the rest of b stays whole for what comes next (without
 * those bounds the shifts cost other programs more than they saved:
 * BENCHMARKS, "Nineteenth round"). The skipped bytes are split off as a
 * free block of their own (binned) and returned, their next being the rest
 * of b (out of its bin); NULL: b as it is (also when no block struct can be
 * had: the shift is an optimisation only). Default pools only.
 */
static __attribute__((noinline)) cca_block_t *compact_pad(cca_pool_t *pool, cca_block_t *b, size_t size)
{
    const cca_segment_t *seg = b->segment;
    if (!seg->es || !seg->es->compact)
        return NULL;
    size_t g = seg->es->granule;
    size_t pad = (g - (b->addr - seg->base) % g) % g;
    if (pool->owner->private_pool || !pad || pad > g / 4 || 2 * (pad + size) > b->size ||
        granules_touched(seg->base, g, b->addr + pad, size) >= granules_touched(seg->base, g, b->addr, size))
        return NULL;
    cca_block_t *front = pool_block_new(pool, b->segment, b->addr, pad);
    if (front)
        pool_split_front(pool, front, b);
    return front;
}

/* Undo compact_pad: the free block pad (binned) and its next (out of its bin) one block again,
 * returned out of its bin. */
static __attribute__((noinline)) cca_block_t *compact_unpad(cca_pool_t *pool, cca_block_t *pad)
{
    return pool_join_front(pool, pad);
}

/*
 * Hand out a block found free or fresh from a segment: split off the rest if
 * split says so (-1: if worth it), update statistics, enter it in the pointer
 * map (pool lock held).
 */
static inline __attribute__((always_inline)) cca_status_t
alloc_found_block_inline(cca_device_t *dev, cca_pool_t *pool, cca_block_t **blockp, size_t size,
                         size_t orig_size, int split, bool may_pad)
{
    cca_block_t *block = *blockp;
    const cca_settings_t *s = cca_state->settings;
    bool already_split = block_is_split(block);
    cca_block_t *remaining = NULL, *pad = NULL;
    bool head_split = false; /* the segment's flag before a split at its head (for the undo) */
    if (split < 0 ? should_split(s, pool, block->size, size) : split > 0) {
        if (may_pad && s->compact_memory && split < 0 && (pad = compact_pad(pool, block, size)))
            block = pad->next; /* (it leaves the rest of block worth splitting) */
        cca_block_t *before = block->prev; /* (read first: the stores below cannot change it) */
        cca_block_t *front = pool_block_new(pool, block->segment, block->addr, size);
        if (!front && pad) {
            /* the shift took the struct the split needed (the pool's last spare): the block
             * stays where it was, as without the shift, and the split gets that struct back */
            block = compact_unpad(pool, pad);
            pad = NULL;
            before = block->prev;
            front = pool_block_new(pool, block->segment, block->addr, size);
        }
        if (!front) {
            bins_insert(&pool->bins, block);
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
        }
        remaining = block;
        front->prev = before;
        if (before) {
            before->next = front;
        } else {
            front->segment->head = front;
            head_split = front->segment->head_split;
            front->segment->head_split = true;
        }
        front->next = remaining;
        remaining->prev = front;
        remaining->addr += size;
        remaining->size -= size;
        block = front;
    }
    block->allocated = true;
    block->requested_size = orig_size;
    if (!ptrmap_insert_fast(cca_state->ptrmap, block, &pool->owner->lock)) {
        /* undo: rejoin the split and return the block to its bin */
        block->allocated = false;
        if (remaining) {
            if (!block->prev)
                remaining->segment->head_split = head_split;
            pool_absorb_neighbour(remaining, block);
            pool_block_delete(block);
            block = remaining;
        }
        bins_insert(&pool->bins, pad ? compact_unpad(pool, pad) : block);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pointer map");
    }
    if (remaining) {
        remaining->gc_count_base = atomic_load_explicit(pool->gc_calls, memory_order_relaxed);
        bins_insert(&pool->bins, remaining);
    }
    alloc_account(dev, pool, block, remaining, already_split, orig_size);
    *blockp = block;
    return CCA_OK;
}

/* alloc_found_block_inline for the other paths than the allocation's best fit (out of line). */
static __attribute__((noinline)) cca_status_t alloc_found_block(cca_device_t *dev, cca_pool_t *pool,
                                                                cca_block_t **blockp, size_t size,
                                                                size_t orig_size, int split)
{
    return alloc_found_block_inline(dev, pool, blockp, size, orig_size, split, true);
}

/*
 * The pool's held-back block (pool_free_block), if a request of size bytes
 * would get it as it is: best fit over the pool as PyTorch has it (the held
 * block merged with its free upper neighbour) picks the merged block, whose
 * split gives back the held block and that neighbour. NULL otherwise (pool
 * lock held; nothing changed).
 */
static cca_block_t *held_fit(cca_pool_t *pool, size_t size)
{
    const cca_settings_t *s = cca_state->settings;
    cca_block_t *h = pool->held;
    if (h->size != size)
        return NULL;
    /* the same answer while the bins are as they were (a settings change merges h first) */
    if (pool->fit_block == h && pool->fit_size == size && pool->fit_version == pool->bins.version)
        return h;
    const cca_block_t *up = h->next;
    size_t merged = h->size + up->size;
    if (merged >= s->max_split_size || !should_split(s, pool, merged, size))
        return NULL;
    /* the merged block sorts after up: best fit picks it unless a block ordered
     * between (size, address) of the request and the merged block fits */
    const cca_block_t *c = bins_best_fit(&pool->bins, size);
    if (c == up)
        c = bins_next(&pool->bins, up);
    if (c && (c->size < merged || (c->size == merged && c->addr < h->addr)))
        return NULL;
    if (h->segment->es && pool->expandable_segments) {
        /* expandable best fit (expandable_fit): with the mode off it skips the block; with it
         * on it moves past the merged block to the next one if that could grow less */
        if (!s->expandable_segments)
            return NULL;
        if (c && block_expandable_size(c) < h->size + block_expandable_size(up))
            return NULL;
    }
    pool->fit_block = h;
    pool->fit_size = size;
    pool->fit_version = pool->bins.version;
    return h;
}

/* Hand out the held block found by held_fit (pool lock held). */
static cca_status_t alloc_held_block(cca_device_t *dev, cca_pool_t *pool, cca_block_t *block,
                                     size_t orig_size)
{
    const cca_settings_t *s = cca_state->settings;
    if (dev->set_fraction && s->garbage_collection_threshold > 0.0) /* get_free_block's count */
        atomic_fetch_add_explicit(pool->gc_calls, 1, memory_order_relaxed);
    if (pool->held_in_map) /* solo mode left it there */
        pool->held_in_map = false;
    else if (!ptrmap_insert_fast(cca_state->ptrmap, block, &pool->owner->lock)) /* still held */
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pointer map");
    block->allocated = true;
    size_t old_req = block->requested_size;
    block->requested_size = orig_size;
    pool->held = NULL;
    cca_block_t *up = block->next;
    up->gc_count_base = atomic_load_explicit(pool->gc_calls, memory_order_relaxed);
    bool split = block->prev || up->next;
    pool->again_block = NULL;
    if (pool->held_stats) {
        pool->again_block = block; /* the record below is this block's (pool_again_ready) */
        /* its free's statistics and these in one update (the same size, the same oversize:
         * a change of max_split_size merges it first) */
        pool->held_stats = false;
        cca_stream_pool_t *sp = pool->owner;
        if (sp->again_pool == pool && old_req == orig_size && pool->again_req == orig_size &&
            pool->again_size == block->size && pool->again_up == up->size &&
            pool->again_split == split) {
            /* the last update again: values and peaks as they are, the counts later */
            pool->again_n++;
            sp->rehold = block;
        } else {
            sp->rehold = NULL;
            ops_apply_again(sp, pool_stat_type(pool->is_small), (int64_t)block->size,
                            (int64_t)up->size, split, block->oversize, (int64_t)old_req,
                            (int64_t)orig_size);
            if (pool->again_n) /* another block's or another size's repeats, counted first */
                pool_flush_agains(pool);
            sp->again_pool = old_req == orig_size ? pool : NULL;
            pool->again_size = block->size;
            pool->again_up = up->size;
            pool->again_req = orig_size;
            pool->again_split = split;
        }
        trace_record_pool(dev->index, CCA_TRACE_ALLOC, block->addr, orig_size, pool->owner->stream,
                          pools_id_of(pool->owner));
    } else {
        alloc_account(dev, pool, block, up, split, orig_size);
    }
    return CCA_OK;
}

/*
 * Complete the frees deferred for other processes whose references are gone
 * (PyTorch's "cuda_ipc_collect" free-memory callback, run first). True if a
 * block was freed. No lock held.
 */
static bool collect_shared_blocks(void)
{
    uintptr_t ready[64];
    bool freed = false;
    size_t n;
    do {
        n = shared_take_collectable(ready, 64);
        for (size_t i = 0; i < n; i++)
            freed |= cca_free((void *)ready[i]) == CCA_OK;
    } while (n == 64);
    return freed;
}

cca_status_t cca_ipc_collect(size_t *pending)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    uintptr_t ready[64];
    cca_status_t result = CCA_OK;
    size_t n;
    do {
        n = shared_take_collectable(ready, 64);
        for (size_t i = 0; i < n; i++) {
            st = cca_free((void *)ready[i]);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
    } while (n == 64);
    if (pending)
        *pending = shared_pending();
    return result;
}

/* Hand out *blockp with a given split decision (checkpoint restore; pool lock held). */
cca_status_t alloc_take_block(cca_device_t *dev, cca_pool_t *pool, cca_block_t **blockp, size_t size,
                              size_t orig_size, int split)
{
    return alloc_found_block(dev, pool, blockp, size, orig_size, split);
}

/*
 * use_on_oom: an allocation of the default pools (sp, the request's kind)
 * that found no memory, even after the release of cached blocks, may take a
 * free block of a pool marked use_on_oom, as PyTorch's try_mempool_fallback
 * (device lock and sp's lock held). Returns the block (out of its bin, in
 * *pool_out's pool) or NULL.
 */
static cca_block_t *oom_fallback(cca_device_t *dev, cca_stream_pool_t *sp, bool is_small, size_t size,
                                cca_pool_t **pool_out)
{
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next) {
        if (!pp->use_on_oom || pp->use_count == 0)
            continue;
        cca_stream_pool_t *psp = pools_find_stream_pool(pp, sp->stream);
        if (!psp)
            continue;
        cca_pool_t *pool = is_small ? &psp->small : &psp->large;
        pool_lock(psp);
        cca_block_t *b = get_free_block(dev, pool, size, false);
        cca_spin_unlock(&psp->lock);
        if (b) {
            *pool_out = pool;
            return b;
        }
    }
    return NULL;
}

/*
 * compact_memory: a small request the small pool cannot serve without
 * growing takes a free piece of the same stream's large pool that holds no
 * whole granule (the rest of a granule a live large block keeps mapped),
 * which no growth could take either: the smallest such piece that fits.
 * Returns it out of its bin, or NULL (sp's lock held; device lock held).
 */
static cca_block_t *residue_fit(const cca_device_t *dev, cca_stream_pool_t *sp, const cca_pool_t *pool,
                                size_t size)
{
    if (!pool->is_small || !cca_state->settings->compact_memory || sp->private_pool ||
        atomic_load_explicit(&dev->route_count, memory_order_relaxed))
        return NULL;
    cca_pool_t *large = &sp->large;
    size_t max_split = cca_state->settings->max_split_size;
    for (cca_block_t *b = bins_best_fit(&large->bins, size); b; b = bins_next(&large->bins, b)) {
        /* get_free_block's oversize rule: a small request never splits such a piece (a granule
         * larger than 2 MiB leaves rests that big), kept whole for a request of its size */
        if (b->size >= max_split)
            return NULL; /* (in size order: so is every piece from here on) */
        const cca_segment_t *seg = b->segment;
        if (!seg->es || !seg->es->compact)
            continue;
        size_t g = seg->es->granule;
        if (b->size >= 2 * g)
            return NULL; /* every piece from here on holds a whole granule */
        uintptr_t plan_lo, plan_hi;
        if (plan_range(large, seg, &plan_lo, &plan_hi) && b->addr < plan_hi && b->addr + b->size > plan_lo)
            continue; /* a planned place (plan.c) */
        uintptr_t first = seg->base + (b->addr - seg->base + g - 1) / g * g;
        if (first + g > b->addr + b->size) {
            bins_remove(&large->bins, b);
            return b;
        }
    }
    return NULL;
}

/* The slow path: the stream pool had no fitting block. */
static cca_status_t malloc_slow(cca_device_t *dev, cca_stream_pool_t *sp, cca_pool_t *pool,
                                size_t size, size_t orig_size, cca_block_t **out)
{
    const cca_settings_t *s = cca_state->settings;
    cca_block_t *block = NULL;
    cca_status_t st;

    bool freed = atomic_load_explicit(&shared_block_count, memory_order_relaxed) &&
                 collect_shared_blocks();
    if (cca_state->free_callback_count)
        freed |= release_free_memory_callbacks();
    if (freed) {
        pool_lock(sp);
        block = get_free_block(dev, pool, size, true);
        if (block) {
            st = alloc_found_block(dev, pool, &block, size, orig_size, -1);
            cca_spin_unlock(&sp->lock);
            *out = block;
            return st;
        }
        cca_spin_unlock(&sp->lock);
    }

    pthread_mutex_lock(&dev->lock);
    pool_lock(sp);
    /* Another thread may have freed into this pool meanwhile. */
    block = get_free_block(dev, pool, size, false);
    if (!block && (block = residue_fit(dev, sp, pool, size))) {
        pool = &sp->large;
    } else if (!block) {
        size_t alloc_size = alloc_segment_size(s, size);
        if (dev->set_fraction && s->garbage_collection_threshold > 0.0)
            release_garbage_collect(dev, sp);
        st = alloc_block(dev, pool, size, alloc_size, false, &block);
        if (st == CCA_ERR_OUT_OF_MEMORY && release_available_cached_blocks(dev, pool, size))
            st = alloc_block(dev, pool, size, alloc_size, false, &block);
        /* no release of every cached block while a route (a capture) is active */
        if (st == CCA_ERR_OUT_OF_MEMORY && !atomic_load_explicit(&dev->route_count, memory_order_relaxed)) {
            cca_status_t rs = release_cached_blocks_locked(dev, sp);
            st = rs == CCA_OK ? alloc_block(dev, pool, size, alloc_size, true, &block) : rs;
        }
        /* memory of pools marked use_on_oom, the last resort once the releases above did not
         * make room (PyTorch's try_mempool_fallback, after its release of cached blocks) */
        if (st == CCA_ERR_OUT_OF_MEMORY && !sp->private_pool && dev->private_pools) {
            cca_pool_t *fallback = NULL;
            block = oom_fallback(dev, sp, pool->is_small, size, &fallback);
            if (block) {
                cca_stream_pool_t *fsp = fallback->owner;
                pool_lock(fsp);
                st = alloc_found_block(dev, fallback, &block, size, orig_size, -1);
                cca_spin_unlock(&fsp->lock);
                cca_spin_unlock(&sp->lock);
                pthread_mutex_unlock(&dev->lock);
                *out = block;
                return st;
            }
        }
        if (st != CCA_OK) {
            cca_spin_unlock(&sp->lock);
            pthread_mutex_unlock(&dev->lock);
            if (st == CCA_ERR_OUT_OF_MEMORY)
                return release_raise_oom(dev, size, alloc_size, sp->stream);
            return st;
        }
    }
    st = alloc_found_block(dev, pool, &block, size, orig_size, -1);
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

/*
 * Before an allocation while routes to private pools are active or frees
 * are set aside: with no route, complete the set-aside frees and reclaim
 * finished events (PyTorch's process_events); with routes (a capture), query
 * no event and find where the allocation goes. *out: a private pool's
 * stream pool (pinned), or NULL for the default one.
 */
static cca_status_t malloc_prepare_routed(cca_device_t *dev, cca_stream_t stream,
                                          cca_stream_pool_t **out)
{
    cca_status_t st;
    *out = NULL;
    pthread_mutex_lock(&dev->lock);
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed)) {
        /* graph_capture_record_stream_reuse: blocks the capture has passed are free again */
        st = events_free_safe_in_capture(dev, stream);
        if (st == CCA_OK)
            st = pools_route_locked(dev, stream, out);
        pthread_mutex_unlock(&dev->lock);
        return st;
    }
    if (dev->reuse_count)
        events_reuse_reset_locked(dev);
    st = events_insert_deferred_locked(dev, NULL);
    pthread_mutex_unlock(&dev->lock);
    if (st == CCA_OK && atomic_load_explicit(&dev->pending_event_count, memory_order_acquire))
        st = events_process(dev);
    return st;
}

/* The end of an allocation from sp, its lock released: a private pool's sp unpinned, the
 * trace context released, the block handed out. */
static inline __attribute__((always_inline)) cca_status_t malloc_done(cca_stream_pool_t *sp, bool context,
                                                                      cca_status_t st,
                                                                      const cca_block_t *block, void **ptr)
{
    if (sp->private_pool)
        pools_unpin(sp);
    if (context)
        trace_context_release();
    if (st == CCA_OK)
        *ptr = (void *)block->addr;
    cca_assert_expensive(device_is_valid());
    return st;
}

/*
 * malloc_locked under compact_memory: a large request of a default pool is
 * first offered to its pool's plan (plan.c), then goes by best fit or the
 * slow path; either way it is recorded for the plan, and the pool holds no
 * block back (every request of it passes here). sp's lock held on entry,
 * released.
 */
static __attribute__((noinline)) cca_status_t malloc_compact(cca_device_t *dev, cca_stream_pool_t *sp,
                                                             cca_pool_t *pool, size_t rsize, size_t size,
                                                             cca_block_t **out)
{
    bool recorded = !pool->is_small && !sp->private_pool &&
                   !atomic_load_explicit(&dev->route_count, memory_order_relaxed);
    cca_block_t *block = NULL;
    cca_status_t st = recorded ? plan_place(dev, pool, rsize, size, &block) : CCA_OK;
    if (!block && st == CCA_OK) {
        block = get_free_block(dev, pool, rsize, true);
        if (block) {
            st = alloc_found_block(dev, pool, &block, rsize, size, -1);
        } else {
            cca_spin_unlock(&sp->lock);
            st = malloc_slow(dev, sp, pool, rsize, size, &block);
            if (st == CCA_OK && recorded && block->pool == pool)
                pool_lock(sp); /* to record it */
            else
                recorded = false;
            if (!recorded) {
                *out = block;
                return st;
            }
        }
    }
    if (st == CCA_OK && recorded) {
        plan_note_alloc(dev, pool, block, rsize);
        pool->last_alloc = NULL; /* never held back: its next request must pass here */
    }
    cca_spin_unlock(&sp->lock);
    *out = block;
    return st;
}

/*
 * The rest of an allocation from sp past its held-back block: best fit in
 * the pool (held blocks merged first), else the slow path; sp's lock held on
 * entry (entered: how, cca_spin_enter), released; unpins a private pool's
 * sp, releases the trace context.
 * Inline in malloc_general, which is out of line: the express path stays short.
 */
static inline __attribute__((always_inline)) cca_status_t malloc_locked(cca_device_t *dev,
                                                                       cca_stream_pool_t *sp,
                                                                       int entered, cca_pool_t *pool,
                                                                       size_t rsize, size_t size,
                                                                       bool context, void **ptr)
{
    cca_status_t st;
    if (sp->small.held || sp->large.held)
        pool_flush(sp);
    cca_block_t *block;
    /* compact_memory's placement out of line: the common case's split stays as short */
    if (__builtin_expect(cca_state->settings->compact_memory, 0)) {
        st = malloc_compact(dev, sp, pool, rsize, size, &block);
        return malloc_done(sp, context, st, block, ptr);
    }
    block = get_free_block(dev, pool, rsize, true);
    if (block) {
        st = alloc_found_block_inline(dev, pool, &block, rsize, size, -1, false);
        cca_spin_leave(&sp->lock, entered);
    } else {
        cca_spin_leave(&sp->lock, entered);
        st = malloc_slow(dev, sp, pool, rsize, size, &block);
    }
    return malloc_done(sp, context, st, block, ptr);
}

/* Whether the thread's last stream pool (pool_cache) is the one of (device, stream), the one
 * pool_stream_get would give. */
static inline __attribute__((always_inline)) bool pool_cache_has(int device, cca_stream_t stream)
{
    /* (a device index the cache holds is valid while the state's generation is its own; the
     * asynchronous backend and the uncached mode, fixed for a state's life, never fill the
     * cache: malloc_on leaves before pool_stream_get) */
    return pool_cache.device_index == device && pool_cache.stream == stream &&
           pool_cache.generation == atomic_load_explicit(&state_generation, memory_order_relaxed);
}

/*
 * The express pair's allocation, tried first where pool_cache_has said yes: a
 * request of size bytes on the thread's last stream pool whose held block is
 * ready for the again update (pool->express: set where the free held it,
 * cleared by any other use of the pool), taken as alloc_held_block's again
 * branch takes it, with malloc_on's conditions for that branch checked at
 * once (history being recorded, with a context or without, sends it back:
 * cca_trace_active, under the lock). False: nothing done, malloc_on decides,
 * given that pool (*cached), so that the cache is not asked twice. The caller
 * asks pool_cache_has itself and calls malloc_general at once for a no: with
 * one call for both, the express path carried a NULL pool in a register.
 */
static inline __attribute__((always_inline)) bool malloc_express(cca_state_t *S, void **ptr, size_t size,
                                                                 cca_stream_pool_t **cached)
{
    cca_device_t *dev = pool_cache.device;
    cca_stream_pool_t *sp = pool_cache.pool;
    *cached = sp;
    cca_pool_t *pool = size <= CCA_SMALL_SIZE ? &sp->small : &sp->large; /* (rounding keeps the side) */
    if (!atomic_load_explicit(&pool->express, memory_order_relaxed) || !ptr ||
        (atomic_load_explicit(&dev->route_count, memory_order_relaxed) |
         atomic_load_explicit(&dev->deferred_count, memory_order_relaxed)) ||
        atomic_load_explicit(&dev->pending_event_count, memory_order_acquire))
        return false;
    int entered = cca_spin_tryenter(&sp->lock);
    if (!entered)
        return false;
    cca_block_t *h = pool->held;
    if (!h || atomic_load_explicit(&pool->express, memory_order_relaxed) != h || h->requested_size != size ||
        sp->again_pool != pool || atomic_load_explicit(&cca_trace_active, memory_order_relaxed)) {
        cca_spin_leave(&sp->lock, entered);
        return false;
    }
    const cca_settings_t *s = S->settings;
    _Atomic int64_t *gc_calls = pool->gc_calls;
    if (dev->set_fraction && s->garbage_collection_threshold > 0.0) /* get_free_block's count */
        atomic_fetch_add_explicit(gc_calls, 1, memory_order_relaxed);
    atomic_store_explicit(&pool->express, NULL, memory_order_relaxed);
    pool->held = NULL;
    pool->held_in_map = false;
    pool->held_stats = false;
    pool->again_n++;
    sp->rehold = h;
    h->allocated = true;
    h->next->gc_count_base = atomic_load_explicit(gc_calls, memory_order_relaxed);
    cca_spin_leave(&sp->lock, entered);
    *ptr = (void *)h->addr;
    cca_assert_expensive(device_is_valid());
    return true;
}

/* cca_malloc_device once the allocator is up and device is valid; cached: the stream pool
 * of (device, stream) if malloc_express found it in the thread's cache, else NULL. */
static inline cca_status_t malloc_on(cca_state_t *S, void **ptr, size_t size, int device,
                                     cca_stream_t stream, cca_stream_pool_t *cached)
{
    cca_status_t st;
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_malloc: ptr is NULL");
    if (size == 0) {
        *ptr = NULL;
        return CCA_OK;
    }
    if (size >= CCA_MAX_REQUEST)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY,
                         "CUDA out of memory. Tried to allocate more than 1EB memory.");
    if (async_enabled())
        return async_malloc(device, size, stream, ptr);
    cca_device_t *dev = &S->devices[device];
    if (S->no_caching)
        return uncached_malloc(dev, size, stream, ptr);
    cca_stream_pool_t *sp = NULL;
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed) |
        atomic_load_explicit(&dev->deferred_count, memory_order_relaxed)) {
        /* routes to private pools, or frees set aside during them (private_pools.c); the
         * pool comes by a variable of its own: sp, its address taken nowhere, stays in a
         * register */
        cca_stream_pool_t *routed;
        st = malloc_prepare_routed(dev, stream, &routed);
        if (st != CCA_OK)
            return st;
        sp = routed;
    } else if (atomic_load_explicit(&dev->pending_event_count, memory_order_acquire)) {
        st = events_process(dev);
        if (st != CCA_OK)
            return st;
    }
    if (!sp) /* (nothing since malloc_express has changed the thread's cache) */
        sp = cached ? cached : pool_stream_get(dev, stream);
    if (!sp)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory (or streams) creating a stream pool");
    size_t rsize = round_size(S->settings, size);
    cca_pool_t *pool = rsize <= CCA_SMALL_SIZE ? &sp->small : &sp->large;
    bool context = trace_context_gather(CCA_RECORD_CONTEXT_STATE); /* outside the locks */
    int entered = cca_spin_enter(&sp->lock); /* (nothing below leaves it and enters it again) */
    cca_block_t *block = pool->held ? held_fit(pool, rsize) : NULL;
    if (block) { /* the cached pair's */
        st = alloc_held_block(dev, pool, block, size);
        cca_spin_leave(&sp->lock, entered);
        return malloc_done(sp, context, st, block, ptr);
    }
    return malloc_locked(dev, sp, entered, pool, rsize, size, context, ptr);
}

/* cca_malloc past its express path, on the backend's current device: out of line, so that
 * the express path saves only the registers the device question needs. */
static __attribute__((noinline)) cca_status_t malloc_general(void **ptr, size_t size, int device,
                                                             cca_stream_t stream, cca_stream_pool_t *cached)
{
    cca_state_t *S = cca_state;
    if (device < 0 || device >= S->device_count) /* the backend's answer, checked once */
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_malloc: device %d is out of range (%d devices)",
                         device, S->device_count);
    return malloc_on(S, ptr, size, device, stream, cached);
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
    if (!pool_cache_has(device, stream))
        return malloc_general(ptr, size, device, stream, NULL);
    cca_stream_pool_t *cached;
    if (malloc_express(S, ptr, size, &cached))
        return CCA_OK;
    return malloc_general(ptr, size, device, stream, cached);
}

cca_status_t cca_malloc(void **ptr, size_t size, cca_stream_t stream)
{
    int device = 0;
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    cca_state_t *S = cca_state;
    cca_backend_t *be = S->backend;
    st = be->get_device(be->ctx, &device);
    if (st != CCA_OK)
        return st;
    if (!pool_cache_has(device, stream)) /* (malloc_general checks the device) */
        return malloc_general(ptr, size, device, stream, NULL);
    cca_stream_pool_t *cached;
    if (malloc_express(S, ptr, size, &cached))
        return CCA_OK;
    return malloc_general(ptr, size, device, stream, cached);
}

/*
 * In solo mode, the block at addr if it is the one a pool of sp handed out
 * last and may be held back as it is returned (the cached pair's): found
 * without the pointer map, which has it (allocated, so the only block there
 * at addr). NULL otherwise (sp's lock held, its held blocks flushed).
 */
static inline cca_block_t *pair_block(cca_stream_pool_t *sp, uintptr_t addr)
{
    for (int kind = 0; kind < 2; kind++) {
        cca_pool_t *pool = kind ? &sp->large : &sp->small;
        cca_block_t *b = pool->last_alloc;
        if (b && b->addr == addr && b->allocated && !b->stream_use_count && pool_may_hold(pool, b))
            return b;
    }
    return NULL;
}

/*
 * The program's return of b, a block of the only stream pool (solo mode),
 * held back and left in the pointer map, where no lookup finds it (its lock
 * held, its held blocks flushed): as pool_hold_block decides, or, again, as
 * the free before its repeat was, with nothing to ask (free_express).
 */
static inline __attribute__((always_inline)) void hold_returned(cca_device_t *dev, cca_block_t *b, bool again)
{
    cca_pool_t *pool = b->pool;
    pool->held_in_map = true;
    b->allocated = false;
    trace_record_pool(dev->index, CCA_TRACE_FREE_REQUESTED, b->addr, b->requested_size, pool->owner->stream,
                      pools_id_of(pool->owner));
    if (again)
        pool_hold(dev, b, true, true);
    else
        pool_hold_block(dev, b, true);
}

/*
 * The express paths' hints for a free of ptr, read before any lock: ptr is
 * the address the thread's last stream pool handed out last, that pool is
 * the process's only one (the pointer map's solo mode: its lock guards the
 * map), and no block is shared with other processes (the asynchronous
 * backend never fills the pool cache; a cache whose generation is current
 * was filled while the state is up). History is left to each express path:
 * the repeat's free records none (cca_trace_active, under the lock), the
 * other takes no context (free_general asks first). The pool, or NULL where
 * a hint says no; *mapp the pointer map where it says yes.
 */
static inline __attribute__((always_inline)) cca_stream_pool_t *free_hints(void *ptr,
                                                                          struct cca_ptrmap_head **mapp)
{
    cca_stream_pool_t *sp = pool_cache.pool;
    if (!ptr || !sp || pool_cache.generation != atomic_load_explicit(&state_generation, memory_order_relaxed))
        return NULL;
    struct cca_ptrmap_head *map = (struct cca_ptrmap_head *)(void *)cca_state->ptrmap;
    if (atomic_load_explicit(&sp->last_addr, memory_order_relaxed) != (uintptr_t)ptr ||
        atomic_load_explicit(&map->solo, memory_order_acquire) != &sp->lock ||
        atomic_load_explicit(&shared_block_count, memory_order_relaxed))
        return NULL;
    *mapp = map;
    return sp;
}

/*
 * The express pair's free, once free_hints said yes for ptr and sp: the
 * block the pool handed out last, returned while the pool holds no block
 * back, is held back as alloc_free's solo path holds it. The block of the
 * pool's last repeat (sp->rehold), with no other statistics update since
 * (again_pool), is held back as the free before its repeat was: the pool's
 * blocks and settings, which pool_may_hold and pool_hold_block asked then,
 * are as they were. False: nothing done.
 */
static inline __attribute__((always_inline)) bool free_express(void *ptr, cca_stream_pool_t *sp)
{
    struct cca_ptrmap_head *map = (struct cca_ptrmap_head *)(void *)cca_state->ptrmap;
    cca_spin_lock(&sp->lock);
    cca_block_t *b = sp->rehold;
    bool again = sp->again_pool && b && b->addr == (uintptr_t)ptr && !b->stream_use_count;
    if (atomic_load_explicit(&map->solo, memory_order_relaxed) != &sp->lock || sp->small.held ||
        sp->large.held || (!again && !(b = pair_block(sp, (uintptr_t)ptr)))) {
        cca_spin_unlock(&sp->lock);
        return false;
    }
    hold_returned(sp->device, b, again);
    cca_spin_unlock(&sp->lock);
    cca_assert_expensive(device_is_valid());
    return true;
}

/*
 * The repeat's free, tried before anything else: the block of the pool's last
 * repeat (sp->rehold), with no other statistics update of the pool since
 * (again_pool) and no history being recorded, held back as free_express holds
 * it (hold_returned's again) with the same checks, its pool's lock entered at
 * once (cca_spin_tryenter). It calls nothing, so cca_free's cached pair saves
 * no register. Else nothing is done: .pool is the pool free_hints gave (NULL
 * where a hint said no).
 */
typedef struct free_repeat_result {
    bool done;
    cca_stream_pool_t *pool;
} free_repeat_result_t;

static inline __attribute__((always_inline)) free_repeat_result_t free_repeat(void *ptr)
{
    struct cca_ptrmap_head *map = NULL;
    cca_stream_pool_t *sp = free_hints(ptr, &map);
    free_repeat_result_t no = {false, sp};
    if (!sp)
        return no;
    int entered = cca_spin_tryenter(&sp->lock);
    if (!entered)
        return no;
    cca_block_t *b = sp->rehold;
    if (!sp->again_pool || !b || b->addr != (uintptr_t)ptr || b->stream_use_count ||
        atomic_load_explicit(&map->solo, memory_order_relaxed) != &sp->lock || sp->small.held ||
        sp->large.held || atomic_load_explicit(&cca_trace_active, memory_order_relaxed)) {
        cca_spin_leave(&sp->lock, entered);
        return no;
    }
    /* hold_returned(dev, b, true) with no history to record */
    cca_pool_t *pool = b->pool;
    b->allocated = false;
    pool_free_mark(b);
    pool->held_in_map = true;
    pool_hold_deferred(pool, b);
    cca_spin_leave(&sp->lock, entered);
    return (free_repeat_result_t){true, sp};
}

/* cca_free's general path: the block found in the pointer map, returned to its pool (or
 * left to its events), under the pool's lock. Inline in free_general and alloc_free. */
static inline __attribute__((always_inline)) cca_status_t free_pointer(void *ptr)
{
    if (!ptr)
        return CCA_OK;
    if (!state_is_up())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_free: pointer %p: cca is not initialised", ptr);
    if (async_enabled())
        return async_free(ptr);
    switch (shared_check_free((uintptr_t)ptr)) {
    case SHARED_FREE_DEFERRED:
        return CCA_OK; /* another process maps it: freed by cca_ipc_collect */
    case SHARED_FREE_TWICE:
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_free: pointer %p was freed already (its free waits until the "
                         "processes it was shared with close it)",
                         ptr);
    case SHARED_FREE_NOW:
        break;
    }
    cca_state_t *S = cca_state;
    bool context = trace_context_gather(CCA_RECORD_CONTEXT_ALL); /* outside the locks */
    /* solo mode (one stream pool in the process): its lock guards the map too, and the
     * block is taken out of the map below, unless it is held back (pool_may_hold) */
    int entered = 0; /* how the lock held was entered (cca_spin_enter) */
    cca_spinlock_t *solo = ptrmap_solo_enter(S->ptrmap, &entered);
    cca_block_t **link = NULL, *block;
    if (solo) {
        cca_stream_pool_t *only = pool_of_lock(solo);
        if (only->small.held || only->large.held)
            pool_flush(only); /* first: the decision below is then pool_free_block's */
        /* (no pair_block first: the cached pair's frees come through the express paths, and
         * a block it would find is found here and held back below, with the same steps) */
        link = ptrmap_find_link_solo(S->ptrmap, (uintptr_t)ptr);
        block = link ? *link : NULL;
    } else {
        block = ptrmap_find(S->ptrmap, (uintptr_t)ptr, true);
    }
    if (!block || !block->pool) {
        if (block && solo) /* (no stream pool is made in the uncached mode: cannot be) */
            ptrmap_unlink_solo(S->ptrmap, link);
        if (solo)
            cca_spin_leave(solo, entered);
        if (context)
            trace_context_release();
        return block ? uncached_free(block) : pool_invalid_pointer("cca_free", ptr);
    }
    cca_stream_pool_t *sp = block->pool->owner;
    cca_device_t *dev = sp->device;
    cca_status_t st = CCA_OK;
    bool plain = false;
    if (solo && solo != &sp->lock) { /* cannot be: solo mode's pool is the only one */
        ptrmap_unlink_solo(S->ptrmap, link);
        cca_spin_leave(solo, entered);
        entered = cca_spin_enter(&sp->lock);
    } else if (!solo) { /* the shards' mode */
        entered = cca_spin_enter(&sp->lock);
    } else if (block->stream_use_count || !pool_may_hold(block->pool, block)) {
        ptrmap_unlink_solo(S->ptrmap, link);
        plain = true; /* its pool's held blocks flushed above, pool_may_hold said no */
    } else {
        block->pool->held_in_map = true; /* held below; not allocated: found by no lookup */
    }
    block->allocated = false;
    if (__builtin_expect(block->plan_serial != 0, 0))
        plan_note_free(block);
    trace_record_pool(dev->index, CCA_TRACE_FREE_REQUESTED, block->addr, block->requested_size, sp->stream,
                      pools_id_of(sp));
    if (!block->stream_use_count) {
        if (plain)
            pool_return_block(dev, block, true);
        else
            pool_free_block(dev, block, true);
    } else {
        int64_t d[OPS_COUNT] = {0};
        d[OPS_ALLOCATION] = -1;
        d[OPS_ALLOCATED_BYTES] = -(int64_t)block->size;
        d[OPS_OVERSIZE] = -(int64_t)block->oversize;
        static const int8_t sign[OPS_COUNT] = {-1, -1, 0, 0, 0, 0, 0, 0};
        ops_apply(block->pool, d, sign);
        if (!events_enter(dev)) {
            events_defer_free(dev, block); /* no event during a capture */
        } else {
            if (atomic_load_explicit(&dev->capture_uses_present, memory_order_relaxed))
                events_forget_capture_uses(dev, block, false);
            st = events_insert(dev, block);
            events_leave(dev);
            if (block->event_count == 0)
                pool_free_block(dev, block, false);
        }
    }
    cca_spin_leave(&sp->lock, entered); /* (nothing above leaves it and enters it again) */
    if (context)
        trace_context_release();
    return st;
}

/* cca_free, for callers that may hold the device lock. */
cca_status_t alloc_free(void *ptr)
{
    return free_pointer(ptr);
}

/* cca_free past free_repeat (sp: the pool free_hints gave, or NULL): out of line, so that
 * the repeat's path saves no register. */
static __attribute__((noinline)) cca_status_t free_general(void *ptr, cca_stream_pool_t *sp)
{
    if (sp && atomic_load_explicit(&cca_trace_context_level, memory_order_relaxed) < CCA_RECORD_CONTEXT_ALL &&
        free_express(ptr, sp))
        return CCA_OK;
    cca_status_t st = free_pointer(ptr);
    cca_assert_expensive(device_is_valid());
    return st;
}

cca_status_t cca_free(void *ptr)
{
    free_repeat_result_t repeat = free_repeat(ptr);
    if (repeat.done) {
        cca_assert_expensive(device_is_valid());
        return CCA_OK;
    }
    return free_general(ptr, repeat.pool);
}

cca_status_t cca_get_base_allocation(void *ptr, void **base, size_t *size)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_get_base_allocation: cca is not initialised");
    if (async_enabled())
        return async_get_base_allocation(ptr, base, size);
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block)
        block = ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)ptr);
    if (!block)
        return pool_invalid_pointer("cca_get_base_allocation", ptr);
    if (!block->pool) {
        if (base)
            *base = (void *)block->addr;
        if (size)
            *size = block->size;
        return CCA_OK;
    }
    if (block->segment->es)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "cca_get_base_allocation: pointer %p: memory allocated with "
                         "expandable_segments:True cannot be shared between processes; allocate "
                         "it with expandable_segments:False (cca_set_settings)", ptr);
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

