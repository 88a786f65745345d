/*
 * expandable.c - expandable segments (PyTorch's expandable_segments:True):
 * one virtual address reservation per (device, stream, pool kind) that grows
 * at its end by mapping physical memory in granules, and gives back the
 * granules no block uses.
 *
 * A reservation is sized as PyTorch sizes it: granule * ceil(9/8 * total
 * device memory / granule) bytes, the granule being 2 MiB for the small pool
 * and large_segment_size (20 MiB by default) for the large pool, fixed when
 * the segment is created (a later settings change affects new segments
 * only). The reservation is one cca_segment_t tiled by blocks like any
 * other, but a block is either mapped (allocated, waiting for events or free
 * in a bin, exactly as in a plain segment) or unmapped: a granule-aligned
 * run of address space with no physical memory, kept in its pool's
 * address-ordered `unmapped` list and never in a bin.
 *
 * Growth (expandable_alloc, PyTorch's try_allocate_expandable_block): the
 * lowest-addressed unmapped run of the stream's pool whose free neighbourhood
 * holds the request is mapped granule by granule (one create + map per
 * granule, one set_access per mapped range and per peer device), merged with
 * its free neighbours and handed out. Release (expandable_unmap): the whole
 * granules a free block covers are unmapped after the segment's stream is
 * synchronised; a reservation with nothing mapped is freed.
 *
 * compact_memory (cca only): both pools map in the device's granularity, and
 * before a growth maps new memory, whole free granules of the default pools'
 * compact segments (any stream, either kind) are unmapped and their handles
 * lent to the growth (dev->lent, empty between calls); the growth's own free
 * run is never taken. A granule moves only once its stream's work on it is
 * done: each free block carries the tick of its return to its stream pool,
 * and an event the growth path records on the stream says which ticks are
 * done (queried, never waited for: granules not yet known done stay, and
 * the growth maps new memory for the rest). Each move is an unmap and a map
 * in the statistics and the history.
 *
 * Statistics as PyTorch keeps them in this mode: reserved_bytes and
 * num_device_alloc / num_device_free follow maps and unmaps; segment,
 * oversize_segments, inactive_split and inactive_split_bytes are never
 * touched by expandable blocks; the history records segment_map and
 * segment_unmap with the range mapped or unmapped.
 *
 * Invariants: every granule of a mapped block is mapped; an unmapped block
 * is granule-aligned at both ends and none of its granules is mapped; two
 * unmapped neighbours are always merged; reserved bytes (and the device's
 * total_allocated_memory share) equal granule * mapped granules. Every
 * function runs with the device lock and the pool's stream pool lock held
 * (shutdown excepted). Layer: above pool.c (block structs, merging) and
 * bins.c, below setup.c (shutdown), release.c and alloc.c, its callers.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "trace.h"

/* ---- the unmapped list of a pool --------------------------------------------------- */

/* Insert an unmapped block into its pool's list, by address. */
static void unmapped_insert(cca_pool_t *pool, cca_block_t *b)
{
    cca_block_t *prev = NULL, *at = pool->unmapped;
    while (at && at->addr < b->addr) {
        prev = at;
        at = at->bin_next;
    }
    b->bin_prev = prev;
    b->bin_next = at;
    if (at)
        at->bin_prev = b;
    if (prev)
        prev->bin_next = b;
    else
        pool->unmapped = b;
}

static void unmapped_remove(cca_pool_t *pool, cca_block_t *b)
{
    if (b->bin_prev)
        b->bin_prev->bin_next = b->bin_next;
    else
        pool->unmapped = b->bin_next;
    if (b->bin_next)
        b->bin_next->bin_prev = b->bin_prev;
    b->bin_prev = b->bin_next = NULL;
}

/* ---- granules ----------------------------------------------------------------------- */

/* Granule index of addr in es, rounded down or up. */
static size_t granule_floor(const cca_segment_t *seg, uintptr_t addr)
{
    return (addr - seg->base) / seg->es->granule;
}

static size_t granule_ceil(const cca_segment_t *seg, uintptr_t addr)
{
    size_t g = seg->es->granule;
    return (addr - seg->base + g - 1) / g;
}

static uintptr_t granule_addr(const cca_segment_t *seg, size_t i)
{
    return seg->base + i * seg->es->granule;
}

/* Make room for granules [0, end) in the handle table. False: out of host memory. */
static bool handles_reserve(cca_expandable_t *es, size_t end)
{
    if (end <= es->handle_cap)
        return true;
    size_t cap = es->handle_cap ? es->handle_cap : 16;
    while (cap < end)
        cap *= 2;
    if (cap > es->max_handles)
        cap = es->max_handles;
    cca_vmm_granule_t *grown = realloc(es->handles, cap * sizeof(*grown));
    if (!grown)
        return false;
    memset(grown + es->handle_cap, 0, (cap - es->handle_cap) * sizeof(*grown));
    es->handles = grown;
    es->handle_cap = cap;
    return true;
}

/* Drop trailing unmapped granules from the table's extent (PyTorch's trimHandles). */
static void handles_trim(cca_expandable_t *es)
{
    while (es->handle_count && !es->handles[es->handle_count - 1].present)
        es->handle_count--;
}

/* Give device (the owner or a peer) access to granules [begin, end). */
static cca_status_t set_access_range(cca_device_t *dev, const cca_segment_t *seg, int device,
                                     size_t begin, size_t end)
{
    cca_backend_t *be = cca_state->backend;
    return be->vmm_set_access(be->ctx, device, (void *)granule_addr(seg, begin),
                              (end - begin) * seg->es->granule);
    (void)dev;
}

/* ---- orphans: granules whose unmap or release failed ------------------------------- */

/* Make room for more orphans, so recording one later cannot fail. */
static _Atomic bool orphan_room_fails; /* tests (expandable_test_fail_orphan_room) */

void expandable_test_fail_orphan_room(bool on)
{
    atomic_store(&orphan_room_fails, on);
}

static bool orphans_reserve(cca_device_t *dev, size_t more)
{
    if (dev->orphan_count + more <= dev->orphan_cap)
        return true;
    if (atomic_load_explicit(&orphan_room_fails, memory_order_relaxed))
        return false;
    size_t cap = dev->orphan_cap ? dev->orphan_cap : 16;
    while (cap < dev->orphan_count + more)
        cap *= 2;
    cca_vmm_orphan_t *grown = realloc(dev->orphans, cap * sizeof(*grown));
    if (!grown)
        return false;
    dev->orphans = grown;
    dev->orphan_cap = cap;
    return true;
}

/* Keep a granule to unmap (if mapped) and release later (room reserved before). */
static void orphan_push(cca_device_t *dev, uintptr_t addr, size_t size, cca_phys_handle_t handle,
                        bool mapped)
{
    dev->orphans[dev->orphan_count++] =
        (cca_vmm_orphan_t){.addr = addr, .size = size, .handle = handle, .mapped = mapped};
}

/* Unmap and release the orphans. Returns the first failure (those stay orphans). */
static void lent_release(cca_device_t *dev, cca_stream_pool_t *held, bool settle);
static bool handle_aliased(const cca_device_t *dev, cca_phys_handle_t h);

cca_status_t expandable_release_orphans(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    lent_release(dev, NULL, false);
    cca_status_t result = CCA_OK;
    size_t kept = 0;
    for (size_t i = 0; i < dev->orphan_count; i++) {
        cca_vmm_orphan_t *o = &dev->orphans[i];
        cca_status_t st = CCA_OK;
        if (o->mapped) {
            st = be->vmm_unmap(be->ctx, dev->index, (void *)o->addr, o->size);
            o->mapped = st != CCA_OK;
        }
        if (st == CCA_OK)
            st = be->vmm_release(be->ctx, dev->index, o->handle);
        if (st != CCA_OK) {
            dev->orphans[kept++] = *o;
            if (result == CCA_OK)
                result = st;
        }
    }
    dev->orphan_count = kept;
    return result;
}

/*
 * Unmap the orphans still mapped (their unmap failed while a map was undone):
 * their ranges are unmapped address space in the allocator's view, which a
 * growth maps again, and a mapping left there would make that map fail.
 * What fails again stays mapped, tried again at the next map.
 */
static void orphans_unmap(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    for (size_t i = 0; i < dev->orphan_count; i++) {
        cca_vmm_orphan_t *o = &dev->orphans[i];
        if (o->mapped && be->vmm_unmap(be->ctx, dev->index, (void *)o->addr, o->size) == CCA_OK)
            o->mapped = false; /* released with the other orphans */
    }
}

/*
 * Unmap granules [begin, mapped) and release handles [begin, created) of an
 * unfinished map; what fails becomes an orphan (room reserved before). A
 * handle still mapped at an aliased block's old address goes back to
 * dev->lent instead (the growth's lent_release waits for its stream first).
 */
static void map_undo(cca_device_t *dev, cca_segment_t *seg, size_t begin, size_t mapped,
                     size_t created, const cca_phys_handle_t *handles)
{
    cca_backend_t *be = cca_state->backend;
    size_t g = seg->es->granule;
    for (size_t i = begin; i < created; i++) {
        uintptr_t addr = granule_addr(seg, i);
        cca_phys_handle_t h = handles[i - begin];
        if (i < mapped && be->vmm_unmap(be->ctx, dev->index, (void *)addr, g) != CCA_OK)
            orphan_push(dev, addr, g, h, true);
        else if (handle_aliased(dev, h))
            dev->lent[dev->lent_count++] = h; /* taken from there: room left */
        else if (be->vmm_release(be->ctx, dev->index, h) != CCA_OK)
            orphan_push(dev, addr, g, h, false);
    }
}

/*
 * Back granules [begin, end) of seg with physical memory: create, map, and
 * give the device and its peers access (PyTorch's ExpandableSegment::map).
 * All or nothing: on failure every handle made here is released and every
 * mapping undone. *aliased: whether a handle mapped here is still mapped at
 * an aliased block's old address (compact_memory: the stream's work there
 * may be pending). Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY (the device is full:
 * PyTorch's "map returned 0 bytes"), another backend status, or
 * CCA_ERR_OUT_OF_MEMORY for host memory (with its own message).
 */
static cca_status_t map_granules(cca_device_t *dev, cca_segment_t *seg, size_t begin, size_t end,
                                 bool *aliased)
{
    cca_backend_t *be = cca_state->backend;
    cca_expandable_t *es = seg->es;
    size_t n = end - begin, created = 0, mapped = 0;
    cca_status_t st = CCA_OK;
    if (!handles_reserve(es, end) || !orphans_reserve(dev, n))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory mapping an expandable segment");
    cca_phys_handle_t local[16];
    cca_phys_handle_t *handles = n <= 16 ? local : malloc(n * sizeof(*handles));
    if (!handles)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory mapping an expandable segment");
    orphans_unmap(dev);
    for (; created < n; created++) {
        if (es->compact && dev->lent_count) {
            handles[created] = dev->lent[--dev->lent_count]; /* unmapped for this growth */
            if (dev->aliased && handle_aliased(dev, handles[created]))
                *aliased = true;
            continue;
        }
        st = be->vmm_create(be->ctx, dev->index, es->granule, &handles[created]);
        if (st != CCA_OK)
            goto out_undo;
    }
    for (; mapped < n; mapped++) {
        st = be->vmm_map(be->ctx, dev->index, (void *)granule_addr(seg, begin + mapped), es->granule,
                         handles[mapped]);
        if (st != CCA_OK)
            goto out_undo;
    }
    st = set_access_range(dev, seg, dev->index, begin, end);
    uint64_t peers = device_peer_mask(dev);
    for (int p = 0; st == CCA_OK && p < CCA_MAX_DEVICES; p++)
        if (peers & ((uint64_t)1 << p))
            st = set_access_range(dev, seg, p, begin, end);
    if (st != CCA_OK)
        goto out_undo;
    for (size_t i = 0; i < n; i++)
        es->handles[begin + i] = (cca_vmm_granule_t){.handle = handles[i], .present = true};
    if (end > es->handle_count)
        es->handle_count = end;
    es->mapped_bytes += n * es->granule;
    goto out_free;
out_undo:
    map_undo(dev, seg, begin, begin + mapped, begin + created, handles);
out_free:
    if (handles != local)
        free(handles);
    return st;
}

/* ---- finding and growing ---------------------------------------------------------- */

/* PyTorch's "allocatable": free, no events, no recorded streams (mapped or not); never an
 * aliased block (compact_memory), whose old mappings are still in the backend. */
static bool allocatable(const cca_block_t *b)
{
    return b && !b->allocated && b->event_count == 0 && b->stream_use_count == 0 && !b->aliased;
}

/* Whether the free run starting at b holds size bytes. */
static bool has_address_space(const cca_block_t *b, size_t size)
{
    size_t bytes = 0;
    while (bytes < size && allocatable(b)) {
        bytes += b->size;
        b = b->next;
    }
    return bytes >= size;
}

/* The granule a new segment of this pool maps at a time (compact: the device's granularity). */
static size_t pool_granule(const cca_device_t *dev, const cca_pool_t *pool)
{
    if (cca_state->settings.compact_memory)
        return dev->vmm_granularity;
    return pool->is_small ? CCA_SMALL_BUFFER : cca_state->settings.large_segment_size;
}

/* Reserve a new expandable segment for pool; its one block (unmapped) in *out. */
static cca_status_t segment_create(cca_device_t *dev, cca_pool_t *pool, cca_block_t **out)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t st;
    if (!dev->vmm_granularity) {
        size_t g = 0;
        st = be->vmm_granularity(be->ctx, dev->index, &g);
        if (st != CCA_OK)
            return st;
        if (!g)
            return cca_raise(CCA_ERR_BACKEND, "the backend reports a virtual memory granularity of 0");
        dev->vmm_granularity = g;
    }
    size_t granule = pool_granule(dev, pool);
    if (granule % dev->vmm_granularity)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "expandable segments: the %s pool maps %zu bytes at a time, not a multiple "
                         "of device %d's granularity (%zu bytes); set large_segment_size_mb to a "
                         "multiple of it",
                         pool->is_small ? "small" : "large", granule, dev->index,
                         dev->vmm_granularity);
    /* address space for 9/8 of the device, so pages freed early can be mapped again at the end */
    size_t space = dev->total_memory + dev->total_memory / 8;
    size_t max_handles = (space + granule - 1) / granule;
    if (!max_handles)
        max_handles = 1;
    cca_segment_t *seg = calloc(1, sizeof(*seg));
    cca_expandable_t *es = calloc(1, sizeof(*es));
    cca_block_t *block = seg && es ? pool_block_new(pool, seg, 0, granule * max_handles) : NULL;
    if (!block) {
        free(es);
        free(seg);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    void *base = NULL;
    st = be->vmm_reserve(be->ctx, dev->index, granule * max_handles, &base);
    if (st != CCA_OK) {
        pool_block_delete(block);
        free(es);
        free(seg);
        return st;
    }
    es->granule = granule;
    es->max_handles = max_handles;
    es->compact = cca_state->settings.compact_memory;
    es->pool = pool;
    seg->es = es;
    seg->base = (uintptr_t)base;
    seg->size = granule * max_handles;
    seg->stream = pool->owner->stream;
    seg->is_small = pool->is_small;
    seg->private_pool = pool->owner->private_pool;
    seg->head = block;
    block->addr = seg->base;
    block->mapped = false;
    unmapped_insert(pool, block);
    seg->next_seg = dev->segments;
    if (dev->segments)
        dev->segments->prev_seg = seg;
    dev->segments = seg;
    dev->segment_count++;
    pool->expandable_segments++;
    if (pool->owner->private_pool)
        pool->owner->private_pool->segment_count++; /* keeps the pool while it is reserved */
    *out = block;
    return CCA_OK;
}

/*
 * PyTorch's find_expandable_block: the lowest-addressed unmapped block of
 * the pool (or the free block just below it) from which size bytes of free
 * address space run; else a new segment.
 */
static cca_status_t find_expandable_block(cca_device_t *dev, cca_pool_t *pool, size_t size,
                                          cca_block_t **out)
{
    for (cca_block_t *u = pool->unmapped; u; u = u->bin_next) {
        cca_block_t *c = allocatable(u->prev) ? u->prev : u;
        if (has_address_space(c, size)) {
            *out = c;
            return CCA_OK;
        }
    }
    return segment_create(dev, pool, out);
}

/* Merge the unmapped neighbour src into the unmapped block dst. */
static void merge_unmapped(cca_pool_t *pool, cca_block_t *dst, cca_block_t *src)
{
    if (!src || src->mapped || !allocatable(src))
        return;
    unmapped_remove(pool, src);
    pool_absorb_neighbour(dst, src);
    pool_block_delete(src);
}

/* Link b into its segment's block list between before and after. */
static void splice(cca_block_t *b, cca_block_t *before, cca_block_t *after)
{
    b->prev = before;
    b->next = after;
    if (before)
        before->next = b;
    else
        b->segment->head = b;
    if (after)
        after->prev = b;
}

static int64_t pool_gc_calls(const cca_pool_t *pool)
{
    return atomic_load_explicit(pool->gc_calls, memory_order_relaxed);
}

/*
 * PyTorch's map_block: map the first size bytes of the unmapped block
 * to_map (whole granules), keep the rest unmapped, merge the mapped part
 * with free neighbours and bin it. *out: the free block now holding it.
 */
static cca_status_t map_block(cca_device_t *dev, cca_block_t *to_map, size_t size, cca_block_t **out)
{
    cca_pool_t *pool = to_map->pool;
    cca_segment_t *seg = to_map->segment;
    size_t begin = granule_floor(seg, to_map->addr);
    size_t end = granule_ceil(seg, to_map->addr + size);
    size_t mapped = (end - begin) * seg->es->granule;
    cca_block_t *rest = NULL;
    if (mapped < to_map->size) {
        rest = pool_block_new(pool, seg, to_map->addr + mapped, to_map->size - mapped);
        if (!rest)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
    }
    bool aliased = false;
    cca_status_t st = map_granules(dev, seg, begin, end, &aliased);
    if (st != CCA_OK) {
        if (rest)
            pool_block_delete(rest);
        return st;
    }
    unmapped_remove(pool, to_map);
    to_map->mapped = true;
    /* fresh or moved granules: no work of this stream on them; an aliased block's handles:
     * the stream's work at the old address may be pending, so the block is as if returned
     * now (known done once the stream's next event completes), should it stay free (a
     * growth failing after this map keeps it cached) and another stream's growth look at it */
    to_map->free_tick = aliased ? ++pool->owner->free_tick : 0;
    if (rest) {
        rest->mapped = false;
        splice(rest, to_map, to_map->next);
        unmapped_insert(pool, rest);
        to_map->size = mapped;
    }
    pool_try_merge_blocks(to_map, to_map->prev, &pool->bins);
    pool_try_merge_blocks(to_map, to_map->next, &pool->bins);
    to_map->gc_count_base = pool_gc_calls(pool);
    bins_insert(&pool->bins, to_map);
    dev->total_allocated_memory += mapped;
    stats_lock(dev);
    stat2_inc(dev->stats.reserved_bytes, pool_stat_type(pool->is_small), (int64_t)mapped);
    dev->stats.num_device_alloc++;
    stats_unlock(dev);
    trace_record(dev->index, CCA_TRACE_SEGMENT_MAP, granule_addr(seg, begin), mapped, seg->stream);
    *out = to_map;
    return CCA_OK;
}

/* ---- best fit in a pool holding expandable blocks ---------------------------------- */

/*
 * PyTorch's get_free_block, for a best fit b that is an expandable block:
 * with the mode on, prefer the next blocks as long as they could grow less;
 * with it off, skip expandable blocks. Returns the block to use, or NULL.
 */
cca_block_t *expandable_fit(const cca_pool_t *pool, cca_block_t *b)
{
    if (cca_state->settings.expandable_segments) {
        if (block_expandable_size(b) == b->size || pool->bins.count == 1)
            return b; /* nothing to grow into, or no other block: no later block counts as smaller */
        cca_block_t *next = bins_next(&pool->bins, b);
        while (b->segment->es && next && block_expandable_size(next) < block_expandable_size(b)) {
            b = next;
            next = bins_next(&pool->bins, b);
        }
        return b;
    }
    do
        b = bins_next(&pool->bins, b);
    while (b && b->segment->es);
    return b;
}

/* ---- unmapping and releasing ---------------------------------------------------------- */

/* Free a segment whose only block is unmapped: its reservation goes back. */
static cca_status_t segment_release(cca_device_t *dev, cca_block_t *block)
{
    cca_backend_t *be = cca_state->backend;
    cca_segment_t *seg = block->segment;
    cca_pool_t *pool = block->pool;
    cca_status_t st = be->vmm_free(be->ctx, dev->index, (void *)seg->base, seg->size);
    if (st != CCA_OK) {
        seg->es->free_failed = true; /* the empty reservation stays, usable for the next growth;
                                      * the next release of cached blocks tries again */
        return st;
    }
    unmapped_remove(pool, block);
    if (seg->prev_seg)
        seg->prev_seg->next_seg = seg->next_seg;
    else
        dev->segments = seg->next_seg;
    if (seg->next_seg)
        seg->next_seg->prev_seg = seg->prev_seg;
    dev->segment_count--;
    pool->expandable_segments--;
    if (pool->owner->private_pool)
        pool->owner->private_pool->segment_count--;
    plan_segment_gone(pool, seg); /* a plan's range there goes with it */
    free(seg->es->handles);
    free(seg->es);
    free(seg);
    pool_block_delete(block);
    return CCA_OK;
}

/* Make room for more lent handles, so lending one later cannot fail, and for an orphan record
 * of every handle lent, so giving them back (lent_release) cannot fail for want of one. */
static bool lent_reserve(cca_device_t *dev, size_t more)
{
    if (!orphans_reserve(dev, dev->lent_count + more))
        return false;
    if (dev->lent_count + more <= dev->lent_cap)
        return true;
    size_t cap = dev->lent_cap ? dev->lent_cap : 16;
    while (cap < dev->lent_count + more)
        cap *= 2;
    cca_phys_handle_t *grown = realloc(dev->lent, cap * sizeof(*grown));
    if (!grown)
        return false;
    dev->lent = grown;
    dev->lent_cap = cap;
    return true;
}

/*
 * Unmap granules [begin, end) of the free block (whole granules inside it;
 * the caller has waited for the segment's stream), split off what stays
 * mapped below and above as free blocks, merge the unmapped run with
 * unmapped neighbours, free the reservation if nothing is mapped (then
 * *released is set: block is gone). lend: the physical handles go to
 * dev->lent for the growth in progress instead of back to the backend (a
 * reservation that could not be freed then fails nothing: it stays, as
 * segment_release leaves it). Returns CCA_OK, or the first backend failure:
 * granules unmapped before it stay unmapped and are accounted; a handle whose
 * release failed is kept and released by a later empty_cache.
 */
static void take_out(cca_device_t *dev, cca_block_t *block, size_t begin, size_t stop,
                     cca_block_t *before, cca_block_t *after);

static cca_status_t alias_unmap(cca_device_t *dev, cca_block_t *b);

static cca_status_t unmap_granules(cca_device_t *dev, cca_block_t *block, size_t begin, size_t end,
                                   bool lend, bool *released)
{
    cca_backend_t *be = cca_state->backend;
    cca_pool_t *pool = block->pool;
    cca_segment_t *seg = block->segment;
    cca_expandable_t *es = seg->es;
    *released = false;
    cca_block_t *before = pool_block_new(pool, seg, 0, 0);
    cca_block_t *after = before ? pool_block_new(pool, seg, 0, 0) : NULL;
    if (!after || !orphans_reserve(dev, end - begin) || (lend && !lent_reserve(dev, end - begin))) {
        if (after)
            pool_block_delete(after);
        if (before)
            pool_block_delete(before);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory unmapping an expandable segment");
    }
    cca_status_t st = CCA_OK;
    size_t stop = begin;
    for (; stop < end; stop++) {
        cca_vmm_granule_t *gr = &es->handles[stop];
        st = be->vmm_unmap(be->ctx, dev->index, (void *)granule_addr(seg, stop), es->granule);
        if (st != CCA_OK)
            break;
        if (lend)
            dev->lent[dev->lent_count++] = gr->handle;
        else if (be->vmm_release(be->ctx, dev->index, gr->handle) != CCA_OK)
            orphan_push(dev, granule_addr(seg, stop), es->granule, gr->handle, false);
        gr->present = false;
        es->mapped_bytes -= es->granule;
    }
    if (stop == begin) {
        pool_block_delete(after);
        pool_block_delete(before);
        return st;
    }
    take_out(dev, block, begin, stop, before, after);
    merge_unmapped(pool, block, block->prev);
    merge_unmapped(pool, block, block->next);
    unmapped_insert(pool, block);
    if (st == CCA_OK && !block->prev && !block->next) {
        st = segment_release(dev, block);
        *released = st == CCA_OK;
        if (lend)
            st = CCA_OK; /* the growth goes on with the granules lent; the empty reservation
                          * stays (free_failed), freed by the next release of cached blocks */
    }
    return st;
}

/*
 * The allocator's half of unmapping granules [begin, stop) of the free block
 * (no longer present in the handle table): split off what stays mapped below
 * and above as free blocks (before and after: spare structs, deleted if not
 * used), leave block as the unmapped run (out of its bin, in no list), and
 * account the unmap (reserved bytes, num_device_free, the history).
 */
static void take_out(cca_device_t *dev, cca_block_t *block, size_t begin, size_t stop,
                     cca_block_t *before, cca_block_t *after)
{
    cca_pool_t *pool = block->pool;
    cca_segment_t *seg = block->segment;
    cca_expandable_t *es = seg->es;
    handles_trim(es);
    uintptr_t uaddr = granule_addr(seg, begin);
    size_t usize = (stop - begin) * es->granule;
    bins_remove(&pool->bins, block);
    size_t before_size = uaddr - block->addr;
    size_t after_size = block->size - before_size - usize;
    int64_t calls = pool_gc_calls(pool);
    if (before_size) {
        before->addr = block->addr;
        before->size = before_size;
        splice(before, block->prev, block);
        before->gc_count_base = calls;
        before->free_tick = block->free_tick;
        bins_insert(&pool->bins, before);
        before = NULL;
    }
    if (after_size) {
        after->addr = uaddr + usize;
        after->size = after_size;
        splice(after, block, block->next);
        after->gc_count_base = calls;
        after->free_tick = block->free_tick;
        bins_insert(&pool->bins, after);
        after = NULL;
    }
    if (before)
        pool_block_delete(before);
    if (after)
        pool_block_delete(after);
    block->addr = uaddr;
    block->size = usize;
    block->mapped = false;
    block->requested_size = 0;
    dev->total_allocated_memory -= usize;
    stats_lock(dev);
    stat2_dec(dev->stats.reserved_bytes, pool_stat_type(pool->is_small), (int64_t)usize);
    dev->stats.num_device_free++;
    stats_unlock(dev);
    trace_record(dev->index, CCA_TRACE_SEGMENT_UNMAP, uaddr, usize, seg->stream);
}

/* Wait for the work of stream on dev: a stream the program has destroyed
 * since cannot be waited for: then wait for the device. */
static cca_status_t wait_stream(cca_device_t *dev, cca_stream_t stream)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = be->stream_synchronize(be->ctx, dev->index, stream);
    if (st != CCA_OK && be->device_synchronize(be->ctx, dev->index) == CCA_OK)
        st = CCA_OK;
    return st;
}

/*
 * PyTorch's unmap_block (+ release_expandable_segment): unmap the whole
 * granules the free block covers once the segment's stream is done (unmap
 * and release do not wait for the GPU as cudaFree does), split off the
 * partial granules at either end as free blocks, merge the unmapped run with
 * unmapped neighbours, free the reservation if nothing is mapped.
 */
cca_status_t expandable_unmap(cca_device_t *dev, cca_block_t *block)
{
    cca_segment_t *seg = block->segment;
    size_t begin = granule_ceil(seg, block->addr);
    size_t end = granule_floor(seg, block->addr + block->size);
    if (begin >= end)
        return CCA_OK;
    cca_status_t st = wait_stream(dev, seg->stream);
    if (st != CCA_OK)
        return st;
    cca_stream_pool_t *owner = block->pool->owner;
    if (owner->ready_tick < owner->free_tick)
        owner->ready_tick = owner->free_tick; /* the stream's work is done */
    for (cca_block_t *b = dev->aliased, *next; b; b = next) {
        next = b->bin_next; /* that work's old mappings go first (another segment's, or this one's
                               beside block: not the block itself) */
        if (b->pool->owner == owner)
            alias_unmap(dev, b);
    }
    bool released;
    return unmap_granules(dev, block, begin, end, false, &released);
}

/* ---- compact_memory: free granules lent to growth ----------------------------------- */

/* Granules a growth from c (PyTorch's map_block sequence) maps for size bytes. */
static size_t granules_needed(const cca_block_t *c, size_t size)
{
    size_t need = 0, have = 0;
    for (const cca_block_t *b = c; b && have < size; b = b->next) {
        size_t take = size - have < b->size ? size - have : b->size;
        if (!b->mapped) {
            size_t g = b->segment->es->granule;
            size_t n = (take + g - 1) / g;
            need += n;
            take = n * g < b->size ? n * g : b->size;
        }
        have += take;
    }
    return need;
}

/* ---- compact_memory: which free blocks are ready to move ------------------------------ */

/* Blocks of sp returned at or before tick are done with (never moves backwards). */
static void ready_to(cca_stream_pool_t *sp, uint64_t tick)
{
    if (tick > sp->ready_tick)
        sp->ready_tick = tick;
}

/* Whether the work of b's stream on the free block b is known to be done. */
static bool block_ready(const cca_block_t *b)
{
    return b->free_tick <= b->pool->owner->ready_tick;
}

/*
 * Learn, without waiting, which free blocks of sp the stream's work is done
 * with (sp's lock held, so nothing is returned meanwhile): if the event an
 * earlier growth recorded on the stream has completed, every block returned
 * before that record is ready; then, if blocks returned since are not known
 * ready, record it again, covering every block returned so far, and ask once
 * more (an idle stream's event completes at once). A record still in flight
 * is left alone (recording again would push its answer back), so its blocks
 * become ready at a later growth. Once per lending call. Only where an event
 * call fails is the stream synchronised instead (wait_stream: the device if
 * the program destroyed the stream); then every block of sp is ready.
 */
static void readiness_refresh(cca_device_t *dev, cca_stream_pool_t *sp)
{
    cca_backend_t *be = cca_state->backend;
    if (sp->ready_stamp == dev->compact_lends)
        return;
    sp->ready_stamp = dev->compact_lends;
    cca_status_t st = CCA_OK;
    if (sp->event_pending) {
        st = be->event_query(be->ctx, dev->index, sp->ready_event);
        if (st == CCA_ERR_NOT_READY)
            return; /* the work before the record in flight is not done yet */
        if (st != CCA_OK)
            goto fallback;
        ready_to(sp, sp->event_tick);
        sp->event_pending = false;
    }
    if (sp->ready_tick == sp->free_tick)
        return; /* every block returned so far is ready */
    if (!sp->ready_event) {
        st = be->event_create(be->ctx, dev->index, &sp->ready_event);
        if (st != CCA_OK) {
            sp->ready_event = NULL;
            goto fallback;
        }
    }
    st = be->event_record(be->ctx, dev->index, sp->ready_event, sp->stream);
    if (st != CCA_OK)
        goto fallback;
    sp->event_tick = sp->free_tick;
    sp->event_pending = true;
    st = be->event_query(be->ctx, dev->index, sp->ready_event);
    if (st == CCA_ERR_NOT_READY)
        return;
    if (st != CCA_OK)
        goto fallback;
    ready_to(sp, sp->event_tick);
    sp->event_pending = false;
    return;
fallback:
    sp->event_pending = false;
    dev->compact_syncs++;
    if (wait_stream(dev, sp->stream) == CCA_OK)
        ready_to(sp, sp->free_tick);
}

/*
 * Destroy every stream's readiness event, so an emptied cache holds no
 * backend resource; what they told (ready_tick) stays true. Device lock
 * held. Returns CCA_OK or the first failure (that event stays).
 */
cca_status_t expandable_destroy_ready_events(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp || !sp->ready_event)
            continue;
        cca_spin_lock(&sp->lock);
        cca_status_t st = be->event_destroy(be->ctx, dev->index, sp->ready_event);
        if (st == CCA_OK) {
            sp->ready_event = NULL;
            sp->event_pending = false;
        } else if (result == CCA_OK) {
            result = st;
        }
        cca_spin_unlock(&sp->lock);
    }
    return result;
}

/* ---- compact_memory: aliasing granules whose stream's work is pending ------------------ */

/*
 * Lend the handles of granules [begin, end) of the free block (whole granules
 * inside it) to the growth in progress of its own stream while that stream's
 * work on them may still be queued: the growth maps them at its own address
 * (a second mapping of the same handle; work queued on the stream later runs
 * after the work queued before), and the old mappings stay in the backend
 * until the stream's event says that work is done (expandable_settle_aliases).
 * In the allocator's view the range is unmapped at once (reserved bytes,
 * num_device_free and the history as for an unmap): an aliased block, in the
 * device's aliased list, that nothing maps or allocates meanwhile. Returns
 * CCA_OK or CCA_ERR_OUT_OF_MEMORY (host memory; nothing changed).
 */
static cca_status_t alias_granules(cca_device_t *dev, cca_block_t *block, size_t begin, size_t end)
{
    cca_pool_t *pool = block->pool;
    cca_segment_t *seg = block->segment;
    cca_expandable_t *es = seg->es;
    cca_block_t *before = pool_block_new(pool, seg, 0, 0);
    cca_block_t *after = before ? pool_block_new(pool, seg, 0, 0) : NULL;
    if (!after || !lent_reserve(dev, end - begin)) {
        if (after)
            pool_block_delete(after);
        if (before)
            pool_block_delete(before);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory unmapping an expandable segment");
    }
    for (size_t i = begin; i < end; i++) {
        dev->lent[dev->lent_count++] = es->handles[i].handle;
        es->handles[i].present = false;
    }
    es->mapped_bytes -= (end - begin) * es->granule;
    take_out(dev, block, begin, end, before, after);
    block->aliased = true;
    block->bin_prev = NULL;
    block->bin_next = dev->aliased;
    if (dev->aliased)
        dev->aliased->bin_prev = block;
    dev->aliased = block;
    dev->aliased_bytes += block->size;
    dev->compact_aliased_bytes += block->size;
    dev->compact_high += block->size; /* once: the same need later takes new memory */
    return CCA_OK;
}

/*
 * Unmap the old mappings of the aliased block b (its stream's work on them
 * done; their handles are not released, being mapped elsewhere) and make it
 * unmapped address space of its pool, merged with its unmapped neighbours; a
 * reservation left with nothing mapped is freed. Granule by granule from the
 * lowest; b->requested_size (unused while aliased) holds the bytes already
 * unmapped, so a failed unmap leaves b aliased and a later call goes on from
 * there. Returns CCA_OK or the backend failure.
 */
static cca_status_t alias_unmap(cca_device_t *dev, cca_block_t *b)
{
    cca_backend_t *be = cca_state->backend;
    size_t g = b->segment->es->granule;
    for (; b->requested_size < b->size; b->requested_size += g) {
        cca_status_t st =
            be->vmm_unmap(be->ctx, dev->index, (void *)(b->addr + b->requested_size), g);
        if (st != CCA_OK)
            return st;
    }
    b->requested_size = 0;
    cca_status_t result = CCA_OK;
    if (b->bin_prev)
        b->bin_prev->bin_next = b->bin_next;
    else
        dev->aliased = b->bin_next;
    if (b->bin_next)
        b->bin_next->bin_prev = b->bin_prev;
    b->bin_prev = b->bin_next = NULL;
    b->aliased = false;
    dev->aliased_bytes -= b->size;
    cca_pool_t *pool = b->pool;
    merge_unmapped(pool, b, b->prev);
    merge_unmapped(pool, b, b->next);
    unmapped_insert(pool, b);
    if (!b->prev && !b->next) {
        cca_status_t st = segment_release(dev, b);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    return result;
}

/*
 * Unmap the old mappings of every aliased block whose stream's work is known
 * done: without waiting (a query of the stream's event, and a record when
 * none is in flight: readiness_refresh), or with wait after synchronising
 * the stream (empty_cache and the release of cached blocks). held: the stream
 * pool whose lock the caller holds (NULL: none); the others are locked in
 * turn. Device lock held. Returns CCA_OK or the first failure (what failed
 * stays aliased, or became an orphan).
 */
cca_status_t expandable_settle_aliases(cca_device_t *dev, cca_stream_pool_t *held, bool wait)
{
    cca_status_t result = CCA_OK;
    for (cca_block_t *b = dev->aliased; b;) {
        cca_block_t *next = b->bin_next;
        cca_stream_pool_t *owner = b->pool->owner;
        if (owner != held)
            pool_lock(owner);
        cca_status_t st = CCA_OK;
        if (!block_ready(b) && !wait) {
            readiness_refresh(dev, owner);
        } else if (!block_ready(b)) {
            uint64_t tick = owner->free_tick; /* the wait covers every block returned so far */
            if (owner != held)
                cca_spin_unlock(&owner->lock); /* no wait under a pool's lock */
            st = wait_stream(dev, owner->stream);
            if (owner != held)
                pool_lock(owner);
            if (st == CCA_OK)
                ready_to(owner, tick);
        }
        if (st == CCA_OK && block_ready(b))
            st = alias_unmap(dev, b);
        if (owner != held)
            cca_spin_unlock(&owner->lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
        b = next;
    }
    return result;
}

/*
 * The reserved bytes below which a growth takes new memory rather than move
 * free granules or alias its stream's pending ones: the most the device has
 * reserved after a growth plus every byte aliased so far and an eighth of
 * every byte moved (dev->compact_high), or COMPACT_ALIAS_SLACK above the most
 * bytes requested at once, if higher; never more than COMPACT_LIMIT_CAP (or,
 * where more, COMPACT_CAP_GRANULES granules) above the most requested. An
 * alias saves memory only while the program's reserve is at its peak, and a
 * loop that needs it at every step would pay its maps at every step (on an
 * H100, ResNet-50 training: 2 GB aliased per 10 steps, 3-5% a step): so each
 * aliased byte raises the limit, the first growth that needs it aliases and
 * the next one maps new memory, once, which then stays. The raises add up
 * over needs that do not come back (a loop whose shapes change at every
 * step, the GPU behind: ViT at a drawn batch, lag 1000, 5 GB aliased over 24
 * steps and 1.023 reserved over requested), so the cap keeps the reserve
 * within 2% of the program's peak wherever free granules can move; a loop
 * that needs more than that to settle moves granules at every step (the
 * short GPT-2 training trace at a lag: 1.020, a map a step, against 1.064
 * and none). cca_empty_cache starts both figures again from what the
 * program holds then (expandable_restart_limit); until the requested peak
 * changes after it, only the current requested bytes count. Device lock and
 * held's lock held.
 */
static _Atomic bool limit_off; /* tests (expandable_test_limit) */

void expandable_test_limit(bool off)
{
    atomic_store(&limit_off, off);
}

#define COMPACT_ALIAS_SLACK 100 /* parts in 10000: 1% */
#define COMPACT_MOVE_RAISE 8    /* the limit rises by 1/8 of each byte moved */
#define COMPACT_LIMIT_CAP 200   /* parts in 10000: at most 2% over the most requested, */
#define COMPACT_CAP_GRANULES 6  /* or at most this many granules over it, if more */
static size_t compact_limit(cca_device_t *dev, cca_stream_pool_t *held, bool *capped)
{
    cca_device_stats_t now;
    stats_read_held(dev, &now, held);
    const cca_stat_t *req = &now.requested_bytes[CCA_STAT_ALL];
    size_t peak = (size_t)req->current;
    if (req->peak != dev->compact_stale_peak && (size_t)req->peak > peak)
        peak = (size_t)req->peak;
    if (peak > dev->compact_requested)
        dev->compact_requested = peak; /* kept across cca_reset_peak_stats, not cca_empty_cache */
    size_t part = dev->compact_requested / 10000;
    size_t limit = dev->compact_requested + part * COMPACT_ALIAS_SLACK;
    size_t cap = part * COMPACT_LIMIT_CAP;
    if (cap < COMPACT_CAP_GRANULES * dev->vmm_granularity)
        cap = COMPACT_CAP_GRANULES * dev->vmm_granularity; /* a small program's granules */
    cap += dev->compact_requested;
    if (dev->compact_high > limit)
        limit = dev->compact_high;
    *capped = limit >= cap;
    return limit < cap ? limit : cap;
}

/*
 * cca_empty_cache: the program gave its cache back, so the limit starts
 * again from what it holds now; a phase that needs less than the one before
 * (inference after training) is not given the earlier phase's reserve to
 * grow into. Device lock held.
 */
void expandable_restart_limit(cca_device_t *dev)
{
    if (!cca_state->settings.compact_memory)
        return;
    cca_device_stats_t now;
    stats_read_held(dev, &now, NULL);
    const cca_stat_t *req = &now.requested_bytes[CCA_STAT_ALL];
    dev->compact_stale_peak = req->peak;
    dev->compact_requested = (size_t)req->current;
    dev->compact_high = dev->total_allocated_memory;
}

/*
 * Unmap up to want whole free granules of the device's compact segments of
 * the default pools, any stream, any kind, into dev->lent, keeping the range
 * [keep_lo, keep_hi) of keep_seg (the growth's run) mapped. Only blocks whose
 * stream's work is known done move (readiness_refresh: events, never a
 * wait); *pending is set when a free block with whole granules was left
 * because it is not known done yet (it may move at a later growth). The
 * growth's own kind (small or large) first: granules taken from the other
 * kind's free runs are often wanted back by it within the step (a move back
 * and forth). Each segment's pool is locked while it is looked at, so no
 * block of it is returned meanwhile. Device lock and held's lock held.
 * Returns CCA_OK (dev->lent may hold fewer than want) or the first backend
 * failure.
 */
static cca_status_t lend_free_granules(cca_device_t *dev, cca_stream_pool_t *held, size_t want,
                                       const cca_segment_t *keep_seg, uintptr_t keep_lo,
                                       uintptr_t keep_hi, bool *pending)
{
    cca_status_t st = CCA_OK;
    size_t target = dev->lent_count + want;
    dev->compact_lends++;
    /* keep_seg may be released from here on (by the settling of aliases, or every other
     * granule of it taken): only its address is compared after this read */
    bool growth_small = keep_seg->is_small;
    expandable_settle_aliases(dev, held, false); /* old mappings now done with: address space back */
    /* passes: the growth's kind (small or large), then the other kind, granules known done;
     * then, of the growth's own stream, granules still pending (aliased), only as many as
     * would otherwise take the device's reserved bytes past their high-water mark: below it,
     * new memory costs no more than the program has already held, and an alias costs maps */
    int passes = held->private_pool ? 2 : 4;
    if (!held->private_pool && !dev->compact_unlimited &&
        !atomic_load_explicit(&limit_off, memory_order_relaxed)) {
        /* only the granules that new memory would take past the limit move: below it new
         * memory stays and a loop settles, where a move at every step costs maps at every
         * step (a 20-step GPT-2 training trace, the GPU keeping up: 2 moves in all, none
         * after warm-up; with the limit on aliases only, 20, a map and an unmap a step) */
        size_t g = dev->vmm_granularity;
        size_t after = dev->total_allocated_memory + target * g; /* lent ones map again */
        size_t limit = compact_limit(dev, held, &dev->compact_capped);
        size_t excess = after > limit ? (after - limit + g - 1) / g : 0;
        if (dev->lent_count + excess < target) {
            target = dev->lent_count + excess;
            dev->compact_held_back = true;
        }
    }
    /* last, the free granules of planned ranges (plan.c), as above: a growth the rest of
     * the cache cannot cover takes them rather than new memory past the limit (the plan maps
     * them again when their places come round) */
    if (!held->private_pool && dev->compact_planned)
        passes += 4;
    for (int pass = 0; pass < passes && st == CCA_OK && dev->lent_count < target; pass++) {
        bool same_kind = pass % 2 == 0, alias = pass % 4 >= 2, in_plans = pass >= 4;
        cca_segment_t *seg = dev->segments;
        while (seg && st == CCA_OK && dev->lent_count < target) {
            cca_segment_t *next_seg = seg->next_seg;
            cca_expandable_t *es = seg->es;
            if (!es || !es->compact || es->pool->owner->private_pool ||
                es->granule != dev->vmm_granularity ||
                (seg->is_small == growth_small) != same_kind || (alias && es->pool->owner != held)) {
                seg = next_seg;
                continue;
            }
            cca_stream_pool_t *owner = es->pool->owner;
            if (owner != held)
                pool_lock(owner);
            for (cca_block_t *b = seg->head; b && st == CCA_OK && dev->lent_count < target;) {
                size_t begin = granule_ceil(seg, b->addr);
                size_t end = granule_floor(seg, b->addr + b->size);
                bool kept = seg == keep_seg && b->addr < keep_hi && b->addr + b->size > keep_lo;
                if (kept && b->addr >= keep_lo) {
                    /* a free block the growth's run starts in: only its granules above the run
                     * (ResNet-50 inference after training, lag 10: 490 free granules there,
                     * all left, and the growth mapped 428 MiB new: 1.153) */
                    size_t above = granule_ceil(seg, keep_hi);
                    begin = begin > above ? begin : above;
                    kept = false;
                } else if (kept) {
                    /* a free block a planned place starts in (expandable_map_range): only its
                     * granules below the place */
                    size_t below = granule_floor(seg, keep_lo);
                    end = end < below ? end : below;
                    kept = false;
                }
                uintptr_t plan_lo, plan_hi;
                if (!in_plans && plan_range(es->pool, seg, &plan_lo, &plan_hi) && b->addr < plan_hi &&
                    b->addr + b->size > plan_lo) {
                    /* a plan's range stays mapped (its places come round every step): only the
                     * block's granules below it, or else above it */
                    size_t pb = granule_floor(seg, plan_lo), pe = granule_ceil(seg, plan_hi);
                    if (begin < pb)
                        end = end < pb ? end : pb;
                    else
                        begin = begin > pe ? begin : pe;
                }
                if (!b->mapped || !allocatable(b) || begin >= end || kept) {
                    b = b->next;
                    continue;
                }
                if (!alias && !block_ready(b))
                    readiness_refresh(dev, owner);
                if (block_ready(b) == alias) {
                    if (!alias && (passes == 2 || owner != held))
                        *pending = true; /* movable once a later query says its work is done */
                    b = b->next;
                    continue;
                }
                size_t left = target - dev->lent_count;
                if (end - begin > left)
                    begin = end - left; /* the top granules: the rest of the block stays below */
                if (alias) {
                    cca_block_t *next = b->next;
                    st = alias_granules(dev, b, begin, end);
                    b = next;
                    continue;
                }
                bool released = false;
                /* a need that comes back at every step moves granules at every step: each
                 * moved byte raises the limit by an eighth, so after a few steps the same need
                 * maps new memory and the loop settles, while a need that comes once costs an
                 * eighth of its size at most (16 ResNet-50 steps, the GPU keeping up: a map
                 * and two unmaps a step without it, 1.012; none after warm-up with it, 1.018) */
                dev->compact_high += (end - begin) * dev->vmm_granularity / COMPACT_MOVE_RAISE;
                st = unmap_granules(dev, b, begin, end, true, &released);
                if (released)
                    break; /* the segment is gone (next_seg kept) */
                b = b->next;
            }
            if (owner != held)
                cca_spin_unlock(&owner->lock);
            seg = next_seg;
        }
    }
    return st;
}

/*
 * Give back handles lent and not used (their bytes are already unaccounted);
 * one whose release fails becomes an orphan (its record's room was made when
 * it was lent: lent_reserve).
 * With settle, a handle still mapped at an aliased block's old address (a
 * growth that failed, or did not need it) is released only once the old
 * mappings are unmapped, after a wait for their stream (held: the stream
 * pool the caller has locked): the release then frees its memory. Where that
 * fails, or without settle, the handle becomes an orphan, released later.
 */
static void lent_release(cca_device_t *dev, cca_stream_pool_t *held, bool settle)
{
    cca_backend_t *be = cca_state->backend;
    if (!orphans_reserve(dev, dev->lent_count))
        return; /* not reached: lent_reserve made the room (a lent handle must not outlive
                 * the call: the next growth, of any stream, would map it) */
    for (size_t i = 0; settle && i < dev->lent_count; i++)
        if (handle_aliased(dev, dev->lent[i])) {
            expandable_settle_aliases(dev, held, true);
            break;
        }
    while (dev->lent_count) {
        cca_phys_handle_t h = dev->lent[--dev->lent_count];
        if (handle_aliased(dev, h) || be->vmm_release(be->ctx, dev->index, h) != CCA_OK)
            orphan_push(dev, 0, 0, h, false);
    }
}

/* Whether the handle h is still mapped at an aliased block's old address. */
static bool handle_aliased(const cca_device_t *dev, cca_phys_handle_t h)
{
    for (const cca_block_t *b = dev->aliased; b; b = b->bin_next) {
        const cca_segment_t *seg = b->segment;
        size_t end = granule_floor(seg, b->addr + b->size);
        for (size_t i = granule_floor(seg, b->addr + b->requested_size); i < end; i++)
            if (seg->es->handles[i].handle == h)
                return true;
    }
    return false;
}

/* ---- growth ----------------------------------------------------------------------- */

/*
 * compact_memory: before a growth from the run at *c maps new physical
 * memory, unmap free granules elsewhere (lend_free_granules) and find the run
 * again (unmapping may have changed it or opened a lower one). Gives up on
 * lending after a few rounds; what is lent is used first by map_granules.
 * Never waits for the GPU: a growth that maps new memory because free
 * granules were not yet known done is counted (cca.compact_pending_growths).
 */
static cca_status_t compact_prepare(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **c)
{
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed))
        return CCA_OK; /* nothing moves while a capture may be under way */
    bool pending = false;
    for (int round = 0; round < 4; round++) {
        size_t need = granules_needed(*c, size);
        if (need <= dev->lent_count)
            break;
        size_t before = dev->lent_count;
        cca_segment_t *seg = (*c)->segment;
        uintptr_t lo = (*c)->addr, hi = (*c)->addr + size + seg->es->granule;
        cca_status_t st = lend_free_granules(dev, pool->owner, need - dev->lent_count, seg, lo, hi,
                                             &pending);
        if (st != CCA_OK)
            return st;
        st = find_expandable_block(dev, pool, size, c);
        if (st != CCA_OK)
            return st;
        /* nothing lent: done, unless settled aliases opened a lower run that needs more */
        if (dev->lent_count == before && granules_needed(*c, size) <= need)
            break;
    }
    if (pending && granules_needed(*c, size) > dev->lent_count)
        dev->compact_pending_growths++;
    return CCA_OK;
}

/* Count the move of the granules lent to the growth or planned place under way, if any
 * (cca.compact_moves, cca.compact_moved_bytes); true if there were. */
static bool count_moves(cca_device_t *dev)
{
    if (!dev->lent_count)
        return false;
    dev->compact_moves++;
    dev->compact_moved_bytes += dev->lent_count * dev->vmm_granularity;
    return true;
}

/*
 * PyTorch's try_allocate_expandable_block. On CCA_OK *out is a mapped block
 * of at least size bytes, out of its bin (the caller splits it). On failure
 * the granules mapped before it stay mapped, merged and cached, as in
 * PyTorch: every mapped byte is in a block and in reserved_bytes. With
 * compact_memory, free granules are lent to the growth first; handles lent
 * and not used are given back.
 */
static cca_status_t expandable_try(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **out)
{
    cca_block_t *c = NULL;
    cca_status_t st = find_expandable_block(dev, pool, size, &c);
    if (st != CCA_OK)
        return st;
    if (c->segment->es->compact && cca_state->settings.compact_memory) {
        st = compact_prepare(dev, pool, size, &c);
        if (count_moves(dev) && dev->compact_capped) /* a need the limit could not grow to */
            plan_note_moved(pool);
    }
    /* under compact_memory the memory fraction is checked here (alloc_block does not): the
     * reserved bytes once the growth has mapped its granules, lent ones included (their bytes
     * left reserved when they were unmapped) */
    if (st == CCA_OK && cca_state->settings.compact_memory && dev->set_fraction &&
        dev->total_allocated_memory + granules_needed(c, size) * c->segment->es->granule >
            dev->allowed_memory_maximum)
        st = CCA_ERR_OUT_OF_MEMORY;
    if (st == CCA_OK && !c->mapped)
        st = map_block(dev, c, c->size < size ? c->size : size, &c);
    while (st == CCA_OK && c->size < size) {
        cca_block_t *next = c->next;
        size_t remaining = size - c->size;
        st = map_block(dev, next, remaining < next->size ? remaining : next->size, &c);
    }
    if (dev->lent_count)
        lent_release(dev, pool->owner, true);
    size_t reserved = dev->total_allocated_memory;
    if (reserved > dev->compact_high)
        dev->compact_high = reserved;
    if (st != CCA_OK)
        return st;
    bins_remove(&pool->bins, c);
    *out = c;
    return CCA_OK;
}

/* The block of seg holding addr. */
static cca_block_t *block_at(const cca_segment_t *seg, uintptr_t addr)
{
    cca_block_t *b = seg->head;
    while (b && b->addr + b->size <= addr)
        b = b->next;
    return b;
}

cca_status_t expandable_map_range(cca_device_t *dev, cca_pool_t *pool, cca_block_t *c, uintptr_t addr,
                                  size_t size, bool within_limit)
{
    cca_segment_t *seg = c->segment;
    size_t g = seg->es->granule;
    size_t lo = granule_floor(seg, addr), hi = granule_ceil(seg, addr + size);
    uintptr_t lo_addr = granule_addr(seg, lo), hi_addr = granule_addr(seg, hi);
    size_t need = 0;
    for (const cca_block_t *b = c; b && b->addr < hi_addr; b = b->next)
        if (!b->mapped) {
            size_t b0 = granule_floor(seg, b->addr), b1 = granule_ceil(seg, b->addr + b->size);
            need += (b1 < hi ? b1 : hi) - (b0 > lo ? b0 : lo);
        }
    if (!need)
        return CCA_OK;
    cca_status_t st = CCA_OK;
    if (!atomic_load_explicit(&dev->route_count, memory_order_relaxed)) {
        bool pending = false;
        st = lend_free_granules(dev, pool->owner, need, seg, lo_addr, hi_addr, &pending);
        if (pending && dev->lent_count < need)
            dev->compact_pending_growths++;
        count_moves(dev);
    }
    /* every other granule of the range's segment may have been lent, the segment released */
    bool here = false;
    for (const cca_segment_t *s = dev->segments; s && !here; s = s->next_seg)
        here = s == seg;
    if (!here) {
        if (dev->lent_count)
            lent_release(dev, pool->owner, true);
        return st != CCA_OK ? st : cca_raise(CCA_ERR_INTERNAL, "compact_memory: the plan's segment is gone");
    }
    if (within_limit && st == CCA_OK) {
        /* as much of the range as the room under the limit maps (the granules lent are out
         * of the reserved bytes until they are mapped again: inside that room) */
        bool capped;
        size_t limit = compact_limit(dev, pool->owner, &capped);
        size_t room = limit > dev->total_allocated_memory ? (limit - dev->total_allocated_memory) / g : 0;
        if (room < need) {
            hi = lo + room;
            hi_addr = granule_addr(seg, hi);
            need = room;
        }
    }
    if (st == CCA_OK && dev->set_fraction &&
        dev->total_allocated_memory + (need - (need < dev->lent_count ? need : dev->lent_count)) * g >
            dev->allowed_memory_maximum)
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "compact_memory: the memory fraction leaves no room");
    /* lending may have split the blocks around the range (never those in it), or joined the
     * run it unmapped below to the range's unmapped block: from the start. No room, nothing
     * to map: that block, starting below the range, would otherwise be given a map of no
     * granules, which the backend refuses (CUDA too) */
    cca_block_t *b = st == CCA_OK && hi > lo ? block_at(seg, lo_addr) : NULL;
    while (st == CCA_OK && b && b->addr < hi_addr) {
        if (b->mapped) {
            b = b->next;
            continue;
        }
        cca_block_t *below = NULL;
        if (b->addr < lo_addr) { /* the range's granules apart from the rest of b */
            below = pool_block_new(pool, seg, b->addr, lo_addr - b->addr);
            if (!below) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for allocator bookkeeping");
                break;
            }
            unmapped_remove(pool, b);
            below->mapped = false;
            splice(below, b->prev, b);
            b->addr = lo_addr;
            b->size -= below->size;
            unmapped_insert(pool, below);
            unmapped_insert(pool, b);
        }
        size_t n = hi_addr - b->addr < b->size ? hi_addr - b->addr : b->size;
        cca_block_t *m = NULL;
        st = map_block(dev, b, n, &m);
        if (st == CCA_OK)
            b = m->next;
        else if (below)
            merge_unmapped(pool, b, below); /* b unmapped as it was: one block again */
    }
    if (dev->lent_count)
        lent_release(dev, pool->owner, true);
    if (dev->total_allocated_memory > dev->compact_high)
        dev->compact_high = dev->total_allocated_memory;
    return st;
}

cca_status_t expandable_plan_range(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_segment_t **seg,
                                   uintptr_t *base)
{
    dev->compact_planned = true; /* (lend_free_granules' passes over planned ranges from now) */
    for (cca_segment_t *s = dev->segments; s; s = s->next_seg) {
        if (!s->es || !s->es->compact || s->es->pool != pool)
            continue;
        cca_block_t *top = s->head;
        while (top->next)
            top = top->next;
        uintptr_t start = granule_addr(s, granule_ceil(s, top->addr));
        if (!top->mapped && allocatable(top) && start + size <= top->addr + top->size) {
            *seg = s;
            *base = start;
            return CCA_OK;
        }
    }
    cca_block_t *block = NULL;
    cca_status_t st = segment_create(dev, pool, &block);
    if (st != CCA_OK)
        return st;
    if (size > block->size)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "compact_memory: a plan larger than a segment");
    *seg = block->segment;
    *base = block->addr;
    return CCA_OK;
}

/*
 * The growth (expandable_try). With compact_memory, a growth under the limit
 * maps new memory rather than move free granules; where the device has no
 * new memory to give (a memory fraction, another process), the growth is
 * tried again with the free granules known done moving whatever the limit,
 * before the caller's out-of-memory path releases every cached block.
 */
cca_status_t expandable_alloc(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **out)
{
    dev->compact_held_back = false;
    dev->compact_capped = false;
    cca_status_t st = expandable_try(dev, pool, size, out);
    if (st == CCA_ERR_OUT_OF_MEMORY && dev->compact_held_back) {
        dev->compact_unlimited = true;
        st = expandable_try(dev, pool, size, out);
        dev->compact_unlimited = false;
    }
    return st;
}

/* The reservations of pool emptied before whose free failed, freed again (device and pool
 * locks held). Returns the first failure (those stay). */
static cca_status_t release_failed_reservations(cca_device_t *dev, cca_pool_t *pool)
{
    cca_status_t result = CCA_OK;
    cca_block_t *u = pool->unmapped;
    while (u) {
        cca_block_t *next = u->bin_next;
        if (u->segment->es->free_failed && !u->prev && !u->next && !u->aliased) {
            cca_status_t st = segment_release(dev, u);
            if (st != CCA_OK && result == CCA_OK)
                result = st;
        }
        u = next;
    }
    return result;
}

/*
 * The expandable half of PyTorch's release_blocks for one pool: unmap every
 * free expandable block, in (size, address) order, after freeing the
 * reservations whose free failed before. Returns the first failure (the
 * others are still tried).
 */
cca_status_t expandable_release_pool(cca_device_t *dev, cca_pool_t *pool)
{
    if (!pool->expandable_segments)
        return CCA_OK;
    cca_status_t retried = release_failed_reservations(dev, pool);
    if (!pool->expandable_segments)
        return retried; /* (its last reservation was one of them) */
    size_t n = 0;
    for (cca_block_t *b = bins_best_fit(&pool->bins, 0); b; b = bins_next(&pool->bins, b))
        n += b->segment->es != NULL;
    if (!n)
        return retried;
    cca_block_t **list = malloc(n * sizeof(*list));
    if (!list)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory releasing cached blocks");
    size_t i = 0;
    for (cca_block_t *b = bins_best_fit(&pool->bins, 0); b; b = bins_next(&pool->bins, b))
        if (b->segment->es)
            list[i++] = b;
    cca_status_t result = retried;
    for (i = 0; i < n; i++) {
        cca_status_t st = expandable_unmap(dev, list[i]);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    free(list);
    return result;
}

/* ---- peers, shutdown, snapshots ------------------------------------------------------- */

/*
 * Give device peer access to every range dev's expandable segments have
 * mapped (PyTorch's addPeer on each segment); dev->peer_mask must already
 * hold peer so later maps include it. Device lock held.
 */
cca_status_t expandable_add_peer(cca_device_t *dev, int peer)
{
    for (cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg) {
        cca_expandable_t *es = seg->es;
        if (!es)
            continue;
        for (size_t i = 0; i < es->handle_count;) {
            if (!es->handles[i].present) {
                i++;
                continue;
            }
            size_t j = i;
            while (j < es->handle_count && es->handles[j].present)
                j++;
            cca_status_t st = set_access_range(dev, seg, peer, i, j);
            if (st != CCA_OK)
                return st;
            i = j;
        }
    }
    return CCA_OK;
}

/*
 * Shutdown (no lock needed: nothing else runs): unmap and release every
 * granule and orphan, free every reservation, and unlink the expandable
 * segments with their blocks, so pool_device_shutdown sees plain ones only.
 */
void expandable_device_shutdown(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    for (cca_block_t *b = dev->aliased; b; b = b->bin_next) /* old mappings of aliased handles */
        for (size_t off = b->requested_size; off < b->size; off += b->segment->es->granule)
            be->vmm_unmap(be->ctx, dev->index, (void *)(b->addr + off), b->segment->es->granule);
    dev->aliased = NULL;
    dev->aliased_bytes = 0;
    expandable_release_orphans(dev); /* before their reservations go */
    cca_segment_t *seg = dev->segments;
    while (seg) {
        cca_segment_t *next = seg->next_seg;
        cca_expandable_t *es = seg->es;
        if (!es) {
            seg = next;
            continue;
        }
        for (size_t i = 0; i < es->handle_count; i++) {
            if (!es->handles[i].present)
                continue;
            be->vmm_unmap(be->ctx, dev->index, (void *)granule_addr(seg, i), es->granule);
            be->vmm_release(be->ctx, dev->index, es->handles[i].handle);
        }
        be->vmm_free(be->ctx, dev->index, (void *)seg->base, seg->size);
        if (seg->prev_seg)
            seg->prev_seg->next_seg = next;
        else
            dev->segments = next;
        if (next)
            next->prev_seg = seg->prev_seg;
        dev->segment_count--;
        for (cca_block_t *b = seg->head; b;) {
            cca_block_t *nb = b->next;
            free(b->stream_uses);
            free(b);
            b = nb;
        }
        free(es->handles);
        free(es);
        free(seg);
        seg = next;
    }
}
