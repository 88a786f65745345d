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
    uint64_t stream;   /* trace stream handle */
    uint8_t kind;      /* replay_kind_t */
    bool deferred;     /* free_requested whose free_completed comes later */
} replay_event_t;

/*
 * Read the snapshot at path: *events (a zero-filled array of core/util.c,
 * *events_bytes long: free it with cca_zarray_free; *count events) is
 * device_traces[device], and *fields a dict of every other top-level field
 * (root NULL-free: pv_doc_root is a dict). Returns CCA_OK, CCA_ERR_IO,
 * CCA_ERR_FORMAT (not a snapshot: no top-level dict or no device_traces list;
 * an event without its action, addr or size; malformed data),
 * CCA_ERR_INVALID_ARGUMENT (no trace for that device), CCA_ERR_OUT_OF_MEMORY.
 * On failure nothing is returned to free.
 */
cca_status_t replay_load(const char *path, int device, pv_doc_t **fields, replay_event_t **events,
                         size_t *count, size_t *events_bytes);

#endif /* CCA_REPLAY_EVENTS_H */
