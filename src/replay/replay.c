/*
 * replay.c - replay a PyTorch memory snapshot's allocation history through
 * cca on a simulated device, and compare every decision with PyTorch's.
 *
 * The trace is decoded into compact events (replay_load.c), replayed on a
 * second thread as they are read (or after the reading: see spec_holds for
 * when the replay made while reading stands). alloc -> cca_malloc on the
 * event's stream; free_requested -> cca_free, and when the block's
 * free_completed comes later, the block is held by an event on a private
 * stream until then; free_completed -> that stream's work completes and the
 * block returns to its pool; oom -> the allocation is attempted and must
 * fail. Segment events are PyTorch's record, compared at the end. The
 * program's private-pool operations (cca_meta["pool_events"]: graph captures,
 * MemPool use, their release, empty_cache, a reset of the peaks) are applied
 * before the event they precede. A graph capture begins as PyTorch's
 * capture_begin does: when no other graph is alive, the default CUDA
 * generator first allocates its seed and offset (8 bytes each, on the
 * capture stream, in the default pools), and only then are allocations
 * routed to the graph's pool.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "replay_events.h"
#include "replay_observe.h"
#include "replay_live.h"
#include "replay_pools.h"
#include "replay_start.h"
#include "state.h"

/* The settings string the trace ran with (cca_meta.conf, else allocator_settings). */
static void trace_settings(const pv_node_t *root, char *buf, size_t size)
{
    const char *s = NULL;
    size_t len = 0;
    const pv_node_t *meta = pv_dict_get(root, "cca_meta");
    const pv_node_t *conf = meta ? pv_dict_get(meta, "conf") : NULL;
    if (!conf || !pv_get_str(conf, &s, &len)) {
        const pv_node_t *as = pv_dict_get(root, "allocator_settings");
        conf = as ? pv_dict_get(as, "PYTORCH_CUDA_ALLOC_CONF") : NULL;
        if (!conf || !pv_get_str(conf, &s, &len))
            s = "", len = 0;
    }
    snprintf(buf, size, "%.*s", (int)len, s);
}

/* Drop the title line (the second line) of a summary for comparison. */
static const char *skip_title(const char *text)
{
    const char *p = strchr(text, '\n');
    if (!p)
        return text;
    p = strchr(p + 1, '\n');
    return p ? p + 1 : text;
}

/*
 * PyTorch's peak reserved over the events from `from` on (and any reset of the
 * peaks among them): its reserved bytes at the end (end_reserved), less the
 * segment events undone from the last.
 */
static int64_t recorded_peak_reserved(const replay_trace_t *trace, const pool_op_t *ops, size_t nops,
                                      size_t from, int64_t end_reserved)
{
    for (size_t k = 0; k < nops; k++)
        if (ops[k].kind == POOL_RESET_PEAKS && ops[k].at > from && ops[k].at <= trace->count)
            from = ops[k].at;
    int64_t reserved = end_reserved, peak = end_reserved;
    for (size_t i = trace->count; i-- > from;) {
        const replay_event_t *e = replay_ev(trace, i);
        if (e->invalid)
            continue;
        if (e->kind == EV_SEGMENT_ALLOC || e->kind == EV_SEGMENT_MAP)
            reserved -= (int64_t)e->size;
        else if (e->kind == EV_SEGMENT_FREE || e->kind == EV_SEGMENT_UNMAP)
            reserved += (int64_t)e->size;
        if (reserved > peak)
            peak = reserved;
    }
    return peak;
}

/* Whether a memory_stats key is a current value (the rest are peaks and counts). */
static bool current_key(const char *key)
{
    size_t n = strlen(key);
    return n > 8 && !strcmp(key + n - 8, ".current");
}

/*
 * Compare the end state with the trace's cca_meta. For a replay of the
 * recorded part only (a start state inferred, or peaks from an event on),
 * PyTorch's peak reserved is taken over that part, and only the current
 * values compare (peaks and counts before the recording are unknown).
 */
static void compare_expected(const pv_node_t *root, const replay_trace_t *trace, const pool_op_t *ops,
                             size_t nops, size_t peaks_from, cca_replay_result_t *r)
{
    for (size_t i = 0; i < trace->count; i++) {
        switch (replay_ev(trace, i)->kind) {
        case EV_ALLOC: r->expected_allocs++; break;
        case EV_SEGMENT_ALLOC: case EV_SEGMENT_MAP: r->expected_segment_allocs++; break;
        case EV_SEGMENT_FREE: case EV_SEGMENT_UNMAP: r->expected_segment_frees++; break;
        case EV_OOM: r->expected_ooms++; break;
        default: break;
        }
    }
    const pv_node_t *meta = pv_dict_get(root, "cca_meta");
    const pv_node_t *fstats = meta ? pv_dict_get(meta, "final_memory_stats") : NULL;
    const pv_node_t *fsummary = meta ? pv_dict_get(meta, "final_memory_summary") : NULL;
    if (!fstats || pv_kind(fstats) != PV_DICT || r->device != 0)
        return; /* cca_meta describes device 0 */
    r->has_expected = true;
    bool part = r->recorded_part_only || peaks_from;
    int64_t v;
    const char *key = part ? "reserved_bytes.all.current" : "reserved_bytes.all.peak";
    const pv_node_t *pr = pv_dict_get(fstats, key);
    if (pr && pv_get_int(pr, &v))
        r->expected_peak_reserved_bytes = part ? recorded_peak_reserved(trace, ops, nops, peaks_from, v) : v;
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++) {
        if (r->recorded_part_only && !current_key(r->memory_stats[i].key))
            continue;
        const pv_node_t *node = pv_dict_get(fstats, r->memory_stats[i].key);
        bool same = node && pv_get_int(node, &v) && v == r->memory_stats[i].value;
        if (!same) {
            if (!r->stats_mismatches)
                snprintf(r->first_stats_mismatch, sizeof(r->first_stats_mismatch),
                         "%s: cca %lld, trace %lld", r->memory_stats[i].key,
                         (long long)r->memory_stats[i].value, node ? (long long)v : -1ll);
            r->stats_mismatches++;
        }
    }
    const char *text;
    size_t len;
    if (!r->recorded_part_only && fsummary && pv_get_str(fsummary, &text, &len) && r->memory_summary) {
        char *copy = strndup(text, len);
        r->summary_matches = copy && !strcmp(skip_title(copy), skip_title(r->memory_summary));
        free(copy);
    }
}

/* ---- the replay loop ----------------------------------------------------------------- */

/* Private streams holding deferred frees live far from any real stream handle. */
#define HOLD_STREAM_BASE 0xcca0000000000000ull

/*
 * The addresses the simulated backend hands out, in the order PyTorch got
 * them: each segment_alloc's, and the base of each expandable segment's
 * reservation, which is the first range mapped outside every live
 * reservation (a reservation spans less than 9/8 of the device plus a
 * granule and is freed when nothing in it is mapped). Read event by event, so
 * the list can grow while the trace is read.
 */
typedef struct addr_rule {
    struct {
        uint64_t base, mapped;
    } resv[64];
    size_t nresv;
    uint64_t span;  /* 9/8 of the device */
    size_t next;    /* events read so far */
} addr_rule_t;

/* Read events next .. upto - 1, stopping once cap addresses were found; returns the count. */
static size_t addr_rule_scan(addr_rule_t *ar, const replay_trace_t *trace, size_t upto, uint64_t *out,
                             size_t cap)
{
    size_t got = 0;
    for (; ar->next < upto && got < cap; ar->next++) {
        const replay_event_t *e = replay_ev(trace, ar->next);
        if (e->kind == EV_SEGMENT_ALLOC) {
            out[got++] = e->addr;
            continue;
        }
        if (e->kind != EV_SEGMENT_MAP && e->kind != EV_SEGMENT_UNMAP)
            continue;
        size_t r = 0;
        while (r < ar->nresv && !(e->addr >= ar->resv[r].base && e->addr < ar->resv[r].base + ar->span))
            r++;
        if (e->kind == EV_SEGMENT_MAP) {
            if (r == ar->nresv) {
                if (ar->nresv == sizeof(ar->resv) / sizeof(ar->resv[0]))
                    continue; /* more live reservations than any trace has: leave it to the rule */
                ar->resv[ar->nresv].base = e->addr;
                ar->resv[ar->nresv++].mapped = 0;
                out[got++] = e->addr;
            }
            ar->resv[r].mapped += e->size;
        } else if (r < ar->nresv) {
            ar->resv[r].mapped -= e->size < ar->resv[r].mapped ? e->size : ar->resv[r].mapped;
            if (!ar->resv[r].mapped)
                ar->resv[r] = ar->resv[--ar->nresv];
        }
    }
    return got;
}

/*
 * The events a replay runs: what it has seen of them, the address rule's place
 * in them, and the time it spent waiting for the reader. A trace read whole
 * has no feed and a view of every event; a replay running while its trace is
 * read (on its own thread) follows the reader's feed.
 */
typedef struct replay_stream {
    replay_feed_t *feed;        /* NULL: the trace is read whole */
    const replay_trace_t *trace;
    replay_view_t view;
    addr_rule_t rule;
    uint64_t wait_ns;
    const replay_observer_t *observer; /* NULL: none (replay_observe.h) */
    const replay_start_t *start; /* the state before the first event (NULL: none) */
    const uint64_t *start_addrs; /* the addresses building it takes, handed out first */
    size_t nstart_addrs, next_start_addr;
    uint64_t start_allocs, start_frees; /* backend calls building it made */
    const pool_carry_t *carry;   /* the private pools then */
    size_t ncarry;
    unsigned live_graphs;        /* graphs alive then */
    /* the first allocation cca placed elsewhere than PyTorch, right after a live block (a start
     * block whose unsplit rest may be missing): the block, and the free block cca split */
    bool mm_set;
    size_t mm_event;
    uint64_t mm_prev, mm_prev_size, mm_free, mm_round;
} replay_stream_t;

/* Whether an event past i is (or becomes) available; waits for the reader if needed. */
static bool stream_more(replay_stream_t *s, size_t i)
{
    if (s->view.published > i)
        return true;
    if (s->view.done)
        return false;
    uint64_t t0 = cca_now_ns();
    bool more = replay_feed_wait(s->feed, i, &s->view);
    s->wait_ns += cca_now_ns() - t0;
    return more;
}

/* The simulated backend's address source (cca_sim_set_address_source): the trace's addresses. */
static bool stream_addresses(void *ctx, uint64_t *out, size_t cap, size_t *got)
{
    replay_stream_t *s = ctx;
    *got = 0;
    while (s->next_start_addr < s->nstart_addrs && *got < cap)
        out[(*got)++] = s->start_addrs[s->next_start_addr++];
    if (*got)
        return true;
    for (;;) {
        *got = addr_rule_scan(&s->rule, s->trace, s->view.published, out, cap);
        if (*got)
            return true;
        if (!stream_more(s, s->rule.next))
            return false;
    }
}

/*
 * The backend call counts each time they changed, so that the second half's
 * can be told once the number of events is known (a trace read while it is
 * replayed ends only at the end).
 */
typedef struct calls_log {
    struct calls_mark {
        size_t at;               /* the counts before event `at` (after its pool operations) */
        uint64_t allocs, frees;
    } *marks;
    size_t count, cap;
} calls_log_t;

/* Note dev's counts before event at if they changed; false when out of memory. */
static bool calls_log_mark(calls_log_t *log, size_t at, const cca_device_t *dev)
{
    uint64_t allocs = (uint64_t)dev->stats.num_device_alloc, frees = (uint64_t)dev->stats.num_device_free;
    if (log->count && log->marks[log->count - 1].allocs == allocs && log->marks[log->count - 1].frees == frees)
        return true;
    if (log->count == log->cap) {
        size_t cap = log->cap ? 2 * log->cap : 256;
        struct calls_mark *m = realloc(log->marks, cap * sizeof(*m));
        if (!m)
            return false;
        log->marks = m;
        log->cap = cap;
    }
    log->marks[log->count++] = (struct calls_mark){at, allocs, frees};
    return true;
}

/* The counts before event at (the last change at or before it). */
static const struct calls_mark *calls_log_at(const calls_log_t *log, size_t at)
{
    size_t k = 0;
    while (k + 1 < log->count && log->marks[k + 1].at <= at)
        k++;
    return log->count && log->marks[k].at <= at ? &log->marks[k] : NULL;
}

/*
 * The period of a trace's allocation sizes (n of them), as
 * scripts/periodic_plan_bound.py finds it: the shift p >= 2 at which the last
 * two thirds of the sizes repeat best, 90% alike or more, the shortest of
 * equals. Only shifts that map six or more of the last eight allocations
 * onto allocations of their sizes are tried (a period maps nearly all of them
 * so, a chance shift seldom); a shift is given up once a tenth of its span
 * differs, or a quarter of the span's first PERIOD_PROBE sizes (a shift that
 * is no period differs nearly everywhere), and the search once it has made
 * PERIOD_WORK comparisons, so that a trace of any length pays little for it.
 * 0: none found, or no memory.
 */
#define PERIOD_PROBE 512
#define PERIOD_WORK ((uint64_t)1 << 24)
static size_t find_period(const uint64_t *sizes, size_t n)
{
    if (n < 16)
        return 0;
    size_t lo = n / 3, half = n / 2;
    uint8_t *mapped = calloc(half, 1); /* at p: how many of the last 8 shift p maps onto their size */
    if (!mapped)
        return 0;
    for (size_t t = n - 1; t + 8 >= n; t--)
        for (size_t p = 2; p < half && p <= t; p++)
            mapped[p] += sizes[t - p] == sizes[t];
    size_t best = 0;
    uint64_t best_same = 0, best_span = 1, work = 0;
    for (size_t p = 2; p < half && work < PERIOD_WORK; p++) {
        if (mapped[p] < 6)
            continue;
        size_t span = n - p - lo;
        if (span < 8)
            break;
        size_t allowed = span - (span * 9 + 9) / 10; /* differences below 90% alike */
        size_t probe = span < PERIOD_PROBE ? span : PERIOD_PROBE;
        size_t differ = 0, i;
        for (i = lo; i < lo + probe; i++)
            differ += sizes[i] != sizes[i + p];
        if (differ * 4 > probe || differ > allowed) {
            work += probe;
            continue;
        }
        for (; i < n - p && differ <= allowed; i++)
            differ += sizes[i] != sizes[i + p];
        work += i - lo;
        if (differ > allowed)
            continue;
        uint64_t same = span - differ;
        if (!best || same * best_span > best_same * span) { /* a better share alike */
            best = p;
            best_same = same;
            best_span = span;
            if (!differ)
                break;
        }
    }
    free(mapped);
    return best;
}

/*
 * The last step of a trace that repeats (nevents events, nallocs of them
 * allocations): the first event of its last period of allocations
 * (find_period), and the period; *period 0 and the return value nevents
 * where none is found.
 */
static size_t last_step_start(const replay_trace_t *trace, size_t nevents, size_t nallocs, size_t *period)
{
    *period = 0;
    uint64_t *sizes = malloc((nallocs ? nallocs : 1) * sizeof(*sizes));
    if (!sizes)
        return nevents;
    size_t n = 0;
    for (size_t i = 0; i < nevents && n < nallocs; i++) {
        const replay_event_t *e = replay_ev(trace, i);
        if (e->kind == EV_ALLOC)
            sizes[n++] = e->size;
    }
    size_t p = find_period(sizes, n);
    free(sizes);
    if (!p)
        return nevents;
    *period = p;
    size_t k = 0, i = 0; /* the event of allocation n - p */
    for (; i < nevents; i++)
        if (replay_ev(trace, i)->kind == EV_ALLOC && k++ == n - p)
            break;
    return i;
}

/*
 * Replay the events of stream (those its reader publishes, until it ends)
 * with the pool operations ops. Returns CCA_OK, or the error that stops the
 * replay (CCA_ERR_IO for a trace whose reading failed: the reader has the
 * error).
 */
/* A live cca block holding trace address addr (cca placed an allocation elsewhere). */
static bool inside_live_block(uint64_t addr)
{
    cca_block_t *b = ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)addr);
    return b && b->allocated && b->addr < addr;
}

/*
 * The first misplaced allocation, event i at p: where cca carved it from the
 * free block right after a live one, that block may be a start block PyTorch
 * had left a rest in (replay_file_observed decides).
 */
static void note_mismatch(replay_stream_t *stream, size_t i, const void *p, uint64_t size)
{
    cca_block_t *b = ptrmap_find_containing(cca_state->ptrmap, (uintptr_t)p);
    if (!b || b->addr != (uintptr_t)p || !b->prev || !b->prev->allocated)
        return;
    stream->mm_set = true;
    stream->mm_event = i;
    stream->mm_prev = b->prev->addr;
    stream->mm_prev_size = b->prev->size;
    stream->mm_free = b->size + (b->next && b->next->in_bin ? b->next->size : 0);
    stream->mm_round = alloc_round_size(cca_state->settings, size);
}

/* Whether event i, a free_completed, follows its free_requested at once (or opens the recording,
 * which began between the two: PyTorch records both in one call, see replay_start.c). */
static bool completes_previous(const replay_trace_t *trace, size_t i)
{
    const replay_event_t *e = replay_ev(trace, i), *prev = i ? replay_ev(trace, i - 1) : NULL;
    return !i || (prev->kind == EV_FREE_REQUESTED && prev->addr == e->addr && !prev->deferred);
}

static cca_status_t run_events(replay_stream_t *stream, const pool_op_t *ops, size_t nops,
                               const cca_replay_options_t *opt, cca_backend_t *sim,
                               cca_replay_result_t *r)
{
    bool trace_addresses = opt->trace_addresses, strict = opt->strict;
    uint64_t event_lag = opt->event_lag, peaks_from = opt->peaks_from_event;
    const replay_trace_t *trace = stream->trace;
    const replay_observer_t *observer = stream->observer; /* read once: one branch an event */
    calls_log_t log = {0};
    const cca_device_t *dev0 = &cca_state->devices[0];
    live_map_t live = {0};
    uint64_t next_hold = HOLD_STREAM_BASE;
    cca_status_t st = CCA_OK;
    size_t next_op = 0;
    size_t freed_at = SIZE_MAX; /* the event after a free_requested that freed its block whole */
    graph_state_t graphs = {stream->live_graphs, NULL, 0};
    size_t i;
    if (stream->start && stream->start->ngroups) {
        /* pools released by every user before the cut (past 64, replay_pools_restore releases
         * them after building, whose holes in them then stay mapped) */
        cca_mempool_id_t released[64];
        size_t nreleased = 0;
        for (size_t k = 0; k < stream->ncarry && nreleased < sizeof(released) / sizeof(*released); k++)
            if (!stream->carry[k].count)
                released[nreleased++] = stream->carry[k].id;
        st = start_build(stream->start, sim, trace_addresses, released, nreleased, &next_hold, &live, r);
        if (st != CCA_OK)
            goto out;
        stream->start_allocs = (uint64_t)dev0->stats.num_device_alloc;
        stream->start_frees = (uint64_t)dev0->stats.num_device_free;
    }
    if (stream->ncarry && (st = replay_pools_restore(stream->carry, stream->ncarry)) != CCA_OK)
        goto out;
    for (i = 0;; i++) {
        bool end = !stream_more(stream, i);
        if (end && !stream->view.ok) {
            st = cca_raise(CCA_ERR_IO, "the trace could not be read");
            goto out;
        }
        if (!end && peaks_from && i + trace->skipped == peaks_from &&
            (st = cca_reset_peak_stats(0)) != CCA_OK)
            goto out;
        for (; next_op < nops && (ops[next_op].at <= i || end); next_op++) {
            st = replay_apply_pool_op(&ops[next_op], next_op, &graphs);
            if (st != CCA_OK)
                goto out;
            r->pool_ops++;
        }
        if (end)
            break;
        if (!calls_log_mark(&log, i, dev0)) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in replay");
            goto out;
        }
        if (event_lag)
            cca_sim_tick(sim, 1); /* the simulated GPU runs event_lag trace events behind */
        const replay_event_t *e = replay_ev(trace, i);
        uint64_t stream_handle = stream->view.streams[e->stream];
        size_t at = i + trace->skipped; /* the event's index in the trace as recorded */
        if (e->invalid) { /* counted by the inference (start_infer) */
            if (e->kind == EV_ALLOC) { /* its free is left out too */
                live_entry_t *le = live_find(&live, e->addr);
                if (!le && !(le = live_put(&live, e->addr))) {
                    st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in replay");
                    goto out;
                }
                le->ptr = 0;
            }
            continue;
        }
        if (graphs.pending && e->kind == EV_ALLOC && stream_handle == graphs.pending->stream) {
            if (e->size == RNG_STATE_ALLOC && graphs.rng_allocs) {
                graphs.rng_allocs--; /* the generator's seed or offset: default pools */
            } else {
                st = replay_capture_route(graphs.pending);
                graphs.pending = NULL;
                if (st != CCA_OK)
                    goto out;
            }
        }
        switch (e->kind) {
        case EV_ALLOC: {
            void *p = NULL;
            r->allocs++;
            bool had;
            live_entry_t *le = live_get(&live, e->addr, &had); /* one probe serves the check too */
            if (!le) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in replay");
                goto out;
            }
            bool inside = had && le->ptr;
            if (inside) {
                st = replay_note_inconsistency(r, strict, at, "event %zu: an allocation at 0x%llx, inside a "
                                               "live block", at, (unsigned long long)e->addr);
                if (st != CCA_OK)
                    goto out;
            }
            cca_status_t as = cca_malloc_device(&p, e->size, 0, (cca_stream_t)(uintptr_t)stream_handle);
            if (as != CCA_OK) {
                r->unexpected_ooms++;
                if (trace_addresses && !r->address_mismatches)
                    snprintf(r->first_address_mismatch, sizeof(r->first_address_mismatch),
                             "event %zu: alloc of %llu bytes failed (%s), PyTorch's did not", i,
                             (unsigned long long)e->size,
                             as == CCA_ERR_OUT_OF_MEMORY ? "out of memory" : cca_status_str(as));
                r->address_mismatches += trace_addresses;
                le->ptr = 0; /* its free is left out */
                le->hold = 0;
                break;
            }
            if (trace_addresses && (uint64_t)(uintptr_t)p != e->addr) {
                /* as long as every allocation landed at PyTorch's address, cca's blocks are
                 * PyTorch's: one holding this address is a live block of the trace */
                if (!inside && !r->address_mismatches && inside_live_block(e->addr)) {
                    st = replay_note_inconsistency(r, strict, at, "event %zu: an allocation at 0x%llx, "
                                                   "inside a live block", at, (unsigned long long)e->addr);
                    if (st != CCA_OK) {
                        cca_free(p);
                        goto out;
                    }
                }
                if (!r->address_mismatches)
                    note_mismatch(stream, i, p, e->size);
                if (!r->address_mismatches)
                    snprintf(r->first_address_mismatch, sizeof(r->first_address_mismatch),
                             "event %zu: alloc of %llu bytes at 0x%llx, PyTorch 0x%llx", i,
                             (unsigned long long)e->size, (unsigned long long)(uintptr_t)p,
                             (unsigned long long)e->addr);
                r->address_mismatches++;
            }
            le->ptr = (uint64_t)(uintptr_t)p;
            if (observer)
                observer->on_alloc(observer->ctx, at, le->ptr);
            le->hold = 0;
            if (graphs.pending && !graphs.rng_allocs) {
                st = replay_capture_route(graphs.pending);
                graphs.pending = NULL;
                if (st != CCA_OK)
                    goto out;
            }
            break;
        }
        case EV_FREE_REQUESTED: {
            live_entry_t *le = live_find(&live, e->addr);
            if (!le || le->hold) {
                st = replay_note_inconsistency(r, strict, at, "event %zu: a free of 0x%llx, %s", at,
                                               (unsigned long long)e->addr,
                                               le ? "freed already" : "a block never allocated nor live "
                                                                      "before the first event");
                if (st != CCA_OK)
                    goto out;
                break;
            }
            if (!le->ptr) { /* an allocation that failed, or was left out */
                if (e->deferred) {
                    le->hold = 1; /* until its free_completed */
                } else {
                    live_del(&live, le);
                    freed_at = i + 1;
                }
                break;
            }
            r->frees++;
            if (e->deferred) {
                le->hold = next_hold++;
                st = cca_sim_keep_manual(sim, 0, (cca_stream_t)(uintptr_t)le->hold);
                if (st != CCA_OK)
                    goto out;
                cca_record_stream((void *)(uintptr_t)le->ptr, (cca_stream_t)(uintptr_t)le->hold);
                cca_free((void *)(uintptr_t)le->ptr);
            } else {
                cca_free((void *)(uintptr_t)le->ptr);
                live_del(&live, le);
                freed_at = i + 1;
            }
            break;
        }
        case EV_FREE_COMPLETED: {
            if (i == freed_at) /* the completion of the free just made (its block gone, no lookup) */
                break;
            live_entry_t *le = live_find(&live, e->addr);
            if (!le || !le->hold) {
                if (!le && completes_previous(trace, i))
                    break;
                st = replay_note_inconsistency(r, strict, at, "event %zu: free_completed of 0x%llx, %s", at,
                                               (unsigned long long)e->addr,
                                               le ? "never requested" : "a block never allocated nor live "
                                                                        "before the first event");
                if (st != CCA_OK)
                    goto out;
                break;
            }
            if (!le->ptr) {
                live_del(&live, le);
                break;
            }
            cca_sim_complete_stream(sim, 0, (cca_stream_t)(uintptr_t)le->hold, false);
            live_del(&live, le);
            st = alloc_process_events();
            if (st != CCA_OK)
                goto out;
            break;
        }
        case EV_OOM: {
            void *p = NULL;
            cca_status_t os = cca_malloc_device(&p, e->size, 0, (cca_stream_t)(uintptr_t)stream_handle);
            if (os == CCA_OK) {
                if (trace_addresses && !r->address_mismatches)
                    snprintf(r->first_address_mismatch, sizeof(r->first_address_mismatch),
                             "event %zu: PyTorch ran out of memory for %llu bytes, cca did not", i,
                             (unsigned long long)e->size);
                r->address_mismatches += trace_addresses;
                cca_free(p);
            }
            break;
        }
        default:
            break;
        }
        if (observer && !observer->after_event(observer->ctx, at)) {
            st = cca_last_error()->status;
            goto out;
        }
    }
    const struct calls_mark *half = calls_log_at(&log, i / 2); /* i: the number of events */
    if (half) {
        r->late_segment_allocs = half->allocs;
        r->late_segment_frees = half->frees;
    }
    size_t period = 0;
    const struct calls_mark *step = calls_log_at(&log, last_step_start(trace, i, r->allocs, &period));
    r->step_allocations = period;
    if (step && period) {
        r->last_step_segment_allocs = step->allocs;
        r->last_step_segment_frees = step->frees;
    }
out:
    free(log.marks);
    free(live.slots);
    return st;
}

/* The device the trace ran on, and the settings string it ran with (options first). */
typedef struct replay_config {
    char settings[1024];
    uint64_t total;       /* bytes */
    double fraction;      /* the per-process memory fraction (0: none) */
} replay_config_t;

#define DEFAULT_TOTAL (80ull << 30)

/* The configuration of the trace (or the options'); a NaN fraction is an inconsistency, ignored. */
static cca_status_t trace_config(const pv_node_t *root, const cca_replay_options_t *opt, replay_config_t *cfg,
                                 cca_replay_result_t *r)
{
    const pv_node_t *meta = pv_dict_get(root, "cca_meta");
    cfg->total = 0;
    cfg->fraction = 0.0;
    if (meta) {
        const pv_node_t *t = pv_dict_get(meta, "total_memory");
        if (t)
            pv_get_u64(t, &cfg->total);
        const pv_node_t *f = pv_dict_get(meta, "fraction");
        if (f)
            pv_get_double(f, &cfg->fraction);
    }
    if (cfg->fraction != cfg->fraction) {
        cfg->fraction = 0.0;
        cca_status_t st = replay_note_inconsistency(r, opt->strict, UINT64_MAX,
                                                    "cca_meta.fraction is NaN: no memory fraction applied");
        if (st != CCA_OK)
            return st;
    }
    if (opt->total_memory)
        cfg->total = opt->total_memory;
    if (!cfg->total)
        cfg->total = DEFAULT_TOTAL;
    if (opt->ignore_fraction)
        cfg->fraction = 0.0;
    if (opt->settings)
        snprintf(cfg->settings, sizeof(cfg->settings), "%s", opt->settings);
    else
        trace_settings(root, cfg->settings, sizeof(cfg->settings));
    return CCA_OK;
}

/*
 * Build the simulated backend and bring cca up with the configuration cfg;
 * with trace_addresses, the backend hands out the addresses of stream's
 * events, in order, as they are read.
 */
static cca_status_t replay_init(const replay_config_t *cfg, const cca_replay_options_t *opt,
                                replay_stream_t *stream, cca_replay_result_t *r, cca_backend_t **sim_out)
{
    snprintf(r->settings, sizeof(r->settings), "%s", cfg->settings);
    cca_sim_config_t sc;
    memset(&sc, 0, sizeof(sc));
    sc.devices = 1;
    sc.total_memory = cfg->total;
    sc.memory_cap = opt->cap;
    sc.manual_events = true;
    cca_backend_t *sim = NULL;
    cca_status_t st = cca_sim_create(&sc, &sim);
    if (st != CCA_OK)
        return st;
    stream->rule.span = cfg->total + cfg->total / 8;
    if (opt->trace_addresses)
        st = cca_sim_set_address_source(sim, stream_addresses, stream);
    /* events on the trace's streams (compact_memory's readiness) complete event_lag
     * trace events after their record; the private streams of deferred frees stay manual */
    if (st == CCA_OK)
        st = cca_sim_time_events(sim, opt->event_lag);
    if (st != CCA_OK) {
        sim->destroy(sim->ctx);
        return st;
    }
    cca_shutdown();
    st = cca_init_with_backend(sim, cfg->settings);
    if (st != CCA_OK)
        return st;
    if (cfg->fraction > 0.0) {
        st = cca_set_memory_fraction(cfg->fraction, 0);
        if (st != CCA_OK) {
            cca_shutdown();
            return st;
        }
    }
    *sim_out = sim;
    return CCA_OK;
}

/*
 * A replay run while the file is read, on a thread of its own, with the
 * configuration guessed before cca_meta (written after the events) is known:
 * the options' settings, else PyTorch's default (""), no memory fraction, no
 * private-pool operations, and the options' device size, else GUESS_TOTAL.
 * It stands if the guess was right, or if the device size did not matter
 * (spec_holds); otherwise the whole trace is replayed again.
 */
#define GUESS_TOTAL (512ull << 30) /* the largest device of the simulator's smallest window */

typedef struct spec {
    replay_stream_t stream;
    cca_replay_options_t opt;
    replay_config_t cfg;
    cca_replay_result_t r;
    cca_backend_t *sim;
    cca_status_t st;
    bool up;          /* cca runs on sim */
    bool finished;    /* every event replayed */
    bool expandable;  /* the settings make expandable segments (the device size matters) */
    double seconds;   /* replaying, waits for the reader excluded */
} spec_t;

static void *spec_main(void *arg)
{
    spec_t *s = arg;
    s->st = replay_init(&s->cfg, &s->opt, &s->stream, &s->r, &s->sim);
    if (s->st != CCA_OK)
        return NULL;
    s->up = true;
    s->expandable = cca_state->settings->expandable_segments;
    if (s->expandable && !s->opt.total_memory)
        return NULL; /* the device size shapes every reservation: it cannot be guessed */
    uint64_t t0 = cca_now_ns();
    s->st = run_events(&s->stream, NULL, 0, &s->opt, s->sim, &s->r);
    uint64_t busy = cca_now_ns() - t0 - s->stream.wait_ns;
    s->seconds = (double)busy / 1e9;
    s->finished = s->st == CCA_OK;
    return NULL;
}

/* Whether the replay run while reading is the one the trace asks for (cca still up on it). */
static bool spec_holds(const spec_t *s, const replay_config_t *want, size_t nops,
                       const replay_trace_t *trace)
{
    if (!s->finished || nops || strcmp(s->cfg.settings, want->settings) || want->fraction > 0.0)
        return false;
    if (want->total == s->cfg.total)
        return true;
    /* another device size: the replay is the same if nothing in it depended on the size.
     * Sizes enter through expandable reservations, out-of-memory errors (and their
     * messages) and the simulator's address windows (one size for devices up to
     * GUESS_TOTAL); capacity checks passed alike if the simulator never held more than
     * the trace's device could. */
    if (s->expandable || want->total > GUESS_TOTAL || s->r.unexpected_ooms)
        return false;
    for (size_t i = 0; i < trace->count; i++)
        if (replay_ev(trace, i)->kind == EV_OOM)
            return false;
    cca_device_stats_t stats;
    cca_sim_usage_t usage;
    if (cca_get_device_stats(0, &stats) != CCA_OK || stats.num_ooms || stats.num_alloc_retries ||
        cca_sim_usage(s->sim, &usage) != CCA_OK)
        return false;
    uint64_t limit = s->opt.cap && s->opt.cap < want->total ? s->opt.cap : want->total;
    return usage.device_peak_bytes[0] <= limit;
}

/* Replays at most this many times more for start blocks' unsplit rests. */
#define MAX_REST_TRIES 64

/* Whether a start block's unsplit rest is unknown. */
static bool start_ambiguous(const replay_start_t *s)
{
    for (size_t k = 0; k < s->nblocks; k++)
        if (s->blocks[k].ambiguous)
            return true;
    return false;
}

/*
 * The replay's first misplaced allocation landed in the free block right
 * after a start block whose end nothing told (ambiguous): PyTorch's free block
 * there was smaller, the block larger by a rest PyTorch left unsplit. Grows
 * the block by the least that keeps the allocation out (the free block then
 * less than its rounded size), if PyTorch could have left that rest (1 MiB
 * or less; under max_split_size, less than max_non_split_rounding from a
 * request that large). cca is still up (its settings). Returns whether it
 * grew one.
 */
static bool widen_rest(replay_start_t *s, const replay_stream_t *w)
{
    if (!w->mm_set || w->mm_free < w->mm_round)
        return false;
    size_t lo = 0, hi = s->nblocks;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (s->blocks[mid].addr < w->mm_prev)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == s->nblocks || s->blocks[lo].addr != w->mm_prev)
        return false;
    start_block_t *b = &s->blocks[lo];
    /* still live at the misplaced allocation: cca's block there is the start block */
    if (!b->ambiguous || (b->event != SIZE_MAX && b->event <= w->mm_event))
        return false;
    const cca_settings_t *set = cca_state->settings;
    uint64_t rounded = alloc_round_size(set, b->requested);
    /* PyTorch splits off more than 1 MiB, except from a request of max_split_size or more */
    uint64_t size = w->mm_prev_size + (w->mm_free - w->mm_round) + CCA_MIN_BLOCK_SIZE;
    if (rounded >= set->max_split_size ? size - rounded >= set->max_non_split_rounding
                                       : size - rounded > CCA_SMALL_SIZE)
        return false;
    b->size = size;
    b->ambiguous = false; /* decided by PyTorch's placement */
    return true;
}

cca_status_t cca_replay_file(const char *path, const cca_replay_options_t *options,
                             cca_replay_result_t *result)
{
    return replay_file_observed(path, options, NULL, result);
}

cca_status_t replay_file_observed(const char *path, const cca_replay_options_t *options,
                                  const replay_observer_t *observer, cca_replay_result_t *result)
{
    if (!path || !result)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_replay_file: path and result are required");
    cca_replay_options_t opt;
    memset(&opt, 0, sizeof(opt));
    if (options)
        opt = *options;
    memset(result, 0, sizeof(*result));
    cca_replay_result_t *r = result;

    /* the pictures and snapshots show the replay's own history: replayed once the file is read */
    bool history = opt.snapshot_path || opt.svg_path;
    uint64_t t0 = cca_now_ns();
    pv_doc_t *doc = NULL;
    replay_trace_t trace;
    memset(&trace, 0, sizeof(trace));
    replay_start_t start;
    memset(&start, 0, sizeof(start));
    uint64_t *start_addrs = NULL, *start_mapped = NULL;
    size_t nstart_addrs = 0;
    uint64_t start_allocs = 0, start_frees = 0;
    pool_carry_t *carry = NULL;
    cca_mempool_id_t *alloc_pool = NULL;
    size_t ncarry = 0;
    unsigned live_graphs = 0;
    replay_feed_t feed;
    spec_t *spec = NULL;
    pthread_t spec_thread;
    if (!opt.sequential && !history && !observer && replay_feed_init(&feed)) {
        spec = calloc(1, sizeof(*spec));
        if (spec) {
            spec->stream.feed = &feed;
            spec->stream.trace = &trace;
            spec->opt = opt;
            snprintf(spec->cfg.settings, sizeof(spec->cfg.settings), "%s", opt.settings ? opt.settings : "");
            spec->cfg.total = opt.total_memory ? opt.total_memory : GUESS_TOTAL;
            /* the chunk table first: the thread reads it */
            trace.chunks = calloc(REPLAY_MAX_CHUNKS, sizeof(*trace.chunks));
        }
        if (!spec || !trace.chunks || pthread_create(&spec_thread, NULL, spec_main, spec)) {
            free(spec);
            spec = NULL;
            replay_feed_destroy(&feed); /* replayed after the reading, as without a thread */
        }
    }
    cca_status_t st = replay_load(path, opt.device, opt.first_event, spec ? &feed : NULL, &doc, &trace);
    if (spec)
        pthread_join(spec_thread, NULL);
    pool_op_t *ops = NULL;
    size_t nops = 0;
    if (st == CCA_OK)
        st = replay_decode_pool_ops(pv_doc_root(doc), &ops, &nops);
    if (st != CCA_OK) {
        if (spec && spec->up)
            cca_shutdown();
        goto out_events;
    }
    r->load_seconds = (double)(cca_now_ns() - t0) / 1e9;
    const pv_node_t *root = pv_doc_root(doc);
    size_t n = trace.count;
    replay_config_t cfg;
    st = replay_pools_cut(ops, &nops, &trace, &carry, &ncarry, &live_graphs);
    if (st == CCA_OK)
        st = trace_config(root, &opt, &cfg, r);
    if (st == CCA_OK)
        st = replay_pools_routes(ops, nops, carry, ncarry, live_graphs, &trace, &alloc_pool);
    if (st == CCA_OK)
        st = start_infer(root, &trace, opt.device, cfg.total + cfg.total / 8, alloc_pool, opt.strict, &start,
                         r);
    if (st == CCA_OK)
        st = start_addresses(&start, &start_addrs, &start_mapped, &nstart_addrs);
    if (st != CCA_OK) {
        if (spec && spec->up)
            cca_shutdown();
        goto out_events;
    }

    if (spec && !start.ngroups && !ncarry && spec_holds(spec, &cfg, nops, &trace)) {
        double load_seconds = r->load_seconds;
        uint64_t inconsistencies = r->inconsistencies, first_event = r->first_inconsistency_event;
        char first[sizeof(r->first_inconsistency)];
        memcpy(first, r->first_inconsistency, sizeof(first));
        *r = spec->r;
        if (inconsistencies) { /* the configuration's, with the replay's */
            if (!r->inconsistencies || first_event <= r->first_inconsistency_event) {
                memcpy(r->first_inconsistency, first, sizeof(first));
                r->first_inconsistency_event = first_event;
            }
            r->inconsistencies += inconsistencies;
        }
        r->load_seconds = load_seconds;
        r->overlapped = true;
        r->seconds = spec->seconds;
    } else {
        if (spec && spec->up)
            cca_shutdown();
        /* replayed again while a misplaced allocation shows a start block's unsplit rest (each
         * time one block larger, bounded); an observer sees only the last replay */
        replay_stream_t whole;
        cca_replay_result_t base = *r;
        bool trial = observer && opt.trace_addresses && start_ambiguous(&start);
        for (unsigned tries = 0;; tries++) {
            if (history) {
                cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
                st = cca_record_history(true, NULL, NULL, 2 * n + 64, CCA_RECORD_CONTEXT_NEVER);
                if (st != CCA_OK)
                    goto out_events;
            }
            /* the whole trace, read: no feed, every event in view */
            memset(&whole, 0, sizeof(whole));
            whole.trace = &trace;
            whole.view = (replay_view_t){n, trace.streams, true, true};
            whole.observer = trial ? NULL : observer;
            whole.start = &start;
            whole.carry = carry;
            whole.ncarry = ncarry;
            whole.live_graphs = live_graphs;
            whole.start_addrs = start_addrs;
            whole.nstart_addrs = nstart_addrs;
            for (size_t k = 0; k < nstart_addrs; k++) {
                if (start_mapped[k] &&
                    whole.rule.nresv < sizeof(whole.rule.resv) / sizeof(whole.rule.resv[0])) {
                    whole.rule.resv[whole.rule.nresv].base = start_addrs[k];
                    whole.rule.resv[whole.rule.nresv++].mapped = start_mapped[k];
                }
            }
            cca_backend_t *sim = NULL;
            st = replay_init(&cfg, &opt, &whole, r, &sim);
            if (st != CCA_OK)
                goto out_history;
            uint64_t t1 = cca_now_ns();
            st = run_events(&whole, ops, nops, &opt, sim, r);
            r->seconds = (double)(cca_now_ns() - t1) / 1e9;
            if (st != CCA_OK)
                break;
            bool again = tries < MAX_REST_TRIES && r->address_mismatches && widen_rest(&start, &whole);
            if (!again && !trial)
                break;
            trial = trial && again; /* the last replay: the observer's */
            cca_shutdown();
            *r = base;
        }
        r->ambiguous_blocks = 0;
        for (size_t k = 0; k < start.nblocks; k++)
            r->ambiguous_blocks += start.blocks[k].ambiguous;
        start_allocs = whole.start_allocs;
        start_frees = whole.start_frees;
        if (st != CCA_OK)
            goto out_shutdown;
    }
    r->events = n;
    r->events_per_second = r->seconds > 0 ? (double)n / r->seconds : 0.0;

    cca_device_stats_t stats;
    cca_get_device_stats(0, &stats);
    r->segment_allocs = (uint64_t)stats.num_device_alloc;
    r->segment_frees = (uint64_t)stats.num_device_free;
    r->late_segment_allocs = r->segment_allocs - r->late_segment_allocs;
    r->late_segment_frees = r->segment_frees - r->late_segment_frees;
    if (r->step_allocations) {
        r->last_step_segment_allocs = r->segment_allocs - r->last_step_segment_allocs;
        r->last_step_segment_frees = r->segment_frees - r->last_step_segment_frees;
    }
    /* the backend calls of the events only: building the start state made the others */
    r->segment_allocs -= start_allocs;
    r->segment_frees -= start_frees;
    r->device = opt.device;
    r->device_count = trace.devices;
    r->recorded_part_only = start.nranges > 0;
    /* the cache's free figures from the extra statistics: with backend:cudaMallocAsync,
     * cca_cache_info's trial allocation would grow the pool and the peaks read below */
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    if (cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT) == CCA_OK) {
        for (size_t k = 0; k < CCA_MEMORY_STATS_EXTRA_COUNT; k++) {
            if (!strcmp(extra[k].key, "cca.cached_free_bytes"))
                r->cached_free_bytes = (uint64_t)extra[k].value;
            else if (!strcmp(extra[k].key, "cca.largest_free_bytes"))
                r->largest_free_bytes = (uint64_t)extra[k].value;
            else if (!strcmp(extra[k].key, "cca.compact_moves"))
                r->compact_moves = (uint64_t)extra[k].value;
            else if (!strcmp(extra[k].key, "cca.compact_pending_growths"))
                r->compact_pending_growths = (uint64_t)extra[k].value;
        }
    }
    r->ooms = (uint64_t)stats.num_ooms;
    r->peak_reserved_bytes = stats.reserved_bytes[CCA_STAT_ALL].peak;
    r->peak_allocated_bytes = stats.allocated_bytes[CCA_STAT_ALL].peak;
    r->peak_requested_bytes = stats.requested_bytes[CCA_STAT_ALL].peak;
    r->peak_active_bytes = stats.active_bytes[CCA_STAT_ALL].peak;
    cca_memory_stats(0, r->memory_stats, CCA_MEMORY_STATS_COUNT);
    cca_memory_summary(0, false, &r->memory_summary);
    compare_expected(root, &trace, ops, nops, opt.peaks_from_event > trace.skipped ?
                     opt.peaks_from_event - trace.skipped : 0, r);
    if (opt.snapshot_path)
        st = cca_dump_snapshot(opt.snapshot_path);
    if (st == CCA_OK && opt.svg_path)
        st = cca_dump_snapshot_svg(opt.svg_path);

out_shutdown:
    if (st != CCA_OK)
        cca_replay_result_free(r); /* a failed --snapshot/--svg write: the caller gets nothing */
    cca_shutdown();
out_history:
    if (history)
        cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
out_events:
    if (spec) {
        replay_feed_destroy(&feed);
        free(spec);
    }
    free(ops);
    free(start_addrs);
    free(start_mapped);
    free(carry);
    free(alloc_pool);
    start_free(&start);
    replay_trace_free(&trace);
    pv_doc_free(doc);
    return st;
}

void cca_replay_result_free(cca_replay_result_t *result)
{
    if (!result)
        return;
    free(result->memory_summary);
    result->memory_summary = NULL;
}

cca_status_t cca_replay_file_devices(const char *path, const cca_replay_options_t *options,
                                     cca_replay_result_t **results, size_t *count)
{
    if (!path || !results || !count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_replay_file_devices: path, results and count are required");
    *results = NULL;
    *count = 0;
    cca_replay_options_t opt;
    memset(&opt, 0, sizeof(opt));
    if (options)
        opt = *options;
    opt.device = 0;
    cca_replay_result_t first;
    cca_status_t st = cca_replay_file(path, &opt, &first);
    if (st != CCA_OK)
        return st;
    size_t n = first.device_count ? first.device_count : 1;
    cca_replay_result_t *all = calloc(n, sizeof(*all));
    if (!all) {
        cca_replay_result_free(&first);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu replay results", n);
    }
    all[0] = first;
    /* the files written at the end show one device: the first */
    opt.snapshot_path = NULL;
    opt.svg_path = NULL;
    for (size_t d = 1; d < n; d++) {
        opt.device = (int)d;
        st = cca_replay_file(path, &opt, &all[d]);
        if (st != CCA_OK) {
            cca_replay_results_free(all, d);
            return st;
        }
    }
    *results = all;
    *count = n;
    return CCA_OK;
}

void cca_replay_results_free(cca_replay_result_t *results, size_t count)
{
    if (!results)
        return;
    for (size_t i = 0; i < count; i++)
        cca_replay_result_free(&results[i]);
    free(results);
}
