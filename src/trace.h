/*
 * trace.h - the allocation history: what the allocator did, in order
 * (PyTorch's TraceEntry actions). Recording is off by default and then costs
 * one relaxed atomic load per event.
 */
#ifndef CCA_TRACE_H
#define CCA_TRACE_H

#include <stdatomic.h>

#include "internal.h"

typedef enum cca_trace_action {
    CCA_TRACE_ALLOC = 0,          /* block handed to the program */
    CCA_TRACE_FREE_REQUESTED,     /* program freed it */
    CCA_TRACE_FREE_COMPLETED,     /* its events completed: reusable */
    CCA_TRACE_SEGMENT_ALLOC,      /* backend malloc */
    CCA_TRACE_SEGMENT_FREE,       /* backend free */
    CCA_TRACE_SEGMENT_MAP,        /* expandable segment mapped pages */
    CCA_TRACE_SEGMENT_UNMAP,      /* expandable segment unmapped pages */
    CCA_TRACE_SNAPSHOT,           /* a snapshot was taken */
    CCA_TRACE_OOM,                /* out of memory; addr is the device's free bytes */
    CCA_TRACE_USER_DEFINED,       /* an annotation */
    CCA_TRACE_ACTION_COUNT
} cca_trace_action_t;

extern atomic_bool cca_trace_active;

void trace_record_slow(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                       cca_stream_t stream);

/* Record one event if history recording is on. */
static inline void trace_record(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                                cca_stream_t stream)
{
    if (atomic_load_explicit(&cca_trace_active, memory_order_relaxed))
        trace_record_slow(device, action, addr, size, stream);
}

static inline void trace_record_oom(int device, size_t device_free, size_t size, cca_stream_t stream)
{
    trace_record(device, CCA_TRACE_OOM, (uintptr_t)device_free, size, stream);
}

/* Name of an action as PyTorch writes it ("alloc", "free_requested", ...). */
const char *trace_action_name(cca_trace_action_t action);

#endif /* CCA_TRACE_H */
