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
 * cannot be recorded, that stream is synchronized instead; if that fails too,
 * the block waits on an entry with no event, whose stream later processing
 * synchronizes (the failure is returned), so the block is never reused too
 * early.
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
            cca_status_t sync = be->stream_synchronize(be->ctx, dev->index, stream);
            if (sync == CCA_OK || !pe) { /* (no memory to remember it: cannot be kept back) */
                free(pe);
                if (sync != CCA_OK && result == CCA_OK)
                    result = sync;
                continue;
            }
            if (result == CCA_OK)
                result = sync;
            event = NULL; /* no event: the stream is synchronised before the block is reused */
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
        pool_lock(sp);
    if (--block->event_count == 0)
        pool_free_block(dev, block, false);
    if (sp != held)
        cca_spin_unlock(&sp->lock);
}

void events_wait_callers(cca_device_t *dev)
{
    for (unsigned spins = 0; atomic_load_explicit(&dev->event_callers, memory_order_seq_cst); spins++)
        cca_spin_backoff(spins);
}

/*
 * Reclaim blocks whose events completed: per stream, in recording order, up
 * to the first event not yet complete (PyTorch's events_process). Called
 * with no stream pool lock held. Nothing is queried while a route is active
 * (the caller's check of the route count may be older than a route's begin).
 */
cca_status_t events_process(cca_device_t *dev)
{
    if (!events_enter(dev))
        return CCA_OK;
    cca_backend_t *be = cca_state->backend;
    cca_status_t result = CCA_OK;
    cca_pending_event_t *done = NULL, **done_tail = &done;
    cca_stream_t blocked[16];
    size_t nblocked = 0;
    pthread_mutex_lock(&dev->events_lock);
    cca_pending_event_t **link = &dev->events_head, *last = NULL;
    while (*link) {
        cca_pending_event_t *pe = *link;
        bool skip = false;
        for (size_t i = 0; i < nblocked && !skip; i++)
            skip = blocked[i] == pe->stream;
        cca_status_t st = skip      ? CCA_ERR_NOT_READY
                          : pe->event ? be->event_query(be->ctx, dev->index, pe->event)
                                      : be->stream_synchronize(be->ctx, dev->index, pe->stream);
        if (st != CCA_OK) {
            if (st != CCA_ERR_NOT_READY && result == CCA_OK)
                result = st;
            if (!skip && nblocked < 16) /* past 16 streams, each event is asked (a stream's
                                            * later event may complete before its earlier one
                                            * is asked again: reclaiming it is still safe) */
                blocked[nblocked++] = pe->stream;
            last = pe;
            link = &pe->next;
            continue;
        }
        *link = pe->next;
        atomic_fetch_sub_explicit(&dev->pending_event_count, 1, memory_order_relaxed);
        if (pe->event)
            event_put_locked(dev, pe->event);
        pe->next = NULL;
        *done_tail = pe;
        done_tail = &pe->next;
    }
    dev->events_tail = last;
    pthread_mutex_unlock(&dev->events_lock);
    events_leave(dev);
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
        cca_status_t st = pe->event ? be->event_synchronize(be->ctx, dev->index, pe->event)
                                    : be->stream_synchronize(be->ctx, dev->index, pe->stream);
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
        if (pe->event)
            event_put(dev, pe->event);
        event_done(dev, pe->block, held);
        free(pe);
    }
    return result;
}

/* ---- frees set aside while routes to private pools are active ------------------------ */

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
 * none (device lock held, no route active; held: the stream pool lock the
 * caller holds, or NULL).
 */
cca_status_t events_insert_deferred_locked(cca_device_t *dev, cca_stream_pool_t *held)
{
    if (!atomic_load_explicit(&dev->deferred_count, memory_order_acquire))
        return CCA_OK;
    pthread_mutex_lock(&dev->events_lock);
    cca_block_t *list = dev->deferred_head;
    dev->deferred_head = NULL;
    atomic_store_explicit(&dev->deferred_count, 0, memory_order_relaxed);
    for (size_t i = 0; i < dev->marker_count; i++)
        free(dev->markers[i].nodes);
    dev->marker_count = 0;
    pthread_mutex_unlock(&dev->events_lock);
    cca_status_t result = CCA_OK;
    while (list) {
        cca_block_t *block = list;
        list = block->bin_next;
        block->bin_next = block->bin_prev = NULL;
        cca_stream_pool_t *sp = block->pool->owner;
        pool_lock_unless_held(sp, held);
        if (atomic_load_explicit(&dev->capture_uses_present, memory_order_relaxed))
            events_forget_capture_uses(dev, block, true);
        cca_status_t st = block->stream_use_count ? events_insert(dev, block) : CCA_OK;
        block->stream_use_count = 0;
        if (block->event_count == 0)
            pool_free_block(dev, block, false);
        pool_unlock_unless_held(sp, held);
        if (st != CCA_OK && result == CCA_OK)
            result = st;
    }
    return result;
}

/* ---- graph_capture_record_stream_reuse ------------------------------------------------- */

/*
 * With graph_capture_record_stream_reuse, a block set aside during a capture
 * carries free markers: the capture's terminal nodes, at free time, of its
 * allocation stream and of every stream that used it. Once every marker lies
 * behind the terminals of the allocation stream (all work captured after it
 * follows the block's last uses), the block is reused within the capture
 * (PyTorch 2.11's record_free_markers / free_safe_blocks_in_capture). The
 * test is on the graph's shape alone: no event is queried.
 */

/* Remove a set-aside block from the deferred list (events_lock held). */
static void deferred_unlink_locked(cca_device_t *dev, cca_block_t *block)
{
    if (block->bin_prev)
        block->bin_prev->bin_next = block->bin_next;
    else
        dev->deferred_head = block->bin_next;
    if (block->bin_next)
        block->bin_next->bin_prev = block->bin_prev;
    block->bin_next = block->bin_prev = NULL;
    atomic_fetch_sub_explicit(&dev->deferred_count, 1, memory_order_relaxed);
}

/* Add the terminal nodes of stream's capture to *nodes; false: not capturing (or failed). */
static bool add_terminals(cca_device_t *dev, cca_stream_t stream, uint64_t *capture,
                          cca_graph_node_t **nodes, size_t *count, size_t *cap)
{
    cca_backend_t *be = cca_state->backend;
    int status = CCA_CAPTURE_NONE;
    uint64_t id = 0;
    const cca_graph_node_t *terms = NULL;
    size_t n = 0;
    if (be->stream_capture_info(be->ctx, dev->index, stream, &status, &id, &terms, &n) != CCA_OK ||
        status != CCA_CAPTURE_ACTIVE || (*capture && id != *capture))
        return false;
    *capture = id;
    for (size_t i = 0; i < n; i++) {
        bool present = false;
        for (size_t j = 0; j < *count && !present; j++)
            present = (*nodes)[j] == terms[i];
        if (present)
            continue;
        if (*count == *cap) {
            size_t ncap = *cap ? *cap * 2 : 8;
            cca_graph_node_t *grown = realloc(*nodes, ncap * sizeof(*grown));
            if (!grown)
                return false;
            *nodes = grown;
            *cap = ncap;
        }
        (*nodes)[(*count)++] = terms[i];
    }
    return true;
}

/*
 * The free markers of block under graph_capture_record_stream_reuse: the
 * terminal nodes of its streams' capture (*nodes malloc'd), or 0 when the
 * setting is off or a stream is not captured (it then waits for the end).
 */
static size_t free_markers(cca_device_t *dev, cca_block_t *block, cca_graph_node_t **nodes)
{
    *nodes = NULL;
    if (!cca_state->settings->graph_capture_record_stream_reuse)
        return 0;
    size_t count = 0, cap = 0;
    uint64_t capture = 0;
    bool ok = add_terminals(dev, block->pool->owner->stream, &capture, nodes, &count, &cap);
    for (uint32_t i = 0; ok && i < block->stream_use_count; i++)
        ok = add_terminals(dev, block->stream_uses[i], &capture, nodes, &count, &cap);
    if (!ok || !count) {
        free(*nodes);
        *nodes = NULL;
        return 0;
    }
    return count;
}

/*
 * A block used on other streams was freed while a route is active: set it
 * aside until no route is (PyTorch's deferred blocks), with its free markers
 * if graph_capture_record_stream_reuse is on; no event may be recorded or
 * queried during a capture (its stream pool lock held).
 */
void events_defer_free(cca_device_t *dev, cca_block_t *block)
{
    cca_graph_node_t *nodes;
    size_t count = free_markers(dev, block, &nodes);
    pthread_mutex_lock(&dev->events_lock);
    if (count && dev->marker_count == dev->marker_cap) {
        size_t ncap = dev->marker_cap ? dev->marker_cap * 2 : 8;
        cca_free_markers_t *grown = realloc(dev->markers, ncap * sizeof(*grown));
        if (grown) {
            dev->markers = grown;
            dev->marker_cap = ncap;
        }
    }
    if (count && dev->marker_count < dev->marker_cap) {
        dev->markers[dev->marker_count++] = (cca_free_markers_t){block, nodes, count};
    } else {
        free(nodes); /* no markers: it waits for the end of the capture */
    }
    block->bin_prev = NULL;
    block->bin_next = dev->deferred_head;
    if (dev->deferred_head)
        dev->deferred_head->bin_prev = block;
    dev->deferred_head = block;
    atomic_fetch_add_explicit(&dev->deferred_count, 1, memory_order_release);
    pthread_mutex_unlock(&dev->events_lock);
}

static inline size_t node_hash(cca_graph_node_t n)
{
    uint64_t x = (uint64_t)(uintptr_t)n * 0x9e3779b97f4a7c15ull;
    return (size_t)(x >> 20);
}

static bool visited_has(const cca_reuse_ctx_t *r, cca_graph_node_t n)
{
    if (!r->cap)
        return false;
    for (size_t i = node_hash(n) & (r->cap - 1);; i = (i + 1) & (r->cap - 1)) {
        if (r->visited[i] == n)
            return true;
        if (!r->visited[i])
            return false;
    }
}

/* Add n to the visited set; false: out of host memory. */
static bool visited_add(cca_reuse_ctx_t *r, cca_graph_node_t n)
{
    if ((r->count + 1) * 2 > r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        cca_graph_node_t *set = calloc(cap, sizeof(*set));
        if (!set)
            return false;
        for (size_t i = 0; i < r->cap; i++) {
            if (!r->visited[i])
                continue;
            size_t j = node_hash(r->visited[i]) & (cap - 1);
            while (set[j])
                j = (j + 1) & (cap - 1);
            set[j] = r->visited[i];
        }
        free(r->visited);
        r->visited = set;
        r->cap = cap;
    }
    size_t j = node_hash(n) & (r->cap - 1);
    while (r->visited[j])
        j = (j + 1) & (r->cap - 1);
    r->visited[j] = n;
    r->count++;
    return true;
}

/* The traversal state of (capture, stream), created on first use (device lock held). */
static cca_reuse_ctx_t *reuse_ctx(cca_device_t *dev, uint64_t capture, cca_stream_t stream)
{
    for (size_t i = 0; i < dev->reuse_count; i++)
        if (dev->reuse[i].capture_id == capture && dev->reuse[i].stream == stream)
            return &dev->reuse[i];
    if (dev->reuse_count == dev->reuse_cap) {
        size_t cap = dev->reuse_cap ? dev->reuse_cap * 2 : 4;
        cca_reuse_ctx_t *grown = realloc(dev->reuse, cap * sizeof(*grown));
        if (!grown)
            return NULL;
        dev->reuse = grown;
        dev->reuse_cap = cap;
    }
    cca_reuse_ctx_t *r = &dev->reuse[dev->reuse_count++];
    memset(r, 0, sizeof(*r));
    r->capture_id = capture;
    r->stream = stream;
    return r;
}

/*
 * Visit every node behind the terminals of stream's capture, skipping what an
 * earlier call already visited (device lock held). CCA_OK, a backend error,
 * or CCA_ERR_OUT_OF_MEMORY.
 */
static cca_status_t visit_behind(cca_device_t *dev, cca_reuse_ctx_t *r, const cca_graph_node_t *terms,
                                 size_t nterms)
{
    cca_backend_t *be = cca_state->backend;
    size_t cap = nterms + 16, top = 0;
    cca_graph_node_t *stack = malloc(cap * sizeof(*stack));
    if (!stack)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory walking a captured graph");
    for (size_t i = 0; i < nterms; i++)
        stack[top++] = terms[i];
    cca_status_t st = CCA_OK;
    while (top && st == CCA_OK) {
        cca_graph_node_t v = stack[--top];
        if (!v || visited_has(r, v))
            continue;
        if (!visited_add(r, v)) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory walking a captured graph");
            break;
        }
        size_t n = 0;
        st = be->graph_node_dependencies(be->ctx, dev->index, v, NULL, &n);
        if (st != CCA_OK || !n)
            continue;
        if (top + n > cap) {
            size_t ncap = (top + n) * 2;
            cca_graph_node_t *grown = realloc(stack, ncap * sizeof(*grown));
            if (!grown) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory walking a captured graph");
                break;
            }
            stack = grown;
            cap = ncap;
        }
        st = be->graph_node_dependencies(be->ctx, dev->index, v, stack + top, &n);
        if (st == CCA_OK)
            top += n;
    }
    free(stack);
    return st;
}

cca_status_t events_free_safe_in_capture(cca_device_t *dev, cca_stream_t stream)
{
    if (!cca_state->settings->graph_capture_record_stream_reuse ||
        !atomic_load_explicit(&dev->deferred_count, memory_order_acquire))
        return CCA_OK;
    cca_backend_t *be = cca_state->backend;
    int status = CCA_CAPTURE_NONE;
    uint64_t capture = 0;
    const cca_graph_node_t *terms = NULL;
    size_t nterms = 0;
    cca_status_t st = be->stream_capture_info(be->ctx, dev->index, stream, &status, &capture, &terms,
                                              &nterms);
    if (st != CCA_OK || status != CCA_CAPTURE_ACTIVE || !nterms)
        return st;
    cca_reuse_ctx_t *r = reuse_ctx(dev, capture, stream);
    if (!r)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory walking a captured graph");
    st = visit_behind(dev, r, terms, nterms);
    if (st != CCA_OK)
        return st;
    /* the set-aside blocks of this stream whose markers are all behind its terminals */
    cca_block_t *ready = NULL;
    pthread_mutex_lock(&dev->events_lock);
    size_t kept = 0;
    for (size_t i = 0; i < dev->marker_count; i++) {
        cca_free_markers_t m = dev->markers[i];
        bool reusable = m.block->pool->owner->stream == stream;
        for (size_t j = 0; j < m.count && reusable; j++)
            reusable = visited_has(r, m.nodes[j]);
        if (!reusable) {
            dev->markers[kept++] = m;
            continue;
        }
        free(m.nodes);
        deferred_unlink_locked(dev, m.block);
        m.block->bin_next = ready;
        ready = m.block;
    }
    dev->marker_count = kept;
    pthread_mutex_unlock(&dev->events_lock);
    while (ready) {
        cca_block_t *block = ready;
        ready = block->bin_next;
        block->bin_next = NULL;
        cca_stream_pool_t *sp = block->pool->owner;
        pool_lock(sp);
        if (atomic_load_explicit(&dev->capture_uses_present, memory_order_relaxed))
            events_forget_capture_uses(dev, block, false);
        block->stream_use_count = 0; /* the graph orders its uses: no event */
        pool_free_block(dev, block, false);
        cca_spin_unlock(&sp->lock);
    }
    return CCA_OK;
}

void events_reuse_reset_locked(cca_device_t *dev)
{
    for (size_t i = 0; i < dev->reuse_count; i++)
        free(dev->reuse[i].visited);
    dev->reuse_count = 0;
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
            uint32_t cap = block->stream_use_cap ? block->stream_use_cap * 2 : 2;
            cca_stream_t *uses = pool_host_alloc_fails() ? NULL : malloc(cap * sizeof(*uses));
            if (!uses) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory in cca_record_stream");
                goto out_unlock;
            }
            if (block->stream_use_count)
                memcpy(uses, block->stream_uses, block->stream_use_count * sizeof(*uses));
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

