/*
 * compact.c - compact_memory (cca only): reserved memory kept close to what
 * the program has requested, by moving physical memory inside expandable
 * segments (expandable.c) to where growth needs it. docs/compact-memory.md
 * has the design and its measurements.
 *
 * Before a growth maps new memory, whole free granules of the default pools'
 * compact segments (any stream, either kind) are unmapped and their handles
 * lent to the growth (dev->lent, empty between calls); the growth's own free
 * run is never taken. A granule moves only once its stream's work on it is
 * done: each free block carries the tick of its return to its stream pool,
 * and an event the growth path records on the stream says which ticks are
 * done (queried, never waited for: granules not yet known done stay, and the
 * growth maps new memory for the rest). A growth's own stream's pending
 * granules may instead be mapped at a second address (aliased), their old
 * mappings unmapped once the stream's event completes. Moves and aliases are
 * made only past a limit near the program's peak, so that a loop settles
 * with nothing to map. Each move is an unmap and a map in the statistics and
 * the history. The planned placement (plan.c) maps its range here too.
 *
 * Invariants: no handle is lent between calls; a granule of another stream
 * moves only once known done; aliased blocks are on the device's aliased
 * list only, their bytes in aliased_bytes. Every function runs with the
 * device lock and the growth's stream pool lock held; other stream pools
 * are locked while they are looked at. Layer: beside expandable.c (they
 * share expandable.h; expandable.c calls it before a growth), below
 * release.c and plan.c, its other callers.
 */
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "expandable.h"

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
    if (expandable_wait_stream(dev, sp->stream) == CCA_OK)
        ready_to(sp, sp->free_tick);
}

/*
 * Destroy every stream's readiness event, so an emptied cache holds no
 * backend resource; what they told (ready_tick) stays true. Device lock
 * held. Returns CCA_OK or the first failure (that event stays).
 */
cca_status_t compact_destroy_ready_events(cca_device_t *dev)
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
 * until the stream's event says that work is done (compact_settle_aliases).
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
    if (!after || !expandable_lent_reserve(dev, end - begin)) {
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
    expandable_take_out(dev, block, begin, end, before, after);
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
    expandable_merge_unmapped(pool, b, b->prev);
    expandable_merge_unmapped(pool, b, b->next);
    expandable_unmapped_insert(pool, b);
    if (!b->prev && !b->next) {
        cca_status_t st = expandable_segment_release(dev, b);
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
cca_status_t compact_settle_aliases(cca_device_t *dev, cca_stream_pool_t *held, bool wait)
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
            st = expandable_wait_stream(dev, owner->stream);
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

/* The stream of owner has been waited for (expandable_unmap): every block returned to it so
 * far is ready, and the old mappings of its aliased blocks go (another segment's, or beside
 * the block being unmapped: never that block itself). */
void compact_stream_done(cca_device_t *dev, cca_stream_pool_t *owner)
{
    ready_to(owner, owner->free_tick);
    for (cca_block_t *b = dev->aliased, *next; b; b = next) {
        next = b->bin_next;
        if (b->pool->owner == owner)
            alias_unmap(dev, b);
    }
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
 * program holds then (compact_restart_limit); until the requested peak
 * changes after it, only the current requested bytes count. Device lock and
 * held's lock held.
 */
static _Atomic bool limit_off; /* tests (compact_test_limit) */

void compact_test_limit(bool off)
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
void compact_restart_limit(cca_device_t *dev)
{
    if (!cca_state->settings->compact_memory)
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
    compact_settle_aliases(dev, held, false); /* old mappings now done with: address space back */
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
                size_t begin = expandable_granule_ceil(seg, b->addr);
                size_t end = expandable_granule_floor(seg, b->addr + b->size);
                bool kept = seg == keep_seg && b->addr < keep_hi && b->addr + b->size > keep_lo;
                if (kept && b->addr >= keep_lo) {
                    /* a free block the growth's run starts in: only its granules above the run
                     * (ResNet-50 inference after training, lag 10: 490 free granules there,
                     * all left, and the growth mapped 428 MiB new: 1.153) */
                    size_t above = expandable_granule_ceil(seg, keep_hi);
                    begin = begin > above ? begin : above;
                    kept = false;
                } else if (kept) {
                    /* a free block a planned place starts in (compact_map_range): only its
                     * granules below the place */
                    size_t below = expandable_granule_floor(seg, keep_lo);
                    end = end < below ? end : below;
                    kept = false;
                }
                uintptr_t plan_lo, plan_hi;
                if (!in_plans && plan_range(es->pool, seg, &plan_lo, &plan_hi) && b->addr < plan_hi &&
                    b->addr + b->size > plan_lo) {
                    /* a plan's range stays mapped (its places come round every step): only the
                     * block's granules below it, or else above it */
                    size_t pb = expandable_granule_floor(seg, plan_lo);
                    size_t pe = expandable_granule_ceil(seg, plan_hi);
                    if (begin < pb)
                        end = end < pb ? end : pb;
                    else
                        begin = begin > pe ? begin : pe;
                }
                if (!b->mapped || !expandable_allocatable(b) || begin >= end || kept) {
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
                st = expandable_unmap_granules(dev, b, begin, end, true, &released);
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
void compact_lent_release(cca_device_t *dev, cca_stream_pool_t *held, bool settle)
{
    cca_backend_t *be = cca_state->backend;
    if (!expandable_orphans_reserve(dev, dev->lent_count))
        return; /* not reached: lent_reserve made the room (a lent handle must not outlive
                 * the call: the next growth, of any stream, would map it) */
    for (size_t i = 0; settle && i < dev->lent_count; i++)
        if (compact_handle_aliased(dev, dev->lent[i])) {
            compact_settle_aliases(dev, held, true);
            break;
        }
    while (dev->lent_count) {
        cca_phys_handle_t h = dev->lent[--dev->lent_count];
        if (compact_handle_aliased(dev, h) || be->vmm_release(be->ctx, dev->index, h) != CCA_OK)
            expandable_orphan_push(dev, 0, 0, h, false);
    }
}

/* Whether the handle h is still mapped at an aliased block's old address. */
bool compact_handle_aliased(const cca_device_t *dev, cca_phys_handle_t h)
{
    for (const cca_block_t *b = dev->aliased; b; b = b->bin_next) {
        const cca_segment_t *seg = b->segment;
        size_t end = expandable_granule_floor(seg, b->addr + b->size);
        for (size_t i = expandable_granule_floor(seg, b->addr + b->requested_size); i < end; i++)
            if (seg->es->handles[i].handle == h)
                return true;
    }
    return false;
}

/*
 * compact_memory: before a growth from the run at *c maps new physical
 * memory, unmap free granules elsewhere (lend_free_granules) and find the run
 * again (unmapping may have changed it or opened a lower one). Gives up on
 * lending after a few rounds; what is lent is used first by map_granules.
 * Never waits for the GPU: a growth that maps new memory because free
 * granules were not yet known done is counted (cca.compact_pending_growths).
 */
static cca_status_t lend_to_growth(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **c)
{
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed))
        return CCA_OK; /* nothing moves while a capture may be under way */
    bool pending = false;
    for (int round = 0; round < 4; round++) {
        size_t need = expandable_granules_needed(*c, size);
        if (need <= dev->lent_count)
            break;
        size_t before = dev->lent_count;
        cca_segment_t *seg = (*c)->segment;
        uintptr_t lo = (*c)->addr, hi = (*c)->addr + size + seg->es->granule;
        cca_status_t st = lend_free_granules(dev, pool->owner, need - dev->lent_count, seg, lo, hi,
                                             &pending);
        if (st != CCA_OK)
            return st;
        st = expandable_find_block(dev, pool, size, c);
        if (st != CCA_OK)
            return st;
        /* nothing lent: done, unless settled aliases opened a lower run that needs more */
        if (dev->lent_count == before && expandable_granules_needed(*c, size) <= need)
            break;
    }
    if (pending && expandable_granules_needed(*c, size) > dev->lent_count)
        dev->compact_pending_growths++;
    return CCA_OK;
}

/* Count the move of the granules lent to the growth or planned place under way, if any
 * (cca.compact_moves, cca.compact_moved_bytes); true if there were. */
bool compact_count_moves(cca_device_t *dev)
{
    if (!dev->lent_count)
        return false;
    dev->compact_moves++;
    dev->compact_moved_bytes += dev->lent_count * dev->vmm_granularity;
    return true;
}

/* lend_to_growth, its moves counted; a loop whose growths move granules at the limit's cap is
 * told to the plan (plan.c: the condition for planning it). */
cca_status_t compact_prepare(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_block_t **c)
{
    cca_status_t st = lend_to_growth(dev, pool, size, c);
    if (compact_count_moves(dev) && dev->compact_capped) /* a need the limit could not grow to */
        plan_note_moved(pool);
    return st;
}

/* The block of seg holding addr. */
static cca_block_t *block_at(const cca_segment_t *seg, uintptr_t addr)
{
    cca_block_t *b = seg->head;
    while (b && b->addr + b->size <= addr)
        b = b->next;
    return b;
}

cca_status_t compact_map_range(cca_device_t *dev, cca_pool_t *pool, cca_block_t *c, uintptr_t addr,
                               size_t size, bool within_limit)
{
    cca_segment_t *seg = c->segment;
    size_t g = seg->es->granule;
    size_t lo = expandable_granule_floor(seg, addr), hi = expandable_granule_ceil(seg, addr + size);
    uintptr_t lo_addr = expandable_granule_addr(seg, lo), hi_addr = expandable_granule_addr(seg, hi);
    size_t need = 0;
    for (const cca_block_t *b = c; b && b->addr < hi_addr; b = b->next)
        if (!b->mapped) {
            size_t b0 = expandable_granule_floor(seg, b->addr);
            size_t b1 = expandable_granule_ceil(seg, b->addr + b->size);
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
        compact_count_moves(dev);
    }
    /* every other granule of the range's segment may have been lent, the segment released */
    bool here = false;
    for (const cca_segment_t *s = dev->segments; s && !here; s = s->next_seg)
        here = s == seg;
    if (!here) {
        if (dev->lent_count)
            compact_lent_release(dev, pool->owner, true);
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
            hi_addr = expandable_granule_addr(seg, hi);
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
            expandable_unmapped_remove(pool, b);
            below->mapped = false;
            expandable_splice(below, b->prev, b);
            b->addr = lo_addr;
            b->size -= below->size;
            expandable_unmapped_insert(pool, below);
            expandable_unmapped_insert(pool, b);
        }
        size_t n = hi_addr - b->addr < b->size ? hi_addr - b->addr : b->size;
        cca_block_t *m = NULL;
        st = expandable_map_block(dev, b, n, &m);
        if (st == CCA_OK)
            b = m->next;
        else if (below)
            expandable_merge_unmapped(pool, b, below); /* b unmapped as it was: one block again */
    }
    if (dev->lent_count)
        compact_lent_release(dev, pool->owner, true);
    if (dev->total_allocated_memory > dev->compact_high)
        dev->compact_high = dev->total_allocated_memory;
    return st;
}

cca_status_t compact_plan_range(cca_device_t *dev, cca_pool_t *pool, size_t size, cca_segment_t **seg,
                                uintptr_t *base)
{
    dev->compact_planned = true; /* (lend_free_granules' passes over planned ranges from now) */
    for (cca_segment_t *s = dev->segments; s; s = s->next_seg) {
        if (!s->es || !s->es->compact || s->es->pool != pool)
            continue;
        cca_block_t *top = s->head;
        while (top->next)
            top = top->next;
        uintptr_t start = expandable_granule_addr(s, expandable_granule_ceil(s, top->addr));
        if (!top->mapped && expandable_allocatable(top) && start + size <= top->addr + top->size) {
            *seg = s;
            *base = start;
            return CCA_OK;
        }
    }
    cca_block_t *block = NULL;
    cca_status_t st = expandable_segment_create(dev, pool, &block);
    if (st != CCA_OK)
        return st;
    if (size > block->size)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "compact_memory: a plan larger than a segment");
    *seg = block->segment;
    *base = block->addr;
    return CCA_OK;
}
