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
 * before a growth maps new memory, compact.c lends it free granules from
 * elsewhere (dev->lent), which map_granules maps first. The two files share
 * their helpers through expandable.h.
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
 * bins.c, beside compact.c (expandable.h), below setup.c (shutdown),
 * release.c and alloc.c, its callers.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "expandable.h"
#include "trace.h"

/* ---- the unmapped list of a pool --------------------------------------------------- */

/* Insert an unmapped block into its pool's list, by address. */
void expandable_unmapped_insert(cca_pool_t *pool, cca_block_t *b)
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

void expandable_unmapped_remove(cca_pool_t *pool, cca_block_t *b)
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
    return be->vmm_set_access(be->ctx, device, (void *)expandable_granule_addr(seg, begin),
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

bool expandable_orphans_reserve(cca_device_t *dev, size_t more)
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
void expandable_orphan_push(cca_device_t *dev, uintptr_t addr, size_t size, cca_phys_handle_t handle,
                            bool mapped)
{
    dev->orphans[dev->orphan_count++] =
        (cca_vmm_orphan_t){.addr = addr, .size = size, .handle = handle, .mapped = mapped};
}

/* Unmap and release the orphans. Returns the first failure (those stay orphans). */
cca_status_t expandable_release_orphans(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    compact_lent_release(dev, NULL, false);
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
 * dev->lent instead (the growth's compact_lent_release waits for its stream first).
 */
static void map_undo(cca_device_t *dev, cca_segment_t *seg, size_t begin, size_t mapped,
                     size_t created, const cca_phys_handle_t *handles)
{
    cca_backend_t *be = cca_state->backend;
    size_t g = seg->es->granule;
    for (size_t i = begin; i < created; i++) {
        uintptr_t addr = expandable_granule_addr(seg, i);
        cca_phys_handle_t h = handles[i - begin];
        if (i < mapped && be->vmm_unmap(be->ctx, dev->index, (void *)addr, g) != CCA_OK)
            expandable_orphan_push(dev, addr, g, h, true);
        else if (compact_handle_aliased(dev, h))
            dev->lent[dev->lent_count++] = h; /* taken from there: room left */
        else if (be->vmm_release(be->ctx, dev->index, h) != CCA_OK)
            expandable_orphan_push(dev, addr, g, h, false);
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
    if (!handles_reserve(es, end) || !expandable_orphans_reserve(dev, n))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory mapping an expandable segment");
    cca_phys_handle_t local[16];
    cca_phys_handle_t *handles = n <= 16 ? local : malloc(n * sizeof(*handles));
    if (!handles)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory mapping an expandable segment");
    orphans_unmap(dev);
    for (; created < n; created++) {
        if (es->compact && dev->lent_count) {
            handles[created] = dev->lent[--dev->lent_count]; /* unmapped for this growth */
            if (dev->aliased && compact_handle_aliased(dev, handles[created]))
                *aliased = true;
            continue;
        }
        st = be->vmm_create(be->ctx, dev->index, es->granule, &handles[created]);
        if (st != CCA_OK)
            goto out_undo;
    }
    for (; mapped < n; mapped++) {
        st = be->vmm_map(be->ctx, dev->index, (void *)expandable_granule_addr(seg, begin + mapped),
                         es->granule, handles[mapped]);
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
bool expandable_allocatable(const cca_block_t *b)
{
    return b && !b->allocated && b->event_count == 0 && b->stream_use_count == 0 && !b->aliased;
}

/* Whether the free run starting at b holds size bytes. */
static bool has_address_space(const cca_block_t *b, size_t size)
{
    size_t bytes = 0;
    while (bytes < size && expandable_allocatable(b)) {
        bytes += b->size;
        b = b->next;
    }
    return bytes >= size;
}

/* The granule a new segment of this pool maps at a time (compact: the device's granularity). */
static size_t pool_granule(const cca_device_t *dev, const cca_pool_t *pool)
{
    if (cca_state->settings->compact_memory)
        return dev->vmm_granularity;
    return pool->is_small ? CCA_SMALL_BUFFER : cca_state->settings->large_segment_size;
}

/* Reserve a new expandable segment for pool; its one block (unmapped) in *out. */
cca_status_t expandable_segment_create(cca_device_t *dev, cca_pool_t *pool, cca_block_t **out)
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
    es->compact = cca_state->settings->compact_memory;
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
    expandable_unmapped_insert(pool, block);
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
cca_status_t expandable_find_block(cca_device_t *dev, cca_pool_t *pool, size_t size,
                                   cca_block_t **out)
{
    for (cca_block_t *u = pool->unmapped; u; u = u->bin_next) {
        cca_block_t *c = expandable_allocatable(u->prev) ? u->prev : u;
        if (has_address_space(c, size)) {
            *out = c;
            return CCA_OK;
        }
    }
    return expandable_segment_create(dev, pool, out);
}

/* Merge the unmapped neighbour src into the unmapped block dst. */
void expandable_merge_unmapped(cca_pool_t *pool, cca_block_t *dst, cca_block_t *src)
{
    if (!src || src->mapped || !expandable_allocatable(src))
        return;
    expandable_unmapped_remove(pool, src);
    pool_absorb_neighbour(dst, src);
    pool_block_delete(src);
}

/* Link b into its segment's block list between before and after. */
void expandable_splice(cca_block_t *b, cca_block_t *before, cca_block_t *after)
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
cca_status_t expandable_map_block(cca_device_t *dev, cca_block_t *to_map, size_t size, cca_block_t **out)
{
    cca_pool_t *pool = to_map->pool;
    cca_segment_t *seg = to_map->segment;
    size_t begin = expandable_granule_floor(seg, to_map->addr);
    size_t end = expandable_granule_ceil(seg, to_map->addr + size);
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
    expandable_unmapped_remove(pool, to_map);
    to_map->mapped = true;
    /* fresh or moved granules: no work of this stream on them; an aliased block's handles:
     * the stream's work at the old address may be pending, so the block is as if returned
     * now (known done once the stream's next event completes), should it stay free (a
     * growth failing after this map keeps it cached) and another stream's growth look at it */
    to_map->free_tick = aliased ? ++pool->owner->free_tick : 0;
    if (!to_map->prev) /* its start mapped: PyTorch's head block takes this mapping's context */
        seg->head_split = false;
    if (rest) {
        rest->mapped = false;
        expandable_splice(rest, to_map, to_map->next);
        expandable_unmapped_insert(pool, rest);
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
    trace_record_pool(dev->index, CCA_TRACE_SEGMENT_MAP, expandable_granule_addr(seg, begin), mapped,
                      seg->stream, pools_id_of(pool->owner));
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
    if (cca_state->settings->expandable_segments) {
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
cca_status_t expandable_segment_release(cca_device_t *dev, cca_block_t *block)
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
    expandable_unmapped_remove(pool, block);
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
 * of every handle lent, so giving them back (compact_lent_release) cannot fail for want of one. */
bool expandable_lent_reserve(cca_device_t *dev, size_t more)
{
    if (!expandable_orphans_reserve(dev, dev->lent_count + more))
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
cca_status_t expandable_unmap_granules(cca_device_t *dev, cca_block_t *block, size_t begin, size_t end,
                                       bool lend, bool *released)
{
    cca_backend_t *be = cca_state->backend;
    cca_pool_t *pool = block->pool;
    cca_segment_t *seg = block->segment;
    cca_expandable_t *es = seg->es;
    *released = false;
    cca_block_t *before = pool_block_new(pool, seg, 0, 0);
    cca_block_t *after = before ? pool_block_new(pool, seg, 0, 0) : NULL;
    if (!after || !expandable_orphans_reserve(dev, end - begin) ||
        (lend && !expandable_lent_reserve(dev, end - begin))) {
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
        st = be->vmm_unmap(be->ctx, dev->index, (void *)expandable_granule_addr(seg, stop), es->granule);
        if (st != CCA_OK)
            break;
        if (lend)
            dev->lent[dev->lent_count++] = gr->handle;
        else if (be->vmm_release(be->ctx, dev->index, gr->handle) != CCA_OK)
            expandable_orphan_push(dev, expandable_granule_addr(seg, stop), es->granule, gr->handle, false);
        gr->present = false;
        es->mapped_bytes -= es->granule;
    }
    if (stop == begin) {
        pool_block_delete(after);
        pool_block_delete(before);
        return st;
    }
    expandable_take_out(dev, block, begin, stop, before, after);
    expandable_merge_unmapped(pool, block, block->prev);
    expandable_merge_unmapped(pool, block, block->next);
    expandable_unmapped_insert(pool, block);
    if (st == CCA_OK && !block->prev && !block->next) {
        st = expandable_segment_release(dev, block);
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
void expandable_take_out(cca_device_t *dev, cca_block_t *block, size_t begin, size_t stop,
                         cca_block_t *before, cca_block_t *after)
{
    cca_pool_t *pool = block->pool;
    cca_segment_t *seg = block->segment;
    cca_expandable_t *es = seg->es;
    handles_trim(es);
    uintptr_t uaddr = expandable_granule_addr(seg, begin);
    size_t usize = (stop - begin) * es->granule;
    bins_remove(&pool->bins, block);
    size_t before_size = uaddr - block->addr;
    size_t after_size = block->size - before_size - usize;
    int64_t calls = pool_gc_calls(pool);
    if (before_size) {
        before->addr = block->addr;
        before->size = before_size;
        expandable_splice(before, block->prev, block);
        before->gc_count_base = calls;
        before->free_tick = block->free_tick;
        bins_insert(&pool->bins, before);
        before = NULL;
    }
    if (after_size) {
        after->addr = uaddr + usize;
        after->size = after_size;
        expandable_splice(after, block, block->next);
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
    trace_record_pool(dev->index, CCA_TRACE_SEGMENT_UNMAP, uaddr, usize, seg->stream,
                      pools_id_of(pool->owner));
}

/* Wait for the work of stream on dev: a stream the program has destroyed
 * since cannot be waited for: then wait for the device. */
cca_status_t expandable_wait_stream(cca_device_t *dev, cca_stream_t stream)
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
    size_t begin = expandable_granule_ceil(seg, block->addr);
    size_t end = expandable_granule_floor(seg, block->addr + block->size);
    if (begin >= end)
        return CCA_OK;
    cca_status_t st = expandable_wait_stream(dev, seg->stream);
    if (st != CCA_OK)
        return st;
    compact_stream_done(dev, block->pool->owner); /* its aliases' old mappings go first */
    bool released;
    return expandable_unmap_granules(dev, block, begin, end, false, &released);
}

/* ---- checkpoint restore (pool_checkpoint.c) -------------------------------------------- */

/*
 * Map every unmapped block of seg that meets [addr, addr + size), from its
 * start (whole granules) to the range's end: the range is then mapped, free
 * where it was unmapped, merged with free neighbours and binned. Returns
 * CCA_OK, or the first failure: what was mapped before it stays mapped, free.
 */
cca_status_t expandable_map_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size)
{
    uintptr_t end = addr + size;
    for (;;) {
        cca_block_t *u = seg->head;
        while (u && (u->mapped || u->addr + u->size <= addr || u->addr >= end))
            u = u->next;
        if (!u)
            return CCA_OK;
        uintptr_t stop = u->addr + u->size < end ? u->addr + u->size : end;
        cca_block_t *out;
        cca_status_t st = expandable_map_block(dev, u, stop - u->addr, &out);
        if (st != CCA_OK)
            return st;
    }
}

/*
 * Unmap the whole granules of [addr, addr + size) that free, mapped blocks of
 * seg hold, once the segment's stream is done (as expandable_unmap). Returns
 * CCA_OK, or the first failure (what was unmapped before it stays unmapped);
 * *released: nothing of seg was mapped any more and its reservation went.
 */
cca_status_t expandable_unmap_range(cca_device_t *dev, cca_segment_t *seg, uintptr_t addr, size_t size,
                                    bool *released)
{
    *released = false;
    cca_status_t st = expandable_wait_stream(dev, seg->stream);
    if (st != CCA_OK)
        return st;
    compact_stream_done(dev, seg->head->pool->owner);
    uintptr_t end = addr + size;
    for (cca_block_t *b = seg->head; b;) {
        uintptr_t lo = b->addr > addr ? b->addr : addr;
        uintptr_t hi = b->addr + b->size < end ? b->addr + b->size : end;
        size_t begin = lo < hi ? expandable_granule_ceil(seg, lo) : 0;
        size_t stop = lo < hi ? expandable_granule_floor(seg, hi) : 0;
        if (!b->mapped || !expandable_allocatable(b) || !b->in_bin || begin >= stop) {
            b = b->next;
            continue;
        }
        st = expandable_unmap_granules(dev, b, begin, stop, false, released);
        if (st != CCA_OK || *released)
            return st;
        b = seg->head; /* the blocks changed: from the start (each pass unmaps one more run) */
    }
    return CCA_OK;
}

/* ---- growth ----------------------------------------------------------------------- */

/* Granules a growth from c (PyTorch's map_block sequence) maps for size bytes. */
size_t expandable_granules_needed(const cca_block_t *c, size_t size)
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
    cca_status_t st = expandable_find_block(dev, pool, size, &c);
    if (st != CCA_OK)
        return st;
    if (c->segment->es->compact && cca_state->settings->compact_memory)
        st = compact_prepare(dev, pool, size, &c);
    /* under compact_memory the memory fraction is checked here (alloc_block does not): the
     * reserved bytes once the growth has mapped its granules, lent ones included (their bytes
     * left reserved when they were unmapped) */
    if (st == CCA_OK && cca_state->settings->compact_memory && dev->set_fraction &&
        dev->total_allocated_memory + expandable_granules_needed(c, size) * c->segment->es->granule >
            dev->allowed_memory_maximum)
        st = CCA_ERR_OUT_OF_MEMORY;
    if (st == CCA_OK && !c->mapped)
        st = expandable_map_block(dev, c, c->size < size ? c->size : size, &c);
    while (st == CCA_OK && c->size < size) {
        cca_block_t *next = c->next;
        size_t remaining = size - c->size;
        st = expandable_map_block(dev, next, remaining < next->size ? remaining : next->size, &c);
    }
    if (dev->lent_count)
        compact_lent_release(dev, pool->owner, true);
    size_t reserved = dev->total_allocated_memory;
    if (reserved > dev->compact_high)
        dev->compact_high = reserved;
    if (st != CCA_OK)
        return st;
    bins_remove(&pool->bins, c);
    *out = c;
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
            cca_status_t st = expandable_segment_release(dev, u);
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
            be->vmm_unmap(be->ctx, dev->index, (void *)expandable_granule_addr(seg, i), es->granule);
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
