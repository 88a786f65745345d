/*
 * sim_control.c - fault injection and the test and replay controls of the
 * simulated backend: every operation counts its calls and fires its armed
 * fault (sim_enter_locked); cca_sim_* arm faults, read usage, complete
 * streams, set caps, push replay addresses and mark streams as capturing.
 * Invariant: controls take the backend's lock, so they act between whole
 * operations, never inside one.
 */
#include <pthread.h>
#include <string.h>

#include "simulator.h"

/* ---- fault injection (lock held) ------------------------------------------------ */


/* ---- test and replay controls --------------------------------------------------- */

/* The simulated backend behind b, or NULL if b is not one. */
static sim_ctx_t *sim_of(cca_backend_t *b)
{
    return b && b->destroy == sim_destroy ? b->ctx : NULL;
}

static cca_status_t not_sim(const char *fn)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", fn);
}

/* Arm (or with nth == 0 disarm) the fault of op; see cca_backend.h. */
cca_status_t cca_sim_inject_fault(cca_backend_t *backend, cca_backend_op_t op, uint64_t nth,
                                  bool persistent, cca_status_t status)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if ((int)op < 0 || op >= CCA_OP_COUNT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_inject_fault: unknown operation %d",
                         (int)op);
    if (nth && status == CCA_OK)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_sim_inject_fault: an injected fault needs a failure status");
    pthread_mutex_lock(&c->lock);
    sim_fault_t *f = &c->faults[op];
    memset(f, 0, sizeof(*f));
    f->countdown = nth;
    f->persistent = persistent;
    f->status = status;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_vmm_has_access(cca_backend_t *backend, const void *addr, int device, bool *has)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (!has)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_vmm_has_access: has is NULL");
    pthread_mutex_lock(&c->lock);
    *has = sim_vmm_access_of(c, (uint64_t)(uintptr_t)addr, device);
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

void cca_sim_clear_faults(cca_backend_t *backend)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    memset(c->faults, 0, sizeof(c->faults));
    pthread_mutex_unlock(&c->lock);
}

uint64_t cca_sim_call_count(cca_backend_t *backend, cca_backend_op_t op)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c || (int)op < 0 || op >= CCA_OP_COUNT)
        return 0;
    pthread_mutex_lock(&c->lock);
    uint64_t n = c->calls[op];
    pthread_mutex_unlock(&c->lock);
    return n;
}

cca_status_t cca_sim_usage(cca_backend_t *backend, cca_sim_usage_t *usage)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (!usage)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_usage: usage is NULL");
    pthread_mutex_lock(&c->lock);
    memset(usage, 0, sizeof(*usage));
    for (int d = 0; d < c->device_count; d++)
        usage->device_bytes[d] = c->devices[d].used;
    for (int d = 0; d < c->device_count; d++)
        usage->device_peak_bytes[d] = c->devices[d].used_peak;
    usage->live_allocations = c->allocs.count;
    usage->live_events = c->events.count;
    usage->live_reservations = c->live_reservations;
    usage->live_handles = c->live_handles;
    usage->live_host = c->live_host;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_complete_stream(cca_backend_t *backend, int device, cca_stream_t stream,
                                     bool all)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (device < -1 || device >= c->device_count || (device == -1 && !all))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_sim_complete_stream: invalid device %d (-1 only with all)", device);
    pthread_mutex_lock(&c->lock);
    if (device == -1) {
        for (int d = 0; d < c->device_count; d++)
            sim_device_complete_locked(c, d);
    } else if (all) {
        sim_device_complete_locked(c, device);
    } else {
        sim_stream_t *s = simmap_get(&c->devices[device].streams, (uint64_t)(uintptr_t)stream);
        if (s)
            sim_stream_complete_locked(c, s, NULL);
    }
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_time_events(cca_backend_t *backend, uint64_t lag)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (!c->manual_events)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_sim_time_events: the backend was not created with manual_events");
    pthread_mutex_lock(&c->lock);
    c->timed_events = true;
    c->event_lag = lag;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_keep_manual(cca_backend_t *backend, int device, cca_stream_t stream)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (device < 0 || device >= c->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_keep_manual: invalid device %d", device);
    pthread_mutex_lock(&c->lock);
    sim_stream_t *s = sim_stream_get_locked(c, device, stream);
    if (s)
        s->manual = true;
    pthread_mutex_unlock(&c->lock);
    return s ? CCA_OK : cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_sim_keep_manual: out of host memory");
}

void cca_sim_tick(cca_backend_t *backend, uint64_t ticks)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    c->clock += ticks;
    pthread_mutex_unlock(&c->lock);
}

uint64_t cca_sim_pending_events(cca_backend_t *backend)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    uint64_t n = c->pending_events;
    pthread_mutex_unlock(&c->lock);
    return n;
}

cca_status_t cca_sim_set_cap(cca_backend_t *backend, int device, size_t cap)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    if (device < 0 || device >= c->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_set_cap: invalid device %d", device);
    pthread_mutex_lock(&c->lock);
    c->devices[device].cap = cap ? cap : c->devices[device].total;
    pthread_mutex_unlock(&c->lock);
    return CCA_OK;
}

cca_status_t cca_sim_push_addresses(cca_backend_t *backend, const uint64_t *addresses, size_t count)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_append_addresses(c, addresses, count);
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t cca_sim_set_address_source(cca_backend_t *backend, cca_sim_address_source_fn source,
                                       void *ctx)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    pthread_mutex_lock(&c->lock);
    cca_status_t st = CCA_OK;
    if (source && c->backed)
        st = cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_sim_set_address_source: an address list "
                       "cannot be used in backed mode (device pointers are host pointers there)");
    else
        c->addr_source = source, c->addr_source_ctx = ctx;
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t cca_sim_set_capturing(cca_backend_t *backend, cca_stream_t stream, bool capturing)
{
    sim_ctx_t *c = sim_of(backend);
    if (!c)
        return not_sim(__func__);
    cca_status_t st = CCA_OK;
    uint64_t key = (uint64_t)(uintptr_t)stream;
    pthread_mutex_lock(&c->lock);
    if (!capturing)
        simmap_remove(&c->capturing, key);
    else if (simmap_get(&c->capturing, key))
        ; /* already capturing */
    else if (simmap_reserve(&c->capturing))
        simmap_put(&c->capturing, key, (void *)1);
    else
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_sim_set_capturing: out of host memory");
    pthread_mutex_unlock(&c->lock);
    return st;
}
