/*
 * trace_ring.h - the history ring's entries, shared by trace.c and the
 * snapshot writers.
 */
#ifndef CCA_TRACE_RING_H
#define CCA_TRACE_RING_H

#include "trace.h"

/* A user context string shared by ring entries, the live-block table and a thread. */
typedef struct trace_ctx {
    atomic_int refs;
    bool notify; /* the context function's: the release callback hears of its end */
    char text[];
} trace_ctx_t;

typedef struct trace_entry {
    cca_trace_action_t action;
    int device;
    uintptr_t addr;       /* address, or the device's free bytes for OOM */
    size_t size;          /* bytes */
    cca_stream_t stream;
    int64_t time_us;      /* wall clock */
    trace_ctx_t *context; /* a reference, or NULL */
    trace_ctx_t *compile; /* the device's compile context then: a reference, or NULL */
    trace_ctx_t *user_md; /* the device's user metadata then: a reference, or NULL */
    cca_mempool_id_t pool; /* the block's or segment's private pool, (0, 0): default */
} trace_entry_t;

/*
 * The ring grows as entries come, up to bound (max_entries: PyTorch's default is
 * sys.maxsize, a bound and not a size). While capacity < bound it has not wrapped:
 * entry i is in slot i and next == count % capacity.
 */
typedef struct trace_ring {
    trace_entry_t *entries;
    size_t capacity;      /* slots allocated */
    size_t bound;         /* most entries kept (max_entries, at least 1) */
    size_t next;          /* slot of the next entry */
    size_t count;         /* entries held (<= capacity) */
    uint64_t total;       /* entries ever recorded */
} trace_ring_t;

/* Start recording into a ring of at most bound entries (keeping the newest entries);
 * slots are allocated as entries come. */
cca_status_t trace_enable(size_t bound);
void trace_disable(void);

/* Copy of the live allocation's context at (device, addr) into *out, malloc'd; NULL if
 * none. False: out of host memory for the copy (*out NULL). */
bool trace_block_context(int device, uintptr_t addr, char **out);

/* Copy of the context of the allocation that created the segment starting at (device,
 * addr) (PyTorch's context_when_segment_allocated) into *out, malloc'd; NULL if none.
 * False: out of host memory for the copy (*out NULL). */
bool trace_segment_context(int device, uintptr_t addr, char **out);

/* Tests: the n-th copy of a live allocation's context from now (trace_block_context)
 * fails (0: none), as it would with the host out of memory. */
void trace_test_fail_copies(long n);

#endif /* CCA_TRACE_RING_H */
