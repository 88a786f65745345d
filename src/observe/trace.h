/*
 * trace.h - the allocation history: what the allocator did, in order
 * (PyTorch's TraceEntry actions; cca_trace_action_t is in cca.h). Recording
 * is off by default and then costs one relaxed atomic load per event, and
 * one more per cca_malloc / cca_free for the user context.
 */
#ifndef CCA_TRACE_H
#define CCA_TRACE_H

#include <stdatomic.h>

#include "internal.h"

/* True while the history is recorded or a tracker is attached. */
extern CCA_HIDDEN atomic_bool cca_trace_active;
/* The cca_record_context_t level while the history is recorded, else NEVER. */
extern CCA_HIDDEN atomic_int cca_trace_context_level;

void trace_record_slow(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                       cca_stream_t stream, cca_mempool_id_t pool);

/*
 * Record one event if history recording is on. A macro, so that the event's
 * fields are read only then: GCC moves no load past the atomic test, and an
 * inline function's arguments were read on every call, recording or not (a
 * few loads at each of the hot paths' events, BENCHMARKS "Twenty-first round").
 */
#define trace_record(device, action, addr, size, stream)                                  \
    trace_record_pool((device), (action), (addr), (size), (stream), ((cca_mempool_id_t){0, 0}))

/* As trace_record, for an event of a block or segment of private pool pool (trackers see it:
 * PyTorch's TraceEntry carries it, and NCCL's registration hook reads it). */
#define trace_record_pool(device, action, addr, size, stream, pool)                       \
    do {                                                                                  \
        if (atomic_load_explicit(&cca_trace_active, memory_order_relaxed))                \
            trace_record_slow((device), (action), (addr), (size), (stream), (pool));      \
    } while (0)

static inline void trace_record_oom(int device, size_t device_free, size_t size, cca_stream_t stream)
{
    trace_record(device, CCA_TRACE_OOM, (uintptr_t)device_free, size, stream);
}

bool trace_context_gather_slow(int level);
void trace_context_release(void);

/*
 * Call the user's context function when the recording level is at least
 * level, and keep the string for this thread's next entries (called with no
 * allocator lock held). True if a context was gathered: the caller then calls
 * trace_context_release() once its entries are recorded.
 */
static inline bool trace_context_gather(int level)
{
    if (atomic_load_explicit(&cca_trace_context_level, memory_order_relaxed) < level)
        return false;
    return trace_context_gather_slow(level);
}

/*
 * The public history functions that need the device (src/runtime/history_api.c
 * wraps them): device_fn gives the current device for entry point what
 * (bringing cca up where the entry point does), or leaves *device as it is.
 * Each returns CCA_OK, device_fn's error, or the public function's errors.
 */
typedef cca_status_t (*trace_device_fn)(const char *what, int *device);
/* cca_record_history; refused: the backend places blocks itself (CCA_ERR_NOT_SUPPORTED). */
cca_status_t trace_record_history(bool enabled, cca_context_fn fn, void *arg, size_t max_entries,
                                  cca_record_context_t when, bool refused);
cca_status_t trace_record_annotation(const char *const *keys, const char *const *values, size_t count,
                                     trace_device_fn device_fn);
cca_status_t trace_push_compile_context(const char *context, trace_device_fn device_fn);
cca_status_t trace_pop_compile_context(trace_device_fn device_fn);
cca_status_t trace_set_user_metadata(const char *metadata, trace_device_fn device_fn);
cca_status_t trace_get_user_metadata(char **metadata, trace_device_fn device_fn);

/* Name of an action as PyTorch writes it ("alloc", "free_requested", ...). */
const char *trace_action_name(cca_trace_action_t action);

#endif /* CCA_TRACE_H */
