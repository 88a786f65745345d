/*
 * replay_start.h - the allocator's state before a trace's first event, for a
 * snapshot recorded after the allocator had begun (_record_memory_history
 * started late, or its ring of max_entries wrapped).
 *
 * Inferred as PyTorch's memory viewer infers it (torch/utils/viz): the
 * snapshot's `segments` are the state at the end; undoing the trace's events
 * from the last to the first leaves the segments (expandable: the mapped
 * ranges) and the blocks live before the first event, with their streams and
 * pools. Then built through cca's own calls on the simulated device (fillers
 * that carve each segment at PyTorch's addresses), so that the replay goes on
 * from that state exactly.
 *
 * Invariant: a start state is empty (ngroups 0) for a trace whose recording
 * began on an empty allocator; nothing is built then.
 */
#ifndef CCA_REPLAY_START_H
#define CCA_REPLAY_START_H

#include "cca.h"
#include "replay_events.h"
#include "replay_live.h"

/* A block live before the first event. */
typedef struct start_block {
    uint64_t addr;        /* trace address */
    uint64_t requested;   /* bytes asked for */
    uint64_t size;        /* the block's bytes where the snapshot says (live at the end), else 0 */
    bool pending;         /* freed before the first event, its stream's work not done yet */
    size_t event;         /* the trace's first event on it (SIZE_MAX: none) */
    bool ambiguous;       /* in a plain large segment, freed in the trace, its end found by nothing:
                             PyTorch may have left up to 1 MiB unsplit in it (size: 0, or the
                             size the replay's placements showed, replay.c) */
} start_block_t;

/* A range of device memory that existed before the first event. */
typedef struct start_range {
    uint64_t addr, size;  /* trace address, bytes */
    uint64_t stream;      /* the stream handle of its segment */
    bool expandable;      /* a mapped range of an expandable segment */
    int small;            /* 1 small pool, 0 large, -1 unknown */
    bool has_pool;        /* pool known (from the snapshot) */
    cca_mempool_id_t pool;
} start_range_t;

/* What building makes at once: a plain segment, or an expandable reservation. */
typedef struct start_group {
    uint64_t base, end;      /* trace addresses: the segment; the reservation to its last mapped byte */
    uint64_t mapped;         /* bytes mapped (a plain segment: its size) */
    uint64_t stream;         /* stream handle */
    bool small, expandable, has_pool;
    cca_mempool_id_t pool;
    size_t first_range, nranges; /* its ranges */
} start_group_t;

/* The state before the first event of one device's trace. */
typedef struct replay_start {
    start_range_t *ranges;   /* address order */
    size_t nranges;
    start_group_t *groups;   /* address order */
    size_t ngroups;
    start_block_t *blocks;   /* address order */
    size_t nblocks;
    uint64_t reserved_bytes; /* bytes of the ranges */
    uint64_t requested_bytes; /* bytes the live blocks asked for */
} replay_start_t;

/*
 * Count an inconsistency of the input at event (UINT64_MAX: none), naming
 * the earliest in r; with strict, raise it (CCA_ERR_FORMAT) and return that,
 * else CCA_OK.
 */
cca_status_t replay_note_inconsistency(cca_replay_result_t *r, bool strict, uint64_t event, const char *fmt,
                                       ...) __attribute__((format(printf, 4, 5)));

/*
 * Infer the state before trace's first event from root's `segments` (those
 * of device) and the events; span: the bytes of an expandable reservation;
 * alloc_pool (NULL: all default): the pool each event's allocation went to.
 * Inconsistencies met are noted in r. Returns
 * CCA_OK, CCA_ERR_OUT_OF_MEMORY, or CCA_ERR_FORMAT under strict. Free *out
 * with start_free whatever the outcome.
 */
cca_status_t start_infer(const pv_node_t *root, const replay_trace_t *trace, int device, uint64_t span,
                         const cca_mempool_id_t *alloc_pool, bool strict, replay_start_t *out,
                         cca_replay_result_t *r);
void start_free(replay_start_t *s);

/*
 * Whether the bytes of ranges (n of them, any order) are those mapped when
 * the trace is played forward (f, replay_forward.c); false also when out of
 * memory.
 */
bool replay_forward_ranges(const replay_forward_t *f, const start_range_t *ranges, size_t n);

/*
 * The addresses at which building s makes its segments and reservations, in
 * the order it makes them (the simulated backend hands them out first);
 * *out malloc'd, or NULL with *count 0. Expandable reservations come with
 * their bytes mapped (resv_mapped, same index; 0 for plain segments).
 */
cca_status_t start_addresses(const replay_start_t *s, uint64_t **out, uint64_t **resv_mapped,
                             size_t *count);

/*
 * Build s on cca (up on sim, device 0, nothing allocated yet): each live
 * block enters live under its trace address; pending ones are held by a
 * private stream from *next_hold on. The private pools of released (nreleased
 * of them) were released by every user before the first event: building
 * gives up its own use of them before it unmaps the holes (PyTorch unmaps a
 * private pool's memory only then). Peaks are reset at the end. A block
 * placed elsewhere than its trace address counts as an address mismatch
 * (with trace_addresses). Returns CCA_OK or the error of a cca call.
 */
cca_status_t start_build(const replay_start_t *s, cca_backend_t *sim, bool trace_addresses,
                         const cca_mempool_id_t *released, size_t nreleased, uint64_t *next_hold,
                         live_map_t *live, cca_replay_result_t *r);

#endif /* CCA_REPLAY_START_H */
