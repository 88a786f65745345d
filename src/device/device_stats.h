/*
 * device_stats.h - the statistics operations of the device allocator, inline
 * for the hot path: the stat helpers, the stats lock, the ops table and its
 * three modes (relaxed per-pool, exact locked, exact logged), ops_apply and
 * its repeat (ops_apply_again). Definitions out of line are in stats.c; the
 * update rules of one statistic and its text are observe/stats_text.h's.
 * Files include device.h, which includes this.
 */
#ifndef CCA_DEVICE_STATS_H
#define CCA_DEVICE_STATS_H

#include "device_types.h"
#include "stats_text.h"

/* ---- helpers shared by the device allocator's files ------------------------- */

static inline bool block_is_split(const cca_block_t *b)
{
    return b->prev || b->next;
}

/* The size a free block could grow to: its own and the unmapped run after it (PyTorch's
 * expandable best fit prefers the block that could grow least). */
static inline size_t block_expandable_size(const cca_block_t *b)
{
    return b->size + (b->next && !b->next->mapped ? b->next->size : 0);
}

static inline int pool_stat_type(bool is_small)
{
    return is_small ? CCA_STAT_SMALL_POOL : CCA_STAT_LARGE_POOL;
}

/* Update the ALL entry and the pool kind's entry of a statistic array. */
static inline void stat2_inc(cca_stat_t *arr, int type, int64_t amount)
{
    stat_increase(&arr[CCA_STAT_ALL], amount);
    stat_increase(&arr[type], amount);
}

static inline void stat2_dec(cca_stat_t *arr, int type, int64_t amount)
{
    stat_decrease(&arr[CCA_STAT_ALL], amount);
    stat_decrease(&arr[type], amount);
}

/*
 * The per-operation statistics (allocation, allocated_bytes, active,
 * active_bytes, requested_bytes, inactive_split, inactive_split_bytes, in
 * stats_op_arrays' order, then oversize_allocations, kept in the ALL row).
 * With exact_peak_stats their current and peak values live in the device's
 * ops table, by type then statistic, so an operation touches the two 128-byte
 * rows of ALL and of its pool's kind; allocated / freed go with them while the
 * device's statistics are locked, to the stream pool's own statistics once
 * they are shared.
 */
enum {
    OPS_ALLOCATION, OPS_ALLOCATED_BYTES, OPS_ACTIVE, OPS_ACTIVE_BYTES, OPS_REQUESTED_BYTES,
    OPS_INACTIVE_SPLIT, OPS_INACTIVE_SPLIT_BYTES, OPS_OVERSIZE, OPS_COUNT
};

typedef struct ops_count {
    int64_t allocated, freed;
} ops_count_t;

/*
 * The device's stats lock and exact mode's values, allocated 64-byte aligned
 * (pool_device_init) apart from the device's fields that every operation
 * reads. The lock's word has a cache line of its own, the merger's fields
 * (the table of stream pools' logs) another; each type's row of current values
 * is one line and its peaks another.
 */
typedef struct ops_table {
    _Alignas(64) cca_spinlock_t lock; /* the stats lock */
    /* the merger's (stats lock): the logs of stream pools that have logged, in slots
     * below log_count */
    _Alignas(64) _Atomic uint32_t log_count;
    uint64_t merged;            /* entries merged so far */
    _Atomic(stats_log_t *) logs[STATS_LOG_SLOTS];
    /* the merge's runs (stats lock): each log's entries up to the merge's time */
    struct stats_run {
        stats_log_t *log;
        uint64_t head, end;
        uint64_t time;          /* the head entry's */
    } runs[STATS_LOG_SLOTS];
    _Alignas(64) int64_t cur[CCA_STAT_TYPES][OPS_COUNT];
    int64_t peak[CCA_STAT_TYPES][OPS_COUNT];
    ops_count_t n[CCA_STAT_TYPES][OPS_COUNT]; /* allocated / freed */
} ops_table_t;

static inline bool stats_try_lock(cca_device_t *dev)
{
    return cca_spin_trylock(&dev->ops->lock);
}

/* The stats lock: the device's own statistics (segments, reserved, counters) and the ops
 * table; a reader of the table's values merges the logs first (stats_lock_merged). */
static inline void stats_lock(cca_device_t *dev)
{
    cca_spin_lock(&dev->ops->lock);
}

static inline void stats_unlock(cca_device_t *dev)
{
    cca_spin_unlock(&dev->ops->lock);
}

/* Every logged entry made before now into the ops table, in time order (stats lock held;
 * stats.c). After it the table holds the values of one order of all operations so far. */
void stats_merge(cca_device_t *dev);

/* The stats lock, the logs merged: the table is current (for its readers). */
static inline void stats_lock_merged(cca_device_t *dev)
{
    stats_lock(dev);
    stats_merge(dev);
}

/* The statistics array of stat in a cca_device_stats_t (oversize_allocations: one entry). */
static inline cca_stat_t *ops_array(cca_device_stats_t *s, int stat)
{
    switch (stat) {
    case OPS_ALLOCATION: return s->allocation;
    case OPS_ALLOCATED_BYTES: return s->allocated_bytes;
    case OPS_ACTIVE: return s->active;
    case OPS_ACTIVE_BYTES: return s->active_bytes;
    case OPS_REQUESTED_BYTES: return s->requested_bytes;
    case OPS_INACTIVE_SPLIT: return s->inactive_split;
    case OPS_INACTIVE_SPLIT_BYTES: return s->inactive_split_bytes;
    default: return &s->oversize_allocations;
    }
}

/*
 * How one operation's statistics are written (ops_apply):
 *   relaxed (exact_peak_stats:False, default pools): all in the stream pool's
 *     own statistics, plain; device values are summed on read, peaks sampled.
 *   locked (exact_peak_stats, the default, while the stream pool is its
 *     device's only one: stats_solo, the common single-thread case): the
 *     device's ops table (values and counts), plain, under nothing more than
 *     the pool's own lock, which orders every operation and every reader.
 *     Of the ALL entries only the peak is written, the rest is the sum of the
 *     two kinds' (stats_fill_ops).
 *   logged (exact_peak_stats beside other pools): the update goes into the
 *     stream pool's own log with the time it was made (stats_log_append), a
 *     line of the pool's own, no lock shared with another thread; whoever
 *     next takes the stats lock to read the table, or finds its log half
 *     full, merges every log's entries made before the moment it looks into
 *     the table, in time order (stats_merge). The table's values and peaks
 *     are those of the operations in the order of their times: one order,
 *     consistent with real time (an operation that ended before another began
 *     has the earlier time), so every peak is exact.
 */
enum { OPS_RELAXED, OPS_LOCKED, OPS_LOGGED };

/* The only pool's lock, for readers of the ops table (then the stats lock); NULL if none. */
void pool_flush(struct cca_stream_pool *sp);

/* Whether pool_flush has anything to do: a held block, repeats not yet counted, or a last
 * update a repeat could still follow (a reader may reset peaks: repeats then count in full). */
static inline bool pool_pending(const struct cca_stream_pool *sp)
{
    return sp->small.held || sp->large.held || sp->small.again_n || sp->large.again_n ||
           sp->again_pool;
}

static inline struct cca_stream_pool *stats_solo_lock(cca_device_t *dev)
{
    struct cca_stream_pool *solo = atomic_load_explicit(&dev->stats_solo, memory_order_acquire);
    if (solo) {
        cca_spin_lock(&solo->lock); /* it lives until shutdown, cleared or not */
        if (pool_pending(solo))
            pool_flush(solo); /* its held-back free's statistics applied, its repeats counted */
    }
    return solo;
}

static inline void stats_solo_unlock(struct cca_stream_pool *solo)
{
    if (solo)
        cca_spin_unlock(&solo->lock);
}

/* How sp's operation writes its statistics (pool lock held). */
static inline int op_stats_mode(const cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (!dev->exact_stats && !sp->private_pool) /* private pools: always the device's */
        return OPS_RELAXED;
    if (atomic_load_explicit(&dev->stats_solo, memory_order_relaxed) == sp)
        return OPS_LOCKED; /* the device's only pool: its own lock (held) orders all */
    return OPS_LOGGED;
}

/*
 * Add amount (non-zero; negative: take away) to one statistic of one type, in
 * mode; sign: 1 or -1 when the caller knows amount's sign (amount may then be
 * 0: the update changes nothing), 0 when not. t: the
 * device's ops table; own: the stream pool's statistics.
 */
static inline __attribute__((always_inline)) void ops_add(ops_table_t *t, cca_device_stats_t *own,
                                                          int mode, int stat, int type,
                                                          int64_t amount, int sign)
{
    bool up = sign > 0 || (sign == 0 && amount > 0);
    if (mode == OPS_RELAXED) {
        cca_stat_t *acc = &ops_array(own, stat)[type];
        acc->current += amount;
        if (up) {
            if (acc->current > acc->peak)
                acc->peak = acc->current;
            acc->allocated += amount;
        } else {
            acc->freed -= amount;
        }
        return;
    }
    int64_t *cur = &t->cur[type][stat], *peak = &t->peak[type][stat];
    ops_count_t *n = &t->n[type][stat];
    *cur += amount; /* locked: one writer at a time, every reader behind the same lock */
    if (up) {
        if (*cur > *peak)
            *peak = *cur;
        n->allocated += amount;
    } else {
        n->freed -= amount;
    }
}

/*
 * The locked mode's update (ops_apply_mode) with the rows of the pool's kind
 * given: its current values, peaks and counts, and the other kind's current
 * values. Indexed through the table at every statistic, a row's address was
 * computed anew for each (a row is 64 or 128 bytes, more than an address's
 * scale); a pool keeps its rows (ops_cur ...), so ops_apply reads them.
 */
static inline __attribute__((always_inline)) void ops_apply_rows(ops_table_t *t, int64_t *cur,
                                                                 int64_t *peak, ops_count_t *n,
                                                                 const int64_t *other,
                                                                 const int64_t d[OPS_COUNT],
                                                                 const int8_t sign[OPS_COUNT])
{
#pragma GCC unroll 8
    for (int k = 0; k < OPS_OVERSIZE; k++) {
        if (!sign[k] && !d[k]) /* a known sign: the update runs even for 0, a no-op */
            continue;
        int64_t c = cur[k] + d[k]; /* one writer at a time, every reader behind the same lock */
        cur[k] = c;
        if (sign[k] > 0 || (sign[k] == 0 && d[k] > 0)) {
            if (c > peak[k])
                peak[k] = c;
            n[k].allocated += d[k];
            /* the ALL entry is the two kinds' sum (stats_fill_ops); only its peak is
             * kept, raised from the sum this update produced */
            int64_t all = c + other[k];
            if (all > t->peak[CCA_STAT_ALL][k])
                t->peak[CCA_STAT_ALL][k] = all;
        } else {
            n[k].freed -= d[k];
        }
    }
    if (sign[OPS_OVERSIZE] || d[OPS_OVERSIZE])
        ops_add(t, NULL, OPS_LOCKED, OPS_OVERSIZE, CCA_STAT_ALL, d[OPS_OVERSIZE], sign[OPS_OVERSIZE]);
}

/*
 * d[k] added to statistic k of type's entry and of the ALL entry (the relaxed
 * mode: own's; the locked mode: the table's). sign[k]: d[k]'s sign where the
 * caller knows it, else 0 (ops_apply); a known sign updates even for 0, and
 * says which way the update goes, else the amount's sign does. The callers'
 * constant signs fold most of the branches away here, and the rest measured
 * cheaper than the merge's straight line (stats.c, stats_entry_apply) on a
 * random workload on one thread (75 against 79 ns a step); the merge, whose
 * entries come with no constant sign, takes the straight line.
 */
static inline __attribute__((always_inline)) void ops_apply_mode(ops_table_t *t,
                                                                 cca_device_stats_t *own,
                                                                 int mode, int type,
                                                                 const int64_t d[OPS_COUNT],
                                                                 const int8_t sign[OPS_COUNT])
{
    if (mode == OPS_LOCKED) {
        ops_apply_rows(t, t->cur[type], t->peak[type], t->n[type],
                       t->cur[CCA_STAT_SMALL_POOL + CCA_STAT_LARGE_POOL - type], d, sign);
        return;
    }
#pragma GCC unroll 8
    for (int k = 0; k < OPS_COUNT; k++) {
        if (!sign[k] && !d[k]) /* a known sign: the update runs even for 0, a no-op */
            continue;
        ops_add(t, own, mode, k, CCA_STAT_ALL, d[k], sign[k]);
        if (k != OPS_OVERSIZE)
            ops_add(t, own, mode, k, type, d[k], sign[k]);
    }
}

/* A log entry's update from an operation's d and sign, as ops_apply takes them (stats.c). */
void stats_entry_fill(stats_entry_t *e, int type, const int64_t d[OPS_COUNT],
                      const int8_t sign[OPS_COUNT]);
/* A log entry into the table: the values ops_apply_mode's locked mode gives the same
 * update (stats lock held; stats.c). */
void stats_entry_apply(ops_table_t *t, const stats_entry_t *e);

/* Take sp's log out of its device's table, its entries merged, and free it (before sp
 * is freed; stats.c). */
void stats_log_release(cca_stream_pool_t *sp);

/* Whether pools may log (the clock fine and cheap enough): 0 asks the clock again, 1 yes,
 * 2 no (tests; stats.c). */
void stats_clock_set_usable(int usable);
/* Whether n clock reads taken in a row show a clock fine enough to order the logs' entries:
 * each later than the one before (no tick spans a read), most of them under 500 ns apart (stats.c). */
bool stats_clock_reads_fine(const uint64_t *reads, size_t n);

/* An operation's d (ops_apply) by value: the logged mode's copy, so that ops_apply's d
 * itself never needs a place in memory and stays in registers on the other modes' paths. */
typedef struct ops_delta {
    int64_t v[OPS_COUNT];
} ops_delta_t;

/* Log the update, with the time it is made, in sp's log (pool lock held; stats.c); with
 * no log to be had, apply it under the stats lock. */
void stats_log_append(cca_stream_pool_t *sp, int type, ops_delta_t d, const int8_t sign[OPS_COUNT]);

/*
 * One operation's statistics: d[k] added to statistic k (OPS_*), in the ALL
 * entry and in the entry of the pool's kind, in one update (stream pool lock
 * held, so one pool's updates land in its lock order). sign[k]: d[k]'s sign
 * where the caller knows it (a constant array), else 0.
 */
static inline __attribute__((always_inline)) void ops_apply(cca_pool_t *pool, const int64_t d[OPS_COUNT],
                                                            const int8_t sign[OPS_COUNT])
{
    cca_stream_pool_t *sp = pool->owner;
    int type = pool_stat_type(pool->is_small);
    int mode = op_stats_mode(sp);
    cca_device_t *dev = sp->device;
    sp->again_pool = NULL;
    if (mode == OPS_LOCKED) {
        ops_apply_rows(dev->ops, pool->ops_cur, pool->ops_peak, pool->ops_n, pool->ops_other, d, sign);
    } else if (mode == OPS_LOGGED) {
        if (!sp->log && atomic_load_explicit(&dev->ops->log_count, memory_order_acquire) == 0 &&
            stats_try_lock(dev)) {
            /* no thread has logged yet (none has met another on the stats lock): the
             * update goes into the table under the lock, as it happens. A log entered
             * since has its entries' times after the load above, merged after this. */
            ops_apply_mode(dev->ops, NULL, OPS_LOCKED, type, d, sign);
            stats_unlock(dev);
        } else {
            ops_delta_t copy;
#pragma GCC unroll 8
            for (int k = 0; k < OPS_COUNT; k++)
                copy.v[k] = d[k];
            stats_log_append(sp, type, copy, sign);
        }
    } else {
        ops_apply_mode(NULL, &sp->stats, OPS_RELAXED, type, d, sign);
    }
}

/* Whether sp may keep a held-back free's statistics unapplied (held_stats; pool lock held). */
static inline bool ops_may_defer(const cca_stream_pool_t *sp)
{
    cca_device_t *dev = sp->device;
    if (sp->private_pool)
        return false;
    if (!dev->exact_stats)
        return true; /* relaxed: readers sum the pools under their locks */
    return atomic_load_explicit(&dev->stats_solo, memory_order_relaxed) == sp;
}

/* One statistic moved by a, then by b, as two ops_add of the relaxed mode would. */
static inline __attribute__((always_inline)) void stat_move2(cca_stat_t *st, int64_t a, int64_t b)
{
    int64_t mid = st->current + a, end = mid + b;
    if (a > 0) {
        st->allocated += a;
        if (mid > st->peak)
            st->peak = mid;
    } else {
        st->freed -= a;
    }
    if (b > 0) {
        st->allocated += b;
        if (end > st->peak)
            st->peak = end;
    } else {
        st->freed -= b;
    }
    st->current = end;
}

/* The same for the locked mode's table entries. */
static inline __attribute__((always_inline)) void ops_move2(int64_t *cur, int64_t *peak,
                                                            ops_count_t *n, int64_t a, int64_t b)
{
    int64_t mid = *cur + a, end = mid + b;
    if (a > 0) {
        n->allocated += a;
        if (mid > *peak)
            *peak = mid;
    } else {
        n->freed -= a;
    }
    if (b > 0) {
        n->allocated += b;
        if (end > *peak)
            *peak = end;
    } else {
        n->freed -= b;
    }
    *cur = end;
}

/*
 * The statistics of a held-back free (held_stats) and of the held block's
 * allocation again, in one update (pool lock held; the modes of
 * ops_may_defer). size: the block's bytes; up: its free upper neighbour's;
 * split: the merged block was a piece of a split segment; old_req, new_req:
 * the two requests' sizes. The same as pool_free_block's update followed by
 * alloc_account's: allocation, allocated_bytes, active, active_bytes,
 * oversize and inactive_split come back to their values (their counts move,
 * and inactive_split_bytes' peak may rise in between, by size, when split),
 * requested_bytes moves by new_req - old_req.
 */
static inline __attribute__((always_inline)) void ops_apply_again(cca_stream_pool_t *sp, int type,
                                                                  int64_t size, int64_t up, bool split,
                                                                  bool oversize, int64_t old_req,
                                                                  int64_t new_req)
{
    cca_device_t *dev = sp->device;
    int other = type == CCA_STAT_SMALL_POOL ? CCA_STAT_LARGE_POOL : CCA_STAT_SMALL_POOL;
    if (!dev->exact_stats) {
        cca_device_stats_t *own = &sp->stats;
        for (int row = 0; row < 2; row++) {
            int ty = row ? type : CCA_STAT_ALL;
            own->allocation[ty].allocated++;
            own->allocation[ty].freed++;
            own->active[ty].allocated++;
            own->active[ty].freed++;
            own->allocated_bytes[ty].allocated += size;
            own->allocated_bytes[ty].freed += size;
            own->active_bytes[ty].allocated += size;
            own->active_bytes[ty].freed += size;
            stat_move2(&own->requested_bytes[ty], -old_req, new_req);
            if (split) {
                stat_move2(&own->inactive_split_bytes[ty], size, -size);
            } else {
                own->inactive_split[ty].allocated++;
                own->inactive_split[ty].freed++;
                own->inactive_split_bytes[ty].allocated += up;
                own->inactive_split_bytes[ty].freed += up;
            }
        }
        if (oversize) {
            own->oversize_allocations.allocated++;
            own->oversize_allocations.freed++;
        }
        return;
    }
    ops_table_t *t = dev->ops; /* locked, the only pool: its lock orders every reader */
    ops_count_t *n = t->n[type];
    n[OPS_ALLOCATION].allocated++;
    n[OPS_ALLOCATION].freed++;
    n[OPS_ACTIVE].allocated++;
    n[OPS_ACTIVE].freed++;
    n[OPS_ALLOCATED_BYTES].allocated += size;
    n[OPS_ALLOCATED_BYTES].freed += size;
    n[OPS_ACTIVE_BYTES].allocated += size;
    n[OPS_ACTIVE_BYTES].freed += size;
    ops_move2(&t->cur[type][OPS_REQUESTED_BYTES], &t->peak[type][OPS_REQUESTED_BYTES],
              &n[OPS_REQUESTED_BYTES], -old_req, new_req);
    if (new_req > old_req) {
        int64_t all = t->cur[type][OPS_REQUESTED_BYTES] + t->cur[other][OPS_REQUESTED_BYTES];
        if (all > t->peak[CCA_STAT_ALL][OPS_REQUESTED_BYTES])
            t->peak[CCA_STAT_ALL][OPS_REQUESTED_BYTES] = all;
    }
    if (split) {
        ops_move2(&t->cur[type][OPS_INACTIVE_SPLIT_BYTES], &t->peak[type][OPS_INACTIVE_SPLIT_BYTES],
                  &n[OPS_INACTIVE_SPLIT_BYTES], size, -size);
        int64_t all = t->cur[type][OPS_INACTIVE_SPLIT_BYTES] + t->cur[other][OPS_INACTIVE_SPLIT_BYTES] +
                      size;
        if (all > t->peak[CCA_STAT_ALL][OPS_INACTIVE_SPLIT_BYTES])
            t->peak[CCA_STAT_ALL][OPS_INACTIVE_SPLIT_BYTES] = all;
    } else {
        n[OPS_INACTIVE_SPLIT].allocated++;
        n[OPS_INACTIVE_SPLIT].freed++;
        n[OPS_INACTIVE_SPLIT_BYTES].allocated += up;
        n[OPS_INACTIVE_SPLIT_BYTES].freed += up;
    }
    if (oversize) {
        t->n[CCA_STAT_ALL][OPS_OVERSIZE].allocated++;
        t->n[CCA_STAT_ALL][OPS_OVERSIZE].freed++;
    }
}

/* Count pool's repeats of its last full ops_apply_again (pool lock held). */
void pool_flush_agains(cca_pool_t *pool);
/* The counts of n repeats of one ops_apply_again (old_req == new_req == req) whose values
 * and peaks were those of the first (pool_flush; pool lock held). */
void ops_again_counts(cca_stream_pool_t *sp, int type, uint64_t n, int64_t size, int64_t up,
                      bool split, int64_t req);

#endif /* CCA_DEVICE_STATS_H */
