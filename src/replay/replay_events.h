/*
 * replay_events.h - a PyTorch memory snapshot as the replay needs it: the
 * compact event list of one device's trace, and the other top-level fields as
 * a tree. replay_load.c reads it in one streaming pass (pickle_stream.h),
 * never holding the file, the decompressed pickle or a tree of the events.
 */
#ifndef CCA_REPLAY_EVENTS_H
#define CCA_REPLAY_EVENTS_H

#include "pickle.h"

typedef enum replay_kind {
    EV_ALLOC,
    EV_FREE_REQUESTED,
    EV_FREE_COMPLETED,
    EV_SEGMENT_ALLOC,
    EV_SEGMENT_FREE,
    EV_SEGMENT_MAP,
    EV_SEGMENT_UNMAP,
    EV_OOM,
    EV_OTHER,
} replay_kind_t;

typedef struct replay_event {
    uint64_t addr;     /* trace address (oom: device free bytes) */
    uint64_t size;     /* bytes */
    uint32_t stream;   /* index of its stream handle in replay_trace_t.streams */
    uint8_t kind;      /* replay_kind_t */
    bool deferred;     /* free_requested whose free_completed comes later */
} replay_event_t;      /* 24 bytes: a big trace's events are most of the replay's memory */

/* One device's trace. */
typedef struct replay_trace {
    replay_event_t *ev;      /* a zero-filled array of core/util.c, ev_bytes long */
    size_t count;            /* events */
    size_t ev_bytes;
    uint64_t *streams;       /* the distinct stream handles, in order of first use */
    size_t nstreams;
} replay_trace_t;

/*
 * Read the snapshot at path: *trace is device_traces[device], and *fields a
 * dict of every other top-level field (root NULL-free: pv_doc_root is a
 * dict). Returns CCA_OK, CCA_ERR_IO, CCA_ERR_FORMAT (not a snapshot: no
 * top-level dict or no device_traces list; an event without its action, addr
 * or size; malformed data), CCA_ERR_INVALID_ARGUMENT (no trace for that
 * device), CCA_ERR_OUT_OF_MEMORY. On failure nothing is returned to free;
 * on success free the trace with replay_trace_free.
 */
cca_status_t replay_load(const char *path, int device, pv_doc_t **fields, replay_trace_t *trace);
void replay_trace_free(replay_trace_t *trace);

#endif /* CCA_REPLAY_EVENTS_H */
