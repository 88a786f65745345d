/*
 * replay_pools.c - the program's private-pool operations in a replay
 * (replay_pools.h). A MemPool exists from its first use (its constructor's
 * createOrIncrefPool left no marker). A graph capture begins as PyTorch's
 * capture_begin does: when no other graph is alive, the default CUDA
 * generator first allocates its seed and offset (8 bytes each, on the
 * capture stream, in the default pools), and only then are allocations
 * routed to the graph's pool (replay.c waits for them).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "replay_events.h"
#include "replay_pools.h"

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
cca_status_t replay_decode_pool_ops(const pv_node_t *root, pool_op_t **out, size_t *count)
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

cca_status_t replay_capture_route(const pool_op_t *op)
{
    int count = 0;
    bool made = op->adopt && cca_pool_use_count(0, op->id, &count) == CCA_OK && count > 0;
    cca_status_t st = cca_begin_allocate_stream_to_pool(0, op->id, (cca_stream_t)(uintptr_t)op->stream);
    if (st == CCA_OK && made)
        st = cca_release_pool(0, op->id); /* the use building made is the route's */
    return st;
}

/*
 * Apply one pool operation as the program's PyTorch did. A MemPool exists
 * from its first use (its constructor's createOrIncrefPool left no marker).
 */
cca_status_t replay_apply_pool_op(const pool_op_t *op, size_t index, graph_state_t *g)
{
    cca_status_t st = CCA_OK;
    int count;
    switch (op->kind) {
    case POOL_GRAPH_CAPTURE:
        if (!op->cache_emptied)
            st = cca_empty_cache();
        if (st == CCA_OK && g->live_graphs++ == 0) {
            g->pending = op; /* the generator registers this first graph: 2 allocations */
            g->rng_allocs = op->rng_done < 2 ? 2 - op->rng_done : 0;
        } else if (st == CCA_OK) {
            st = replay_capture_route(op);
        }
        break;
    case POOL_GRAPH_CAPTURE_END:
        if (g->pending && g->pending->id.first == op->id.first &&
            g->pending->id.second == op->id.second) {
            st = replay_capture_route(g->pending); /* a capture that allocated nothing */
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
    if (st != CCA_OK) {
        /* the cause is copied out first: cca_raise writes the record it is read from */
        char why[sizeof(cca_last_error()->message)];
        snprintf(why, sizeof(why), "%s", cca_last_error()->message);
        return cca_raise(CCA_ERR_FORMAT, "pool event %zu (pool %llu, %llu) cannot be applied: %s", index,
                         (unsigned long long)op->id.first, (unsigned long long)op->id.second, why);
    }
    return CCA_OK;
}

/* The carried state of pool id in carry (added if new); NULL when out of memory. */
static pool_carry_t *carry_of(pool_carry_t **carry, size_t *count, cca_mempool_id_t id)
{
    for (size_t i = 0; i < *count; i++)
        if ((*carry)[i].id.first == id.first && (*carry)[i].id.second == id.second)
            return &(*carry)[i];
    pool_carry_t *grown = realloc(*carry, (*count + 1) * sizeof(**carry));
    if (!grown)
        return NULL;
    *carry = grown;
    memset(&grown[*count], 0, sizeof(grown[*count]));
    grown[*count].id = id;
    return &grown[(*count)++];
}

cca_status_t replay_pools_cut(pool_op_t *ops, size_t *nops, const replay_trace_t *trace,
                              pool_carry_t **out, size_t *count, unsigned *live_graphs)
{
    *out = NULL;
    *count = 0;
    *live_graphs = 0;
    size_t n = 0, skipped = trace->skipped;
    for (size_t i = 0; i < *nops; i++) {
        const pool_op_t *op = &ops[i];
        size_t at = op->at; /* op may be ops[n], written below */
        if (op->at >= skipped) {
            ops[n] = *op;
            ops[n++].at -= skipped;
            continue;
        }
        size_t own = op->kind == POOL_GRAPH_CAPTURE ? trace->quiet_before : trace->releases_before;
        /* the program's next operation begun before the first event kept: this one is over */
        bool over = i + 1 < *nops && ops[i + 1].at <= skipped;
        if ((op->kind == POOL_EMPTY_CACHE || op->kind == POOL_GRAPH_CAPTURE ||
             op->kind == POOL_MEMPOOL_DELETE) && op->at + own >= skipped && !over) {
            /* the recording began among the segment frees it made (and a capture's generator
             * allocations): it goes on from the start */
            ops[n] = *op;
            ops[n].at = 0;
            if (op->kind == POOL_GRAPH_CAPTURE) {
                /* a segment made after it (for the generator, or the first allocation in the
                 * pool) says its empty_cache was over; each 8-byte allocation after it was
                 * one of the generator's */
                ops[n].cache_emptied = trace->made_at > at;
                ops[n].rng_done = (trace->rng_at[0] > at) + (trace->rng_at[1] > at);
                bool used = false; /* by an operation before it */
                for (size_t k = 0; k < *count && !used; k++)
                    used = (*out)[k].id.first == op->id.first && (*out)[k].id.second == op->id.second;
                ops[n].adopt = !used;
            }
            n++;
            continue;
        }
        if (op->kind == POOL_EMPTY_CACHE || op->kind == POOL_RESET_PEAKS)
            continue;
        pool_carry_t *c = carry_of(out, count, op->id);
        if (!c) {
            free(*out);
            *out = NULL;
            *count = 0;
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pool events");
        }
        /* the use counts as replay_apply_pool_op's calls change them */
        switch (op->kind) {
        case POOL_GRAPH_CAPTURE:
            c->count++;
            c->stream_route = true;
            c->stream = op->stream;
            ++*live_graphs;
            break;
        case POOL_GRAPH_CAPTURE_END: c->stream_route = false; break;
        case POOL_GRAPH_DELETE:
            c->count -= c->count > 0;
            *live_graphs -= *live_graphs > 0;
            break;
        case POOL_MEMPOOL_BEGIN:
            c->count += c->count ? 1 : 2;
            c->thread_route = true;
            break;
        case POOL_MEMPOOL_END:
            c->thread_route = false;
            c->count -= c->count > 0;
            break;
        case POOL_MEMPOOL_DELETE: c->count -= c->count > 0; break;
        default: break;
        }
    }
    *nops = n;
    return CCA_OK;
}

cca_status_t replay_pools_restore(const pool_carry_t *carry, size_t count)
{
    cca_status_t st = CCA_OK;
    for (size_t i = 0; i < count && st == CCA_OK; i++) {
        const pool_carry_t *c = &carry[i];
        int now = 0;
        if (cca_pool_use_count(0, c->id, &now) != CCA_OK)
            now = 0;
        /* routes first (each adds a use), then the count: never 0 while a route is on */
        if (c->stream_route) {
            st = cca_begin_allocate_stream_to_pool(0, c->id, (cca_stream_t)(uintptr_t)c->stream);
            now += st == CCA_OK;
        }
        if (st == CCA_OK && c->thread_route && (st = cca_begin_allocate_thread_to_pool(0, c->id)) == CCA_OK)
            now++;
        for (; st == CCA_OK && now < c->count; now++)
            st = cca_pool_create(0, c->id);
        for (; st == CCA_OK && now > c->count && now > 0; now--)
            st = cca_release_pool(0, c->id);
    }
    if (st != CCA_OK) {
        char why[sizeof(cca_last_error()->message)];
        snprintf(why, sizeof(why), "%s", cca_last_error()->message);
        return cca_raise(st, "the private pools before the first event cannot be set up: %s", why);
    }
    return CCA_OK;
}

cca_status_t replay_pools_routes(const pool_op_t *ops, size_t nops, const pool_carry_t *carry,
                                 size_t ncarry, unsigned live_graphs, const replay_trace_t *trace,
                                 cca_mempool_id_t **out)
{
    *out = NULL;
    if (!nops && !ncarry)
        return CCA_OK;
    struct route {
        cca_mempool_id_t id;
        bool thread;
        uint64_t stream;
        unsigned rng;  /* the generator's allocations still to come before it begins */
    } *routes = calloc(nops + 2 * ncarry + 1, sizeof(*routes));
    cca_mempool_id_t *pools = calloc(trace->count ? trace->count : 1, sizeof(*pools));
    if (!routes || !pools) {
        free(routes);
        free(pools);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pool events");
    }
    size_t n = 0, next = 0; /* routes, oldest first */
    for (size_t k = 0; k < ncarry; k++) {
        if (carry[k].stream_route)
            routes[n++] = (struct route){carry[k].id, false, carry[k].stream, 0};
        if (carry[k].thread_route)
            routes[n++] = (struct route){carry[k].id, true, 0, 0};
    }
    bool releasing = false; /* segment frees right after a pool's release are its segments */
    cca_mempool_id_t released = {0, 0};
    for (size_t i = 0; i < trace->count; i++) {
        const replay_event_t *e = replay_ev(trace, i);
        if (e->kind != EV_SEGMENT_FREE && e->kind != EV_SEGMENT_UNMAP)
            releasing = false;
        for (; next < nops && ops[next].at <= i; next++) {
            const pool_op_t *op = &ops[next];
            releasing = op->kind == POOL_GRAPH_DELETE || op->kind == POOL_MEMPOOL_END ||
                        op->kind == POOL_MEMPOOL_DELETE;
            released = op->id;
            if (op->kind == POOL_GRAPH_CAPTURE) {
                /* as replay_apply_pool_op: the generator first, for the only graph alive */
                unsigned rng = live_graphs++ ? 0 : op->rng_done < 2 ? 2 - op->rng_done : 0;
                routes[n++] = (struct route){op->id, false, op->stream, rng};
            } else if (op->kind == POOL_MEMPOOL_BEGIN) {
                routes[n++] = (struct route){op->id, true, 0, 0};
            } else if (op->kind == POOL_GRAPH_DELETE) {
                live_graphs -= live_graphs > 0;
            } else if (op->kind == POOL_GRAPH_CAPTURE_END || op->kind == POOL_MEMPOOL_END) {
                for (size_t k = 0; k < n; k++) {
                    if (routes[k].id.first == op->id.first && routes[k].id.second == op->id.second) {
                        memmove(&routes[k], &routes[k + 1], (n - k - 1) * sizeof(*routes));
                        n--;
                        break;
                    }
                }
            }
        }
        if ((e->kind == EV_SEGMENT_FREE || e->kind == EV_SEGMENT_UNMAP) && releasing)
            pools[i] = released;
        if (e->kind != EV_ALLOC)
            continue;
        for (size_t k = 0; k < n; k++) {
            if (routes[k].thread || routes[k].stream == trace->streams[e->stream]) {
                if (!routes[k].thread && routes[k].rng) {
                    if (e->size == RNG_STATE_ALLOC) {
                        routes[k].rng--; /* the generator's: not routed yet */
                        continue;
                    }
                    routes[k].rng = 0;
                }
                pools[i] = routes[k].id;
                break;
            }
        }
    }
    free(routes);
    *out = pools;
    return CCA_OK;
}
