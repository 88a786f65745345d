/*
 * replay_start.c - the state before a trace's first event (replay_start.h):
 * inferred from the snapshot's end state and the events, and built on cca.
 *
 * Inference: the snapshot's `segments` of the device give the segments (for
 * expandable segments, the mapped ranges) and the live blocks at the end;
 * the events, undone from the last to the first, give them before the first
 * event: an alloc takes its block out, a free_completed puts it back (held by
 * its stream's work until its free_requested is undone), a segment_alloc or
 * segment_map takes its range out, a segment_free or segment_unmap puts it
 * back. For a consistent trace this is what torch.utils.viz draws as
 * "allocated before the trace began", and nothing for a trace recorded from
 * an empty allocator.
 *
 * Building, with cca's calls only (the allocator's own rules make the blocks):
 * each segment, or expandable reservation, is carved by filler allocations
 * into pieces at PyTorch's addresses: the live blocks, the free stretches
 * between them and, in a reservation, the unmapped holes (a large segment is
 * made whole first, by one allocation of its size, and cut from its head).
 * Then each live block's filler is freed and the block allocated in its place
 * with its own size, from the highest address down; then the holes' fillers
 * are freed and the cache emptied, which unmaps exactly their whole granules;
 * then the free stretches' fillers are freed. A large-pool free stretch of
 * 1 MiB or less cannot be a filler of its own (the request would go to the
 * small pool): it joins a hole beside it, whose unmapping leaves it free, or
 * the block before it (in a plain segment, the rest PyTorch leaves unsplit;
 * in a reservation, split off again when the block is allocated). The peaks
 * are reset at the end: the figures cover the recorded part.
 *
 * Limits: one reservation per stream and pool kind; a segment of a private
 * pool that no event after the start touches is taken for a default one.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "replay_start.h"
#include "state.h"

cca_status_t replay_note_inconsistency(cca_replay_result_t *r, bool strict, uint64_t event, const char *fmt,
                                       ...)
{
    char text[sizeof(r->first_inconsistency)];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof(text), fmt, ap);
    va_end(ap);
    /* the first: the earliest event's (the inference meets them from the last event back) */
    if (!r->inconsistencies++ || event < r->first_inconsistency_event) {
        snprintf(r->first_inconsistency, sizeof(r->first_inconsistency), "%s", text);
        r->first_inconsistency_event = event;
    }
    if (strict)
        return cca_raise(CCA_ERR_FORMAT, "inconsistent trace: %s", text);
    return CCA_OK;
}

/* ---- inference ---------------------------------------------------------------------- */

typedef struct work_block {
    start_block_t b;
    bool alive;
} work_block_t;

typedef struct infer {
    start_range_t *ranges;
    size_t nranges, cap_ranges;
    work_block_t *blocks;
    size_t nblocks, cap_blocks;
    size_t dead;           /* 1 + the index of a removed block, whose slot a new one takes (0: none);
                              they chain through b.event, so the blocks stay as many as live at once */
    live_map_t index;      /* block address -> index + 1 (in ptr) */
} infer_t;

static bool grow(void **array, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t n = *cap ? *cap * 2 : 64;
    while (n < need)
        n *= 2;
    void *p = realloc(*array, n * elem);
    if (!p)
        return false;
    *array = p;
    *cap = n;
    return true;
}

static bool range_add(infer_t *in, const start_range_t *r)
{
    if (!grow((void **)&in->ranges, &in->cap_ranges, in->nranges + 1, sizeof(*in->ranges)))
        return false;
    in->ranges[in->nranges++] = *r;
    return true;
}

/* Take [addr, addr + size) out of the ranges; *found: some of it was there. */
static bool range_remove(infer_t *in, uint64_t addr, uint64_t size, bool *found)
{
    uint64_t end = addr + size;
    *found = false;
    for (size_t i = 0; i < in->nranges; i++) {
        start_range_t *r = &in->ranges[i];
        uint64_t lo = r->addr, hi = r->addr + r->size;
        if (hi <= addr || lo >= end)
            continue;
        *found = true;
        if (lo < addr && hi > end) { /* a hole in the middle: two ranges */
            start_range_t upper = *r;
            upper.addr = end;
            upper.size = hi - end;
            r->size = addr - lo;
            if (!range_add(in, &upper))
                return false;
        } else if (lo < addr) {
            r->size = addr - lo;
        } else if (hi > end) {
            r->addr = end;
            r->size = hi - end;
        } else {
            in->ranges[i--] = in->ranges[--in->nranges];
        }
    }
    return true;
}

static work_block_t *block_find(infer_t *in, uint64_t addr)
{
    live_entry_t *e = live_find(&in->index, addr);
    return e ? &in->blocks[e->ptr - 1] : NULL;
}

static bool block_add(infer_t *in, uint64_t addr, uint64_t requested, uint64_t size, bool pending,
                      size_t event)
{
    if (!in->dead && !grow((void **)&in->blocks, &in->cap_blocks, in->nblocks + 1, sizeof(*in->blocks)))
        return false;
    live_entry_t *e = live_put(&in->index, addr);
    if (!e)
        return false;
    size_t k = in->dead ? in->dead - 1 : in->nblocks++;
    if (in->dead)
        in->dead = in->blocks[k].b.event;
    e->ptr = k + 1;
    in->blocks[k] = (work_block_t){{addr, requested, size, pending, event, false}, true};
    return true;
}

/* Remove the block of index entry e (block_find's lookup, not made again). */
static void block_remove(infer_t *in, live_entry_t *e)
{
    work_block_t *b = &in->blocks[e->ptr - 1];
    live_del(&in->index, e);
    b->alive = false;
    b->b.event = in->dead;
    in->dead = (size_t)(b - in->blocks) + 1;
}

static bool get_u64(const pv_node_t *dict, const char *key, uint64_t *out)
{
    const pv_node_t *n = pv_dict_get(dict, key);
    int64_t v;
    if (n && pv_get_u64(n, out))
        return true;
    if (n && pv_get_int(n, &v)) {
        *out = (uint64_t)v;
        return true;
    }
    return false;
}

/* The snapshot's segments of device (the state at the end) into in. */
static cca_status_t read_end_state(const pv_node_t *root, int device, infer_t *in)
{
    const pv_node_t *segs = pv_dict_get(root, "segments");
    if (!segs || (pv_kind(segs) != PV_LIST && pv_kind(segs) != PV_TUPLE))
        return CCA_OK;
    for (size_t i = 0; i < pv_len(segs); i++) {
        const pv_node_t *s = pv_at(segs, i);
        uint64_t dev = 0;
        start_range_t r;
        memset(&r, 0, sizeof(r));
        if (pv_kind(s) != PV_DICT || (get_u64(s, "device", &dev) && dev != (uint64_t)device))
            continue;
        if (!get_u64(s, "address", &r.addr) || !get_u64(s, "total_size", &r.size) || !r.size)
            continue;
        get_u64(s, "stream", &r.stream);
        const pv_node_t *n = pv_dict_get(s, "is_expandable");
        r.expandable = n && pv_get_bool(n, &r.expandable) && r.expandable;
        n = pv_dict_get(s, "segment_type");
        r.small = n ? pv_str_eq(n, "small") : -1;
        n = pv_dict_get(s, "segment_pool_id");
        if (n && pv_len(n) == 2 && pv_get_u64(pv_at(n, 0), &r.pool.first) &&
            pv_get_u64(pv_at(n, 1), &r.pool.second))
            r.has_pool = true;
        if (!range_add(in, &r))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the snapshot's segments");
        const pv_node_t *blocks = pv_dict_get(s, "blocks");
        for (size_t k = 0; blocks && k < pv_len(blocks); k++) {
            const pv_node_t *b = pv_at(blocks, k);
            const pv_node_t *state = pv_kind(b) == PV_DICT ? pv_dict_get(b, "state") : NULL;
            bool live = state && pv_str_eq(state, "active_allocated");
            bool pending = state && pv_str_eq(state, "active_pending_free");
            uint64_t addr, size, requested;
            if (!(live || pending) || !get_u64(b, "address", &addr) || !get_u64(b, "size", &size))
                continue;
            if (!get_u64(b, "requested_size", &requested))
                requested = size;
            if (block_find(in, addr))
                continue;
            if (!block_add(in, addr, requested, size, pending, SIZE_MAX))
                return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the snapshot's blocks");
        }
    }
    return CCA_OK;
}

static int cmp_range(const void *a, const void *b)
{
    uint64_t x = ((const start_range_t *)a)->addr, y = ((const start_range_t *)b)->addr;
    return x < y ? -1 : x > y;
}

static int cmp_block(const void *a, const void *b)
{
    uint64_t x = ((const start_block_t *)a)->addr, y = ((const start_block_t *)b)->addr;
    return x < y ? -1 : x > y;
}

#define LARGE_GRANULE ((uint64_t)20 << 20)

static uint64_t round_512(uint64_t size)
{
    if (size < CCA_MIN_BLOCK_SIZE)
        return CCA_MIN_BLOCK_SIZE;
    return (size + CCA_MIN_BLOCK_SIZE - 1) & ~(uint64_t)(CCA_MIN_BLOCK_SIZE - 1);
}

/*
 * The size of each live block of a plain large segment whose size the
 * snapshot does not give (freed in the trace): PyTorch leaves a rest of
 * 1 MiB or less unsplit in the block, and the first allocation after it,
 * while it lives, lands at the head of the free block beyond it, which is
 * where it ends. A block nothing lands after keeps its rounded size and is
 * marked ambiguous (the replay may still find its end: replay.c).
 */
static void find_slack(const infer_t *in, start_block_t *blocks, size_t n, const replay_trace_t *trace)
{
    bool *open = calloc(n ? n : 1, sizeof(*open));
    if (!open)
        return; /* the rounded sizes stand */
    size_t ri = 0, candidates = 0;
    for (size_t i = 0; i < n; i++) {
        while (ri < in->nranges && in->ranges[ri].addr + in->ranges[ri].size <= blocks[i].addr)
            ri++;
        const start_range_t *rg = ri < in->nranges ? &in->ranges[ri] : NULL;
        open[i] = !blocks[i].size && rg && !rg->small && !rg->expandable;
        candidates += open[i];
        /* room for a rest: more than 1 MiB free after its rounded end (less joins it whole) */
        uint64_t next = i + 1 < n && rg && blocks[i + 1].addr < rg->addr + rg->size ? blocks[i + 1].addr
                        : rg ? rg->addr + rg->size : 0;
        blocks[i].ambiguous = open[i] && next > blocks[i].addr + round_512(blocks[i].requested) + CCA_SMALL_SIZE;
    }
    for (size_t k = 0; k < trace->count && candidates; k++) {
        const replay_event_t *e = replay_ev(trace, k);
        if ((e->kind != EV_ALLOC && e->kind != EV_FREE_REQUESTED) || e->invalid)
            continue;
        size_t lo = 0, hi = n; /* the last block at or below e->addr */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (blocks[mid].addr <= e->addr)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (!lo || !open[lo - 1])
            continue;
        start_block_t *b = &blocks[lo - 1];
        uint64_t end = b->addr + round_512(b->requested);
        if (e->kind == EV_FREE_REQUESTED) {
            if (e->addr == b->addr) {
                open[lo - 1] = false; /* freed: what lands beyond it says nothing any more */
                candidates--;
            }
        } else if (e->addr >= end && e->addr <= end + CCA_SMALL_SIZE) {
            b->size = e->addr - b->addr;
            open[lo - 1] = false;
            candidates--;
        }
    }
    for (size_t i = 0; i < n; i++)
        blocks[i].ambiguous = blocks[i].ambiguous && !blocks[i].size;
    free(open);
}

/* Undo event i (the events after it undone already). */
static cca_status_t undo_event(infer_t *in, const replay_trace_t *trace, size_t i, bool strict,
                               cca_replay_result_t *r)
{
    const replay_event_t *e = replay_ev(trace, i);
    bool found;
    work_block_t *b;
    if (e->invalid && e->kind != EV_ALLOC)
        return CCA_OK; /* left out (an invalid alloc's block still begins there) */
    switch (e->kind) {
    case EV_ALLOC: {
        live_entry_t *le = live_find(&in->index, e->addr);
        if (le) {
            block_remove(in, le);
            return CCA_OK;
        }
        return replay_note_inconsistency(r, strict, i + trace->skipped,
                                         "event %zu: a block allocated at 0x%llx is neither freed later "
                                         "nor live in the snapshot's segments", i + trace->skipped,
                                         (unsigned long long)e->addr);
    }
    case EV_FREE_COMPLETED:
        b = block_find(in, e->addr);
        /* the recording's first event: PyTorch records a free's request and completion in
         * one call unless the block was used on another stream, so the block was freed with it */
        if (i == 0 && !b)
            return CCA_OK;
        if (b)
            return replay_note_inconsistency(r, strict, i + trace->skipped,
                                             "event %zu: the block at 0x%llx is freed twice",
                                             i + trace->skipped,
                                             (unsigned long long)e->addr);
        if (!block_add(in, e->addr, e->size, 0, true, i))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        return CCA_OK;
    case EV_FREE_REQUESTED:
        b = block_find(in, e->addr);
        if (b) {
            b->b.pending = false;
            b->b.event = i;
            return CCA_OK;
        }
        if (!block_add(in, e->addr, e->size, 0, false, i))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        return CCA_OK;
    case EV_SEGMENT_ALLOC:
    case EV_SEGMENT_MAP:
        if (!range_remove(in, e->addr, e->size, &found))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        if (!found)
            return replay_note_inconsistency(r, strict, i + trace->skipped,
                                             "event %zu: memory mapped at 0x%llx is neither freed later "
                                             "nor in the snapshot's segments", i + trace->skipped,
                                             (unsigned long long)e->addr);
        return CCA_OK;
    case EV_SEGMENT_FREE:
    case EV_SEGMENT_UNMAP: {
        start_range_t rg;
        memset(&rg, 0, sizeof(rg));
        rg.addr = e->addr;
        rg.size = e->size;
        rg.stream = trace->streams[e->stream];
        rg.expandable = e->kind == EV_SEGMENT_UNMAP;
        rg.small = -1;
        if (!range_remove(in, e->addr, e->size, &found) || !range_add(in, &rg))
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        if (found)
            return replay_note_inconsistency(r, strict, i + trace->skipped,
                                             "event %zu: memory at 0x%llx is freed twice", i + trace->skipped,
                                             (unsigned long long)e->addr);
        return CCA_OK;
    }
    default:
        return CCA_OK;
    }
}

/*
 * A reservation whose lower ranges were unmapped before the first event
 * began lower than its lowest mapped byte, by whole granules: where its
 * address space from there would run into the segment or reservation above
 * it (which PyTorch's driver placed after it), it begins at the highest such
 * address that keeps clear of that one (and above the one below). From the
 * highest group down, so that each sees the base of the one above settled.
 */
static void lower_bases(replay_start_t *s, uint64_t span)
{
    for (size_t k = s->ngroups; k-- > 1;) {
        start_group_t *g = &s->groups[k - 1];
        uint64_t granule = g->small ? CCA_SMALL_BUFFER : LARGE_GRANULE;
        uint64_t size = (span + granule - 1) / granule * granule; /* as expandable.c reserves */
        uint64_t limit = s->groups[k].base, floor = k > 1 ? s->groups[k - 2].end : 0;
        if (!g->expandable || limit < size || g->base + size <= limit)
            continue;
        uint64_t steps = (g->base - (limit - size) + granule - 1) / granule;
        if (steps * granule <= g->base && g->base - steps * granule >= floor)
            g->base -= steps * granule;
    }
}

/*
 * Group the ranges (address order) into what building makes one at a time: a
 * plain segment each, and an expandable reservation for the mapped ranges of
 * one stream and pool within one span. A reservation begins at its lowest
 * mapped byte, or lower where the trace maps below it while it lives.
 */
static cca_status_t group_ranges(replay_start_t *s, const replay_trace_t *trace, uint64_t span)
{
    s->groups = calloc(s->nranges ? s->nranges : 1, sizeof(*s->groups));
    if (!s->groups)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
    int small = -1; /* the last group's pool, where known */
    for (size_t i = 0; i < s->nranges; i++) {
        const start_range_t *rg = &s->ranges[i];
        start_group_t *g = s->ngroups ? &s->groups[s->ngroups - 1] : NULL;
        /* a range unmapped in the trace has no known pool: it joins the reservation it is in */
        if (g && rg->expandable && g->expandable && g->stream == rg->stream &&
            (rg->small < 0 || small < 0 || rg->small == small) && (!rg->has_pool || !g->has_pool ||
            (g->pool.first == rg->pool.first && g->pool.second == rg->pool.second)) &&
            rg->addr + rg->size <= g->base + span) {
            g->end = rg->addr + rg->size;
            g->mapped += rg->size;
            g->nranges++;
            if (rg->small >= 0)
                g->small = (small = rg->small) > 0;
            if (rg->has_pool) {
                g->has_pool = true;
                g->pool = rg->pool;
            }
            continue;
        }
        small = rg->small;
        g = &s->groups[s->ngroups++];
        g->base = rg->addr;
        g->end = rg->addr + rg->size;
        g->mapped = rg->size;
        g->stream = rg->stream;
        g->small = rg->small > 0;
        g->expandable = rg->expandable;
        g->has_pool = rg->has_pool;
        g->pool = rg->pool;
        g->first_range = i;
        g->nranges = 1;
    }
    for (size_t k = 0; k < s->ngroups; k++) {
        start_group_t *g = &s->groups[k];
        if (!g->expandable)
            continue;
        uint64_t mapped = g->mapped;
        for (size_t i = 0; i < trace->count && mapped; i++) {
            const replay_event_t *e = replay_ev(trace, i);
            if ((e->kind != EV_SEGMENT_MAP && e->kind != EV_SEGMENT_UNMAP) || e->invalid ||
                trace->streams[e->stream] != g->stream || e->addr + span < g->end ||
                e->addr >= g->base + span)
                continue;
            bool other = false; /* in the reservation of another group */
            for (size_t o = 0; o < s->ngroups && !other; o++)
                other = o != k && s->groups[o].expandable && e->addr >= s->groups[o].base &&
                        e->addr < s->groups[o].base + span;
            if (other)
                continue;
            if (e->kind == EV_SEGMENT_UNMAP) {
                mapped -= e->size < mapped ? e->size : mapped;
            } else {
                mapped += e->size;
                if (e->addr < g->base)
                    g->base = e->addr;
            }
        }
    }
    lower_bases(s, span);
    return CCA_OK;
}

/*
 * The pool of each range the snapshot does not give (freed in the trace): that
 * of the first allocation in it (alloc_pool: the pool each event's allocation
 * was routed to), or of the release that freed it.
 */
static void find_pools(infer_t *in, const replay_trace_t *trace, const cca_mempool_id_t *alloc_pool)
{
    for (size_t i = 0; i < trace->count; i++) {
        const replay_event_t *e = replay_ev(trace, i);
        if (e->invalid || (e->kind != EV_ALLOC && e->kind != EV_SEGMENT_FREE && e->kind != EV_SEGMENT_UNMAP))
            continue;
        size_t lo = 0, hi = in->nranges; /* the last range at or below e->addr */
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (in->ranges[mid].addr <= e->addr)
                lo = mid + 1;
            else
                hi = mid;
        }
        start_range_t *rg = lo ? &in->ranges[lo - 1] : NULL;
        if (!rg || rg->has_pool || e->addr >= rg->addr + rg->size)
            continue;
        rg->has_pool = true; /* an allocation says which, and a free by a pool's release */
        rg->pool = alloc_pool[i];
    }
}

cca_status_t start_infer(const pv_node_t *root, const replay_trace_t *trace, int device, uint64_t span,
                         const cca_mempool_id_t *alloc_pool, bool strict, replay_start_t *out,
                         cca_replay_result_t *r)
{
    infer_t in;
    start_block_t *blocks = NULL;
    memset(&in, 0, sizeof(in));
    memset(out, 0, sizeof(*out));
    /* sizes no request has: counted here, left out by the replay */
    for (size_t i = 0; trace->invalid && i < trace->count; i++) {
        const replay_event_t *e = replay_ev(trace, i);
        if (e->invalid)
            replay_note_inconsistency(r, false, i + trace->skipped,
                                      "event %zu: size %lld is negative or 1 EB or more", i + trace->skipped,
                                      (long long)e->size);
    }
    cca_status_t st = read_end_state(root, device, &in);
    /* a snapshot without the device's segments says nothing of its end state: no start
     * state, and the replay reports a free it cannot explain */
    if (st != CCA_OK || !in.nranges)
        goto out;
    /* a trace that began on an empty allocator and ends as the snapshot: nothing to undo */
    bool played = !replay_forward_off && !trace->forward.broken && in.nblocks == trace->forward.blocks.count &&
                  replay_forward_ranges(&trace->forward, in.ranges, in.nranges);
    for (size_t i = 0; played && i < in.nblocks; i++)
        played = in.blocks[i].b.addr && replay_key_has(&trace->forward.blocks, in.blocks[i].b.addr);
    if (played)
        goto out;
    for (size_t i = trace->count; st == CCA_OK && i-- > 0;)
        st = undo_event(&in, trace, i, false, r);
    if (st != CCA_OK)
        goto out;
    /* keep what is left: ranges and live blocks, in address order */
    if (in.nranges)
        qsort(in.ranges, in.nranges, sizeof(*in.ranges), cmp_range);
    /* mapped ranges of a reservation that touch are one (a plain segment stays itself) */
    size_t merged = 0;
    for (size_t i = 0; i < in.nranges; i++) {
        start_range_t *last = merged ? &in.ranges[merged - 1] : NULL, *rg = &in.ranges[i];
        if (last && last->expandable && rg->expandable && last->addr + last->size == rg->addr &&
            last->stream == rg->stream && (last->small < 0 || rg->small < 0 || last->small == rg->small)) {
            last->size += rg->size;
            if (last->small < 0)
                last->small = rg->small;
            if (!last->has_pool && rg->has_pool) {
                last->has_pool = true;
                last->pool = rg->pool;
            }
            continue;
        }
        in.ranges[merged++] = *rg;
    }
    in.nranges = merged;
    if (alloc_pool)
        find_pools(&in, trace, alloc_pool);
    size_t n = 0;
    blocks = malloc((in.nblocks ? in.nblocks : 1) * sizeof(*blocks));
    if (!blocks) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        goto out;
    }
    for (size_t i = 0; i < in.nblocks; i++)
        if (in.blocks[i].alive)
            blocks[n++] = in.blocks[i].b;
    qsort(blocks, n, sizeof(*blocks), cmp_block);
    /* every block must lie in a range */
    size_t kept = 0, ri = 0;
    for (size_t i = 0; i < n; i++) {
        while (ri < in.nranges && in.ranges[ri].addr + in.ranges[ri].size <= blocks[i].addr)
            ri++;
        bool inside = ri < in.nranges && in.ranges[ri].addr <= blocks[i].addr &&
                      blocks[i].addr + (blocks[i].requested ? blocks[i].requested : 1) <=
                          in.ranges[ri].addr + in.ranges[ri].size;
        if (!inside) {
            st = replay_note_inconsistency(r, false, blocks[i].event + trace->skipped,
                                           "event %zu: a free of 0x%llx (%llu bytes), a block never "
                                           "allocated nor in a segment before the first event",
                                           blocks[i].event + trace->skipped,
                                           (unsigned long long)blocks[i].addr,
                                           (unsigned long long)blocks[i].requested);
            if (st != CCA_OK)
                goto out;
            continue;
        }
        if (in.ranges[ri].small < 0 && blocks[i].requested <= CCA_SMALL_SIZE)
            in.ranges[ri].small = 1;
        out->requested_bytes += blocks[i].requested;
        blocks[kept++] = blocks[i];
    }
    for (size_t i = 0; i < in.nranges; i++) {
        start_range_t *rg = &in.ranges[i];
        if (rg->small < 0 && !rg->expandable) /* a plain segment of the small pool is 2 MiB */
            rg->small = rg->size == CCA_SMALL_BUFFER;
        /* the large pool maps 20 MiB granules (PyTorch's default large segment size) */
        if (rg->small < 0 && rg->expandable && rg->size % LARGE_GRANULE)
            rg->small = 1;
        out->reserved_bytes += rg->size;
    }
    find_slack(&in, blocks, kept, trace);
    out->ranges = in.ranges;
    out->nranges = in.nranges;
    out->blocks = blocks;
    out->nblocks = kept;
    in.ranges = NULL;
    blocks = NULL;
    st = group_ranges(out, trace, span);
out:
    /* under strict the earliest of those met stops the replay */
    if (st == CCA_OK && strict && r->inconsistencies)
        st = cca_raise(CCA_ERR_FORMAT, "inconsistent trace: %s", r->first_inconsistency);
    free(blocks);
    free(in.ranges);
    free(in.blocks);
    free(in.index.slots);
    return st;
}

void start_free(replay_start_t *s)
{
    free(s->groups);
    free(s->ranges);
    free(s->blocks);
    memset(s, 0, sizeof(*s));
}

cca_status_t start_addresses(const replay_start_t *s, uint64_t **out, uint64_t **resv_mapped,
                             size_t *count)
{
    *out = NULL;
    *resv_mapped = NULL;
    *count = 0;
    if (!s->ngroups)
        return CCA_OK;
    uint64_t *addrs = malloc(s->ngroups * sizeof(*addrs));
    uint64_t *mapped = malloc(s->ngroups * sizeof(*mapped));
    if (!addrs || !mapped) {
        free(addrs);
        free(mapped);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
    }
    for (size_t k = 0; k < s->ngroups; k++) {
        addrs[k] = s->groups[k].base;
        mapped[k] = s->groups[k].expandable ? s->groups[k].mapped : 0;
    }
    *out = addrs;
    *resv_mapped = mapped;
    *count = s->ngroups;
    return CCA_OK;
}

/* ---- building ------------------------------------------------------------------------ */

enum { PIECE_BLOCK, PIECE_FREE, PIECE_HOLE };

typedef struct piece {
    uint64_t addr, size;      /* trace address, bytes */
    uint8_t kind;
    size_t block;             /* PIECE_BLOCK: its index in s->blocks */
    size_t first_filler, nfillers;
} piece_t;

typedef struct builder {
    const replay_start_t *s;
    piece_t *pieces;
    size_t npieces, cap_pieces;
    size_t group_first;       /* the first piece of the group being cut */
    uint64_t *fillers;        /* cca pointers, each piece's in a row */
    size_t nfillers, cap_fillers;
    bool trace_addresses;
    cca_replay_result_t *r;
} builder_t;

static bool piece_add(builder_t *b, uint64_t addr, uint64_t size, uint8_t kind, size_t block)
{
    if (!size)
        return true;
    piece_t *last = b->npieces > b->group_first ? &b->pieces[b->npieces - 1] : NULL;
    if (last && kind != PIECE_BLOCK && last->kind == kind && last->addr + last->size == addr) {
        last->size += size;
        return true;
    }
    if (!grow((void **)&b->pieces, &b->cap_pieces, b->npieces + 1, sizeof(*b->pieces)))
        return false;
    b->pieces[b->npieces++] = (piece_t){addr, size, kind, block, 0, 0};
    return true;
}

/* The free stretch [lo, hi) of group g as pieces: mapped (free) and unmapped (holes). */
static bool add_region(builder_t *b, const start_group_t *g, uint64_t lo, uint64_t hi)
{
    const start_range_t *rg = &b->s->ranges[g->first_range];
    uint64_t pos = lo;
    for (size_t i = 0; i < g->nranges && pos < hi; i++) {
        uint64_t a = rg[i].addr, e = rg[i].addr + rg[i].size;
        if (e <= pos)
            continue;
        if (a >= hi)
            break;
        if (a > pos && !piece_add(b, pos, a - pos, PIECE_HOLE, 0))
            return false;
        if (a > pos)
            pos = a;
        uint64_t stop = e < hi ? e : hi;
        if (!piece_add(b, pos, stop - pos, PIECE_FREE, 0))
            return false;
        pos = stop;
    }
    return pos >= hi || piece_add(b, pos, hi - pos, PIECE_HOLE, 0);
}

/*
 * The pieces of group g from its blocks [*bi, ...): blocks, free stretches and
 * holes from its base to its end. A large-pool free stretch of 1 MiB or less
 * joins a hole beside it, else the block before it.
 */
static bool group_pieces(builder_t *b, const start_group_t *g, size_t *bi, bool *placed)
{
    const replay_start_t *s = b->s;
    size_t first = b->npieces;
    uint64_t pos = g->base;
    b->group_first = first;
    for (; *bi < s->nblocks && s->blocks[*bi].addr < g->end; (*bi)++) {
        const start_block_t *blk = &s->blocks[*bi];
        uint64_t size = blk->size ? blk->size : alloc_round_size(cca_state->settings, blk->requested);
        if (blk->addr < pos || blk->addr + size > g->end) {
            replay_note_inconsistency(b->r, false, UINT64_MAX,
                                      "the block at 0x%llx (%llu bytes) overlaps another one",
                                      (unsigned long long)blk->addr, (unsigned long long)size);
            continue;
        }
        if (blk->addr > pos && !add_region(b, g, pos, blk->addr))
            return false;
        if (!piece_add(b, blk->addr, size, PIECE_BLOCK, *bi))
            return false;
        placed[*bi] = true;
        pos = blk->addr + size;
    }
    if (pos < g->end && !add_region(b, g, pos, g->end))
        return false;
    if (g->small)
        return true;
    for (size_t i = first; i < b->npieces; i++) {
        piece_t *p = &b->pieces[i];
        if (p->kind != PIECE_FREE || p->size > CCA_SMALL_SIZE)
            continue;
        piece_t *prev = i > first ? p - 1 : NULL, *next = i + 1 < b->npieces ? p + 1 : NULL;
        if (next && next->kind == PIECE_HOLE) {
            next->addr = p->addr;
            next->size += p->size;
        } else if (prev && (prev->kind == PIECE_HOLE || prev->kind == PIECE_BLOCK)) {
            prev->size += p->size;
        } else {
            continue;
        }
        memmove(p, p + 1, (b->npieces - i - 1) * sizeof(*p));
        b->npieces--;
        i--;
    }
    return true;
}

/* Check that cca put a piece where PyTorch had it (delta: cca's address - the trace's). */
static void check_place(builder_t *b, uint64_t got, uint64_t addr, uint64_t delta, const char *what)
{
    if (got == addr + delta)
        return;
    if (!b->r->address_mismatches)
        snprintf(b->r->first_address_mismatch, sizeof(b->r->first_address_mismatch),
                 "before the first event: %s at 0x%llx, PyTorch 0x%llx", what,
                 (unsigned long long)(got - delta), (unsigned long long)addr);
    b->r->address_mismatches++;
}

static cca_status_t start_malloc(void **p, uint64_t size, uint64_t stream)
{
    cca_status_t st = cca_malloc_device(p, size, 0, (cca_stream_t)(uintptr_t)stream);
    if (st != CCA_OK) {
        char why[sizeof(cca_last_error()->message)];
        snprintf(why, sizeof(why), "%s", cca_last_error()->message);
        return cca_raise(st, "the state before the first event cannot be built: %s", why);
    }
    return CCA_OK;
}

static bool private_pool(const start_group_t *g)
{
    return g->has_pool && (g->pool.first || g->pool.second);
}

static cca_status_t route_begin(const start_group_t *g)
{
    int count;
    cca_status_t st = CCA_OK;
    if (!private_pool(g))
        return CCA_OK;
    if (cca_pool_use_count(0, g->pool, &count) != CCA_OK)
        st = cca_pool_create(0, g->pool);
    return st == CCA_OK ? cca_begin_allocate_thread_to_pool(0, g->pool) : st;
}

/* End the route (its use of the pool given back: the pool keeps the one it was made with). */
static void route_end(const start_group_t *g)
{
    if (private_pool(g) && cca_end_allocate_to_pool(0, g->pool) == CCA_OK)
        cca_release_pool(0, g->pool);
}

/* Carve group g into its pieces [first, last) with filler allocations. */
static cca_status_t carve(builder_t *b, const start_group_t *g, size_t first, size_t last, uint64_t *delta)
{
    void *p = NULL;
    cca_status_t st = CCA_OK;
    bool have_delta = false;
    if (!g->small && last - first > 1) {
        /* one allocation maps or makes all of it, the pieces are cut from its head */
        st = start_malloc(&p, g->end - g->base, g->stream);
        if (st != CCA_OK)
            return st;
        *delta = (uint64_t)(uintptr_t)p - (b->trace_addresses ? (uint64_t)(uintptr_t)p : g->base);
        have_delta = true;
        check_place(b, (uint64_t)(uintptr_t)p, g->base, *delta, "a segment");
        cca_free(p);
    }
    for (size_t i = first; i < last; i++) {
        piece_t *pc = &b->pieces[i];
        pc->first_filler = b->nfillers;
        uint64_t chunk = g->small ? CCA_SMALL_SIZE : pc->size;
        for (uint64_t off = 0; off < pc->size; off += chunk) {
            uint64_t size = pc->size - off < chunk ? pc->size - off : chunk;
            st = start_malloc(&p, size, g->stream);
            if (st != CCA_OK)
                return st;
            if (!grow((void **)&b->fillers, &b->cap_fillers, b->nfillers + 1, sizeof(*b->fillers))) {
                cca_free(p);
                return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
            }
            b->fillers[b->nfillers++] = (uint64_t)(uintptr_t)p;
            pc->nfillers++;
            if (!have_delta) {
                uint64_t at = pc->addr + off;
                *delta = b->trace_addresses ? 0 : (uint64_t)(uintptr_t)p - at;
                have_delta = true;
            }
            check_place(b, (uint64_t)(uintptr_t)p, pc->addr + off, *delta, "a piece of a segment");
        }
    }
    return CCA_OK;
}

static void free_fillers(builder_t *b, const piece_t *pc)
{
    for (size_t k = 0; k < pc->nfillers; k++)
        cca_free((void *)(uintptr_t)b->fillers[pc->first_filler + k]);
}

cca_status_t start_build(const replay_start_t *s, cca_backend_t *sim, bool trace_addresses,
                         const cca_mempool_id_t *released, size_t nreleased, uint64_t *next_hold,
                         live_map_t *live, cca_replay_result_t *r)
{
    builder_t b;
    memset(&b, 0, sizeof(b));
    b.s = s;
    b.trace_addresses = trace_addresses;
    b.r = r;
    cca_status_t st = CCA_OK;
    size_t *group_first = calloc(s->ngroups + 1, sizeof(*group_first));
    uint64_t *delta = calloc(s->ngroups + 1, sizeof(*delta));
    bool *placed = calloc(s->nblocks + 1, sizeof(*placed));
    if (!group_first || !delta || !placed) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
        goto out;
    }
    size_t bi = 0;
    for (size_t k = 0; k < s->ngroups; k++) {
        group_first[k] = b.npieces;
        while (bi < s->nblocks && s->blocks[bi].addr < s->groups[k].base)
            bi++;
        if (!group_pieces(&b, &s->groups[k], &bi, placed)) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
            goto out;
        }
    }
    group_first[s->ngroups] = b.npieces;
    for (size_t k = 0; k < s->ngroups && st == CCA_OK; k++) {
        st = route_begin(&s->groups[k]);
        if (st == CCA_OK)
            st = carve(&b, &s->groups[k], group_first[k], group_first[k + 1], &delta[k]);
        route_end(&s->groups[k]);
    }
    if (st != CCA_OK)
        goto out;
    /* each live block in its place: its piece is the only free block of its pool then (no
     * hole is freed yet, whose mapped rests could join it), from the highest address down so
     * that what a block splits off stays beside the one above it, placed already */
    for (size_t k = s->ngroups; k-- > 0 && st == CCA_OK;) {
        const start_group_t *g = &s->groups[k];
        for (size_t i = group_first[k + 1]; i-- > group_first[k] && st == CCA_OK;) {
            piece_t *pc = &b.pieces[i];
            if (pc->kind != PIECE_BLOCK)
                continue;
            const start_block_t *blk = &s->blocks[pc->block];
            free_fillers(&b, pc);
            pc->nfillers = 0;
            void *p = NULL;
            st = route_begin(g);
            if (st == CCA_OK)
                st = start_malloc(&p, blk->requested, g->stream);
            route_end(g);
            if (st != CCA_OK)
                break;
            check_place(&b, (uint64_t)(uintptr_t)p, blk->addr, delta[k], "a block");
            live_entry_t *le = live_put(live, blk->addr);
            if (!le) {
                cca_free(p);
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the start state");
                break;
            }
            le->ptr = (uint64_t)(uintptr_t)p;
            if (blk->pending) {
                le->hold = (*next_hold)++;
                st = cca_sim_keep_manual(sim, 0, (cca_stream_t)(uintptr_t)le->hold);
                if (st == CCA_OK)
                    st = cca_record_stream(p, (cca_stream_t)(uintptr_t)le->hold);
                cca_free(p);
            }
            r->inferred_blocks++;
            r->inferred_requested_bytes += blk->requested;
        }
    }
    if (st != CCA_OK)
        goto out;
    /* the holes go back unmapped: all else is allocated (or held) now, so emptying
     * the cache unmaps exactly their whole granules */
    bool holes = false;
    for (size_t i = 0; i < b.npieces; i++) {
        if (b.pieces[i].kind == PIECE_HOLE) {
            free_fillers(&b, &b.pieces[i]);
            holes = true;
        }
    }
    /* a pool released by every user: building's own use given back (its last) */
    for (size_t k = 0; k < nreleased && st == CCA_OK; k++) {
        int count = 0;
        if (cca_pool_use_count(0, released[k], &count) == CCA_OK && count == 1)
            st = cca_release_pool(0, released[k]);
    }
    if (st != CCA_OK)
        goto out;
    if (holes && (st = cca_empty_cache()) != CCA_OK)
        goto out;
    for (size_t i = 0; i < b.npieces; i++)
        if (b.pieces[i].kind == PIECE_FREE)
            free_fillers(&b, &b.pieces[i]);
    r->inferred_segments = s->nranges;
    r->inferred_reserved_bytes = s->reserved_bytes;
    st = cca_reset_peak_stats(0);
out:
    free(group_first);
    free(delta);
    free(placed);
    free(b.pieces);
    free(b.fillers);
    return st;
}
