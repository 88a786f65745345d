/*
 * snapshot.c - cca_snapshot(): every segment and block of every device, as
 * PyTorch's SegmentInfo / BlockInfo; and the dumps of the live state
 * (cca_dump_snapshot*), which gather it here and hand it to
 * observe/snapshot_write.c as plain data (snapshot_parts_t).
 *
 * Invariant: a device is walked with its lock and every one of its stream
 * pool locks held, so the picture of a device is one instant of it (no block
 * is split, merged, handed out or freed while it is read). The snapshot
 * owns copies of everything it reports; nothing points into the allocator.
 */
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "snapshot_io.h"
#include "state.h"
#include "trace.h"
#include "trace_ring.h"

void cca_snapshot_free(cca_snapshot_t *snap)
{
    if (!snap)
        return;
    for (size_t i = 0; i < snap->segment_count; i++) {
        cca_segment_info_t *seg = &snap->segments[i];
        for (size_t j = 0; j < seg->block_count; j++)
            free((char *)seg->blocks[j].context);
        free(seg->blocks);
        free((char *)seg->context);
    }
    free(snap->segments);
    free(snap);
}

static void lock_one(cca_stream_pool_t *sp, void *lock)
{
    if (*(bool *)lock)
        pool_lock(sp);
    else
        cca_spin_unlock(&sp->lock);
}

/* Lock or unlock every stream pool of dev, the private pools' too (device lock held). */
static void lock_pools(cca_device_t *dev, bool lock)
{
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (sp)
            lock_one(sp, &lock);
    }
    pools_for_each_stream_pool(dev, lock_one, &lock);
}

/*
 * Fill one segment's record (device and pool locks held) from head: a whole
 * plain segment, or one mapped run of an expandable segment (PyTorch
 * reports each contiguous mapped range as a segment). False: out of memory.
 */
static bool snapshot_segment(cca_device_t *dev, const cca_segment_t *seg, const cca_block_t *head,
                             bool contexts, cca_segment_info_t *out)
{
    size_t n = 0;
    for (const cca_block_t *b = head; b && b->mapped; b = b->next)
        n++;
    memset(out, 0, sizeof(*out));
    out->blocks = calloc(n ? n : 1, sizeof(*out->blocks));
    if (!out->blocks)
        return false;
    out->device = dev->index;
    out->address = head->addr;
    out->stream = seg->stream;
    out->is_large = !seg->is_small;
    out->is_expandable = seg->es != NULL;
    cca_mempool_id_t pool_id = pools_id_of(head->pool->owner);
    out->owner_private_pool_id[0] = pool_id.first;
    out->owner_private_pool_id[1] = pool_id.second;
    out->block_count = n;
    size_t i = 0;
    /* PyTorch: the head block's context_when_segment_allocated, which a split at the head
     * leaves with the rest (the new head block has none) */
    char *seg_context = NULL;
    if (contexts && head == seg->head && !seg->head_split &&
        !trace_segment_context(dev->index, head->addr, &seg_context))
        goto out_free;
    out->context = seg_context;
    for (const cca_block_t *b = head; b && b->mapped; b = b->next, i++) {
        cca_block_info_t *bi = &out->blocks[i];
        bool pending = !b->allocated && (b->event_count > 0 || b->stream_use_count > 0);
        bi->address = b->addr;
        bi->size = b->size;
        bi->requested_size = b->requested_size;
        bi->state = b->allocated ? CCA_BLOCK_ACTIVE_ALLOCATED
                    : pending    ? CCA_BLOCK_ACTIVE_PENDING_FREE
                                 : CCA_BLOCK_INACTIVE;
        out->total_size += b->size;
        if (b->allocated)
            out->allocated_size += b->size;
        if (bi->state != CCA_BLOCK_INACTIVE) {
            out->active_size += b->size;
            out->requested_size += b->requested_size;
            char *context = NULL;
            if (contexts && !trace_block_context(dev->index, b->addr, &context))
                goto out_free;
            bi->context = context;
        }
    }
    return true;

out_free: /* nothing of the record is kept: it is not counted in the snapshot */
    for (size_t j = 0; j < i; j++)
        free((char *)out->blocks[j].context);
    free(out->blocks);
    out->blocks = NULL;
    free((char *)out->context);
    out->context = NULL;
    return false;
}

static int segment_order(const void *a, const void *b)
{
    const cca_segment_info_t *x = a, *y = b;
    if (x->device != y->device)
        return x->device < y->device ? -1 : 1;
    return x->address < y->address ? -1 : x->address > y->address;
}

/* Append the segments of one device to snap; record its snapshot entry. */
static cca_status_t snapshot_device(cca_device_t *dev, cca_snapshot_t *snap, size_t *cap)
{
    cca_status_t st = CCA_OK;
    bool contexts = atomic_load_explicit(&cca_trace_context_level, memory_order_relaxed) >=
                    CCA_RECORD_CONTEXT_STATE;
    size_t total_active = 0;
    pthread_mutex_lock(&dev->lock);
    lock_pools(dev, true);
    size_t records = 0; /* one per plain segment, one per mapped run of an expandable one */
    for (const cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg)
        for (const cca_block_t *b = seg->head; b; b = seg->es ? b->next : NULL)
            records += b->mapped && (!b->prev || !b->prev->mapped);
    if (snap->segment_count + records > *cap) {
        size_t want = snap->segment_count + records;
        cca_segment_info_t *list = realloc(snap->segments, (want ? want : 1) * sizeof(*list));
        if (!list) {
            st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory taking a snapshot");
            goto out_unlock;
        }
        snap->segments = list;
        *cap = want;
    }
    for (const cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg) {
        for (const cca_block_t *head = seg->head; head; head = head->next) {
            if (!head->mapped || (head->prev && head->prev->mapped))
                continue; /* not the start of a mapped run */
            cca_segment_info_t *out = &snap->segments[snap->segment_count];
            if (!snapshot_segment(dev, seg, head, contexts, out)) {
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory taking a snapshot");
                goto out_unlock;
            }
            snap->segment_count++;
            total_active += out->active_size;
            if (!seg->es)
                break;
        }
    }
    trace_record(dev->index, CCA_TRACE_SNAPSHOT, 0, total_active, NULL);
out_unlock:
    lock_pools(dev, false);
    pthread_mutex_unlock(&dev->lock);
    return st;
}

cca_status_t cca_snapshot(cca_snapshot_t **out)
{
    if (!out)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_snapshot: out is NULL");
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (cca_state->settings->backend == CCA_BACKEND_ASYNC)
        return cca_raise(CCA_ERR_NOT_SUPPORTED,
                         "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For "
                         "backend:native, snapshot returns a detailed summary of all blocks tracked "
                         "by the allocator, but the cudaMallocAsync backend does not track "
                         "individual blocks.)");
    cca_snapshot_t *snap = calloc(1, sizeof(*snap));
    if (!snap)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory taking a snapshot");
    size_t cap = 0;
    for (int d = 0; d < cca_state->device_count; d++) {
        st = snapshot_device(&cca_state->devices[d], snap, &cap);
        if (st != CCA_OK) {
            cca_snapshot_free(snap);
            return st;
        }
    }
    if (snap->segment_count > 1)
        qsort(snap->segments, snap->segment_count, sizeof(*snap->segments), segment_order);
    *out = snap;
    return CCA_OK;
}

/* The live allocator's state and history as PyTorch's snapshot tree. */
static cca_status_t snapshot_build(pv_doc_t **out)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    /* history first: the snapshot entries this call records belong to the next dump (as PyTorch) */
    cca_trace_entry_t *entries = NULL;
    size_t count = 0;
    st = cca_history_get(&entries, &count);
    if (st != CCA_OK)
        return st;
    cca_snapshot_t *snap = NULL;
    st = cca_snapshot(&snap);
    if (st != CCA_OK)
        goto out_history;
    cca_device_t *dev = &cca_state->devices[0];
    pthread_mutex_lock(&dev->lock);
    double fraction = dev->set_fraction && dev->total_memory
                          ? (double)dev->allowed_memory_maximum / (double)dev->total_memory
                          : 0.0;
    pthread_mutex_unlock(&dev->lock);
    snapshot_parts_t parts = {
        .snapshot = snap,
        .entries = entries,
        .entry_count = count,
        .device_count = cca_state->device_count,
        .settings = cca_state->settings,
        .total_memory = dev->total_memory,
        .fraction = fraction,
    };
    st = snapshot_tree(&parts, out);
    cca_snapshot_free(snap);
out_history:
    cca_history_free(entries);
    return st;
}

/* A dump of the live state to path as format, for entry point what. */
static cca_status_t dump(const char *path, snapshot_format_t format, const char *what)
{
    cca_status_t st = snapshot_check_path(path, what);
    if (st != CCA_OK)
        return st;
    pv_doc_t *doc = NULL;
    st = snapshot_build(&doc);
    if (st != CCA_OK)
        return st;
    st = snapshot_write_doc(doc, format, path);
    pv_doc_free(doc);
    return st;
}

cca_status_t cca_dump_snapshot(const char *path)
{
    return dump(path, SNAPSHOT_PICKLE, "cca_dump_snapshot");
}

cca_status_t cca_dump_snapshot_json(const char *path)
{
    return dump(path, SNAPSHOT_JSON, "cca_dump_snapshot_json");
}

cca_status_t cca_dump_snapshot_svg(const char *path)
{
    return dump(path, SNAPSHOT_SVG, "cca_dump_snapshot_svg");
}
