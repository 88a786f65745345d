/*
 * pool_checkpoint.c - a private pool's live allocations and checkpoints
 * (PyTorch's checkPoolLiveAllocations, getCheckpointState and
 * setCheckpointPoolState, used by cudagraph trees): the blocks of a pool's
 * segments saved, and a pool returned to them later by freeing what is
 * allocated now and allocating again, at their addresses, the blocks that
 * were allocated then. A client of the allocation path (alloc.c), above it.
 *
 * Invariant: a checkpoint is restored only onto segments that still belong
 * to the pool with the checkpoint's sizes, checked before anything changes.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "device.h"
#include "shared.h"

/* Lock (or unlock) every stream pool of pp (device lock held). */
static void lock_pool(cca_private_pool_t *pp, bool lock)
{
    for (size_t i = 0; i < pp->stream_pool_count; i++) {
        if (lock)
            cca_spin_lock(&pp->stream_pools[i]->lock);
        else
            cca_spin_unlock(&pp->stream_pools[i]->lock);
    }
}

/* Whether seg is one of pp's segments: from the segment itself, fixed for its life, so that
 * the walks over the device's segments (device lock held, pp's pools locked) read nothing
 * another stream pool's lock guards (a segment's head block changes with merges under its
 * own pool's lock). */
static inline bool segment_in_pool(const cca_segment_t *seg, const cca_private_pool_t *pp)
{
    return seg->private_pool == pp;
}

static int by_address(const void *a, const void *b)
{
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

cca_status_t cca_pool_check_live_allocations(int device, cca_mempool_id_t id, void *const *ptrs,
                                             size_t count, bool *matches)
{
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args("cca_pool_check_live_allocations", device, id, &dev);
    if (st != CCA_OK)
        return st;
    if (!matches || (!ptrs && count))
        return cca_raise(CCA_ERR_INVALID_ARGUMENT,
                         "cca_pool_check_live_allocations: matches is NULL, or ptrs NULL with count %zu",
                         count);
    uintptr_t *want = malloc((count ? count : 1) * sizeof(*want));
    if (!want)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory checking live allocations");
    for (size_t i = 0; i < count; i++)
        want[i] = (uintptr_t)ptrs[i];
    qsort(want, count, sizeof(*want), by_address);
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (!pp) {
        st = pools_unknown("cca_pool_check_live_allocations", device, id);
        goto out_unlock;
    }
    lock_pool(pp, true);
    size_t live = 0;
    bool ok = true;
    for (const cca_segment_t *seg = dev->segments; seg && ok; seg = seg->next_seg) {
        if (!segment_in_pool(seg, pp))
            continue;
        for (const cca_block_t *b = seg->head; b && ok; b = b->next) {
            if (!b->allocated)
                continue;
            live++;
            ok = count && bsearch(&b->addr, want, count, sizeof(*want), by_address);
        }
    }
    lock_pool(pp, false);
    *matches = ok && live == count;
out_unlock:
    pthread_mutex_unlock(&dev->lock);
    free(want);
    return st;
}

/* One block of a checkpoint (PyTorch's BlockState). */
typedef struct ckpt_block {
    uintptr_t addr;
    size_t size;
    bool allocated;
    bool mapped;            /* false: unmapped address space of an expandable segment */
} ckpt_block_t;

/* One segment of a checkpoint (PyTorch's SegmentState). */
typedef struct ckpt_segment {
    uintptr_t base;
    size_t size;            /* bytes, the sum of its blocks */
    cca_stream_t stream;
    bool is_small;
    bool expandable;        /* an expandable segment (size: its reservation) */
    size_t block_count;
    ckpt_block_t *blocks;
} ckpt_segment_t;

struct cca_pool_state {
    int device;
    cca_mempool_id_t id;
    size_t segment_count;
    ckpt_segment_t *segments;
};

void cca_pool_state_free(cca_pool_state_t *state)
{
    if (!state)
        return;
    for (size_t i = 0; i < state->segment_count; i++)
        free(state->segments[i].blocks);
    free(state->segments);
    free(state);
}

cca_mempool_id_t cca_pool_state_id(const cca_pool_state_t *state)
{
    cca_mempool_id_t none = {0, 0};
    return state ? state->id : none;
}

size_t cca_pool_state_segments(const cca_pool_state_t *state)
{
    return state ? state->segment_count : 0;
}

/*
 * The pool for a checkpoint operation: it exists, has not been released to
 * 0, no route is active and no block of it waits for events (device lock
 * held). Completes the set-aside frees first, as PyTorch does.
 */
static cca_status_t checkpoint_pool_locked(const char *what, cca_device_t *dev, cca_mempool_id_t id,
                                           cca_private_pool_t **out)
{
    cca_private_pool_t *pp = pools_find_locked(dev, id);
    if (!pp)
        return pools_unknown(what, dev->index, id);
    if (pp->use_count == 0)
        return cca_raise(CCA_ERR_BUSY, "%s: private pool (%" PRIu64 ", %" PRIu64 ") was released; "
                         "a freeable pool has no checkpoint", what, id.first, id.second);
    if (atomic_load_explicit(&dev->route_count, memory_order_relaxed))
        return cca_raise(CCA_ERR_BUSY, "%s: a route to a private pool is active on device %d", what,
                         dev->index);
    /* an allocation routed to the pool before its route ended may still be under way on
     * another thread (pinned under this lock, which no new one can take: no route is
     * active): it would change the pool under the walks and the restore */
    if (atomic_load_explicit(&pp->pins, memory_order_acquire))
        return cca_raise(CCA_ERR_BUSY, "%s: an allocation routed to private pool (%" PRIu64 ", %" PRIu64
                         ") has not returned yet on another thread; call again once it has",
                         what, id.first, id.second);
    cca_status_t st = events_insert_deferred_locked(dev, NULL);
    if (st != CCA_OK)
        return st;
    lock_pool(pp, true); /* frees of the pool's blocks on other threads wait */
    for (const cca_segment_t *seg = dev->segments; seg && st == CCA_OK; seg = seg->next_seg) {
        if (!segment_in_pool(seg, pp))
            continue;
        for (const cca_block_t *b = seg->head; b && st == CCA_OK; b = b->next)
            if (b->event_count || (b->mapped && !b->allocated && !b->in_bin))
                st = cca_raise(CCA_ERR_BUSY, "%s: block 0x%" PRIxPTR " of the pool waits for stream "
                               "events; synchronize first", what, b->addr);
    }
    lock_pool(pp, false);
    if (st == CCA_OK)
        *out = pp;
    return st;
}

/*
 * A restore goes through the segments in its checkpoint's order, allocating
 * each one's blocks whole before freeing those free in the checkpoint, so the
 * order decides the peak of allocated bytes it passes through. PyTorch's:
 * segments whose first block is allocated, then those whose first block is
 * free, small pool before large, each part by (stream, first block's size,
 * address), as its free-block sets order them; the first part keeps the
 * device's order (PyTorch's is that of a hash set of its block objects).
 */
static int checkpoint_part(const ckpt_segment_t *cs)
{
    return cs->blocks[0].allocated ? 0 : cs->is_small ? 1 : 2;
}

static int by_checkpoint_order(const ckpt_segment_t *x, const ckpt_segment_t *y)
{
    int px = checkpoint_part(x), py = checkpoint_part(y);
    if (px != py)
        return px < py ? -1 : 1;
    if (px == 0)
        return 0; /* made stable by checkpoint_order */
    if (x->stream != y->stream)
        return (uintptr_t)x->stream < (uintptr_t)y->stream ? -1 : 1;
    if (x->blocks[0].size != y->blocks[0].size)
        return x->blocks[0].size < y->blocks[0].size ? -1 : 1;
    return x->base < y->base ? -1 : x->base > y->base;
}

static void checkpoint_order(cca_pool_state_t *s)
{
    /* insertion sort: stable, and a pool has few segments */
    for (size_t i = 1; i < s->segment_count; i++) {
        ckpt_segment_t cs = s->segments[i];
        size_t j = i;
        for (; j > 0 && by_checkpoint_order(&s->segments[j - 1], &cs) > 0; j--)
            s->segments[j] = s->segments[j - 1];
        s->segments[j] = cs;
    }
}

cca_status_t cca_pool_get_checkpoint(int device, cca_mempool_id_t id, cca_pool_state_t **state)
{
    const char *what = "cca_pool_get_checkpoint";
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args(what, device, id, &dev);
    if (st != CCA_OK)
        return st;
    if (!state)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: state is NULL", what);
    cca_pool_state_t *s = calloc(1, sizeof(*s));
    if (!s)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
    s->device = device;
    s->id = id;
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp;
    st = checkpoint_pool_locked(what, dev, id, &pp);
    if (st != CCA_OK)
        goto out_unlock;
    lock_pool(pp, true);
    size_t nseg = 0;
    for (const cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg)
        nseg += segment_in_pool(seg, pp);
    s->segments = calloc(nseg ? nseg : 1, sizeof(*s->segments));
    for (const cca_segment_t *seg = dev->segments; seg && s->segments; seg = seg->next_seg) {
        if (!segment_in_pool(seg, pp))
            continue;
        ckpt_segment_t *cs = &s->segments[s->segment_count];
        size_t n = 0;
        for (const cca_block_t *b = seg->head; b; b = b->next)
            n++;
        cs->blocks = calloc(n, sizeof(*cs->blocks));
        if (!cs->blocks)
            break;
        s->segment_count++;
        cs->base = seg->base;
        cs->stream = seg->stream;
        cs->is_small = seg->is_small;
        cs->expandable = seg->es != NULL;
        for (const cca_block_t *b = seg->head; b; b = b->next) {
            cs->blocks[cs->block_count++] = (ckpt_block_t){b->addr, b->size, b->allocated, b->mapped};
            cs->size += b->size;
        }
    }
    lock_pool(pp, false);
    if (!s->segments || s->segment_count != nseg)
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", what);
    else
        checkpoint_order(s);
out_unlock:
    pthread_mutex_unlock(&dev->lock);
    if (st != CCA_OK) {
        cca_pool_state_free(s);
        return st;
    }
    *state = s;
    return CCA_OK;
}

void cca_checkpoint_delta_free(cca_checkpoint_delta_t *delta)
{
    if (!delta)
        return;
    free(delta->freed);
    free(delta->allocated);
    memset(delta, 0, sizeof(*delta));
}

/* The pool's segment at base, whole and free, matching cs (device lock held), or NULL. */
static cca_segment_t *checkpoint_segment_locked(cca_device_t *dev, cca_private_pool_t *pp,
                                                const ckpt_segment_t *cs)
{
    for (cca_segment_t *seg = dev->segments; seg; seg = seg->next_seg)
        if (seg->base == cs->base && segment_in_pool(seg, pp) && seg->size == cs->size &&
            seg->stream == cs->stream && seg->is_small == cs->is_small &&
            (seg->es != NULL) == cs->expandable)
            return seg;
    return NULL;
}

/* Append p to a pointer list (grown by doubling). False: out of host memory. */
static bool list_push(void ***list, size_t *count, size_t *cap, void *p)
{
    if (*count == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        void **grown = pool_host_alloc_fails() ? NULL : realloc(*list, ncap * sizeof(*grown));
        if (!grown)
            return false;
        *list = grown;
        *cap = ncap;
    }
    (*list)[(*count)++] = p;
    return true;
}

/* Room for n pointers in a list, so that n pushes cannot fail. False: out of host memory. */
static bool list_reserve(void ***list, size_t *cap, size_t n)
{
    if (n <= *cap)
        return true;
    void **grown = pool_host_alloc_fails() ? NULL : realloc(*list, n * sizeof(*grown));
    if (!grown)
        return false;
    *list = grown;
    *cap = n;
    return true;
}

/*
 * Before a restore changes anything (device lock held; every checkpoint
 * segment found in the pool; live: the pool's allocated blocks), what it could
 * otherwise fail for halfway for want of host memory: room in the delta's lists, block structs for the
 * checkpoint segments' splits (their stream pools' spares), buckets for the
 * pointer map's inserts. Returns CCA_OK, or CCA_ERR_OUT_OF_MEMORY with the
 * pool unchanged.
 */
static cca_status_t checkpoint_reserve(cca_device_t *dev, cca_private_pool_t *pp,
                                       const cca_pool_state_t *state, size_t live,
                                       cca_checkpoint_delta_t *d, size_t *freed_cap,
                                       size_t *allocated_cap)
{
    size_t kept = 0, blocks = 0;
    for (size_t i = 0; i < state->segment_count; i++) {
        blocks += state->segments[i].block_count;
        for (size_t j = 0; j < state->segments[i].block_count; j++)
            kept += state->segments[i].blocks[j].allocated;
    }
    if (!list_reserve(&d->freed, freed_cap, live) || !list_reserve(&d->allocated, allocated_cap, kept))
        goto oom;
    for (size_t i = 0; i < state->segment_count; i++) {
        const ckpt_segment_t *cs = &state->segments[i];
        cca_stream_pool_t *sp = checkpoint_segment_locked(dev, pp, cs)->head->pool->owner;
        pool_lock(sp); /* one struct per block at most (the checkpoint's: enough for sp's); with
                        * expandable segments also those a map (1) and an unmap (2) split off */
        bool ok = pool_spares_reserve(sp, cs->expandable ? 4 * blocks : blocks);
        cca_spin_unlock(&sp->lock);
        for (size_t j = 0; ok && j < cs->block_count; j++)
            ok = ptrmap_reserve(cca_state->ptrmap, cs->blocks[j].addr);
        if (!ok)
            goto oom;
    }
    return CCA_OK;
oom:
    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory restoring a checkpoint");
}

/*
 * Allocate the blocks of one checkpoint segment at their addresses, then
 * free those not allocated in the checkpoint (device lock held; the segment
 * is one free block). PyTorch's setSegmentStateToCheckpoint.
 */
static cca_status_t checkpoint_restore_segment(cca_device_t *dev, cca_segment_t *seg,
                                               const ckpt_segment_t *cs, cca_checkpoint_delta_t *d,
                                               size_t *allocated_cap)
{
    cca_block_t *curr = seg->head;
    cca_stream_pool_t *sp = curr->pool->owner;
    cca_status_t st = CCA_OK;
    for (size_t i = 0; i < cs->block_count && st == CCA_OK; i++) {
        const ckpt_block_t *bs = &cs->blocks[i];
        pool_lock(sp);
        cca_pool_t *pool = curr->pool;
        bins_remove(&pool->bins, curr);
        st = alloc_take_block(dev, pool, &curr, bs->size, bs->size, curr->size > bs->size ? 1 : 0);
        cca_block_t *next = st == CCA_OK ? curr->next : NULL;
        cca_spin_unlock(&sp->lock);
        curr = next;
    }
    if (st != CCA_OK)
        return st;
    size_t i = 0;
    for (cca_block_t *b = seg->head; b && i < cs->block_count; i++) {
        cca_block_t *next = b->next;
        void *p = (void *)b->addr;
        if (cs->blocks[i].allocated) {
            if (!list_push(&d->allocated, &d->allocated_count, allocated_cap, p))
                return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory restoring a checkpoint");
        } else {
            st = alloc_free(p);
            if (st != CCA_OK)
                return st;
        }
        b = next;
    }
    return CCA_OK;
}

/*
 * Before the frees of a restore: map the ranges of an expandable checkpoint
 * segment that were mapped then and are not now (device lock held). A failure
 * leaves what it mapped free and cached, and the pool's blocks unchanged.
 */
static cca_status_t checkpoint_map_segment(cca_device_t *dev, cca_segment_t *seg, const ckpt_segment_t *cs)
{
    cca_stream_pool_t *sp = seg->head->pool->owner;
    cca_status_t st = CCA_OK;
    pool_lock(sp);
    for (size_t i = 0; i < cs->block_count && st == CCA_OK; i++)
        if (cs->blocks[i].mapped)
            st = expandable_map_range(dev, seg, cs->blocks[i].addr, cs->blocks[i].size);
    cca_spin_unlock(&sp->lock);
    return st;
}

/*
 * After the frees: unmap the ranges of an expandable checkpoint segment that
 * were unmapped then (free now). Never fails the restore: a range the backend
 * would not unmap stays mapped and free, cached (checkpoint_restore_expandable
 * takes it as a free piece). False: the segment's reservation went with its
 * last mapped range (the checkpoint had nothing mapped in it).
 */
static bool checkpoint_unmap_segment(cca_device_t *dev, cca_segment_t *seg, const ckpt_segment_t *cs)
{
    cca_stream_pool_t *sp = seg->head->pool->owner;
    bool released = false;
    pool_lock(sp);
    for (size_t i = 0; i < cs->block_count && !released; i++)
        if (!cs->blocks[i].mapped)
            (void)expandable_unmap_range(dev, seg, cs->blocks[i].addr, cs->blocks[i].size, &released);
    cca_spin_unlock(&sp->lock);
    return !released;
}

/*
 * Allocate an expandable checkpoint segment's blocks at their addresses (device
 * lock held; every mapped run of it one free block): each mapped run is cut
 * into pieces at the checkpoint's block boundaries and every piece allocated,
 * then the pieces not allocated in the checkpoint are freed (a range mapped now
 * and unmapped then is such a piece).
 */
static cca_status_t checkpoint_restore_expandable(cca_device_t *dev, cca_segment_t *seg,
                                                  const ckpt_segment_t *cs, cca_checkpoint_delta_t *d,
                                                  size_t *allocated_cap)
{
    cca_stream_pool_t *sp = seg->head->pool->owner;
    cca_status_t st = CCA_OK;
    size_t k = 0; /* the checkpoint block at the cursor */
    for (cca_block_t *b = seg->head; b && st == CCA_OK;) {
        if (!b->mapped || b->allocated) {
            b = b->next;
            continue;
        }
        cca_block_t *curr = b;
        uintptr_t end = b->addr + b->size;
        pool_lock(sp);
        while (st == CCA_OK && curr->addr < end) {
            while (k < cs->block_count && cs->blocks[k].addr + cs->blocks[k].size <= curr->addr)
                k++;
            uintptr_t piece_end = k < cs->block_count ? cs->blocks[k].addr + cs->blocks[k].size : end;
            size_t piece = (piece_end < end ? piece_end : end) - curr->addr;
            cca_pool_t *pool = curr->pool;
            bins_remove(&pool->bins, curr);
            st = alloc_take_block(dev, pool, &curr, piece, piece, curr->size > piece ? 1 : 0);
            if (st == CCA_OK && curr->addr + curr->size < end)
                curr = curr->next;
            else
                break;
        }
        cca_spin_unlock(&sp->lock);
        b = st == CCA_OK ? curr->next : NULL;
    }
    if (st != CCA_OK)
        return st;
    k = 0;
    for (cca_block_t *b = seg->head; b;) {
        cca_block_t *next = b->next;
        if (b->allocated) {
            while (k < cs->block_count && cs->blocks[k].addr < b->addr)
                k++;
            bool kept = k < cs->block_count && cs->blocks[k].addr == b->addr && cs->blocks[k].allocated &&
                        cs->blocks[k].size == b->size;
            void *p = (void *)b->addr;
            if (kept) {
                if (!list_push(&d->allocated, &d->allocated_count, allocated_cap, p))
                    return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory restoring a checkpoint");
            } else if ((st = alloc_free(p)) != CCA_OK) {
                return st;
            }
        }
        b = next;
    }
    return CCA_OK;
}

cca_status_t cca_pool_set_checkpoint(int device, const cca_pool_state_t *state,
                                     cca_checkpoint_delta_t *delta)
{
    const char *what = "cca_pool_set_checkpoint";
    if (!state || !delta)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: state and delta are required", what);
    cca_device_t *dev = NULL;
    cca_status_t st = pools_args(what, device, state->id, &dev);
    if (st != CCA_OK)
        return st;
    if (state->device != device)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the checkpoint is of device %d, not %d", what,
                         state->device, device);
    cca_checkpoint_delta_t d;
    memset(&d, 0, sizeof(d));
    size_t freed_cap = 0, allocated_cap = 0;
    pthread_mutex_lock(&dev->lock);
    cca_private_pool_t *pp;
    st = checkpoint_pool_locked(what, dev, state->id, &pp);
    if (st != CCA_OK)
        goto out_unlock;
    /* the checks walk the pool's blocks with its stream pools locked: a free on another
     * thread comes before them or after */
    lock_pool(pp, true);
    size_t live = 0; /* allocated blocks: the delta's freed list at most */
    /* a block another process maps cannot be freed now (its free would be deferred) */
    for (cca_segment_t *seg = dev->segments; seg && st == CCA_OK; seg = seg->next_seg) {
        if (!segment_in_pool(seg, pp))
            continue;
        for (cca_block_t *b = seg->head; b && st == CCA_OK; b = b->next) {
            live += b->allocated;
            if (b->allocated && shared_holds(b->addr))
                st = cca_raise(CCA_ERR_BUSY, "%s: block 0x%" PRIxPTR " of the pool is mapped by "
                               "another process (IPC); it cannot be freed now", what, b->addr);
            /* nor one used on other streams: its free would wait for their events, and
             * the restore would hand it out again while it waits (PyTorch fails then) */
            else if (b->allocated && b->stream_use_count)
                st = cca_raise(CCA_ERR_BUSY, "%s: block 0x%" PRIxPTR " of the pool is in use on "
                               "other streams (record_stream); free it, or restore once it is "
                               "freed and its streams are done", what, b->addr);
        }
    }
    /* every segment of the checkpoint must still be the pool's, as it was */
    for (size_t i = 0; i < state->segment_count && st == CCA_OK; i++)
        if (!checkpoint_segment_locked(dev, pp, &state->segments[i]))
            st = cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: segment 0x%" PRIxPTR " of the checkpoint is "
                           "no longer in the pool", what, state->segments[i].base);
    lock_pool(pp, false);
    if (st != CCA_OK)
        goto out_unlock;
    st = checkpoint_reserve(dev, pp, state, live, &d, &freed_cap, &allocated_cap);
    if (st != CCA_OK)
        goto out_unlock;
    /* expandable segments: map again what was mapped at the checkpoint, before anything is
     * freed, so that a backend failure leaves the pool's blocks as they are */
    for (size_t i = 0; i < state->segment_count && st == CCA_OK; i++)
        if (state->segments[i].expandable)
            st = checkpoint_map_segment(dev, checkpoint_segment_locked(dev, pp, &state->segments[i]),
                                        &state->segments[i]);
    if (st != CCA_OK)
        goto out_unlock;
    /* free every block of the pool allocated now (PyTorch's freeBlocksAllocatedToPool):
     * listed in one walk (the list has room for them all: no routed allocation can add
     * one), then freed, each free locking its own pool */
    lock_pool(pp, true);
    for (cca_segment_t *seg = dev->segments; seg && st == CCA_OK; seg = seg->next_seg)
        for (cca_block_t *b = segment_in_pool(seg, pp) ? seg->head : NULL; b && st == CCA_OK; b = b->next)
            if (b->allocated && !list_push(&d.freed, &d.freed_count, &freed_cap, (void *)b->addr))
                st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory restoring a checkpoint");
    lock_pool(pp, false);
    for (size_t i = 0; i < d.freed_count && st == CCA_OK; i++)
        st = alloc_free(d.freed[i]);
    for (size_t i = 0; i < state->segment_count && st == CCA_OK; i++) {
        const ckpt_segment_t *cs = &state->segments[i];
        cca_segment_t *seg = checkpoint_segment_locked(dev, pp, cs);
        if (!cs->expandable)
            st = checkpoint_restore_segment(dev, seg, cs, &d, &allocated_cap);
        else if (checkpoint_unmap_segment(dev, seg, cs))
            st = checkpoint_restore_expandable(dev, seg, cs, &d, &allocated_cap);
    }
out_unlock:
    pthread_mutex_unlock(&dev->lock);
    if (st != CCA_OK) {
        cca_checkpoint_delta_free(&d);
        return st;
    }
    *delta = d;
    cca_assert_expensive(device_is_valid());
    return CCA_OK;
}
