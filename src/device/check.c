/*
 * check.c - the device caching allocator's invariant checker.
 *
 * With every lock of a device held it verifies, from scratch:
 *  - segments: each is tiled exactly by its blocks (addresses contiguous
 *    from the base, sizes summing to the segment size, back links right),
 *    every block belongs to the segment's stream pool of the segment's kind;
 *  - expandable segments: every granule under a mapped block is mapped and
 *    none under an unmapped block; unmapped blocks are granule-aligned, free,
 *    never in a bin, in their pool's address-ordered unmapped list exactly
 *    once, and never next to another unmapped block; mapped bytes add up;
 *    an aliased block (compact_memory: its old mappings still in the
 *    backend) is an unmapped block of a compact segment of a default pool,
 *    on the device's aliased list exactly once and in no unmapped list,
 *    next to anything; the list's bytes equal aliased_bytes;
 *  - blocks: each is exactly one of allocated, waiting for its events, set
 *    aside during a route to a private pool (on the deferred list), or free; a free block sits in exactly one bin, the bin of its own pool,
 *    bins are sorted by (size, address) and agree with their bitmaps; no two
 *    free neighbours are left unmerged;
 *  - events: the pending list's entries per block equal its event count, the
 *    pending counter and the owned-event count agree;
 *  - statistics (current values) equal what the structures imply: segments
 *    and reserved bytes per pool kind, allocations and allocated bytes,
 *    active blocks (allocated + waiting for events) and bytes, inactive split
 *    blocks and bytes (free blocks of split segments), requested bytes,
 *    oversize allocations and segments;
 *  - the pointer map holds exactly the allocated blocks (and the uncached
 *    allocations of CCA_NO_CACHING mode);
 *  - private pools: each one's segment count is the number of segments its
 *    stream pools hold, the deferred counter is the deferred list's length.
 * runtime/invariants.c adds the pinned host allocator's own check.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"

/* A block seen in the segment walk, with what the other walks found. */
typedef struct seen_block {
    const cca_block_t *block;
    uint32_t bin_visits;  /* times met in a bin */
    uint32_t event_refs;  /* pending events naming it */
    uint32_t deferred_refs; /* times on the deferred list */
    uint32_t unmapped_visits; /* times met in an unmapped list */
    uint32_t aliased_visits;  /* times met in the device's aliased list */
    bool in_map;          /* found in the pointer map */
} seen_block_t;

typedef struct check_ctx {
    char msg[512];        /* first violation */
    bool failed;
    seen_block_t *seen;   /* sorted by block pointer */
    size_t seen_count, seen_cap;
    size_t map_uncached;  /* uncached allocations in the pointer map */
} check_ctx_t;

static void fail(check_ctx_t *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void fail(check_ctx_t *c, const char *fmt, ...)
{
    if (c->failed)
        return;
    c->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->msg, sizeof(c->msg), fmt, ap);
    va_end(ap);
}

static int by_block(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)((const seen_block_t *)a)->block;
    uintptr_t y = (uintptr_t)((const seen_block_t *)b)->block;
    return x < y ? -1 : x > y;
}

static seen_block_t *seen_find(check_ctx_t *c, const cca_block_t *b)
{
    seen_block_t key = {.block = b};
    if (!c->seen_count)
        return NULL;
    return bsearch(&key, c->seen, c->seen_count, sizeof(key), by_block);
}

/* Statistics recomputed from the structures. */
typedef struct expected_stats {
    int64_t segment[CCA_STAT_TYPES], reserved[CCA_STAT_TYPES];
    int64_t allocation[CCA_STAT_TYPES], allocated_bytes[CCA_STAT_TYPES];
    int64_t active[CCA_STAT_TYPES], active_bytes[CCA_STAT_TYPES];
    int64_t inactive_split[CCA_STAT_TYPES], inactive_split_bytes[CCA_STAT_TYPES];
    int64_t requested[CCA_STAT_TYPES];
    int64_t oversize_allocations, oversize_segments;
} expected_stats_t;

static void add2(int64_t *arr, int type, int64_t v)
{
    arr[CCA_STAT_ALL] += v;
    arr[type] += v;
}

static const char *const type_names[CCA_STAT_TYPES] = {"all", "small_pool", "large_pool"};

static void compare_stat(check_ctx_t *c, int dev, const char *name, const cca_stat_t *have,
                         const int64_t *want)
{
    for (int t = 0; t < CCA_STAT_TYPES; t++)
        if (have[t].current != want[t])
            fail(c, "device %d: %s.%s.current is %" PRId64 " but the structures imply %" PRId64,
                 dev, name, type_names[t], have[t].current, want[t]);
}

/* An expandable segment's granule table against its blocks (after the tiling walk). */
static void check_granules(check_ctx_t *c, cca_device_t *dev, const cca_segment_t *seg)
{
    const cca_expandable_t *es = seg->es;
    size_t g = es->granule, present = 0;
    if (es->compact && (g != dev->vmm_granularity || es->pool != seg->head->pool)) {
        fail(c, "device %d: compact segment 0x%" PRIxPTR ": granule %zu is not the device's "
             "granularity %zu, or its pool is not its blocks'", dev->index, seg->base, g,
             dev->vmm_granularity);
        return;
    }
    if (es->handle_count > es->max_handles || es->handle_count > es->handle_cap ||
        seg->size != g * es->max_handles) {
        fail(c, "device %d: expandable segment 0x%" PRIxPTR ": granule table out of bounds",
             dev->index, seg->base);
        return;
    }
    for (size_t i = 0; i < es->handle_count; i++)
        present += es->handles[i].present;
    if (es->handle_count && !es->handles[es->handle_count - 1].present)
        fail(c, "device %d: expandable segment 0x%" PRIxPTR ": granule table not trimmed",
             dev->index, seg->base);
    if (present * g != es->mapped_bytes)
        fail(c, "device %d: expandable segment 0x%" PRIxPTR ": %zu granules mapped, mapped_bytes "
             "says %zu", dev->index, seg->base, present, es->mapped_bytes);
    size_t covered = 0;
    for (const cca_block_t *b = seg->head; b && !c->failed; b = b->next) {
        size_t first = (b->addr - seg->base) / g;
        size_t last = (b->addr + b->size - 1 - seg->base) / g;
        if (!b->mapped) {
            if ((b->addr - seg->base) % g || b->size % g)
                fail(c, "device %d: unmapped block 0x%" PRIxPTR " is not granule-aligned",
                     dev->index, b->addr);
            for (size_t i = first; i <= last && i < es->handle_count; i++)
                if (es->handles[i].present)
                    fail(c, "device %d: granule %zu under unmapped block 0x%" PRIxPTR " is mapped",
                         dev->index, i, b->addr);
            continue;
        }
        const cca_stream_pool_t *owner = b->pool->owner;
        if (b->free_tick > owner->free_tick || owner->ready_tick > owner->free_tick)
            fail(c, "device %d: block 0x%" PRIxPTR " was returned at tick %" PRIu64 ", its pool "
                 "has counted %" PRIu64 " returns and says %" PRIu64 " are done", dev->index,
                 b->addr, b->free_tick, owner->free_tick, owner->ready_tick);
        for (size_t i = first; i <= last; i++)
            if (i >= es->handle_count || !es->handles[i].present) {
                fail(c, "device %d: block 0x%" PRIxPTR " lies on unmapped granule %zu", dev->index,
                     b->addr, i);
                break;
            }
        covered += b->size;
    }
    if (!c->failed && covered != es->mapped_bytes)
        fail(c, "device %d: expandable segment 0x%" PRIxPTR ": mapped blocks hold %zu bytes, %zu "
             "are mapped", dev->index, seg->base, covered, es->mapped_bytes);
}

/* Walk the segments: tiling, pool membership, per-block state; fill seen[]. */
static void check_segments(check_ctx_t *c, cca_device_t *dev, expected_stats_t *e)
{
    size_t nseg = 0, reserved = 0;
    for (cca_segment_t *seg = dev->segments; seg && !c->failed; seg = seg->next_seg) {
        nseg++;
        if (seg->next_seg && seg->next_seg->prev_seg != seg)
            fail(c, "device %d: segment list back link broken at 0x%" PRIxPTR, dev->index, seg->base);
        int type = seg->is_small ? CCA_STAT_SMALL_POOL : CCA_STAT_LARGE_POOL;
        if (seg->es) {
            /* PyTorch counts no segment for it; reserved bytes are the mapped ones */
            add2(e->reserved, type, (int64_t)seg->es->mapped_bytes);
            reserved += seg->es->mapped_bytes;
        } else {
            add2(e->segment, type, 1);
            add2(e->reserved, type, (int64_t)seg->size);
            e->oversize_segments += seg->oversize;
            reserved += seg->size;
        }
        const cca_block_t *b = seg->head;
        if (!b || b->prev || b->addr != seg->base) {
            fail(c, "device %d: segment 0x%" PRIxPTR ": its head block is missing or not at the base",
                 dev->index, seg->base);
            break;
        }
        if (b->pool && b->pool->owner->private_pool != seg->private_pool)
            fail(c, "device %d: segment 0x%" PRIxPTR " names another private pool than its blocks'",
                 dev->index, seg->base);
        bool split = b->next != NULL && !seg->es;
        uintptr_t expect_addr = seg->base;
        size_t total = 0;
        for (; b && !c->failed; b = b->next) {
            if (b->addr != expect_addr)
                fail(c, "device %d: segment 0x%" PRIxPTR ": block at 0x%" PRIxPTR
                     " should start at 0x%" PRIxPTR " (gap or overlap)",
                     dev->index, seg->base, b->addr, expect_addr);
            if (b->size == 0 || b->size % CCA_MIN_BLOCK_SIZE)
                fail(c, "device %d: block 0x%" PRIxPTR " has size %zu, not a positive multiple of %zu",
                     dev->index, b->addr, b->size, CCA_MIN_BLOCK_SIZE);
            if (b->next && b->next->prev != b)
                fail(c, "device %d: block 0x%" PRIxPTR ": next->prev does not point back",
                     dev->index, b->addr);
            if (b->segment != seg)
                fail(c, "device %d: block 0x%" PRIxPTR " names another segment", dev->index, b->addr);
            if (!b->pool || b->pool->is_small != seg->is_small || !b->pool->owner ||
                b->pool->owner->stream != seg->stream || b->pool->owner->device != dev)
                fail(c, "device %d: block 0x%" PRIxPTR " is not in its segment's pool (stream %p, %s)",
                     dev->index, b->addr, (void *)seg->stream, seg->is_small ? "small" : "large");
            bool deferred = !b->allocated && !b->in_bin && !b->event_count && b->stream_use_count;
            int states = (int)b->allocated + (int)b->in_bin + (int)(b->event_count > 0) + deferred +
                         (int)!b->mapped;
            if (!b->mapped && !seg->es)
                fail(c, "device %d: block 0x%" PRIxPTR " of a plain segment is marked unmapped",
                     dev->index, b->addr);
            if (!b->mapped && !b->aliased && b->next && !b->next->mapped && !b->next->aliased)
                fail(c, "device %d: unmapped neighbours 0x%" PRIxPTR " and 0x%" PRIxPTR
                     " are not merged", dev->index, b->addr, b->next->addr);
            if (states != 1)
                fail(c, "device %d: block 0x%" PRIxPTR " is in %d states (allocated %d, free %d, "
                     "events %u); it must be in exactly one",
                     dev->index, b->addr, states, b->allocated, b->in_bin, b->event_count);
            if (b->in_bin && b->next && b->next->in_bin)
                fail(c, "device %d: free neighbours 0x%" PRIxPTR " and 0x%" PRIxPTR " are not merged",
                     dev->index, b->addr, b->next->addr);
            if (b->allocated) {
                add2(e->allocation, type, 1);
                add2(e->allocated_bytes, type, (int64_t)b->size);
                e->oversize_allocations += b->oversize;
            }
            if (!b->mapped) {
                /* unmapped address space: in no statistic */
            } else if (!b->in_bin) {
                add2(e->active, type, 1);
                add2(e->active_bytes, type, (int64_t)b->size);
                add2(e->requested, type, (int64_t)b->requested_size);
            } else if (split) {
                add2(e->inactive_split, type, 1);
                add2(e->inactive_split_bytes, type, (int64_t)b->size);
            }
            if (c->seen_count == c->seen_cap) {
                size_t cap = c->seen_cap ? c->seen_cap * 2 : 256;
                seen_block_t *more = realloc(c->seen, cap * sizeof(*more));
                if (!more) {
                    fail(c, "out of host memory checking invariants");
                    return;
                }
                c->seen = more;
                c->seen_cap = cap;
            }
            c->seen[c->seen_count++] = (seen_block_t){.block = b};
            expect_addr = b->addr + b->size;
            total += b->size;
        }
        if (!c->failed && total != seg->size)
            fail(c, "device %d: segment 0x%" PRIxPTR ": blocks sum to %zu bytes, segment has %zu",
                 dev->index, seg->base, total, seg->size);
        if (!c->failed && seg->es)
            check_granules(c, dev, seg);
    }
    if (!c->failed && dev->lent_count)
        fail(c, "device %d: %zu physical handles lent between calls (a growth left them)",
             dev->index, dev->lent_count);
    if (!c->failed && nseg != dev->segment_count)
        fail(c, "device %d: %zu segments listed, segment_count says %zu", dev->index, nseg,
             dev->segment_count);
    if (!c->failed && reserved != dev->total_allocated_memory)
        fail(c, "device %d: segments hold %zu bytes, total_allocated_memory says %zu", dev->index,
             reserved, dev->total_allocated_memory);
}

/* Walk one pool's bins directly: order, bitmaps, membership; count bin visits. */
static void check_pool(check_ctx_t *c, cca_device_t *dev, cca_pool_t *pool)
{
    const cca_bins_t *bins = &pool->bins;
    size_t count = 0;
    const cca_block_t *last = NULL;
    /* Only the bins the bitmap marks are walked: a block in an unmarked bin is
     * then met in no bin, which the per-block check reports. */
    for (unsigned bin = 0; bin < CCA_BIN_COUNT && !c->failed; bin++) {
        uint64_t word = bins->words[bin >> 6] >> (bin & 63);
        if (!word) {
            bin |= 63; /* rest of this word is empty */
            continue;
        }
        if (!(word & 1))
            continue;
        if (!bins->heads[bin])
            fail(c, "device %d: bin %u: bitmap says non-empty but the list is empty", dev->index, bin);
        const cca_block_t *prev = NULL;
        for (const cca_block_t *b = bins->heads[bin]; b && !c->failed; b = b->bin_next) {
            count++;
            if (b->bin_prev != prev)
                fail(c, "device %d: bin %u: back link broken at block 0x%" PRIxPTR, dev->index, bin,
                     b->addr);
            if (b->bin != bin || !b->in_bin || b->pool != pool)
                fail(c, "device %d: block 0x%" PRIxPTR " in bin %u of stream %p's %s pool belongs "
                     "elsewhere (bin %u, in_bin %d, pool %s)",
                     dev->index, b->addr, bin, (void *)pool->owner->stream,
                     pool->is_small ? "small" : "large", b->bin, b->in_bin,
                     b->pool == pool ? "same" : "other");
            if (last && (last->size > b->size || (last->size == b->size && last->addr >= b->addr)))
                fail(c, "device %d: bins out of (size, address) order at block 0x%" PRIxPTR,
                     dev->index, b->addr);
            seen_block_t *s = seen_find(c, b);
            if (!s)
                fail(c, "device %d: free block %p (0x%" PRIxPTR ") is in a bin but tiles no segment",
                     dev->index, (const void *)b, b->addr);
            else
                s->bin_visits++;
            prev = b;
            last = b;
        }
    }
    const cca_block_t *uprev = NULL;
    for (const cca_block_t *b = pool->unmapped; b && !c->failed; b = b->bin_next) {
        if (b->bin_prev != uprev || b->mapped || b->pool != pool)
            fail(c, "device %d: unmapped list of stream %p's %s pool broken at 0x%" PRIxPTR,
                 dev->index, (void *)pool->owner->stream, pool->is_small ? "small" : "large", b->addr);
        if (uprev && uprev->addr >= b->addr)
            fail(c, "device %d: unmapped list out of address order at 0x%" PRIxPTR, dev->index,
                 b->addr);
        seen_block_t *s = seen_find(c, b);
        if (!s)
            fail(c, "device %d: unmapped block 0x%" PRIxPTR " tiles no segment", dev->index, b->addr);
        else
            s->unmapped_visits++;
        uprev = b;
    }
    for (unsigned w = 0; w < CCA_BIN_WORDS && !c->failed; w++)
        if (((bins->summary >> w) & 1) != (bins->words[w] != 0))
            fail(c, "device %d: bin summary bit %u disagrees with its word", dev->index, w);
    if (!c->failed && count != bins->count)
        fail(c, "device %d: stream %p %s pool: %zu blocks in bins, count says %zu", dev->index,
             (void *)pool->owner->stream, pool->is_small ? "small" : "large", count, bins->count);
}

/* compact_memory: the aliased list's blocks, links and bytes. */
static void check_aliased(check_ctx_t *c, cca_device_t *dev)
{
    size_t bytes = 0;
    const cca_block_t *prev = NULL;
    for (const cca_block_t *b = dev->aliased; b && !c->failed; b = b->bin_next) {
        if (b->bin_prev != prev)
            fail(c, "device %d: aliased list broken at 0x%" PRIxPTR, dev->index, b->addr);
        seen_block_t *s = seen_find(c, b);
        if (!s)
            fail(c, "device %d: aliased block 0x%" PRIxPTR " tiles no segment", dev->index, b->addr);
        else
            s->aliased_visits++;
        bytes += b->size;
        prev = b;
    }
    if (!c->failed && bytes != dev->aliased_bytes)
        fail(c, "device %d: aliased blocks hold %zu bytes, aliased_bytes says %zu", dev->index,
             bytes, dev->aliased_bytes);
}

/* Pending events: each names a waiting block; list, counters agree. */
static void check_events(check_ctx_t *c, cca_device_t *dev)
{
    size_t n = 0, with_event = 0; /* (an entry with none waits for its stream's synchronisation) */
    const cca_pending_event_t *last = NULL;
    for (const cca_pending_event_t *pe = dev->events_head; pe && !c->failed; pe = pe->next) {
        n++;
        with_event += pe->event != NULL;
        last = pe;
        seen_block_t *s = seen_find(c, pe->block);
        if (!s)
            fail(c, "device %d: a pending event names a block that tiles no segment", dev->index);
        else
            s->event_refs++;
    }
    if (c->failed)
        return;
    if (dev->events_tail != last)
        fail(c, "device %d: events_tail is not the last pending event", dev->index);
    size_t counted = atomic_load(&dev->pending_event_count);
    if (counted != n)
        fail(c, "device %d: %zu pending events listed, pending_event_count says %zu", dev->index, n,
             counted);
    if (dev->events_created != with_event + dev->event_pool_count)
        fail(c, "device %d: %zu events owned, but %zu pending + %zu pooled", dev->index,
             dev->events_created, with_event, dev->event_pool_count);
    size_t nd = 0;
    for (const cca_block_t *b = dev->deferred_head; b && !c->failed; b = b->bin_next) {
        nd++;
        seen_block_t *s = seen_find(c, b);
        if (!s)
            fail(c, "device %d: a set-aside free names a block that tiles no segment", dev->index);
        else
            s->deferred_refs++;
    }
    for (size_t i = 0; i < dev->marker_count && !c->failed; i++) {
        const cca_block_t *b = dev->markers[i].block;
        bool listed = false;
        for (const cca_block_t *d = dev->deferred_head; d && !listed; d = d->bin_next)
            listed = d == b;
        if (!listed || !dev->markers[i].count)
            fail(c, "device %d: free markers name block 0x%" PRIxPTR ", which is not set aside "
                 "(or they are empty)", dev->index, b->addr);
    }
    if (!c->failed && nd != atomic_load(&dev->deferred_count))
        fail(c, "device %d: %zu set-aside frees listed, deferred_count says %u", dev->index, nd,
             (unsigned)atomic_load(&dev->deferred_count));
}

/* Each private pool's segment count against its segments (device lock held). */
static void check_private_pools(check_ctx_t *c, cca_device_t *dev)
{
    for (const cca_private_pool_t *pp = dev->private_pools; pp && !c->failed; pp = pp->next) {
        size_t n = 0;
        for (const cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg)
            n += seg->head && seg->head->pool->owner->private_pool == pp;
        if (n != pp->segment_count)
            fail(c, "device %d: private pool (%llu, %llu) holds %zu segments, its count says %zu",
                 dev->index, (unsigned long long)pp->id.first, (unsigned long long)pp->id.second, n,
                 pp->segment_count);
        if (pp->use_count < 0)
            fail(c, "device %d: private pool (%llu, %llu) has use count %d", dev->index,
                 (unsigned long long)pp->id.first, (unsigned long long)pp->id.second, pp->use_count);
    }
}

static void map_visit(cca_block_t *b, void *arg)
{
    check_ctx_t *c = arg;
    if (!b->pool) {
        c->map_uncached++;
        return;
    }
    seen_block_t *s = seen_find(c, b); /* NULL: a block of another device */
    if (s && b->allocated)
        s->in_map = true;
}

/* Cross-check the walks and the statistics of one device (all its locks held). */
static void check_device(check_ctx_t *c, cca_device_t *dev, const expected_stats_t *e)
{
    for (size_t i = 0; i < c->seen_count && !c->failed; i++) {
        const seen_block_t *s = &c->seen[i];
        const cca_block_t *b = s->block;
        if (b->in_bin && s->bin_visits != 1)
            fail(c, "device %d: free block 0x%" PRIxPTR " is in %u bins, must be in exactly one",
                 dev->index, b->addr, s->bin_visits);
        if (!b->in_bin && s->bin_visits)
            fail(c, "device %d: block 0x%" PRIxPTR " is in a bin but not marked free", dev->index,
                 b->addr);
        bool deferred = !b->allocated && !b->in_bin && !b->event_count && b->stream_use_count;
        if (s->deferred_refs != (uint32_t)deferred)
            fail(c, "device %d: block 0x%" PRIxPTR " is %s but on the set-aside list %u times",
                 dev->index, b->addr, deferred ? "set aside" : "not set aside", s->deferred_refs);
        if (s->unmapped_visits != (uint32_t)(!b->mapped && !b->aliased))
            fail(c, "device %d: block 0x%" PRIxPTR " (%s) is in %u unmapped lists", dev->index,
                 b->addr, b->mapped ? "mapped" : b->aliased ? "aliased" : "unmapped",
                 s->unmapped_visits);
        if (s->aliased_visits != (uint32_t)b->aliased)
            fail(c, "device %d: block 0x%" PRIxPTR " (%s) is in the aliased list %u times",
                 dev->index, b->addr, b->aliased ? "aliased" : "not aliased", s->aliased_visits);
        if (b->aliased && (b->mapped || !b->segment->es || !b->segment->es->compact ||
                           b->pool->owner->private_pool))
            fail(c, "device %d: aliased block 0x%" PRIxPTR " is mapped or not of a default pool's "
                 "compact segment", dev->index, b->addr);
        if (s->event_refs != b->event_count)
            fail(c, "device %d: block 0x%" PRIxPTR " counts %u events, %u are pending", dev->index,
                 b->addr, b->event_count, s->event_refs);
        if (b->allocated && !s->in_map)
            fail(c, "device %d: allocated block 0x%" PRIxPTR " is missing from the pointer map",
                 dev->index, b->addr);
    }
    if (c->failed)
        return;
    /* Without exact_peak_stats the per-operation statistics live in the default stream
     * pools, and in the device's table for private pools' operations. */
    cca_device_stats_t view = dev->stats;
    if (dev->exact_stats) {
        stats_fill_ops(dev, &view); /* every stream pool lock is held: no writer runs */
    } else {
        cca_device_stats_t table;
        memset(&table, 0, sizeof(table));
        stats_fill_ops(dev, &table);
        cca_stat_t *v[CCA_OP_STAT_ARRAYS], *pv[CCA_OP_STAT_ARRAYS];
        stats_op_arrays(&view, v);
        stats_op_arrays(&table, pv);
        for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
            for (int t = 0; t < CCA_STAT_TYPES; t++)
                v[k][t].current = pv[k][t].current;
        view.oversize_allocations.current = table.oversize_allocations.current;
        for (size_t i = 0; i < dev->pool_table_cap; i++) {
            cca_stream_pool_t *sp = atomic_load(&dev->pool_table[i]);
            if (!sp)
                continue;
            stats_op_arrays(&sp->stats, pv);
            for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
                for (int t = 0; t < CCA_STAT_TYPES; t++)
                    v[k][t].current += pv[k][t].current;
            view.oversize_allocations.current += sp->stats.oversize_allocations.current;
        }
    }
    const cca_device_stats_t *st = &view;
    compare_stat(c, dev->index, "segment", st->segment, e->segment);
    compare_stat(c, dev->index, "reserved_bytes", st->reserved_bytes, e->reserved);
    compare_stat(c, dev->index, "allocation", st->allocation, e->allocation);
    compare_stat(c, dev->index, "allocated_bytes", st->allocated_bytes, e->allocated_bytes);
    compare_stat(c, dev->index, "active", st->active, e->active);
    compare_stat(c, dev->index, "active_bytes", st->active_bytes, e->active_bytes);
    compare_stat(c, dev->index, "inactive_split", st->inactive_split, e->inactive_split);
    compare_stat(c, dev->index, "inactive_split_bytes", st->inactive_split_bytes,
                 e->inactive_split_bytes);
    compare_stat(c, dev->index, "requested_bytes", st->requested_bytes, e->requested);
    if (st->oversize_allocations.current != e->oversize_allocations)
        fail(c, "device %d: oversize_allocations.current is %" PRId64 " but %" PRId64
             " allocated blocks were counted oversize", dev->index, st->oversize_allocations.current,
             e->oversize_allocations);
    if (st->oversize_segments.current != e->oversize_segments)
        fail(c, "device %d: oversize_segments.current is %" PRId64 " but %" PRId64
             " segments were counted oversize", dev->index, st->oversize_segments.current,
             e->oversize_segments);
}

/* A device's stream pools, listed once with its lock held. */
typedef struct pool_list {
    cca_stream_pool_t **pools;
    size_t count;
} pool_list_t;

/*
 * Lock all stream pools of a device whose lock the caller holds, in the
 * allocator's order, and list the pools (the device lock keeps the table
 * fixed); or unlock them (the device lock stays held). Every device's lock is
 * taken before any pool's: the allocator takes a pool lock of one device while
 * holding another's device lock (ptrmap_pool_made ends solo mode from the
 * first pool of a second device). False: no host memory for the list
 * (nothing of this device but its lock is left locked).
 */
static void list_private(cca_stream_pool_t *sp, void *arg)
{
    pool_list_t *list = arg;
    list->pools[list->count++] = sp;
}

static bool lock_device(cca_device_t *dev, pool_list_t *list, bool lock)
{
    if (lock) {
        list->count = 0;
        list->pools = malloc((dev->pool_count + pools_stream_pool_count(dev) + 1) * sizeof(*list->pools));
        if (!list->pools)
            return false;
        for (size_t i = 0; i < dev->pool_table_cap && list->count < dev->pool_count; i++) {
            cca_stream_pool_t *sp = atomic_load(&dev->pool_table[i]);
            if (sp)
                list->pools[list->count++] = sp;
        }
        pools_for_each_stream_pool(dev, list_private, list);
    }
    for (size_t i = 0; i < list->count; i++) {
        if (lock)
            pool_lock(list->pools[i]);
        else
            cca_spin_unlock(&list->pools[i]->lock);
    }
    if (lock) {
        pthread_mutex_lock(&dev->events_lock);
        stats_lock_merged(dev); /* every stream pool lock held: no entry is being made */
    } else {
        stats_unlock(dev);
        pthread_mutex_unlock(&dev->events_lock);
        free(list->pools);
        list->pools = NULL;
    }
    return true;
}

cca_status_t device_check_invariants(char *why, size_t why_len)
{
    if (why && why_len)
        why[0] = '\0';
    if (!cca_is_initialized())
        return CCA_OK;
    cca_state_t *S = cca_state;
    check_ctx_t c;
    memset(&c, 0, sizeof(c));
    size_t pooled_allocated = 0;
    pool_list_t lists[CCA_MAX_DEVICES];
    int locked = 0;
    for (int d = 0; d < S->device_count; d++)
        pthread_mutex_lock(&S->devices[d].lock);
    while (locked < S->device_count && lock_device(&S->devices[locked], &lists[locked], true))
        locked++;
    if (locked < S->device_count)
        fail(&c, "out of host memory checking invariants");
    for (int d = 0; d < S->device_count && !c.failed; d++) {
        cca_device_t *dev = &S->devices[d];
        expected_stats_t e;
        memset(&e, 0, sizeof(e));
        c.seen_count = 0;
        check_segments(&c, dev, &e);
        if (c.failed)
            break;
        if (c.seen_count)
            qsort(c.seen, c.seen_count, sizeof(*c.seen), by_block);
        for (size_t i = 0; i < lists[d].count && !c.failed; i++) {
            cca_stream_pool_t *sp = lists[d].pools[i];
            if (sp->device != dev)
                fail(&c, "device %d: stream pool %p belongs to another device", d, (void *)sp->stream);
            check_pool(&c, dev, &sp->small);
            check_pool(&c, dev, &sp->large);
        }
        if (!c.failed)
            check_events(&c, dev);
        if (!c.failed)
            check_aliased(&c, dev);
        if (!c.failed)
            check_private_pools(&c, dev);
        if (c.failed)
            break;
        /* The map is shared by every device: count this device's blocks in it. */
        c.map_uncached = 0;
        ptrmap_for_each(S->ptrmap, map_visit, &c, ptrmap_solo(S->ptrmap)); /* every pool locked */
        for (size_t i = 0; i < c.seen_count; i++)
            pooled_allocated += c.seen[i].block->allocated;
        check_device(&c, dev, &e);
    }
    if (!c.failed) {
        /* Every map entry must be an allocated block of some device, or uncached. */
        size_t in_map = ptrmap_count(S->ptrmap, ptrmap_solo(S->ptrmap));
        if (in_map != pooled_allocated + c.map_uncached)
            fail(&c, "the pointer map holds %zu blocks, but %zu are allocated (+ %zu uncached)",
                 in_map, pooled_allocated, c.map_uncached);
        if (S->no_caching && pooled_allocated)
            fail(&c, "uncached mode, yet %zu pooled blocks are allocated", pooled_allocated);
    }
    for (int d = locked - 1; d >= 0; d--)
        lock_device(&S->devices[d], &lists[d], false);
    for (int d = S->device_count - 1; d >= 0; d--)
        pthread_mutex_unlock(&S->devices[d].lock);
    free(c.seen);
    if (!c.failed)
        return CCA_OK;
    if (why && why_len)
        snprintf(why, why_len, "%s", c.msg);
    if (!strcmp(c.msg, "out of host memory checking invariants"))
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s", c.msg);
    return cca_raise(CCA_ERR_INTERNAL, "allocator invariant violated: %s", c.msg);
}

bool device_is_valid(void)
{
    char why[512];
    if (device_check_invariants(why, sizeof(why)) == CCA_OK)
        return true;
    cca_outputf("cca: %s\n", why);
    return false;
}
