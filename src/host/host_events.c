/*
 * host_events.c - the host allocator's events: a pool of events per device,
 * the list of pending events (oldest first) and the background thread that
 * collects completed ones.
 * Invariant: a block returns to its free list only when its last pending
 * event completes; no allocator lock is held across a backend call.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "pinned.h"

/* ------------------------------------------------------------------------ */
/* Events                                                                    */
/* ------------------------------------------------------------------------ */

/* A pooled event of device, or a new one. Returns CCA_OK, CCA_ERR_OUT_OF_MEMORY, backend status. */
cca_status_t host_event_get(host_alloc_t *h, int device, host_event_t **out)
{
    pthread_mutex_lock(&h->pool_lock);
    host_event_t *e = h->pool[device];
    if (e)
        h->pool[device] = e->next;
    pthread_mutex_unlock(&h->pool_lock);
    if (!e) {
        e = host_records_alloc_fails() ? NULL : calloc(1, sizeof(*e));
        if (!e)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for a pinned-block event");
        cca_status_t status = h->backend->event_create(h->backend->ctx, device, &e->event);
        if (status != CCA_OK) {
            free(e);
            return status;
        }
        e->device = device;
    }
    e->next = NULL;
    e->block = NULL;
    *out = e;
    return CCA_OK;
}

void host_event_put(host_alloc_t *h, host_event_t *e)
{
    e->block = NULL;
    pthread_mutex_lock(&h->pool_lock);
    e->next = h->pool[e->device];
    h->pool[e->device] = e;
    pthread_mutex_unlock(&h->pool_lock);
}

/*
 * Collect completed events, oldest first, stopping at the first that is not
 * ready; blocks whose last event completed become available. Returns CCA_OK
 * or the status of a failed query (that event stays pending).
 */
cca_status_t host_process_events(host_alloc_t *h)
{
    cca_backend_t *be = h->backend;
    for (;;) {
        pthread_mutex_lock(&h->events_lock);
        host_event_t *e = h->ev_head;
        if (e) {
            h->ev_head = e->next;
            if (!h->ev_head)
                h->ev_tail = NULL;
        }
        pthread_mutex_unlock(&h->events_lock);
        if (!e)
            return CCA_OK;

        cca_status_t status = be->event_query(be->ctx, e->device, e->event);
        if (status != CCA_OK) {
            pthread_mutex_lock(&h->events_lock);
            e->next = h->ev_head;
            h->ev_head = e;
            if (!h->ev_tail)
                h->ev_tail = e;
            pthread_mutex_unlock(&h->events_lock);
            return status == CCA_ERR_NOT_READY ? CCA_OK : status;
        }
        host_block_t *b = e->block;
        atomic_fetch_sub(&h->ev_pending, 1);
        host_event_put(h, e);
        if (atomic_fetch_sub(&b->event_count, 1) == 1)
            host_block_available(h, b);
    }
}

static void *background_main(void *arg)
{
    host_alloc_t *h = arg;
    pthread_mutex_lock(&h->bg_lock);
    while (!h->bg_stop) {
        if (atomic_load(&h->ev_pending) == 0) {
            pthread_cond_wait(&h->bg_cond, &h->bg_lock);
            continue;
        }
        pthread_mutex_unlock(&h->bg_lock);
        (void)host_process_events(h);
        pthread_mutex_lock(&h->bg_lock);
        if (!h->bg_stop && atomic_load(&h->ev_pending) != 0) {
            /* Events are not signalled to us: poll, as PyTorch's thread does. */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += HOST_POLL_NS;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&h->bg_cond, &h->bg_lock, &until);
        }
    }
    pthread_mutex_unlock(&h->bg_lock);
    return NULL;
}

static atomic_bool start_fails; /* tests (host_test_fail_background_start) */

void host_test_fail_background_start(bool on)
{
    atomic_store_explicit(&start_fails, on, memory_order_relaxed);
}

cca_status_t host_background_start(host_alloc_t *h)
{
    if (h->bg_running)
        return CCA_OK;
    h->bg_stop = false;
    if (atomic_load_explicit(&start_fails, memory_order_relaxed) ||
        pthread_create(&h->bg_thread, NULL, background_main, h) != 0)
        return cca_raise(CCA_ERR_BACKEND, "cannot start the pinned-memory event thread");
    h->bg_running = true;
    return CCA_OK;
}

void host_background_stop(host_alloc_t *h)
{
    if (!h->bg_running)
        return;
    pthread_mutex_lock(&h->bg_lock);
    h->bg_stop = true;
    pthread_cond_signal(&h->bg_cond);
    pthread_mutex_unlock(&h->bg_lock);
    pthread_join(h->bg_thread, NULL);
    h->bg_running = false;
}
