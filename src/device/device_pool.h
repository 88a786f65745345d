/*
 * device_pool.h - operations on blocks and stream pools (pool.c), inline where
 * a malloc or free runs them: block structs and spares, the stream pool table,
 * pool locks, split, merge, the held-back free and its statistics. Files
 * include device.h, which includes this.
 */
#ifndef CCA_DEVICE_POOL_H
#define CCA_DEVICE_POOL_H

#include "device_stats.h"

/* ---- pool.c: blocks, stream pools, device set-up ------------------------------ */

/* A block struct of the heap (pool_block_new's, when the pool has no spare); NULL: none. */
cca_block_t *pool_block_struct(void);
/* Tests: the n-th host allocation from now among the stream pools' block structs, the
 * pointer map's buckets, a block's record_stream streams and a checkpoint restore's lists
 * fails (0: none), as it would with the host out of memory; pool_host_alloc_fails asks
 * before each. */
void pool_test_fail_host_alloc(long n);
/* Tests: with off, compact_memory's growths move free granules known done whatever the limit
 * (compact.c: lend_free_granules), so a threaded test moves granules at every growth. */
void compact_test_limit(bool off);
/* Tests: with on, the device's room for orphan records cannot grow, as with the host out of
 * memory. */
void expandable_test_fail_orphan_room(bool on);
bool pool_host_alloc_fails(void);
/* At least n block structs among sp's spares, so that n splits cannot fail for want of
 * host memory (pool lock held). False: no host memory (those made are kept). */
bool pool_spares_reserve(cca_stream_pool_t *sp, size_t n);

/*
 * A block struct from the stream pool's spares, or a new one (pool lock
 * held); NULL: no host memory. Every field is set here, explicitly (a memset
 * of the whole struct showed up as the top cost of the split path): a new
 * field must be too. Inline: the allocation's split makes one.
 */
static inline cca_block_t *pool_block_new(cca_pool_t *pool, cca_segment_t *seg, uintptr_t addr,
                                          size_t size)
{
    cca_stream_pool_t *sp = pool->owner;
    cca_block_t *b = sp->spare_blocks;
    if (b) {
        sp->spare_blocks = b->bin_next;
        sp->spare_count--;
    } else if (!(b = pool_block_struct())) {
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
    b->free_tick = 0;
    b->event_count = 0;
    b->bin = 0;
    b->allocated = false;
    b->in_bin = false;
    b->oversize = false;
    b->mapped = true;
    b->aliased = false;
    b->plan_serial = 0;
    b->stream_use_count = 0;
    b->stream_use_cap = 0;
    b->stream_uses = NULL;
    return b;
}

/* Give a block struct back to its stream pool's spares (pool lock held; inline: a free's
 * merge gives one back). */
static inline void pool_block_delete(cca_block_t *b)
{
    if (b->stream_uses) {
        free(b->stream_uses);
        b->stream_uses = NULL;
    }
    cca_stream_pool_t *sp = b->pool->owner;
    if (b->pool->last_alloc == b)
        b->pool->last_alloc = NULL;
    if (b->pool->fit_block == b)
        b->pool->fit_block = NULL;
    if (sp->spare_count >= 4096) {
        free(b);
        return;
    }
    b->bin_next = sp->spare_blocks;
    sp->spare_blocks = b;
    sp->spare_count++;
}
/* The calling thread's last stream pool, valid while the state generation is unchanged. */
typedef struct pool_cache {
    uint64_t generation;
    int device_index;     /* device's index: a valid one while generation is current */
    cca_device_t *device;
    cca_stream_t stream;
    cca_stream_pool_t *pool;
} pool_cache_t;
extern CCA_HIDDEN CCA_THREAD_HOT pool_cache_t pool_cache;
extern CCA_HIDDEN _Atomic uint64_t state_generation; /* advanced by each device set-up and shutdown */
cca_stream_pool_t *pool_stream_get_slow(cca_device_t *dev, cca_stream_t stream);

/* The pool of (device, stream), created on first use. NULL: out of host memory or streams. */
static inline cca_stream_pool_t *pool_stream_get(cca_device_t *dev, cca_stream_t stream)
{
    if (pool_cache.device == dev && pool_cache.stream == stream &&
        pool_cache.generation == atomic_load_explicit(&state_generation, memory_order_relaxed))
        return pool_cache.pool;
    return pool_stream_get_slow(dev, stream);
}
/* A stream pool outside the device's table (a private pool's); NULL: no host memory. */
cca_stream_pool_t *pool_stream_pool_new(cca_device_t *dev, cca_stream_t stream);
/* Free such a stream pool and its spare block structs. */
void pool_stream_pool_delete(cca_stream_pool_t *sp);
/* Unlink and free a private pool holding no segment (device lock held). */
void pool_private_destroy(cca_device_t *dev, cca_private_pool_t *pp);
/* Stream pools of a device sorted by stream handle (device lock held); caller frees. */
cca_stream_pool_t **pool_sorted_locked(cca_device_t *dev, size_t *count);
/* Merge the free block src (if free) into dst; bytes subsumed, or 0 (stream pool lock held). */
size_t pool_try_merge_blocks(cca_block_t *dst, cca_block_t *src, cca_bins_t *bins);
/* Merge the blocks held back from merging in both pools of sp, their statistics
 * applied (its lock held). */
void pool_flush(cca_stream_pool_t *sp);
/* The pointer map's solo mode ends (the solo pool's lock, held): its held blocks out of it. */
void pool_solo_end(cca_spinlock_t *solo);

/* The stream pool whose lock is lock. */
static inline cca_stream_pool_t *pool_of_lock(cca_spinlock_t *lock)
{
    return (cca_stream_pool_t *)((char *)lock - offsetof(cca_stream_pool_t, lock));
}
/*
 * Whether block, just returned, may be held back from merging (pool lock
 * held, the pool's held block flushed): the block its pool handed out last
 * (the cached pair's; holding others would mostly cost a merge later), of a
 * default pool's plain segment, whose upper neighbour is free and whose lower
 * one is not, so the merge would only take in the upper one. A request of
 * the block's size that best fit would serve from the merged block then gets
 * it back as it is (alloc.c), the cached pair's split and merge never made.
 * Blocks of expandable segments too: anything that looks at their free
 * blocks or maps, unmaps or lends granules locks the pool with pool_lock.
 */
static inline bool pool_may_hold(const cca_pool_t *pool, const cca_block_t *block)
{
    const cca_block_t *next = block->next;
    return block == pool->last_alloc && next && next->in_bin &&
           !(block->prev && block->prev->in_bin) && !pool->owner->private_pool;
}
/* Lock a stream pool for anything but the cached pair: its held-back block
 * is merged first, so the caller sees the pool exactly as PyTorch's. */
static inline void pool_lock(cca_stream_pool_t *sp)
{
    cca_spin_lock(&sp->lock);
    if (pool_pending(sp))
        pool_flush(sp);
}

/* pool_lock for a caller that may hold sp's lock already (held): its held-back frees
 * merged either way; pool_unlock_unless_held after. */
static inline void pool_lock_unless_held(cca_stream_pool_t *sp, const cca_stream_pool_t *held)
{
    if (sp != held)
        cca_spin_lock(&sp->lock);
    if (pool_pending(sp))
        pool_flush(sp);
}

static inline void pool_unlock_unless_held(cca_stream_pool_t *sp, const cca_stream_pool_t *held)
{
    if (sp != held)
        cca_spin_unlock(&sp->lock);
}
/* Return a block to its pool: merge, bin, statistics (stream pool lock held). */
void pool_free_block(cca_device_t *dev, cca_block_t *block, bool program_free);
/* The statistics of a held-back return applied now (pool_hold_block; pool.c). */
void pool_hold_stats(cca_block_t *block, bool program_free);

/* What every return of a block starts with: the trace (pool_free_begin), the garbage
 * collector's age, the tick compact_memory's readiness goes by (pool_free_mark; stream pool
 * lock held). True for a block of an expandable segment. */
static inline __attribute__((always_inline)) bool pool_free_mark(cca_block_t *block)
{
    cca_pool_t *pool = block->pool;
    block->gc_count_base = atomic_load_explicit(pool->gc_calls, memory_order_relaxed);
    bool expandable = pool->expandable_segments && block->segment->es;
    if (expandable) /* the newest tick: a merge keeps the higher one (pool_try_merge_blocks) */
        block->free_tick = ++pool->owner->free_tick; /* compact_memory's readiness (compact.c) */
    return expandable;
}

static inline __attribute__((always_inline)) bool pool_free_begin(cca_device_t *dev, cca_block_t *block)
{
    trace_record_pool(dev->index, CCA_TRACE_FREE_COMPLETED, block->addr, block->requested_size,
                      block->pool->owner->stream,
                      (block->pool->owner->private_pool ? block->pool->owner->private_pool->id
                                                        : (cca_mempool_id_t){0, 0}));
    return pool_free_mark(block);
}

/* The signs of a block's return's statistics where known (pool_return_block, pool.c). */
static const int8_t pool_free_sign[OPS_COUNT] = {0, 0, -1, -1, -1, 0, 0, 0};
/* The same with the program's free in it (allocation and allocated_bytes known to fall: a
 * block's size is never 0), so that the update asks neither amount's sign nor whether it
 * is 0. Oversize stays unknown: mostly 0, skipped then. */
static const int8_t pool_program_free_sign[OPS_COUNT] = {-1, -1, -1, -1, -1, 0, 0, 0};

/* dst takes in src, its neighbour in the segment, taken out of every list before: src's
 * bytes and its place in the segment's block list (the caller gives src's struct back). */
static inline __attribute__((always_inline)) void pool_absorb_neighbour(cca_block_t *dst,
                                                                         const cca_block_t *src)
{
    if (dst->prev == src) {
        dst->addr = src->addr;
        dst->prev = src->prev;
        if (dst->prev)
            dst->prev->next = dst;
        else
            dst->segment->head = dst;
    } else {
        dst->next = src->next;
        if (dst->next)
            dst->next->prev = dst;
    }
    dst->size += src->size;
}

/* Link front, a new struct for the first front->size bytes of the free block b (out of its
 * bin), before b, which keeps the rest; front takes b's return tick and cache count and goes
 * into the bin (compact_memory: a block shifted to its granule, a planned place). Pool lock
 * held. */
static inline void pool_split_front(cca_pool_t *pool, cca_block_t *front, cca_block_t *b)
{
    front->prev = b->prev;
    if (front->prev) {
        front->prev->next = front;
    } else {
        front->segment->head = front;
        front->segment->head_split = true;
    }
    front->next = b;
    b->prev = front;
    b->addr += front->size;
    b->size -= front->size;
    front->free_tick = b->free_tick;
    front->gc_count_base = b->gc_count_base;
    bins_insert(&pool->bins, front);
}

/* Undo pool_split_front: front (in its bin) and its next, out of its bin, one block again,
 * returned out of its bin. */
static inline cca_block_t *pool_join_front(cca_pool_t *pool, cca_block_t *front)
{
    cca_block_t *b = front->next;
    bins_remove(&pool->bins, front);
    pool_absorb_neighbour(b, front);
    pool_block_delete(front);
    return b;
}

/* Merge src into dst if src is free; returns the bytes subsumed (pool lock held). */
static inline __attribute__((always_inline)) size_t pool_merge_blocks(cca_block_t *dst, cca_block_t *src,
                                                                     cca_bins_t *bins)
{
    if (!src || !src->in_bin)
        return 0;
    bins_remove(bins, src);
    pool_absorb_neighbour(dst, src);
    if (src->free_tick > dst->free_tick)
        dst->free_tick = src->free_tick;
    size_t subsumed = src->size;
    pool_block_delete(src);
    return subsumed;
}

/* pool_free_block where the caller knows the pool holds no block back and pool_may_hold
 * says no for this one: merge with free neighbours, bin, statistics (stream pool lock held;
 * inline: a free's general path returns its block here). */
static inline __attribute__((always_inline)) void pool_return_block(cca_device_t *dev, cca_block_t *block,
                                                                    bool program_free)
{
    cca_pool_t *pool = block->pool;
    size_t original_size = block->size;
    size_t requested = block->requested_size;
    bool expandable = pool_free_begin(dev, block);
    int64_t net_blocks = 0, net_bytes = 0;
    cca_block_t *candidates[2] = {block->prev, block->next};
    for (int i = 0; i < 2; i++) {
        size_t subsumed = pool_merge_blocks(block, candidates[i], &pool->bins);
        if (subsumed) {
            net_blocks -= 1;
            net_bytes -= (int64_t)subsumed;
        }
    }
    bins_insert(&pool->bins, block);
    if (block_is_split(block)) {
        net_blocks += 1;
        net_bytes += (int64_t)block->size;
    }
    int64_t d[OPS_COUNT] = {0};
    if (program_free) {
        /* the program's free and the block's return in one statistics update */
        d[OPS_ALLOCATION] = -1;
        d[OPS_ALLOCATED_BYTES] = -(int64_t)original_size;
        d[OPS_OVERSIZE] = -(int64_t)block->oversize;
    }
    if (!expandable) { /* PyTorch keeps expandable blocks out of inactive_split */
        d[OPS_INACTIVE_SPLIT] = net_blocks;
        d[OPS_INACTIVE_SPLIT_BYTES] = net_bytes;
    }
    d[OPS_ACTIVE] = -1;
    d[OPS_ACTIVE_BYTES] = -(int64_t)original_size;
    d[OPS_REQUESTED_BYTES] = -(int64_t)requested;
    ops_apply(pool, d, program_free ? pool_program_free_sign : pool_free_sign);
}

/*
 * Whether the held block h's next allocation of the size it had would be the
 * again update of alloc.c's held path as the pool stands (stream pool lock
 * held): held_fit's yes cached for it with the bins unchanged since, the
 * pool's again record last used for h (its size, request, upper neighbour
 * and split: none of them moves while the bins stay, and the record stays
 * the stream pool's last update while again_pool says so, which the
 * allocation checks). Nothing changes the answer while h stays held: any
 * other use of the pool flushes h first.
 */
static inline bool pool_again_ready(const cca_pool_t *pool, const cca_block_t *h)
{
    return pool->again_block == h && pool->fit_block == h && pool->fit_version == pool->bins.version;
}

/* Hold block back from merging with its free's statistics put off: pool_flush applies them
 * (held_free_deltas), or the block's next allocation folds them into its own (alloc.c);
 * ready for the express allocation where it stays in the map and repeats the pool's last
 * update (stream pool lock held, pool_free_mark done). */
static inline __attribute__((always_inline)) void pool_hold_deferred(cca_pool_t *pool, cca_block_t *block)
{
    pool->held = block;
    pool->held_stats = true;
    atomic_store_explicit(&pool->express, pool->held_in_map && pool_again_ready(pool, block) ? block : NULL,
                          memory_order_relaxed);
}

/* Hold a block returned to its pool back from merging (stream pool lock held, its held
 * blocks flushed), its free's statistics put off if defer (pool_hold_block says when). */
static inline __attribute__((always_inline)) void pool_hold(cca_device_t *dev, cca_block_t *block,
                                                            bool program_free, bool defer)
{
    cca_pool_t *pool = block->pool;
    pool_free_begin(dev, block);
    if (defer) {
        pool_hold_deferred(pool, block);
        return;
    }
    pool->held = block;
    atomic_store_explicit(&pool->express, NULL, memory_order_relaxed);
    pool_hold_stats(block, program_free); /* the merge's with the upper neighbour, put off */
}

/* Hold a block returned to its pool back from merging, pool_may_hold said yes (stream pool
 * lock held, its held blocks flushed): the cached pair's return. An expandable block's
 * statistics are applied now: they leave inactive_split alone, which ops_apply_again does
 * not know. */
static inline __attribute__((always_inline)) void pool_hold_block(cca_device_t *dev, cca_block_t *block,
                                                                  bool program_free)
{
    pool_hold(dev, block, program_free,
              program_free && ops_may_defer(block->pool->owner) && !block->segment->es);
}
/* Raise CCA_ERR_INVALID_POINTER for ptr, saying whether it lies inside a block. */
cca_status_t pool_invalid_pointer(const char *what, const void *ptr);
/* Set a device's state up (cca_state->settings readable) and down. */
cca_status_t pool_device_init(cca_device_t *dev, int index, size_t total_memory);
void pool_device_shutdown(cca_device_t *dev);
/* Give a plain (not expandable) segment's memory back: to its pool's own allocator or the backend. */
cca_status_t pool_segment_give_back(cca_device_t *dev, cca_segment_t *seg);

#endif /* CCA_DEVICE_POOL_H */
