/*
 * stats.c - the device statistics entry points: reading DeviceStats (exact,
 * or summed over stream pools with sampled peaks without exact_peak_stats),
 * resetting peaks and accumulated counters, memory_stats and memory_summary.
 * Invariant: a read never changes a current value; in sampled mode it may
 * only raise peaks to the current sums.
 */
#include <stdlib.h>
#include <string.h>

#include "async.h"
#include "check.h"
#include "device.h"
#include "state.h"
#include "trace.h"

/* ---- statistics ------------------------------------------------------------------ */

static cca_status_t device_arg(int device, cca_device_t **dev)
{
    cca_status_t st = state_ensure();
    if (st != CCA_OK)
        return st;
    if (device < 0 || device >= cca_state->device_count)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "device %d is out of range (%d devices)", device,
                         cca_state->device_count);
    *dev = &cca_state->devices[device];
    return CCA_OK;
}

/* Add the per-operation statistics of src into dst (current, allocated, freed). */
static void stats_add_ops(cca_device_stats_t *dst, cca_device_stats_t *src)
{
    cca_stat_t *d[CCA_OP_STAT_ARRAYS], *s[CCA_OP_STAT_ARRAYS];
    stats_op_arrays(dst, d);
    stats_op_arrays(src, s);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++) {
            d[k][t].current += s[k][t].current;
            d[k][t].allocated += s[k][t].allocated;
            d[k][t].freed += s[k][t].freed;
        }
    dst->oversize_allocations.current += src->oversize_allocations.current;
    dst->oversize_allocations.allocated += src->oversize_allocations.allocated;
    dst->oversize_allocations.freed += src->oversize_allocations.freed;
}

/* Locked mode's ALL entries: the sums of the two kinds' (stats lock held). */
static void ops_sum_all(ops_table_t *t)
{
    for (int k = 0; k < OPS_OVERSIZE; k++) {
        ops_count_t *n = t->n[CCA_STAT_ALL] + k;
        t->cur[CCA_STAT_ALL][k] = t->cur[CCA_STAT_SMALL_POOL][k] + t->cur[CCA_STAT_LARGE_POOL][k];
        n->allocated = t->n[CCA_STAT_SMALL_POOL][k].allocated + t->n[CCA_STAT_LARGE_POOL][k].allocated;
        n->freed = t->n[CCA_STAT_SMALL_POOL][k].freed + t->n[CCA_STAT_LARGE_POOL][k].freed;
    }
}

/* ---- the combining stats lock ------------------------------------------------------ */

void stats_lock_slow(cca_device_t *dev)
{
    for (unsigned spins = 0;; spins++) {
        if (atomic_load_explicit(&dev->ops->lock.locked, memory_order_relaxed) == 0 &&
            stats_try_lock(dev))
            return;
        cca_spin_backoff(spins);
    }
}

/* Which d[] entries a request keeps as bytes (int64) and as counts (int32). */
static const int request_bytes[4] = {OPS_ALLOCATED_BYTES, OPS_ACTIVE_BYTES, OPS_REQUESTED_BYTES,
                                     OPS_INACTIVE_SPLIT_BYTES};
static const int request_counts[4] = {OPS_ALLOCATION, OPS_ACTIVE, OPS_INACTIVE_SPLIT, OPS_OVERSIZE};

/* Apply one published update and tell its thread (stats lock held). */
static void stats_apply_request(cca_device_t *dev, struct stats_request *r)
{
    int64_t d[OPS_COUNT];
    for (int i = 0; i < 4; i++) {
        d[request_bytes[i]] = r->bytes[i];
        d[request_counts[i]] = r->counts[i];
    }
    ops_apply_mode(dev->ops, NULL, OPS_LOCKED, r->type, d, r->sign);
    dev->ops->combined++;
    atomic_store_explicit(&r->state, STATS_REQ_DONE, memory_order_release);
}

/*
 * The holder found the lock's word at 2: set it back to 1, then apply every
 * update published before the thread that published it saw the lock held
 * (it set the 2 after publishing, and the exchange here reads that 2); a few
 * rounds while more arrive. Updates published later are applied by the next
 * holder, or by their own thread once it finds the lock free. The slots are
 * fetched first, all at once, then applied.
 */
void stats_serve(cca_device_t *dev)
{
    ops_table_t *t = dev->ops;
    for (int round = 0; round < 4; round++) {
        if (atomic_exchange_explicit(&t->lock.locked, 1, memory_order_acq_rel) != 2)
            return;
        uint32_t n = atomic_load_explicit(&t->request_count, memory_order_acquire);
        struct stats_request *slot[STATS_REQUEST_SLOTS];
        for (uint32_t i = 0; i < n; i++) {
            slot[i] = atomic_load_explicit(&t->requests[i], memory_order_acquire);
            if (slot[i])
                __builtin_prefetch(slot[i], 1);
        }
        for (uint32_t i = 0; i < n; i++) {
            struct stats_request *r = slot[i];
            if (r && atomic_load_explicit(&r->state, memory_order_acquire) == STATS_REQ_PENDING)
                stats_apply_request(dev, r);
        }
    }
}

/* sp's request slot, entered in a free place of the device's table the first time it
 * waits (sp's lock held); NULL: the table is full, sp waits for the lock instead. */
static struct stats_request *stats_request_slot(cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (sp->request_slot == -1) {
        sp->request_slot = -2;
        for (uint32_t i = 0; i < STATS_REQUEST_SLOTS; i++) {
            struct stats_request *none = NULL;
            if (!atomic_compare_exchange_strong_explicit(&dev->ops->requests[i], &none,
                                                         &sp->request, memory_order_acq_rel,
                                                         memory_order_relaxed))
                continue;
            sp->request_slot = (int)i;
            uint32_t n = atomic_load_explicit(&dev->ops->request_count, memory_order_relaxed);
            while (n <= i && !atomic_compare_exchange_weak_explicit(&dev->ops->request_count, &n,
                                                                    i + 1, memory_order_release,
                                                                    memory_order_relaxed)) {
            }
            break;
        }
    }
    return sp->request_slot >= 0 ? &sp->request : NULL;
}

void stats_request_release(cca_stream_pool_t *sp)
{
    if (sp->request_slot < 0)
        return;
    cca_device_t *dev = sp->device;
    stats_lock(dev); /* no holder is reading the table meanwhile */
    atomic_store_explicit(&dev->ops->requests[sp->request_slot], NULL, memory_order_relaxed);
    stats_unlock(dev);
    sp->request_slot = -1;
}

void stats_combine(cca_stream_pool_t *sp, int type, const int64_t d[OPS_COUNT],
                   const int8_t sign[OPS_COUNT])
{
    cca_device_t *dev = sp->device;
    struct stats_request *r = stats_request_slot(sp);
    if (!r) { /* no slot left: wait for the lock itself */
        stats_lock_slow(dev);
        ops_apply_mode(dev->ops, NULL, OPS_LOCKED, type, d, sign);
        stats_unlock(dev);
        return;
    }
    for (int i = 0; i < 4; i++) {
        r->bytes[i] = d[request_bytes[i]];
        r->counts[i] = (int32_t)d[request_counts[i]]; /* blocks: a few at most */
    }
    r->type = type;
    r->sign = sign;
    atomic_store_explicit(&r->state, STATS_REQ_PENDING, memory_order_release);
    _Atomic int *word = &dev->ops->lock.locked;
    for (unsigned spins = 0;; spins++) {
        if (atomic_load_explicit(&r->state, memory_order_acquire) == STATS_REQ_DONE)
            return; /* (DONE stays until the next update overwrites it) */
        if (spins % 4) { /* mostly its own slot: the lock's line stays with its holder */
            cca_spin_backoff(spins);
            continue;
        }
        int w = atomic_load_explicit(word, memory_order_relaxed);
        if (w == 0 && stats_try_lock(dev)) {
            /* the lock is this thread's: no one else applies the update now, and the
             * requests this thread serves as it lets go are no longer its own */
            if (atomic_load_explicit(&r->state, memory_order_relaxed) == STATS_REQ_PENDING) {
                ops_apply_mode(dev->ops, NULL, OPS_LOCKED, type, d, sign);
                atomic_store_explicit(&r->state, STATS_REQ_DONE, memory_order_relaxed);
            }
            stats_unlock(dev);
            return;
        }
        if (w == 1) /* tell the holder an update waits (after publishing it) */
            atomic_compare_exchange_strong_explicit(word, &w, 2, memory_order_acq_rel,
                                                    memory_order_relaxed);
        cca_spin_backoff(spins);
    }
}

/* The exact mode's values and counts into out (stats lock held). */
void stats_fill_ops(const cca_device_t *dev, cca_device_stats_t *out)
{
    for (int k = 0; k < OPS_COUNT; k++)
        for (int t = 0; t < (k == OPS_OVERSIZE ? 1 : CCA_STAT_TYPES); t++) {
            const ops_count_t *n = &dev->ops->n[t][k];
            cca_stat_t *d = &ops_array(out, k)[t];
            d->current = dev->ops->cur[t][k];
            d->peak = dev->ops->peak[t][k];
            d->allocated = n->allocated;
            d->freed = n->freed;
        }
    for (int k = 0; k < OPS_OVERSIZE; k++) { /* ALL is the kinds' sum, but its peak */
        cca_stat_t *a = ops_array(out, k);
        a[CCA_STAT_ALL].current = a[CCA_STAT_SMALL_POOL].current + a[CCA_STAT_LARGE_POOL].current;
        a[CCA_STAT_ALL].allocated = a[CCA_STAT_SMALL_POOL].allocated + a[CCA_STAT_LARGE_POOL].allocated;
        a[CCA_STAT_ALL].freed = a[CCA_STAT_SMALL_POOL].freed + a[CCA_STAT_LARGE_POOL].freed;
    }
}

/* add applied to out and each stream pool's own statistics, each pool locked in turn
 * (held: the one the caller holds). */
static void stats_sum_pools(cca_device_t *dev, cca_stream_pool_t *held,
                            void (*add)(cca_device_stats_t *, cca_device_stats_t *),
                            cca_device_stats_t *out)
{
    for (size_t i = 0; i < dev->pool_table_cap; i++) {
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        if (sp != held)
            pool_lock(sp);
        add(out, &sp->stats);
        if (sp != held)
            cca_spin_unlock(&sp->lock);
    }
}

/* exact_peak_stats: the ops table's values and counts. */
static void stats_read_exact(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held)
{
    cca_stream_pool_t *solo = held ? NULL : stats_solo_lock(dev); /* (held: relaxed mode only) */
    stats_lock(dev);
    *out = dev->stats; /* its per-operation statistics are the ops table's, below */
    stats_fill_ops(dev, out);
    stats_unlock(dev);
    stats_solo_unlock(solo);
}

/*
 * The device's statistics: in exact mode the ops table's current and peak
 * values with the counts; otherwise the device's own (segments, counters,
 * sampled peaks) with the per-operation values summed over the stream pools,
 * the peaks first raised to those sums. held: a stream pool lock the caller
 * holds (that pool is read without locking it again).
 */
void stats_read_held(cca_device_t *dev, cca_device_stats_t *out, cca_stream_pool_t *held)
{
    if (dev->exact_stats) {
        stats_read_exact(dev, out, held);
        return;
    }
    cca_device_stats_t sum;
    memset(&sum, 0, sizeof(sum));
    stats_sum_pools(dev, held, stats_add_ops, &sum);
    cca_stat_t *d[CCA_OP_STAT_ARRAYS], *s[CCA_OP_STAT_ARRAYS];
    stats_lock(dev);
    stats_op_arrays(&dev->stats, d);
    stats_op_arrays(&sum, s);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++)
            if (s[k][t].current > d[k][t].peak)
                d[k][t].peak = s[k][t].current;
    if (sum.oversize_allocations.current > dev->stats.oversize_allocations.peak)
        dev->stats.oversize_allocations.peak = sum.oversize_allocations.current;
    *out = dev->stats;
    stats_unlock(dev);
    stats_op_arrays(out, d);
    for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
        for (int t = 0; t < CCA_STAT_TYPES; t++) {
            d[k][t].current = s[k][t].current;
            d[k][t].allocated = s[k][t].allocated;
            d[k][t].freed = s[k][t].freed;
        }
    out->oversize_allocations.current = sum.oversize_allocations.current;
    out->oversize_allocations.allocated = sum.oversize_allocations.allocated;
    out->oversize_allocations.freed = sum.oversize_allocations.freed;
}

void stats_read(cca_device_t *dev, cca_device_stats_t *out)
{
    stats_read_held(dev, out, NULL);
}

cca_status_t cca_get_device_stats(int device, cca_device_stats_t *stats)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    if (!stats)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_get_device_stats: stats is NULL");
    if (async_enabled())
        return async_get_device_stats(device, stats);
    stats_read(dev, stats);
    size_t mss = cca_state->settings.max_split_size;
    stats->max_split_size = mss == SIZE_MAX ? -1 : (int64_t)mss;
    return CCA_OK;
}

static void reset_accumulated(cca_stat_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        s[i].allocated = s[i].freed = 0;
}

static void reset_peak(cca_stat_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        s[i].peak = s[i].current;
}

/* Visit every cca_stat_t of the struct (they are laid out first, contiguously). */
#define STATS_ARRAY_COUNT (9 * CCA_STAT_TYPES)

cca_status_t cca_reset_accumulated_stats(int device)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    if (async_enabled())
        return async_reset_accumulated_stats(device);
    pthread_mutex_lock(&dev->lock);
    for (size_t i = 0; i < dev->pool_table_cap; i++) { /* relaxed mode's counts */
        cca_stream_pool_t *sp = atomic_load_explicit(&dev->pool_table[i], memory_order_acquire);
        if (!sp)
            continue;
        pool_lock(sp);
        reset_accumulated(&sp->stats.allocation[0], STATS_ARRAY_COUNT);
        reset_accumulated(&sp->stats.oversize_allocations, 1);
        cca_spin_unlock(&sp->lock);
    }
    cca_stream_pool_t *solo = stats_solo_lock(dev);
    stats_lock(dev);
    cca_device_stats_t *s = &dev->stats;
    for (int k = 0; k < OPS_COUNT; k++) /* exact mode's */
        for (int t = 0; t < CCA_STAT_TYPES; t++)
            dev->ops->n[t][k].allocated = dev->ops->n[t][k].freed = 0;
    reset_accumulated(&s->allocation[0], STATS_ARRAY_COUNT); /* relaxed mode's, and segments' */
    reset_accumulated(&s->oversize_allocations, 1);
    reset_accumulated(&s->oversize_segments, 1);
    s->num_alloc_retries = s->num_ooms = s->num_sync_all_streams = 0;
    s->num_device_alloc = s->num_device_free = 0;
    stats_unlock(dev);
    stats_solo_unlock(solo);
    pthread_mutex_unlock(&dev->lock);
    return CCA_OK;
}

cca_status_t cca_reset_peak_stats(int device)
{
    cca_device_t *dev = NULL;
    cca_status_t st = device_arg(device, &dev);
    if (st != CCA_OK)
        return st;
    if (async_enabled())
        return async_reset_peak_stats(device);
    cca_device_stats_t now;
    if (!dev->exact_stats)
        stats_read(dev, &now);
    cca_stream_pool_t *solo = dev->exact_stats ? stats_solo_lock(dev) : NULL;
    stats_lock(dev);
    cca_device_stats_t *s = &dev->stats;
    reset_peak(s->segment, CCA_STAT_TYPES);
    reset_peak(s->reserved_bytes, CCA_STAT_TYPES);
    reset_peak(&s->oversize_segments, 1);
    if (dev->exact_stats) {
        ops_sum_all(dev->ops); /* ALL's currents first */
        for (int k = 0; k < OPS_COUNT; k++)
            for (int t = 0; t < (k == OPS_OVERSIZE ? 1 : CCA_STAT_TYPES); t++)
                dev->ops->peak[t][k] = dev->ops->cur[t][k];
    } else {
        reset_peak(&s->allocation[0], STATS_ARRAY_COUNT);
        reset_peak(&s->oversize_allocations, 1);
        /* sampled peaks restart from the current sums */
        cca_stat_t *d[CCA_OP_STAT_ARRAYS], *c[CCA_OP_STAT_ARRAYS];
        stats_op_arrays(s, d);
        stats_op_arrays(&now, c);
        for (int k = 0; k < CCA_OP_STAT_ARRAYS; k++)
            for (int t = 0; t < CCA_STAT_TYPES; t++)
                d[k][t].peak = c[k][t].current;
        s->oversize_allocations.peak = now.oversize_allocations.current;
    }
    stats_unlock(dev);
    stats_solo_unlock(solo);
    return CCA_OK;
}

cca_status_t cca_memory_stats(int device, cca_stat_entry_t *out, size_t count)
{
    cca_device_stats_t stats;
    cca_status_t st = cca_get_device_stats(device, &stats);
    if (st != CCA_OK)
        return st;
    if (!out || count < CCA_MEMORY_STATS_COUNT)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memory_stats: out must hold %d entries",
                         CCA_MEMORY_STATS_COUNT);
    stats_flatten(&stats, out);
    return CCA_OK;
}

cca_status_t cca_memory_summary(int device, bool abbreviated, char **text)
{
    cca_device_stats_t stats;
    cca_status_t st = cca_get_device_stats(device, &stats);
    if (st != CCA_OK)
        return st;
    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_memory_summary: text is NULL");
    cca_strbuf_t sb;
    sb_init(&sb);
    stats_format_summary(&stats, device, abbreviated, &sb);
    if (sb.failed || !sb.data) {
        sb_free(&sb);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory formatting the summary");
    }
    *text = sb.data;
    return CCA_OK;
}

