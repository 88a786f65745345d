/*
 * sim_events.c - the simulated backend's events and streams: event create,
 * destroy, record, query and synchronize, stream and device synchronization,
 * and the capture status of streams. Events complete at once, or in manual
 * mode stay pending on their stream until a synchronization (or
 * cca_sim_complete_stream) completes them in record order.
 * Invariant: a pending event is in exactly one stream's list, its lists are
 * in record order, and pending_events counts the pending events.
 */
#include <pthread.h>
#include <stdlib.h>

#include "sim_internal.h"

/* ---- events (manual mode) ------------------------------------------------------ */

static void event_unlink(sim_ctx_t *c, sim_event_t *e)
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
        event_unlink(c, e);
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

/* ---- streams and events ---------------------------------------------------------- */

/* Complete every event recorded on stream. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT,
 * or a fault. */
static cca_status_t sim_stream_synchronize(void *ctx, int device, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_STREAM_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_STREAM_SYNCHRONIZE, device);
        goto out_unlock;
    }
    sim_stream_t *s = simmap_get(&c->devices[device].streams, (uint64_t)(uintptr_t)stream);
    if (s)
        sim_stream_complete_locked(c, s, NULL);
    sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Complete every event of device. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_device_synchronize(void *ctx, int device)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_DEVICE_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_DEVICE_SYNCHRONIZE, device);
        goto out_unlock;
    }
    sim_device_complete_locked(c, device);
    sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Create an event; the handle is its record. Returns CCA_OK,
 * CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND (host memory), or a fault. */
static cca_status_t sim_event_create(void *ctx, int device, cca_event_t *event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_CREATE);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_EVENT_CREATE, device);
        goto out_unlock;
    }
    if (!event) {
        st = cca_backend_error(CCA_ERR_INVALID_ARGUMENT, SIM_CUDA_INVALID_VALUE,
                               "sim: event_create: NULL output pointer");
        goto out_unlock;
    }
    sim_event_t *e = NULL;
    st = sim_event_new_locked(c, CCA_OP_EVENT_CREATE, device, &e);
    if (st == CCA_OK)
        *event = e;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
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

/* Destroy an event, pending or not. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT
 * (unknown event), or a fault. */
static cca_status_t sim_event_destroy(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_DESTROY);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_DESTROY, device, event, &st);
    if (!e)
        goto out_unlock;
    event_unlink(c, e);
    simmap_remove(&c->events, (uint64_t)(uintptr_t)e);
    free(e);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Record an event on stream: complete at once, or (manual mode) pending at the end
 * of the stream's list. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND,
 * or a fault. */
static cca_status_t sim_event_record(void *ctx, int device, cca_event_t event, cca_stream_t stream)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_RECORD);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_RECORD, device, event, &st);
    if (!e || !c->manual_events)
        goto out_unlock;
    sim_map_t *streams = &c->devices[device].streams;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    sim_stream_t *s = simmap_get(streams, key);
    if (!s) {
        s = calloc(1, sizeof(*s));
        if (!s || !simmap_reserve(streams)) {
            free(s);
            st = sim_host_oom(CCA_OP_EVENT_RECORD);
            goto out_unlock;
        }
        simmap_put(streams, key, s);
    }
    event_unlink(c, e); /* re-recording re-arms the event */
    e->stream = s;
    e->pending = true;
    e->prev = s->tail;
    e->next = NULL;
    if (s->tail)
        s->tail->next = e;
    else
        s->head = e;
    s->tail = e;
    c->pending_events++;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* CCA_OK if the event completed (or was never recorded), CCA_ERR_NOT_READY if
 * pending; CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_event_query(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_QUERY);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_QUERY, device, event, &st);
    if (e && e->pending)
        st = CCA_ERR_NOT_READY; /* a state, not a failure: nothing recorded */
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Complete the event and the events recorded before it on its stream. Returns
 * CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_event_synchronize(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_SYNCHRONIZE);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_SYNCHRONIZE, device, event, &st);
    if (e && e->pending)
        sim_stream_complete_locked(c, e->stream, e);
    if (e)
        sim_pool_sync_locked(c, device);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* CCA_CAPTURE_ACTIVE for streams marked by cca_sim_set_capturing, else
 * CCA_CAPTURE_NONE. Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_stream_capture_status(void *ctx, int device, cca_stream_t stream,
                                              int *status)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_STREAM_CAPTURE_STATUS);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_STREAM_CAPTURE_STATUS, device);
        goto out_unlock;
    }
    *status = simmap_get(&c->capturing, (uint64_t)(uintptr_t)stream) ? CCA_CAPTURE_ACTIVE
                                                                    : CCA_CAPTURE_NONE;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Install the event and stream operations into the table. */
void sim_events_install(cca_backend_t *b)
{
    b->stream_synchronize = sim_stream_synchronize;
    b->device_synchronize = sim_device_synchronize;
    b->event_create = sim_event_create;
    b->event_destroy = sim_event_destroy;
    b->event_record = sim_event_record;
    b->event_query = sim_event_query;
    b->event_synchronize = sim_event_synchronize;
    b->stream_capture_status = sim_stream_capture_status;
}
