/*
 * sim_events.c - the simulated backend's event records: making and finding
 * events, and completing them. Events complete at once, or in manual mode
 * stay pending on their stream until a synchronization (or
 * cca_sim_complete_stream) completes them in record order; in timed mode
 * (cca_sim_time_events, manual mode only) those of streams not kept manual
 * complete event_lag ticks (cca_sim_tick) after their record. The
 * operations on them are in sim_streams.c.
 * Invariant: a pending event is in exactly one stream's list, its lists are
 * in record order, and pending_events counts the pending events.
 */
#include <pthread.h>
#include <stdlib.h>

#include "simulator.h"

/* ---- events (manual mode) ------------------------------------------------------ */

void sim_event_unlink(sim_ctx_t *c, sim_event_t *e)
{
    sim_stream_t *s = e->stream;
    if (!e->pending)
        return;
    if (e->prev)
        e->prev->next = e->next;
    else
        s->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        s->tail = e->prev;
    e->prev = e->next = NULL;
    e->stream = NULL;
    e->pending = false;
    c->pending_events--;
}

/* Complete the events of s recorded up to and including last (NULL: all). */
void sim_stream_complete_locked(sim_ctx_t *c, sim_stream_t *s, sim_event_t *last)
{
    while (s->head) {
        sim_event_t *e = s->head;
        sim_event_unlink(c, e);
        if (e == last)
            break;
    }
}

void sim_device_complete_locked(sim_ctx_t *c, int device)
{
    sim_map_t *m = &c->devices[device].streams;
    for (size_t i = 0; m->slots && i <= m->mask; i++)
        if (m->slots[i].value)
            sim_stream_complete_locked(c, m->slots[i].value, NULL);
}

sim_stream_t *sim_stream_get_locked(sim_ctx_t *c, int device, cca_stream_t stream)
{
    sim_map_t *streams = &c->devices[device].streams;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    sim_stream_t *s = simmap_get(streams, key);
    if (s)
        return s;
    s = calloc(1, sizeof(*s));
    if (!s || !simmap_reserve(streams)) {
        free(s);
        return NULL;
    }
    simmap_put(streams, key, s);
    return s;
}

cca_status_t sim_event_new_locked(sim_ctx_t *c, cca_backend_op_t op, int device, sim_event_t **out)
{
    sim_event_t *e = calloc(1, sizeof(*e));
    if (!e || !simmap_reserve(&c->events)) {
        free(e);
        return sim_host_oom(op);
    }
    e->device = device;
    simmap_put(&c->events, (uint64_t)(uintptr_t)e, e);
    *out = e;
    return CCA_OK;
}

/* The live event of handle on device, or NULL after recording the error. */
sim_event_t *sim_find_event(sim_ctx_t *c, cca_backend_op_t op, int device, cca_event_t event,
                            cca_status_t *st)
{
    sim_event_t *e = simmap_get(&c->events, (uint64_t)(uintptr_t)event);
    if (e && e->device == device)
        return e;
    *st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                            "sim: %s: %p is not a live event of device %d",
                            cca_backend_op_name(op), (void *)event, device);
    return NULL;
}
