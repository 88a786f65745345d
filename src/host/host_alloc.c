/*
 * host_alloc.c - the pinned host caching allocator (PyTorch's CachingHostAllocator):
 * its core (free lists, creation, malloc, free, record, empty_cache,
 * statistics); pinned.h lists the other files.
 *
 * Requests are rounded up to a power of two (or, above
 * pinned_max_round_threshold, to a page) and served from one LIFO free list
 * per power-of-two size class. The free lists, the pointer map, the blocks'
 * states and the exact active statistics share one spinlock: a cached
 * allocation takes it once, and so does a free with no stream recorded
 * (lookup, double-free check, statistics and the push in one critical
 * section of a few dozen instructions). A miss takes pinned
 * memory from the system: backend host_alloc (cudaHostAlloc), or malloc +
 * parallel page pre-fault + host_register, or a bump carve from the reserve
 * segment. Blocks are never split or merged.
 *
 * A freed block that was used on other streams (host_record_event) gets one
 * event per stream; it returns to its free list only when all of them have
 * completed. Completed events are collected at allocation time (oldest first,
 * stopping at the first one not ready) or by a background thread. A block a
 * stream capture used, or freed while a stream it was used on is captured,
 * is kept at free instead (the graph's replays read it; no event can say
 * when they are done) and given back only when the allocator goes.
 *
 * Invariants:
 *  - every block held from the system is in the pointer map (hash table,
 *    exact address) and in the sorted range array (interior lookups) until
 *    it is given back; a block is in at most one free list, and only when it
 *    is not allocated, has no pending event and is not kept for a graph;
 *  - the backend is never called with any of this file's locks held, and no
 *    two locks are ever held together.
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
/* Creation and destruction                                                  */
/* ------------------------------------------------------------------------ */

static void store_settings(host_alloc_t *h, const cca_settings_t *s)
{
    size_t threads = s->pinned_num_register_threads ? s->pinned_num_register_threads : 1;
    atomic_store(&h->round_threshold, s->pinned_max_round_threshold);
    atomic_store(&h->max_cached, s->pinned_max_cached_size);
    atomic_store(&h->register_threads, threads);
    atomic_store(&h->reserve_request, s->pinned_reserve_segment_size);
    atomic_store(&h->use_register, s->pinned_use_cuda_host_register);
    atomic_store(&h->use_background, s->pinned_use_background_threads);
}

cca_status_t host_create(cca_backend_t *backend, const cca_settings_t *settings,
                         host_alloc_t **out)
{
    cca_status_t status;
    if (!backend || !settings || !out)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "host_create: backend, settings and out are required");
    host_alloc_t *h = calloc(1, sizeof(*h));
    if (!h)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pinned allocator");
    h->backend = backend;
    store_settings(h, settings);
    h->nbuckets = HOST_MAP_BUCKETS;
    h->buckets = calloc(h->nbuckets, sizeof(host_block_t *));
    if (!h->buckets) {
        status = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for the pinned allocator");
        goto out_free;
    }
    cca_spin_init(&h->lock);
    pthread_mutex_init(&h->settings_lock, NULL);
    pthread_mutex_init(&h->ranges_lock, NULL);
    pthread_mutex_init(&h->events_lock, NULL);
    pthread_mutex_init(&h->pool_lock, NULL);
    pthread_mutex_init(&h->reserve_lock, NULL);
    pthread_mutex_init(&h->stats_lock, NULL);
    pthread_mutex_init(&h->bg_lock, NULL);
    pthread_cond_init(&h->bg_cond, NULL);
    if (settings->pinned_use_background_threads) {
        status = host_background_start(h);
        if (status != CCA_OK) {
            host_destroy(h);
            return status;
        }
    }
    *out = h;
    return CCA_OK;

out_free:
    free(h);
    return status;
}

void host_destroy(host_alloc_t *h)
{
    if (!h)
        return;
    cca_backend_t *be = h->backend;
    host_background_stop(h);

    /* Pending events: their blocks go back below with everything else. */
    for (host_event_t *e = h->ev_head, *next; e; e = next) {
        next = e->next;
        (void)be->event_destroy(be->ctx, e->device, e->event);
        free(e);
    }
    for (int d = 0; d < CCA_MAX_DEVICES; d++) {
        for (host_event_t *e = h->pool[d], *next; e; e = next) {
            next = e->next;
            (void)be->event_destroy(be->ctx, e->device, e->event);
            free(e);
        }
    }
    for (size_t i = 0; i < h->nranges; i++) {
        host_block_t *b = h->ranges[i];
        if (b->origin != HOST_ORIGIN_RESERVE)
            (void)host_sys_free(h, b->ptr, b->origin);
        if (b->uses != b->inline_uses)
            free(b->uses);
        free(b);
    }
    if (h->reserve_state == 2)
        (void)host_sys_free(h, h->reserve_base, h->reserve_origin);
    free(h->ranges);
    free(h->buckets);
    pthread_mutex_destroy(&h->settings_lock);
    pthread_mutex_destroy(&h->ranges_lock);
    pthread_mutex_destroy(&h->events_lock);
    pthread_mutex_destroy(&h->pool_lock);
    pthread_mutex_destroy(&h->reserve_lock);
    pthread_mutex_destroy(&h->stats_lock);
    pthread_mutex_destroy(&h->bg_lock);
    pthread_cond_destroy(&h->bg_cond);
    free(h);
}

cca_status_t host_apply_settings(host_alloc_t *h, const cca_settings_t *settings)
{
    cca_status_t status = CCA_OK;
    if (!h || !settings)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "host_apply_settings: NULL argument");
    pthread_mutex_lock(&h->settings_lock);
    if (settings->pinned_use_background_threads) {
        /* the thread first: if it cannot start, no setting has changed */
        status = host_background_start(h);
        if (status == CCA_OK) {
            store_settings(h, settings);
            /* a free that found the thread off before the store did not wake it */
            pthread_mutex_lock(&h->bg_lock);
            pthread_cond_signal(&h->bg_cond);
            pthread_mutex_unlock(&h->bg_lock);
        }
    } else {
        /* allocations collect events again before the thread goes (stopping cannot fail) */
        store_settings(h, settings);
        host_background_stop(h);
    }
    pthread_mutex_unlock(&h->settings_lock);
    return status;
}

/* ------------------------------------------------------------------------ */
/* Allocation, free, record                                                  */
/* ------------------------------------------------------------------------ */

/*
 * host_malloc's miss: a block of rounded bytes (class index) carved from the
 * reserve segment, else from the system. Its records (the block, its place
 * in the range array) are made first: once the memory is obtained nothing
 * can fail (a carve could not be given back to the segment, and memory from
 * the system would count as taken and given back). Same returns as host_malloc.
 */
static __attribute__((noinline)) cca_status_t malloc_miss(host_alloc_t *h, void **ptr,
                                                          size_t rounded, size_t index)
{
    cca_status_t status;
    void *mem = NULL;
    host_origin_t origin = HOST_ORIGIN_RESERVE;
    host_block_t *b = host_records_alloc_fails() ? NULL : calloc(1, sizeof(*b));
    if (!b)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory for a pinned block record");
    status = host_ranges_reserve(h);
    if (status != CCA_OK)
        goto out_free_block;
    status = host_reserve_take(h, rounded, &mem);
    if (status != CCA_OK)
        goto out_unreserve;
    if (!mem) {
        status = host_sys_alloc(h, rounded, &mem, &origin);
        if (status != CCA_OK)
            goto out_unreserve;
    }
    b->ptr = mem;
    b->size = rounded;
    b->origin = origin;
    b->uses = b->inline_uses;
    b->uses_cap = HOST_INLINE_USES;
    b->allocated = true;
    atomic_init(&b->event_count, 0);
    host_ranges_insert(h, b);

    pthread_mutex_lock(&h->stats_lock);
    host_stat_increase(&h->allocations, 1);
    host_stat_increase(&h->allocated_bytes, (int64_t)rounded);
    pthread_mutex_unlock(&h->stats_lock);
    cca_spin_lock(&h->lock);
    host_map_insert_locked(h, b);
    host_count_taken_locked(h, &h->classes[index], rounded);
    cca_spin_unlock(&h->lock);
    *ptr = mem;
    return CCA_OK;

out_unreserve:
    host_ranges_unreserve(h);
out_free_block:
    free(b);
    return status;
}

cca_status_t host_malloc(host_alloc_t *h, void **ptr, size_t size)
{
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_host_malloc: ptr is NULL");
    if (size == 0) {
        *ptr = NULL;
        return CCA_OK;
    }
    if (size >= CCA_MAX_REQUEST)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_host_malloc: %zu bytes is not a valid size (1 EB or more)", size);

    if (atomic_load_explicit(&h->ev_pending, memory_order_relaxed) != 0 &&
        !atomic_load_explicit(&h->use_background, memory_order_relaxed))
        (void)host_process_events(h); /* a failed query leaves its block cached */

    /* The block size: the next power of two, or a page multiple above the threshold. */
    size_t index = host_ceil_log2(size);
    size_t rounded = (size_t)1 << index;
    if (size > atomic_load_explicit(&h->round_threshold, memory_order_relaxed)) {
        rounded = host_round_up(size, HOST_PAGE);
        index = host_ceil_log2(rounded);
    }
    cca_spin_lock(&h->lock);
    host_block_t *b = host_class_pop_locked(h, index, rounded);
    cca_spin_unlock(&h->lock);
    if (!b)
        return malloc_miss(h, ptr, rounded, index);
    *ptr = b->ptr;
    return CCA_OK;
}

/*
 * host_release_ptr's error: ptr is not a block's start (b NULL) or its block
 * is not allocated. Called with the lock held; releases it. Returns
 * CCA_ERR_INVALID_POINTER.
 */
static __attribute__((noinline, cold)) cca_status_t free_error_unlock(host_alloc_t *h, void *ptr,
                                                                     host_block_t *b)
{
    size_t size = b ? b->size : 0; /* b may be given back once the lock is dropped */
    cca_spin_unlock(&h->lock);
    if (!b)
        return host_raise_unknown(h, ptr, "cca_host_free");
    return cca_raise(CCA_ERR_INVALID_POINTER,
                     "cca_host_free: pointer %p (pinned block of %zu bytes) was already freed",
                     ptr, size);
}

/*
 * host_release_ptr for a block used on streams (b->nuses > 0, just marked not
 * allocated): one event recorded per stream, with no lock held; the block
 * becomes available when the last completes. On failure the block is
 * allocated again with its streams, as before the call. Called with the lock
 * held; releases it. Returns host_release_ptr's statuses.
 */
static __attribute__((noinline)) cca_status_t free_recording_events_unlock(host_alloc_t *h,
                                                                           host_block_t *b)
{
    cca_backend_t *be = h->backend;
    cca_status_t status = CCA_OK;
    size_t nuses = b->nuses;
    host_use_t inline_copy[HOST_INLINE_USES];
    host_use_t *uses = inline_copy;
    size_t uses_cap = b->uses_cap;
    if (b->uses == b->inline_uses) {
        memcpy(inline_copy, b->inline_uses, nuses * sizeof(*uses));
    } else {
        uses = b->uses;
        b->uses = b->inline_uses;
        b->uses_cap = HOST_INLINE_USES;
    }
    b->nuses = 0;
    cca_spin_unlock(&h->lock);

    /* A stream being captured now cannot say by an event when its earlier work is done (an
     * event recorded there is part of the graph): the block is kept, as a captured one. */
    host_event_t *first = NULL, *last = NULL;
    size_t recorded = 0;
    for (size_t i = 0; i < nuses; i++) {
        int capture = CCA_CAPTURE_NONE;
        status = uses[i].stream ? be->stream_capture_status(be->ctx, uses[i].device, uses[i].stream, &capture)
                                : CCA_OK;
        if (status == CCA_ERR_NOT_SUPPORTED)
            capture = CCA_CAPTURE_NONE;
        else if (status != CCA_OK)
            goto out_restore;
        if (capture != CCA_CAPTURE_NONE) {
            cca_spin_lock(&h->lock);
            b->captured = true;
            cca_spin_unlock(&h->lock);
            if (uses != inline_copy)
                free(uses);
            return CCA_OK;
        }
    }

    /* One event per stream, recorded with no lock held. */
    for (size_t i = 0; i < nuses; i++) {
        host_event_t *e = NULL;
        status = host_event_get(h, uses[i].device, &e);
        if (status != CCA_OK)
            goto out_restore;
        status = be->event_record(be->ctx, uses[i].device, e->event, uses[i].stream);
        if (status != CCA_OK) {
            host_event_put(h, e);
            goto out_restore;
        }
        e->block = b;
        if (last)
            last->next = e;
        else
            first = e;
        last = e;
        recorded++;
    }
    if (uses != inline_copy)
        free(uses);
    atomic_store(&b->event_count, recorded);

    pthread_mutex_lock(&h->events_lock);
    if (h->ev_tail)
        h->ev_tail->next = first;
    else
        h->ev_head = first;
    h->ev_tail = last;
    atomic_fetch_add(&h->ev_pending, recorded);
    pthread_mutex_unlock(&h->events_lock);

    if (atomic_load_explicit(&h->use_background, memory_order_relaxed)) {
        pthread_mutex_lock(&h->bg_lock);
        pthread_cond_signal(&h->bg_cond);
        pthread_mutex_unlock(&h->bg_lock);
    }
    return CCA_OK;

out_restore:
    /* Events already recorded go back to the pool; the block is allocated again. */
    for (host_event_t *e = first, *next; e; e = next) {
        next = e->next;
        host_event_put(h, e);
    }
    cca_spin_lock(&h->lock);
    if (uses == inline_copy) {
        memcpy(b->inline_uses, inline_copy, nuses * sizeof(*uses));
    } else {
        b->uses = uses;
        b->uses_cap = uses_cap;
    }
    b->nuses = nuses;
    b->allocated = true;
    cca_spin_unlock(&h->lock);
    return status;
}

cca_status_t host_release_ptr(host_alloc_t *h, void *ptr)
{
    if (!ptr)
        return CCA_OK;
    cca_spin_lock(&h->lock);
    host_block_t *b = host_map_find_locked(h, ptr);
    if (!b || !b->allocated)
        return free_error_unlock(h, ptr, b);
    b->allocated = false;
    if (b->captured) { /* kept as it is for the graph (counted active), until shutdown */
        host_use_t *uses = b->uses != b->inline_uses ? b->uses : NULL;
        b->uses = b->inline_uses;
        b->uses_cap = HOST_INLINE_USES;
        b->nuses = 0;
        cca_spin_unlock(&h->lock);
        free(uses);
        return CCA_OK;
    }
    if (b->nuses != 0)
        return free_recording_events_unlock(h, b);
    /* No stream recorded: available at once, in this critical section. */
    bool discard = host_block_available_locked(h, b);
    cca_spin_unlock(&h->lock);
    if (discard)
        host_block_discard(h, b);
    return CCA_OK;
}

/* What ptr names (no backend call; no lock held): a block handed out and not freed (its
 * start to *base), one freed, or nothing of this allocator's. */
typedef enum { HOST_PTR_UNKNOWN, HOST_PTR_FREED, HOST_PTR_LIVE } host_ptr_state_t;

static host_ptr_state_t host_ptr_state(host_alloc_t *h, void *ptr, void **base)
{
    size_t size;
    *base = ptr;
    for (int attempt = 0; attempt < 2; attempt++) {
        cca_spin_lock(&h->lock);
        host_block_t *b = host_map_find_locked(h, *base);
        bool live = b && b->allocated;
        cca_spin_unlock(&h->lock);
        if (b)
            return live ? HOST_PTR_LIVE : HOST_PTR_FREED;
        if (attempt == 0 && !host_ranges_find(h, ptr, base, &size))
            break;
    }
    return HOST_PTR_UNKNOWN;
}

/* Add (stream, device) to b's uses. Lock held. Returns CCA_OK or CCA_ERR_OUT_OF_MEMORY. */
static cca_status_t block_add_use_locked(host_block_t *b, cca_stream_t stream, int device)
{
    for (size_t i = 0; i < b->nuses; i++)
        if (b->uses[i].stream == stream && b->uses[i].device == device)
            return CCA_OK;
    if (b->nuses == b->uses_cap) {
        size_t cap = b->uses_cap * 2;
        host_use_t *uses = host_records_alloc_fails() ? NULL : malloc(cap * sizeof(*uses));
        if (!uses)
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory recording a stream use");
        memcpy(uses, b->uses, b->nuses * sizeof(*uses));
        if (b->uses != b->inline_uses)
            free(b->uses);
        b->uses = uses;
        b->uses_cap = cap;
    }
    b->uses[b->nuses++] = (host_use_t){stream, device};
    return CCA_OK;
}

cca_status_t host_record_event(host_alloc_t *h, void *ptr, cca_stream_t stream)
{
    cca_backend_t *be = h->backend;
    int device = 0;
    cca_status_t status;
    if (!ptr)
        return cca_raise(CCA_ERR_INVALID_POINTER, "cca_host_record_event: pointer is NULL");
    status = be->get_device(be->ctx, &device);
    if (status != CCA_OK)
        return status;
    if (device < 0 || device >= CCA_MAX_DEVICES)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_host_record_event: current device %d is out of range", device);
    void *base; /* the block's start */
    host_ptr_state_t state = host_ptr_state(h, ptr, &base);
    if (state == HOST_PTR_UNKNOWN)
        return cca_raise(CCA_ERR_INVALID_POINTER,
                         "cca_host_record_event: pointer %p was not allocated by cca's pinned host "
                         "allocator",
                         ptr);
    /* a use by a stream being captured is a use by every replay of the graph (the legacy
     * default stream, NULL, is never captured: CUDA refuses to ask it while another is); the
     * backend is asked with no lock held, so the block is looked up again after */
    int capture = CCA_CAPTURE_NONE;
    status = state == HOST_PTR_LIVE && stream ? be->stream_capture_status(be->ctx, device, stream, &capture)
                                              : CCA_OK;
    if (status == CCA_ERR_NOT_SUPPORTED)
        capture = CCA_CAPTURE_NONE;
    else if (status != CCA_OK)
        return status;
    cca_spin_lock(&h->lock);
    host_block_t *b = state == HOST_PTR_LIVE ? host_map_find_locked(h, base) : NULL;
    if (b && b->allocated) {
        status = block_add_use_locked(b, stream, device);
        if (status == CCA_OK && capture != CCA_CAPTURE_NONE)
            b->captured = true;
    } else { /* freed, before the call or since the lookup */
        status = cca_raise(CCA_ERR_INVALID_POINTER,
                           "cca_host_record_event: pointer %p is in a pinned block that is not "
                           "allocated (freed)",
                           ptr);
    }
    cca_spin_unlock(&h->lock);
    return status;
}

cca_status_t host_empty_cache(host_alloc_t *h)
{
    cca_status_t first_error = host_process_events(h);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        host_block_t *taken = NULL;
        cca_spin_lock(&h->lock);
        host_block_t **link = &c->head;
        while (*link) {
            host_block_t *b = *link;
            if (b->origin == HOST_ORIGIN_RESERVE) {
                link = &b->free_next;
                continue;
            }
            *link = b->free_next;
            c->count--;
            if (b->size != (size_t)1 << i)
                c->odd--;
            b->free_next = taken;
            taken = b;
        }
        cca_spin_unlock(&h->lock);
        while (taken) {
            host_block_t *b = taken;
            taken = b->free_next;
            b->free_next = NULL;
            cca_status_t status = host_block_release(h, b);
            if (status != CCA_OK) {
                cca_spin_lock(&h->lock);
                host_class_push_locked(h, b);
                cca_spin_unlock(&h->lock);
                if (first_error == CCA_OK)
                    first_error = status;
            }
        }
    }
    /* The pooled events go back too: after freeing everything, nothing is left. */
    host_event_t *events[CCA_MAX_DEVICES];
    pthread_mutex_lock(&h->pool_lock);
    for (int d = 0; d < CCA_MAX_DEVICES; d++) {
        events[d] = h->pool[d];
        h->pool[d] = NULL;
    }
    pthread_mutex_unlock(&h->pool_lock);
    cca_backend_t *be = h->backend;
    for (int d = 0; d < CCA_MAX_DEVICES; d++)
        for (host_event_t *e = events[d], *next; e; e = next) {
            next = e->next;
            cca_status_t status = be->event_destroy(be->ctx, e->device, e->event);
            if (status == CCA_OK) {
                free(e);
                continue;
            }
            /* keep it pooled (destroyed at shutdown) and report the failure */
            if (first_error == CCA_OK)
                first_error = status;
            pthread_mutex_lock(&h->pool_lock);
            e->next = h->pool[e->device];
            h->pool[e->device] = e;
            pthread_mutex_unlock(&h->pool_lock);
        }
    return first_error;
}

/* ------------------------------------------------------------------------ */
/* Statistics and validity                                                   */
/* ------------------------------------------------------------------------ */

cca_status_t host_get_stats(host_alloc_t *h, cca_host_stats_t *stats)
{
    if (!stats)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_host_get_stats: stats is NULL");
    memset(stats, 0, sizeof(*stats));
    pthread_mutex_lock(&h->stats_lock);
    stats->allocations = h->allocations;
    stats->allocated_bytes = h->allocated_bytes;
    stats->num_host_alloc = h->num_host_alloc;
    stats->num_host_free = h->num_host_free;
    stats->host_alloc_time = h->alloc_time;
    stats->host_free_time = h->free_time;
    pthread_mutex_unlock(&h->stats_lock);
    /* One critical section: the active statistics are a consistent snapshot. */
    cca_spin_lock(&h->lock);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        stats->active_requests.allocated += c->taken;
        stats->active_requests.freed += c->returned;
        stats->active_bytes.allocated += c->taken_bytes;
        stats->active_bytes.freed += c->returned_bytes;
    }
    stats->active_requests.current = h->active.requests;
    stats->active_requests.peak = h->active.peak_requests;
    stats->active_bytes.current = h->active.bytes;
    stats->active_bytes.peak = h->active.peak_bytes;
    cca_spin_unlock(&h->lock);
    return CCA_OK;
}

void host_reset_accumulated_stats(host_alloc_t *h)
{
    pthread_mutex_lock(&h->stats_lock);
    h->allocations.allocated = h->allocations.freed = 0;
    h->allocated_bytes.allocated = h->allocated_bytes.freed = 0;
    h->num_host_alloc = h->num_host_free = 0;
    memset(&h->alloc_time, 0, sizeof(h->alloc_time));
    memset(&h->free_time, 0, sizeof(h->free_time));
    pthread_mutex_unlock(&h->stats_lock);
    cca_spin_lock(&h->lock);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        c->taken = c->taken_bytes = c->returned = c->returned_bytes = 0;
    }
    cca_spin_unlock(&h->lock);
}

void host_reset_peak_stats(host_alloc_t *h)
{
    pthread_mutex_lock(&h->stats_lock);
    h->allocations.peak = h->allocations.current;
    h->allocated_bytes.peak = h->allocated_bytes.current;
    h->alloc_time.max = h->alloc_time.min = 0;
    h->free_time.max = h->free_time.min = 0;
    pthread_mutex_unlock(&h->stats_lock);
    cca_spin_lock(&h->lock);
    h->active.peak_requests = h->active.requests;
    h->active.peak_bytes = h->active.bytes;
    cca_spin_unlock(&h->lock);
}

bool host_is_valid(host_alloc_t *h)
{
    bool valid = true;
    size_t cached = 0;
    cca_spin_lock(&h->lock);
    for (size_t i = 0; i < HOST_CLASSES; i++) {
        host_class_t *c = &h->classes[i];
        size_t count = 0, odd = 0;
        for (host_block_t *b = c->head; b; b = b->free_next) {
            count++;
            if (b->size != (size_t)1 << i)
                odd++;
            if (host_ceil_log2(b->size) != i || b->allocated || b->captured || atomic_load(&b->event_count) != 0)
                valid = false;
        }
        if (count != c->count || odd != c->odd)
            valid = false;
        cached += count;
    }
    size_t mapped = 0;
    for (size_t i = 0; i < h->nbuckets; i++)
        for (host_block_t *b = h->buckets[i]; b; b = b->map_next)
            mapped++;
    if (mapped != h->mapped)
        valid = false;
    cca_spin_unlock(&h->lock);
    pthread_mutex_lock(&h->ranges_lock);
    if (mapped != h->nranges || cached > h->nranges ||
        h->nranges + h->ranges_reserved > h->ranges_cap)
        valid = false;
    for (size_t i = 1; i < h->nranges; i++)
        if ((uintptr_t)h->ranges[i - 1]->ptr + h->ranges[i - 1]->size > (uintptr_t)h->ranges[i]->ptr)
            valid = false;
    pthread_mutex_unlock(&h->ranges_lock);
    pthread_mutex_lock(&h->stats_lock);
    if (h->allocations.current != (int64_t)mapped)
        valid = false;
    pthread_mutex_unlock(&h->stats_lock);
    return valid;
}
