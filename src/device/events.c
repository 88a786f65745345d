/*
 * events.c - record_stream: the streams a block is used on, the events
 * recorded on them when it is freed, and the reclaiming of blocks whose
 * events completed (PyTorch's insert_events / process_events /
 * synchronize_and_free_events), with the device's pool of reusable events.
 * While a route to a private pool is active (a graph capture) no event may
 * be recorded or queried: the free of a block used on other streams is set
 * aside until none is (PyTorch's deferred blocks), and the streams recorded
 * meanwhile are dropped then (work captured in a graph needs no event).
 * Invariant: a block with event_count > 0 is in no bin and not allocated;
 * pending events sit in recording order in the device's list, guarded by
 * events_lock (a leaf lock); a set-aside block (not allocated, no event, not
 * binned, stream uses left) is on the device's deferred list, linked through
 * its bin links (events_lock).
 */
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "check.h"
#include "device.h"
#include "state.h"
#include "trace.h"

/* ---- record_stream events ------------------------------------------------- */

/* An event from the device's pool, or a new one. */
static cca_status_t event_get(cca_device_t *dev, cca_event_t *event)
{
    pthread_mutex_lock(&dev->events_lock);
    if (dev->event_pool_count) {
        *event = dev->event_pool[--dev->event_pool_count];
        pthread_mutex_unlock(&dev->events_lock);
        return CCA_OK;
    }
    pthread_mutex_unlock(&dev->events_lock);
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = be->event_create(be->ctx, dev->index, event);
    if (st == CCA_OK) {
        pthread_mutex_lock(&dev->events_lock);
        dev->events_created++;
        pthread_mutex_unlock(&dev->events_lock);
    }
    return st;
}

/* Return an event to the device's pool (events_lock held). */
static void event_put_locked(cca_device_t *dev, cca_event_t event)
{
    if (dev->event_pool_count == dev->event_pool_cap) {
        size_t cap = dev->event_pool_cap ? dev->event_pool_cap * 2 : 16;
        cca_event_t *pool = realloc(dev->event_pool, cap * sizeof(*pool));
        if (!pool) {
            cca_backend_t *be = cca_state->backend;
            be->event_destroy(be->ctx, dev->index, event);
            dev->events_created--;
            return;
        }
        dev->event_pool = pool;
        dev->event_pool_cap = cap;
    }
    dev->event_pool[dev->event_pool_count++] = event;
}

static void event_put(cca_device_t *dev, cca_event_t event)
{
    pthread_mutex_lock(&dev->events_lock);
    event_put_locked(dev, event);
    pthread_mutex_unlock(&dev->events_lock);
}

/*
 * At free time: record one event per stream that used the block, so it is
 * reused only when their work is done (stream pool lock held). If an event
 * cannot be recorded, that stream is synchronized instead, so the block can
 * never be reused too early.
 */
cca_status_t events_insert(cca_device_t *dev, cca_block_t *block)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    for (uint32_t i = 0; i < block->stream_use_count; i++) {
        cca_stream_t stream = block->stream_uses[i];
        cca_pending_event_t *pe = malloc(sizeof(*pe));
        cca_event_t event = NULL;
        cca_status_t st = pe ? event_get(dev, &event)
                             : cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a stream event");
        if (st == CCA_OK) {
            st = be->event_record(be->ctx, dev->index, event, stream);
            if (st != CCA_OK)
                event_put(dev, event);
        }
        if (st != CCA_OK) {
            free(pe);
            cca_status_t sync = be->stream_synchronize(be->ctx, dev->index, stream);
            if (sync != CCA_OK && result == CCA_OK)
                result = sync;
            continue;
        }
        pe->event = event;
        pe->block = block;
        pe->stream = stream;
        pe->next = NULL;
        block->event_count++;
        pthread_mutex_lock(&dev->events_lock);
        if (dev->events_tail)
            dev->events_tail->next = pe;
        else
            dev->events_head = pe;
        dev->events_tail = pe;
        atomic_fetch_add_explicit(&dev->pending_event_count, 1, memory_order_release);
        pthread_mutex_unlock(&dev->events_lock);
    }
    block->stream_use_count = 0;
    return result;
}

/* A block's event completed: give the block back once its last one did. */
static void event_done(cca_device_t *dev, cca_block_t *block, cca_stream_pool_t *held)
{
    cca_stream_pool_t *sp = block->pool->owner;
    if (sp != held)
        cca_spin_lock(&sp->lock);
    if (--block->event_count == 0)
        pool_free_block(dev, block, false);
    if (sp != held)
        cca_spin_unlock(&sp->lock);
}

/*
 * Reclaim blocks whose events completed: per stream, in recording order, up
 * to the first event not yet complete (PyTorch's events_process). Called
 * with no stream pool lock held.
 */
cca_status_t events_process(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    cca_pending_event_t *done = NULL, **done_tail = &done;
    cca_stream_t blocked[16];
    size_t nblocked = 0;
    bool overflow = false;
    pthread_mutex_lock(&dev->events_lock);
    cca_pending_event_t **link = &dev->events_head, *last = NULL;
    while (*link) {
        cca_pending_event_t *pe = *link;
        bool skip = overflow;
        for (size_t i = 0; i < nblocked && !skip; i++)
            skip = blocked[i] == pe->stream;
        cca_status_t st = skip ? CCA_ERR_NOT_READY : be->event_query(be->ctx, dev->index, pe->event);
        if (st != CCA_OK) {
            if (st != CCA_ERR_NOT_READY && result == CCA_OK)
                result = st;
            if (!skip) {
                if (nblocked < 16)
                    blocked[nblocked++] = pe->stream;
                else
                    overflow = true;
            }
            last = pe;
            link = &pe->next;
            continue;
        }
        *link = pe->next;
        atomic_fetch_sub_explicit(&dev->pending_event_count, 1, memory_order_relaxed);
        event_put_locked(dev, pe->event);
        pe->next = NULL;
        *done_tail = pe;
        done_tail = &pe->next;
    }
    dev->events_tail = last;
    pthread_mutex_unlock(&dev->events_lock);
    while (done) {
        cca_pending_event_t *pe = done;
        done = pe->next;
        event_done(dev, pe->block, NULL);
        free(pe);
    }
    return result;
}

/*
 * Wait for every pending event and reclaim the blocks (PyTorch's
 * events_synchronize_and_free). held: the stream pool lock the caller holds.
 */
cca_status_t events_synchronize_and_free(cca_device_t *dev, cca_stream_pool_t *held,
                                         cca_private_pool_t *only)
{
    cca_backend_t *be = cca_state->backend;
    stats_lock(dev);
    dev->stats.num_sync_all_streams++;
    stats_unlock(dev);
    pthread_mutex_lock(&dev->events_lock);
    cca_pending_event_t *list = dev->events_head;
    dev->events_head = dev->events_tail = NULL;
    if (only) {
        /* keep, in order, the events of blocks of other pools */
        cca_pending_event_t *mine = NULL, **mine_tail = &mine, **link = &list;
        while (*link) {
            cca_pending_event_t *pe = *link;
            if (pe->block->pool->owner->private_pool == only) {
                *link = pe->next;
                pe->next = NULL;
                *mine_tail = pe;
                mine_tail = &pe->next;
            } else {
                dev->events_tail = pe;
                link = &pe->next;
            }
        }
        dev->events_head = list;
        list = mine;
    }
    pthread_mutex_unlock(&dev->events_lock);
    cca_status_t result = CCA_OK;
    while (list) {
        cca_pending_event_t *pe = list;
        cca_status_t st = be->event_synchronize(be->ctx, dev->index, pe->event);
        if (st != CCA_OK) {
            /* put the rest back in front, in order */
            pthread_mutex_lock(&dev->events_lock);
            cca_pending_event_t *tail = list;
            while (tail->next)
                tail = tail->next;
            tail->next = dev->events_head;
            if (!dev->events_head)
                dev->events_tail = tail;
            dev->events_head = list;
            pthread_mutex_unlock(&dev->events_lock);
            result = st;
            break;
        }
        list = pe->next;
        atomic_fetch_sub_explicit(&dev->pending_event_count, 1, memory_order_relaxed);
        event_put(dev, pe->event);
        event_done(dev, pe->block, held);
        free(pe);
    }
    return result;
}

/* ---- frees set aside while routes to private pools are active ------------------------ */

/*
 * A block used on other streams was freed while a route is active: set it
 * aside until no route is (PyTorch's deferred blocks); no event may be
 * recorded or queried during a capture (its stream pool lock held).
 */
void events_defer_free(cca_device_t *dev, cca_block_t *block)
{
    pthread_mutex_lock(&dev->events_lock);
    block->bin_prev = NULL;
    block->bin_next = dev->deferred_head;
    if (dev->deferred_head)
        dev->deferred_head->bin_prev = block;
    dev->deferred_head = block;
    atomic_fetch_add_explicit(&dev->deferred_count, 1, memory_order_release);
    pthread_mutex_unlock(&dev->events_lock);
}

/*
 * record_stream while a route is active: remember (block, stream), so the
 * use is dropped if the block's free is set aside (work captured in a graph
 * needs no event; PyTorch's block_to_cudagraph_stream_uses). Stream pool lock
 * held. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY (nothing recorded).
 */
cca_status_t events_note_capture_use(cca_device_t *dev, cca_block_t *block, cca_stream_t stream)
{
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&dev->events_lock);
    if (dev->capture_use_count == dev->capture_use_cap) {
        size_t cap = dev->capture_use_cap ? dev->capture_use_cap * 2 : 16;
        cca_capture_use_t *grown = realloc(dev->capture_uses, cap * sizeof(*grown));
        if (!grown) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_record_stream");
            goto out_unlock;
        }
        dev->capture_uses = grown;
        dev->capture_use_cap = cap;
    }
    dev->capture_uses[dev->capture_use_count++] = (cca_capture_use_t){block, stream};
    atomic_store_explicit(&dev->capture_uses_present, true, memory_order_relaxed);
out_unlock:
    pthread_mutex_unlock(&dev->events_lock);
    return st;
}

/*
 * Forget the capture-time stream uses of block; with drop, also remove those
 * streams from its stream uses (stream pool lock held).
 */
void events_forget_capture_uses(cca_device_t *dev, cca_block_t *block, bool drop)
{
    pthread_mutex_lock(&dev->events_lock);
    size_t kept = 0;
    for (size_t i = 0; i < dev->capture_use_count; i++) {
        cca_capture_use_t u = dev->capture_uses[i];
        if (u.block != block) {
            dev->capture_uses[kept++] = u;
            continue;
        }
        for (uint32_t j = 0; drop && j < block->stream_use_count; j++)
            if (block->stream_uses[j] == u.stream) {
                block->stream_uses[j] = block->stream_uses[--block->stream_use_count];
                break;
            }
    }
    dev->capture_use_count = kept;
    if (!kept)
        atomic_store_explicit(&dev->capture_uses_present, false, memory_order_relaxed);
    pthread_mutex_unlock(&dev->events_lock);
}

/*
 * Complete the frees set aside during routes (PyTorch's
 * insert_events_deferred_until_no_capture): drop the stream uses recorded
 * during the routes, record events on the others, and return the blocks with
 * none (device lock held, no route active).
 */
cca_status_t events_insert_deferred_locked(cca_device_t *dev)
{
    if (!atomic_load_explicit(&dev->deferred_count, memory_order_acquire))
        return CCA_OK;
    pthread_mutex_lock(&dev->events_lock);
    cca_block_t *list = dev->deferred_head;
    dev->deferred_head = NULL;
    atomic_store_explicit(&dev->deferred_count, 0, memory_order_relaxed);
    pthread_mutex_unlock(&dev->events_lock);
    cca_status_t result = CCA_OK;
    while (list) {
        cca_block_t *block = list;
        list = block->bin_next;
        block->bin_next = block->bin_prev = NULL;
        cca_stream_pool_t *sp = block->pool->owner;
        cca_spin_lock(&sp->lock);
        if (atomic_load_explicit(&dev->capture_uses_present, memory_order_relaxed))
            events_forget_capture_uses(dev, block, true);
        cca_status_t st = block->stream_use_count ? events_insert(dev, block) : CCA_OK;
        block->stream_use_count = 0;
        if (block->event_count == 0)
            pool_free_block(dev, block, false);
        cca_spin_unlock(&sp->lock);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    return result;
}

cca_status_t cca_record_stream(void *ptr, cca_stream_t stream)
{
    if (!cca_is_initialized())
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_record_stream: cca is not initialised");
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_record_stream: pointer is NULL");
    if (async_enabled())
        return async_record_stream(ptr, stream);
    cca_block_t *block = ptrmap_find(cca_state->ptrmap, (uintptr_t)ptr, false);
    if (!block)
        return pool_invalid_pointer("cca_record_stream", ptr);
    if (!block->pool)
        return CCA_OK; /* uncached mode: memory is freed synchronously */
    cca_stream_pool_t *sp = block->pool->owner;
    if (stream == sp->stream)
        return CCA_OK;
    cca_status_t st = CCA_OK;
    cca_spin_lock(&sp->lock);
    bool present = false;
    for (uint32_t i = 0; i < block->stream_use_count && !present; i++)
        present = block->stream_uses[i] == stream;
    if (!present) {
        if (block->stream_use_count == block->stream_use_cap) {
            uint32_t cap = block->stream_use_cap * 2;
            cca_stream_t *uses = malloc(cap * sizeof(*uses));
            if (!uses) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_record_stream");
                goto out_unlock;
            }
            memcpy(uses, block->stream_uses, block->stream_use_count * sizeof(*uses));
            if (block->stream_uses != block->stream_uses_inline)
                free(block->stream_uses);
            block->stream_uses = uses;
            block->stream_use_cap = cap;
        }
        cca_device_t *dev = sp->device;
        if (atomic_load_explicit(&dev->route_count, memory_order_relaxed)) {
            st = events_note_capture_use(dev, block, stream);
            if (st != CCA_OK)
                goto out_unlock;
        }
        block->stream_uses[block->stream_use_count++] = stream;
    }
out_unlock:
    cca_spin_unlock(&sp->lock);
    cca_assert_expensive(device_is_valid());
    return st;
}

/* ---- cache control and queries ------------------------------------------------- */

/*
 * Give the device's pooled (idle) events back to the backend, so an emptied
 * cache holds no backend resource. Returns CCA_OK or the backend's error (that
 * event stays pooled).
 */
cca_status_t events_destroy_pooled(cca_device_t *dev)
{
    cca_backend_t *be = cca_state->backend;
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&dev->events_lock);
    while (dev->event_pool_count) {
        st = be->event_destroy(be->ctx, dev->index, dev->event_pool[dev->event_pool_count - 1]);
        if (st != CCA_OK)
            break;
        dev->event_pool_count--;
        dev->events_created--;
    }
    pthread_mutex_unlock(&dev->events_lock);
    return st;
}

/* ---- internal entry points for the rest of cca ------------------------------------ */

/* Reclaim blocks whose events completed on every device (replay, tests). */
cca_status_t alloc_process_events(void)
{
    if (!cca_is_initialized())
        return CCA_OK;
    for (int d = 0; d < cca_state->device_count; d++) {
        cca_status_t st = events_process(&cca_state->devices[d]);
        if (st != CCA_OK)
            return st;
    }
    return CCA_OK;
}

