/*
 * sim_streams.c - the simulated backend's stream and event operations:
 * stream and device synchronisation (where the stream-ordered pool trims to
 * its release threshold, as the driver does), event create / destroy /
 * record / query / synchronize, stream capture status, and their entries in
 * the operation table. The event records they work on are in sim_events.c.
 */
#include <pthread.h>
#include <stdlib.h>

#include "simulator.h"

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
    sim_event_unlink(c, e);
    simmap_remove(&c->events, (uint64_t)(uintptr_t)e);
    free(e);
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* Record an event on stream: complete at once, or (manual mode) pending at the end
 * of the stream's list (timed mode: due event_lag ticks from now, at once for 0). Returns CCA_OK, CCA_ERR_INVALID_ARGUMENT, CCA_ERR_BACKEND,
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
    sim_stream_t *s = sim_stream_get_locked(c, device, stream);
    if (!s) {
        st = sim_host_oom(CCA_OP_EVENT_RECORD);
        goto out_unlock;
    }
    sim_event_unlink(c, e); /* re-recording re-arms the event */
    bool timed = c->timed_events && !s->manual;
    if (timed && !c->event_lag)
        goto out_unlock; /* completes at once */
    e->due = timed ? c->clock + c->event_lag : UINT64_MAX;
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

/* CCA_OK if the event completed (or was never recorded, or is timed and due),
 * CCA_ERR_NOT_READY if pending; CCA_ERR_INVALID_ARGUMENT, or a fault. */
static cca_status_t sim_event_query(void *ctx, int device, cca_event_t event)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_EVENT_QUERY);
    if (st != CCA_OK)
        goto out_unlock;
    sim_event_t *e = sim_find_event(c, CCA_OP_EVENT_QUERY, device, event, &st);
    if (e && e->pending && e->due <= c->clock)
        sim_stream_complete_locked(c, e->stream, e); /* timed: its ticks have passed */
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
