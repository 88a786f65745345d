/*
 * device.h - the device caching allocator's internal interface: its structures
 * (device_types.h), statistics operations (device_stats.h) and block and pool
 * operations (device_pool.h), included here, then the functions each file of
 * src/device/ offers the others: pointer map, bins, hot path, record_stream
 * events, release, statistics entry points, peers, private pools, expandable
 * segments, compact_memory and the uncached mode.
 *
 * Lock order: device -> stream pool -> pointer-map shard / stats lock
 * (device_types.h says what each guards).
 */
#ifndef CCA_DEVICE_H
#define CCA_DEVICE_H

#include "device_types.h"

/* ---- ptrmap.c -------------------------------------------------------------- */

struct cca_ptrmap;
cca_status_t ptrmap_create(struct cca_ptrmap **out, void (*solo_end)(cca_spinlock_t *solo));
void ptrmap_destroy(struct cca_ptrmap *m);
/* A stream pool was made (its lock; NULL for one that may not guard the map, a private
 * pool's): the first starts solo mode, the second ends it, calling first, under the solo
 * lock, the map's solo_end function (given to ptrmap_create) with that lock. */
void ptrmap_pool_made(struct cca_ptrmap *m, cca_spinlock_t *pool_lock);
/* A stream pool is freed (its lock): solo mode ends if it was its pool's. */
void ptrmap_pool_gone(struct cca_ptrmap *m, cca_spinlock_t *pool_lock);
/* What the hot path reads of the map (its first member). */
struct cca_ptrmap_head {
    _Atomic(cca_spinlock_t *) solo; /* the only stream pool's lock; NULL: the shards' */
};
/* In solo mode, the only stream pool's lock, taken (then no shard lock is needed while it
 * is held), *entered how (cca_spin_enter); else NULL, nothing taken. */
static inline __attribute__((always_inline)) cca_spinlock_t *ptrmap_solo_enter(struct cca_ptrmap *m,
                                                                               int *entered)
{
    struct cca_ptrmap_head *h = (struct cca_ptrmap_head *)(void *)m;
    cca_spinlock_t *solo = atomic_load_explicit(&h->solo, memory_order_acquire);
    if (!solo)
        return NULL;
    *entered = cca_spin_enter(solo);
    if (atomic_load_explicit(&h->solo, memory_order_relaxed) == solo)
        return solo;
    cca_spin_leave(solo, *entered); /* solo mode ended meanwhile */
    return NULL;
}
/* ptrmap_solo_enter for a caller that leaves with cca_spin_unlock. */
static inline cca_spinlock_t *ptrmap_solo_lock(struct cca_ptrmap *m)
{
    int entered;
    return ptrmap_solo_enter(m, &entered);
}
/* The solo mode's lock, not taken (for a caller holding every stream pool lock), or NULL. */
cca_spinlock_t *ptrmap_solo(struct cca_ptrmap *m);
/* Insert a block keyed by its address. Returns false on allocation failure. held: a
 * stream pool lock the caller holds (or NULL); _held calls take no lock it stands for. */
bool ptrmap_insert(struct cca_ptrmap *m, cca_block_t *block);
/* Make sure that inserting a block at addr cannot fail for want of host memory (the tables
 * it could go to have buckets; a table never gives them back). False: no host memory. */
bool ptrmap_reserve(struct cca_ptrmap *m, uintptr_t addr);
bool ptrmap_insert_held(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held);
/* Solo mode's lookup and unlink without a call, and an insert inline: ptrmap.h. */
/* Take block itself out of the map (a held block kept there; held: as for _held). */
void ptrmap_remove_block(struct cca_ptrmap *m, cca_block_t *block, const cca_spinlock_t *held);
/* Find a live block by its exact address (a pooled block not allocated, held back in solo
 * mode, is not found); remove it when remove is set. */
cca_block_t *ptrmap_find(struct cca_ptrmap *m, uintptr_t addr, bool remove);
cca_block_t *ptrmap_find_held(struct cca_ptrmap *m, uintptr_t addr, bool remove,
                              const cca_spinlock_t *held);
/* Find the live block containing addr (slow: scans; no stream pool lock held). */
cca_block_t *ptrmap_find_containing(struct cca_ptrmap *m, uintptr_t addr);
/* Call fn on every block (no locks taken by fn). */
void ptrmap_for_each(struct cca_ptrmap *m, void (*fn)(cca_block_t *, void *), void *arg,
                     const cca_spinlock_t *held);
size_t ptrmap_count(struct cca_ptrmap *m, const cca_spinlock_t *held);
/* Tests: as solo mode ends, every shard without buckets fails to get them (its blocks stay
 * in the solo table, which the shards' lookups look at last). */
void ptrmap_test_spill_no_memory(bool on);

/* ---- bins.c ---------------------------------------------------------------- */

/* (insert, remove and best fit: bins.h) */
/* Largest free block, or NULL. */
cca_block_t *bins_largest(const cca_bins_t *bins);
/* Visit every free block in (size, addr) order; fn may not modify the bins. */
void bins_for_each(const cca_bins_t *bins, void (*fn)(cca_block_t *, void *), void *arg);
/* Next block in (size, addr) order after b, or NULL. */
cca_block_t *bins_next(const cca_bins_t *bins, const cca_block_t *b);
cca_block_t *bins_prev(const cca_bins_t *bins, const cca_block_t *b);

#include "device_stats.h"
#include "device_pool.h"

/* ---- alloc.c: the hot path ------------------------------------------------------ */

size_t alloc_round_size(const cca_settings_t *s, size_t size);
size_t alloc_segment_size(const cca_settings_t *s, size_t size);
/* Hand out *blockp (out of its bin) for size bytes; split: 1 yes, 0 no (pool lock held). */
cca_status_t alloc_take_block(cca_device_t *dev, cca_pool_t *pool, cca_block_t **blockp, size_t size,
                              size_t orig_size, int split);
/* cca_free without the expensive assertion (callers holding the device lock). */
cca_status_t alloc_free(void *ptr);

/* ---- events.c: record_stream events ------------------------------------------- */

/*
 * Enter a stretch that records, queries or synchronises stream events without
 * the device lock; false (nothing entered) while a route is active. Each
 * side's store comes before its load (sequentially consistent): either the
 * caller sees the route, or the route's begin sees the caller and waits for
 * events_leave (events_wait_callers), so no event call of it overlaps a
 * capture begun once the route is in place (PyTorch's mutex orders them).
 */
static inline bool events_enter(cca_device_t *dev)
{
    atomic_fetch_add_explicit(&dev->event_callers, 1, memory_order_seq_cst);
    if (!atomic_load_explicit(&dev->route_count, memory_order_seq_cst))
        return true;
    atomic_fetch_sub_explicit(&dev->event_callers, 1, memory_order_release);
    return false;
}

static inline void events_leave(cca_device_t *dev)
{
    atomic_fetch_sub_explicit(&dev->event_callers, 1, memory_order_release);
}

/* Wait until the stretches entered before the route just published are over (device lock
 * held; they take no device lock). */
void events_wait_callers(cca_device_t *dev);
/* Record an event on every stream that used the block (stream pool lock held). */
cca_status_t events_insert(cca_device_t *dev, cca_block_t *block);
/* Reclaim blocks whose events completed (no stream pool lock held; none while a route is active). */
cca_status_t events_process(cca_device_t *dev);
/* Wait for every pending event (of blocks of private pool only, if set) and reclaim the
 * blocks; held: the pool lock the caller holds. */
cca_status_t events_synchronize_and_free(cca_device_t *dev, cca_stream_pool_t *held,
                                         cca_private_pool_t *only);
/* Set aside the free of a block used on other streams while a route is active (pool lock held). */
void events_defer_free(cca_device_t *dev, cca_block_t *block);
/* record_stream while a route is active: remember the use (pool lock held). */
cca_status_t events_note_capture_use(cca_device_t *dev, cca_block_t *block, cca_stream_t stream);
/* Forget block's capture-time uses; with drop, remove them from its stream uses (pool lock held). */
void events_forget_capture_uses(cca_device_t *dev, cca_block_t *block, bool drop);
/* Complete the set-aside frees (device lock held, no route active; held: a stream pool lock
 * the caller holds, or NULL). */
cca_status_t events_insert_deferred_locked(cca_device_t *dev, cca_stream_pool_t *held);
/* Return the set-aside blocks of stream that its capture has passed (device lock held). */
cca_status_t events_free_safe_in_capture(cca_device_t *dev, cca_stream_t stream);
/* Forget the capture graphs' traversals (device lock held, no route active). */
void events_reuse_reset_locked(cca_device_t *dev);
/* Give the device's idle events back to the backend. */
cca_status_t events_destroy_pooled(cca_device_t *dev);
/* events_process on every device (replay, tests). */
cca_status_t alloc_process_events(void);

/* ---- release.c: release, garbage collection, out of memory ----------------------- */

/* PyTorch's release_cached_blocks (device lock held; held: the pool lock the caller holds). */
cca_status_t release_cached_blocks_locked(cca_device_t *dev, cca_stream_pool_t *held);
/* Release oversize cached blocks covering size (device and pool locks held). */
bool release_available_cached_blocks(cca_device_t *dev, cca_pool_t *pool, size_t size);
/* Age-based garbage collection (device lock held). */
void release_garbage_collect(cca_device_t *dev, cca_stream_pool_t *held);
/* Release every unsplit free block of a pool (device lock held, its pool lock taken unless held). */
cca_status_t release_pool_blocks(cca_device_t *dev, cca_pool_t *pool, cca_stream_pool_t *held);
/* Run the free-memory callbacks (no lock held); true if any freed memory. */
bool release_free_memory_callbacks(void);
/* PyTorch's out-of-memory error, observers notified (no lock held). */
cca_status_t release_raise_oom(cca_device_t *dev, size_t size, size_t alloc_size, cca_stream_t stream);

/* ---- stats.c: statistics entry points ------------------------------------------ */

/* The device's statistics (see stats.c); held: a stream pool lock the caller holds. */
void stats_read_held(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held);
void stats_read(cca_device_t *dev, cca_device_stats_t *out);
/* exact_peak_stats: the ops table's current and peak values into out's per-operation arrays. */
void stats_fill_ops(const cca_device_t *dev, cca_device_stats_t *out);

/* ---- peer.c: peer access ------------------------------------------------------- */

/* The devices that may access dev's memory (bit p: device p). Lock-free read. */
static inline uint64_t device_peer_mask(cca_device_t *dev)
{
    return atomic_load_explicit(&dev->peer_mask, memory_order_acquire);
}
/* Give every device of dev's peer mask access to a mapped range (dev->lock held). */
cca_status_t peer_set_access_locked(cca_device_t *dev, void *addr, size_t size);

/* ---- private_pools.c: private pools and routes (above setup, below stats) ------------ */

static inline bool pools_id_eq(cca_mempool_id_t a, cca_mempool_id_t b)
{
    return a.first == b.first && a.second == b.second;
}

static inline bool pools_id_is_default(cca_mempool_id_t id)
{
    return id.first == 0 && id.second == 0;
}

/* Check device and a private pool id for entry point what; *dev on CCA_OK. */
cca_status_t pools_args(const char *what, int device, cca_mempool_id_t id, cca_device_t **dev);
/* CCA_ERR_INVALID_ARGUMENT naming an unknown pool. */
cca_status_t pools_unknown(const char *what, int device, cca_mempool_id_t id);
/* The pool with id, or NULL (device lock held). */
cca_private_pool_t *pools_find_locked(cca_device_t *dev, cca_mempool_id_t id);
/* The stream pool of (pp, stream) if it exists (device lock held). */
cca_stream_pool_t *pools_find_stream_pool(cca_private_pool_t *pp, cca_stream_t stream);
/* Where an allocation on stream goes under the routes: a pinned private stream pool, or NULL. */
cca_status_t pools_route_locked(cca_device_t *dev, cca_stream_t stream, cca_stream_pool_t **out);
void pools_unpin(cca_stream_pool_t *sp);
/* Free bytes cached in private pools (device lock held). */
size_t pools_cached_bytes_locked(cca_device_t *dev);
/* How many private stream pools dev has (device lock held). */
size_t pools_stream_pool_count(cca_device_t *dev);

/* fn on every private pool's stream pool (device lock held); a structure walk, for observe/ too. */
static inline void pools_for_each_stream_pool(cca_device_t *dev,
                                              void (*fn)(cca_stream_pool_t *, void *), void *arg)
{
    for (cca_private_pool_t *pp = dev->private_pools; pp; pp = pp->next)
        for (size_t i = 0; i < pp->stream_pool_count; i++)
            fn(pp->stream_pools[i], arg);
}

/* The id of sp's private pool, (0, 0) for a default stream pool. */
static inline cca_mempool_id_t pools_id_of(const cca_stream_pool_t *sp)
{
    cca_mempool_id_t none = {0, 0};
    return sp->private_pool ? sp->private_pool->id : none;
}

/* ---- expandable.c: expandable segments (above pool.c, below setup.c) --------------
 * All with the device lock and the pool's stream pool lock held, but shutdown. */

/* Grow the pool's expandable segment to hold size bytes (PyTorch's
 * try_allocate_expandable_block); *out leaves its bin. CCA_ERR_OUT_OF_MEMORY: device full. */
cca_status_t expandable_alloc(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **out);
/* get_free_block's step for an expandable best fit b: the block to use, or NULL. */
cca_block_t *expandable_fit(const cca_pool_t *pool, cca_block_t *b);
/* Unmap the whole granules of a free expandable block; free an empty reservation. */
cca_status_t expandable_unmap(cca_device_t *dev, cca_block_t *block);
/* Checkpoint restore: map what is unmapped of [addr, addr + size) in seg (free, binned). */
cca_status_t expandable_map_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size);
/* Checkpoint restore: unmap the whole granules of [addr, addr + size) that free blocks of seg
 * hold (the stream waited for first); *released: the reservation went with them. */
cca_status_t expandable_unmap_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size,
                                    bool *released);
/* Unmap every free expandable block of a pool (release_blocks' expandable half). */
cca_status_t expandable_release_pool(cca_device_t *dev, cca_pool_t *pool);
/* Release handles whose release failed before (device lock held). */
cca_status_t expandable_release_orphans(cca_device_t *dev);
/* Give peer access to every mapped range of dev (device lock held; peer in peer_mask). */
cca_status_t expandable_add_peer(cca_device_t *dev, int peer);
/* Shutdown: give every expandable segment and orphan back to the backend, unlink them. */
void expandable_device_shutdown(cca_device_t *dev);

/* ---- compact.c: compact_memory's moves of free granules (beside expandable.c) ---------
 * With the device lock held; the helpers it shares with expandable.c are in expandable.h. */

/* The planned placement (plan.c): map every granule of [addr, addr + size), free address
 * space of pool's segment from c (the block holding addr) on, free granules moved there
 * first as for a growth; within_limit: only the granules from addr on that moved granules
 * and the room under the limit cover (the pool's lock held too). */
cca_status_t compact_map_range(cca_device_t *dev, cca_pool_t *pool, cca_block_t *c, uintptr_t addr,
                               size_t size, bool within_limit);
/* The planned placement: address space for a plan of size bytes, free and unmapped: the top
 * of one of pool's compact segments, else a new segment's start (the pool's lock held too). */
cca_status_t compact_plan_range(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_segment_t **seg,
                                uintptr_t *base);
/* Unmap the old mappings of aliased blocks whose stream's work is done (wait: after
 * synchronising the stream); held: the stream pool locked by the caller, or NULL. */
cca_status_t compact_settle_aliases(cca_device_t *dev, cca_stream_pool_t *held, bool wait);
/* Destroy the streams' readiness events (empty_cache). */
cca_status_t compact_destroy_ready_events(cca_device_t *dev);
/* The growth limit starts again from the bytes held now (empty_cache). */
void compact_restart_limit(cca_device_t *dev);

/* ---- uncached.c: CCA_NO_CACHING ------------------------------------------------- */

cca_status_t uncached_malloc(cca_device_t *dev, size_t size, cca_stream_t stream, void **ptr);
cca_status_t uncached_free(cca_block_t *block);

#endif /* CCA_DEVICE_H */
