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
#include "state.h"

/* A private-pool operation of the program (cca_meta["pool_events"]). */
typedef enum pool_op_kind {
    POOL_GRAPH_CAPTURE,     /* empty_cache, then route the capture stream to the pool */
    POOL_GRAPH_CAPTURE_END, /* end that route */
    POOL_GRAPH_DELETE,      /* the graph is gone: release its pool */
    POOL_MEMPOOL_BEGIN,     /* use_mem_pool: route the (only) thread to the pool */
    POOL_MEMPOOL_END,       /* end of use_mem_pool: end the route, release the pool */
    POOL_MEMPOOL_DELETE,    /* the MemPool is gone: release its pool, empty its cache */
    POOL_EMPTY_CACHE,       /* torch.cuda.empty_cache() */
    POOL_RESET_PEAKS,       /* torch.cuda.reset_peak_memory_stats() */
} pool_op_kind_t;

typedef struct pool_op {
    uint64_t at;            /* applied before trace event `at` */
    pool_op_kind_t kind;
    cca_mempool_id_t id;
    uint64_t stream;        /* graph_capture: the capture stream */
} pool_op_t;

/* Live blocks: trace address -> cca pointer (and the private stream if deferred). */
typedef struct live_entry {
    uint64_t key;      /* trace address; 0 = empty */
    uint64_t ptr;      /* cca's pointer */
    uint64_t hold;     /* private stream holding it after free_requested, 0 if none */
    bool tomb;
} live_entry_t;

typedef struct live_map {
    live_entry_t *slots;
    size_t cap, count, used;
} live_map_t;

static inline size_t live_hash(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    return (size_t)k;
}

static bool live_grow(live_map_t *m)
{
    size_t cap = m->cap ? m->cap * 2 : 1024;
    live_entry_t *slots = calloc(cap, sizeof(*slots));
    if (!slots)
        return false;
    for (size_t i = 0; i < m->cap; i++) {
        live_entry_t *e = &m->slots[i];
        if (!e->key || e->tomb)
            continue;
        size_t j = live_hash(e->key) & (cap - 1);
        while (slots[j].key)
            j = (j + 1) & (cap - 1);
        slots[j] = *e;
    }
    free(m->slots);
    m->slots = slots;
    m->cap = cap;
    m->used = m->count;
    return true;
}

static live_entry_t *live_find(live_map_t *m, uint64_t key)
{
    if (!m->cap)
        return NULL;
    for (size_t j = live_hash(key) & (m->cap - 1);; j = (j + 1) & (m->cap - 1)) {
        live_entry_t *e = &m->slots[j];
        if (!e->key)
            return NULL;
        if (e->key == key && !e->tomb)
            return e;
    }
}

static live_entry_t *live_put(live_map_t *m, uint64_t key)
{
    if ((m->used + 1) * 2 > m->cap && !live_grow(m))
        return NULL;
    size_t j = live_hash(key) & (m->cap - 1);
    while (m->slots[j].key && !(m->slots[j].key == key && !m->slots[j].tomb) && !m->slots[j].tomb)
        j = (j + 1) & (m->cap - 1);
    live_entry_t *e = &m->slots[j];
    if (!e->key)
        m->used++;
    e->key = key;
    e->tomb = false;
    e->ptr = 0;
    e->hold = 0;
    m->count++;
    return e;
}

static void live_del(live_map_t *m, live_entry_t *e)
{
    e->tomb = true;
    m->count--;
}

/* ---- reading the snapshot ------------------------------------------------------- */

static bool get_u64_field(const pv_node_t *dict, const char *key, uint64_t *out)
{
    const pv_node_t *n = pv_dict_get(dict, key);
    if (!n)
        return false;
    if (pv_get_u64(n, out))
        return true;
    int64_t v;
    if (pv_get_int(n, &v)) {
        *out = (uint64_t)v;
        return true;
    }
    return false;
}

/* Decode cca_meta["pool_events"] (absent: none). */
static cca_status_t decode_pool_ops(const pv_node_t *root, pool_op_t **out, size_t *count)
{
    static const struct {
        const char *name;
        pool_op_kind_t kind;
    } names[] = {
        {"graph_capture", POOL_GRAPH_CAPTURE},   {"graph_capture_end", POOL_GRAPH_CAPTURE_END},
        {"graph_delete", POOL_GRAPH_DELETE},     {"mempool_begin", POOL_MEMPOOL_BEGIN},
        {"mempool_end", POOL_MEMPOOL_END},       {"mempool_delete", POOL_MEMPOOL_DELETE},
        {"empty_cache", POOL_EMPTY_CACHE},       {"reset_peaks", POOL_RESET_PEAKS},
    };
    *out = NULL;
    *count = 0;
    const pv_node_t *meta = pv_dict_get(root, "cca_meta");
    const pv_node_t *list = meta ? pv_dict_get(meta, "pool_events") : NULL;
    if (!list)
        return CCA_OK;
    if (pv_kind(list) != PV_LIST)
        return cca_raise(CCA_ERR_FORMAT, "cca_meta.pool_events is not a list");
    size_t n = pv_len(list);
    pool_op_t *ops = calloc(n ? n : 1, sizeof(*ops));
    if (!ops)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu pool events", n);
    for (size_t i = 0; i < n; i++) {
        const pv_node_t *e = pv_at(list, i);
        const pv_node_t *op = pv_kind(e) == PV_DICT ? pv_dict_get(e, "op") : NULL;
        size_t k = 0;
        while (op && k < sizeof(names) / sizeof(names[0]) && !pv_str_eq(op, names[k].name))
            k++;
        if (!op || k == sizeof(names) / sizeof(names[0]) || !get_u64_field(e, "at", &ops[i].at) ||
            (i && ops[i].at < ops[i - 1].at)) {
            free(ops);
            return cca_raise(CCA_ERR_FORMAT, "pool event %zu: unknown op, or no \"at\" in program order", i);
        }
        ops[i].kind = names[k].kind;
        const pv_node_t *pool = pv_dict_get(e, "pool");
        if (ops[i].kind != POOL_EMPTY_CACHE && ops[i].kind != POOL_RESET_PEAKS) {
            if (!pool || pv_len(pool) != 2 || !pv_get_u64(pv_at(pool, 0), &ops[i].id.first) ||
                !pv_get_u64(pv_at(pool, 1), &ops[i].id.second)) {
                free(ops);
                return cca_raise(CCA_ERR_FORMAT, "pool event %zu: no [a, b] pool id", i);
            }
        }
        if (ops[i].kind == POOL_GRAPH_CAPTURE && !get_u64_field(e, "stream", &ops[i].stream)) {
            free(ops);
            return cca_raise(CCA_ERR_FORMAT, "pool event %zu: graph_capture without its stream", i);
        }
    }
    *out = ops;
    *count = n;
    return CCA_OK;
}

/* Graph state of a replay: the capture whose route waits for the generator's allocations. */
typedef struct graph_state {
    unsigned live_graphs;       /* graphs captured and not deleted (generator registrations) */
    const pool_op_t *pending;   /* a capture whose route has not begun yet */
    unsigned rng_allocs;        /* generator allocations still expected before it begins */
} graph_state_t;

/* The size of each of the generator's seed and offset tensors (one int64). */
#define RNG_STATE_ALLOC 8

static cca_status_t begin_capture_route(const pool_op_t *op)
{
    return cca_begin_allocate_stream_to_pool(0, op->id, (cca_stream_t)(uintptr_t)op->stream);
}

/*
 * Apply one pool operation as the program's PyTorch did. A MemPool exists
 * from its first use (its constructor's createOrIncrefPool left no marker).
 */
static cca_status_t apply_pool_op(const pool_op_t *op, size_t index, graph_state_t *g)
{
    cca_status_t st = CCA_OK;
    int count;
    switch (op->kind) {
    case POOL_GRAPH_CAPTURE:
        st = cca_empty_cache();
        if (st == CCA_OK && g->live_graphs++ == 0) {
            g->pending = op; /* the generator registers this first graph: 2 allocations */
            g->rng_allocs = 2;
        } else if (st == CCA_OK) {
            st = begin_capture_route(op);
        }
        break;
    case POOL_GRAPH_CAPTURE_END:
        if (g->pending && g->pending->id.first == op->id.first &&
            g->pending->id.second == op->id.second) {
            st = begin_capture_route(g->pending); /* a capture that allocated nothing */
            g->pending = NULL;
        }
        if (st == CCA_OK)
            st = cca_end_allocate_to_pool(0, op->id);
        break;
    case POOL_GRAPH_DELETE:
        g->live_graphs -= g->live_graphs > 0;
        st = cca_release_pool(0, op->id);
        break;
    case POOL_MEMPOOL_BEGIN:
        if (cca_pool_use_count(0, op->id, &count) != CCA_OK)
            st = cca_pool_create(0, op->id);
        if (st == CCA_OK)
            st = cca_begin_allocate_thread_to_pool(0, op->id);
        break;
    case POOL_MEMPOOL_END:
        st = cca_end_allocate_to_pool(0, op->id);
        if (st == CCA_OK)
            st = cca_release_pool(0, op->id);
        break;
    case POOL_MEMPOOL_DELETE:
        st = cca_release_pool(0, op->id);
        if (st == CCA_OK)
            st = cca_empty_cache_pool(op->id);
        break;
    case POOL_EMPTY_CACHE: st = cca_empty_cache(); break;
    case POOL_RESET_PEAKS: st = cca_reset_peak_stats(0); break;
    }
    if (st != CCA_OK)
        return cca_raise(CCA_ERR_FORMAT, "pool event %zu (pool %llu, %llu) cannot be applied: %s",
                         index, (unsigned long long)op->id.first, (unsigned long long)op->id.second,
                         cca_last_error()->message);
    return CCA_OK;
}

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

/* Compare the end state with the trace's cca_meta. */
static void compare_expected(const pv_node_t *root, const replay_trace_t *trace, cca_replay_result_t *r)
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
    if (!fstats || pv_kind(fstats) != PV_DICT)
        return;
    r->has_expected = true;
    const pv_node_t *pr = pv_dict_get(fstats, "reserved_bytes.all.peak");
    int64_t v;
    if (pr && pv_get_int(pr, &v))
        r->expected_peak_reserved_bytes = v;
    for (size_t i = 0; i < CCA_MEMORY_STATS_COUNT; i++) {
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
    if (fsummary && pv_get_str(fsummary, &text, &len) && r->memory_summary) {
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
static cca_status_t run_events(replay_stream_t *stream, const pool_op_t *ops, size_t nops,
                               bool trace_addresses, uint64_t event_lag, cca_backend_t *sim,
                               cca_replay_result_t *r)
{
    const replay_trace_t *trace = stream->trace;
    calls_log_t log = {0};
    const cca_device_t *dev0 = &cca_state->devices[0];
    live_map_t live = {0};
    uint64_t next_hold = HOLD_STREAM_BASE;
    cca_status_t st = CCA_OK;
    size_t next_op = 0;
    graph_state_t graphs = {0, NULL, 0};
    size_t i;
    for (i = 0;; i++) {
        bool end = !stream_more(stream, i);
        if (end && !stream->view.ok) {
            st = cca_raise(CCA_ERR_IO, "the trace could not be read");
            goto out;
        }
        for (; next_op < nops && (ops[next_op].at <= i || end); next_op++) {
            st = apply_pool_op(&ops[next_op], next_op, &graphs);
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
        if (graphs.pending && e->kind == EV_ALLOC && stream_handle == graphs.pending->stream) {
            if (e->size == RNG_STATE_ALLOC && graphs.rng_allocs) {
                graphs.rng_allocs--; /* the generator's seed or offset: default pools */
            } else {
                st = begin_capture_route(graphs.pending);
                graphs.pending = NULL;
                if (st != CCA_OK)
                    goto out;
            }
        }
        switch (e->kind) {
        case EV_ALLOC: {
            void *p = NULL;
            r->allocs++;
            cca_status_t as = cca_malloc_device(&p, e->size, 0, (cca_stream_t)(uintptr_t)stream_handle);
            if (as != CCA_OK) {
                r->unexpected_ooms++;
                if (trace_addresses && !r->address_mismatches)
                    snprintf(r->first_address_mismatch, sizeof(r->first_address_mismatch),
                             "event %zu: alloc of %llu bytes failed: %.60s", i,
                             (unsigned long long)e->size, cca_last_error()->message);
                r->address_mismatches += trace_addresses;
                break;
            }
            if (trace_addresses && (uint64_t)(uintptr_t)p != e->addr) {
                if (!r->address_mismatches)
                    snprintf(r->first_address_mismatch, sizeof(r->first_address_mismatch),
                             "event %zu: alloc of %llu bytes at 0x%llx, PyTorch 0x%llx", i,
                             (unsigned long long)e->size, (unsigned long long)(uintptr_t)p,
                             (unsigned long long)e->addr);
                r->address_mismatches++;
            }
            live_entry_t *le = live_put(&live, e->addr);
            if (!le) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in replay");
                goto out;
            }
            le->ptr = (uint64_t)(uintptr_t)p;
            if (graphs.pending && !graphs.rng_allocs) {
                st = begin_capture_route(graphs.pending);
                graphs.pending = NULL;
                if (st != CCA_OK)
                    goto out;
            }
            break;
        }
        case EV_FREE_REQUESTED: {
            live_entry_t *le = live_find(&live, e->addr);
            if (!le || le->hold)
                break; /* allocated before the trace began, or failed here */
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
            }
            break;
        }
        case EV_FREE_COMPLETED: {
            live_entry_t *le = live_find(&live, e->addr);
            if (!le || !le->hold)
                break;
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

static void trace_config(const pv_node_t *root, const cca_replay_options_t *opt, replay_config_t *cfg)
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
    s->st = run_events(&s->stream, NULL, 0, s->opt.trace_addresses, s->opt.event_lag, s->sim, &s->r);
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

cca_status_t cca_replay_file(const char *path, const cca_replay_options_t *options,
                             cca_replay_result_t *result)
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
    replay_feed_t feed;
    spec_t *spec = NULL;
    pthread_t spec_thread;
    if (!opt.sequential && !history && replay_feed_init(&feed)) {
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
    cca_status_t st = replay_load(path, opt.device, spec ? &feed : NULL, &doc, &trace);
    if (spec)
        pthread_join(spec_thread, NULL);
    pool_op_t *ops = NULL;
    size_t nops = 0;
    if (st == CCA_OK)
        st = decode_pool_ops(pv_doc_root(doc), &ops, &nops);
    if (st != CCA_OK) {
        if (spec && spec->up)
            cca_shutdown();
        goto out_events;
    }
    r->load_seconds = (double)(cca_now_ns() - t0) / 1e9;
    const pv_node_t *root = pv_doc_root(doc);
    size_t n = trace.count;
    replay_config_t cfg;
    trace_config(root, &opt, &cfg);

    if (spec && spec_holds(spec, &cfg, nops, &trace)) {
        double load_seconds = r->load_seconds;
        *r = spec->r;
        r->load_seconds = load_seconds;
        r->overlapped = true;
        r->seconds = spec->seconds;
    } else {
        if (spec && spec->up)
            cca_shutdown();
        if (history) {
            cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
            st = cca_record_history(true, NULL, NULL, 2 * n + 64, CCA_RECORD_CONTEXT_NEVER);
            if (st != CCA_OK)
                goto out_events;
        }
        /* the whole trace, read: no feed, every event in view */
        replay_stream_t whole;
        memset(&whole, 0, sizeof(whole));
        whole.trace = &trace;
        whole.view = (replay_view_t){n, trace.streams, true, true};
        cca_backend_t *sim = NULL;
        st = replay_init(&cfg, &opt, &whole, r, &sim);
        if (st != CCA_OK)
            goto out_history;
        uint64_t t1 = cca_now_ns();
        st = run_events(&whole, ops, nops, opt.trace_addresses, opt.event_lag, sim, r);
        r->seconds = (double)(cca_now_ns() - t1) / 1e9;
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
    compare_expected(root, &trace, r);
    if (opt.snapshot_path)
        st = cca_dump_snapshot(opt.snapshot_path);
    if (st == CCA_OK && opt.svg_path)
        st = cca_dump_snapshot_svg(opt.svg_path);

out_shutdown:
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
