/*
 * trace.c - the allocation-history ring buffer. Invariant: while recording
 * is on, entries hold the last `capacity` events in the order they happened
 * (a global sequence under one lock, so events of all devices interleave
 * correctly).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "trace.h"
#include "trace_ring.h"

atomic_bool cca_trace_active;

static pthread_mutex_t trace_lock = PTHREAD_MUTEX_INITIALIZER;
static trace_ring_t ring;

static const char *const action_names[CCA_TRACE_ACTION_COUNT] = {
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom", "user_defined",
};

const char *trace_action_name(cca_trace_action_t action)
{
    return (unsigned)action < CCA_TRACE_ACTION_COUNT ? action_names[action] : "unknown";
}

void trace_record_slow(int device, cca_trace_action_t action, uintptr_t addr, size_t size,
                       cca_stream_t stream)
{
    pthread_mutex_lock(&trace_lock);
    if (ring.capacity) {
        trace_entry_t *e = &ring.entries[ring.next];
        e->action = action;
        e->device = device;
        e->addr = addr;
        e->size = size;
        e->stream = stream;
        e->time_us = cca_wall_us();
        ring.next = (ring.next + 1) % ring.capacity;
        if (ring.count < ring.capacity)
            ring.count++;
        ring.total++;
    }
    pthread_mutex_unlock(&trace_lock);
}

cca_status_t trace_enable(size_t capacity)
{
    if (capacity == 0)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "history capacity must be > 0");
    trace_entry_t *entries = calloc(capacity, sizeof(*entries));
    if (!entries)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for %zu history entries", capacity);
    pthread_mutex_lock(&trace_lock);
    free(ring.entries);
    memset(&ring, 0, sizeof(ring));
    ring.entries = entries;
    ring.capacity = capacity;
    atomic_store(&cca_trace_active, true);
    pthread_mutex_unlock(&trace_lock);
    return CCA_OK;
}

void trace_disable(void)
{
    pthread_mutex_lock(&trace_lock);
    atomic_store(&cca_trace_active, false);
    free(ring.entries);
    memset(&ring, 0, sizeof(ring));
    pthread_mutex_unlock(&trace_lock);
}

cca_status_t trace_copy(trace_entry_t **out, size_t *count)
{
    pthread_mutex_lock(&trace_lock);
    size_t n = ring.count;
    trace_entry_t *copy = malloc((n ? n : 1) * sizeof(*copy));
    if (!copy) {
        pthread_mutex_unlock(&trace_lock);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory copying the history");
    }
    size_t first = (ring.next + ring.capacity - n) % (ring.capacity ? ring.capacity : 1);
    for (size_t i = 0; i < n; i++)
        copy[i] = ring.entries[(first + i) % ring.capacity];
    pthread_mutex_unlock(&trace_lock);
    *out = copy;
    *count = n;
    return CCA_OK;
}
