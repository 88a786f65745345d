/*
 * replay_pools.h - the program's private-pool operations that a trace
 * carries (cca_meta["pool_events"]: graph captures, MemPool use, their
 * release, empty_cache, a reset of the peaks), applied by the replay before
 * the event they precede; and, for a trace whose first events were left out,
 * the pools' use counts and routes as those events left them.
 */
#ifndef CCA_REPLAY_POOLS_H
#define CCA_REPLAY_POOLS_H

#include "cca.h"
#include "pickle.h"

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
    /* a graph capture begun before the first event kept (replay_pools_cut): its empty_cache
     * done already, and the generator's allocations made already (0 to 2) */
    bool cache_emptied;
    unsigned rng_done;
    /* such a capture into a pool that nothing before it used: the pool that building the
     * state before the first event made is its own (its route takes that use over) */
    bool adopt;
} pool_op_t;

/* Graph state of a replay: the capture whose route waits for the generator's allocations. */
typedef struct graph_state {
    unsigned live_graphs;       /* graphs captured and not deleted (generator registrations) */
    const pool_op_t *pending;   /* a capture whose route has not begun yet */
    unsigned rng_allocs;        /* generator allocations still expected before it begins */
} graph_state_t;

/* The size of each of the generator's seed and offset tensors (one int64). */
#define RNG_STATE_ALLOC 8

/* Decode cca_meta["pool_events"] of root (absent: none); *out malloc'd. CCA_OK, CCA_ERR_FORMAT,
 * CCA_ERR_OUT_OF_MEMORY. */
cca_status_t replay_decode_pool_ops(const pv_node_t *root, pool_op_t **out, size_t *count);
/* Begin the route of a graph capture op to its pool (taking over the use of an adopted one). */
cca_status_t replay_capture_route(const pool_op_t *op);
/* Apply op (the index-th) as the program's PyTorch did; CCA_ERR_FORMAT names it on failure. */
cca_status_t replay_apply_pool_op(const pool_op_t *op, size_t index, graph_state_t *g);

/* A private pool as the operations before a cut left it. */
typedef struct pool_carry {
    cca_mempool_id_t id;
    int count;                /* its use count */
    bool thread_route;        /* a MemPool in use (use_mem_pool) */
    bool stream_route;        /* a graph capture underway on stream */
    uint64_t stream;
} pool_carry_t;

struct replay_trace;
/*
 * The pools that the operations before trace's first event kept (trace->skipped
 * events left out) leave (*out malloc'd, *count of them) and the graphs alive
 * then; then drop those operations and move the others up by skipped. An
 * empty_cache or a MemPool's deletion whose segment frees run into the first
 * event kept (trace->releases_before of them just before it), or a graph
 * capture whose frees and generator allocations do (trace->quiet_before),
 * goes on at the start: the rest of its frees follow; a capture's empty_cache
 * and generator allocations that the events left out show done are not
 * redone. CCA_OK or CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t replay_pools_cut(pool_op_t *ops, size_t *nops, const struct replay_trace *trace,
                              pool_carry_t **out, size_t *count, unsigned *live_graphs);
/* Bring the pools to their carried use counts and routes (after the start state is built). */
cca_status_t replay_pools_restore(const pool_carry_t *carry, size_t count);

/*
 * The pool each alloc event of trace was routed to ((0, 0): the default
 * pools) by the routes carry leaves and ops (moved up already) begin and
 * end (the generator's allocations that begin a first capture, live_graphs
 * alive at the start, stay in the default pools), and the pool whose release
 * each segment free right after it gave back: *out malloc'd (one per event),
 * NULL without pool operations. CCA_OK or CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t replay_pools_routes(const pool_op_t *ops, size_t nops, const pool_carry_t *carry,
                                 size_t ncarry, unsigned live_graphs, const struct replay_trace *trace,
                                 cca_mempool_id_t **out);

#endif /* CCA_REPLAY_POOLS_H */
