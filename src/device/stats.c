/*
 * stats.c - the device statistics entry points: reading DeviceStats (exact,
 * or summed over stream pools with sampled peaks without exact_peak_stats),
 * resetting peaks and accumulated counters, memory_stats and memory_summary.
 * Invariant: a read never changes a current value; in sampled mode it may
 * only raise peaks to the current sums.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* ---- the statistics logs ---------------------------------------------------------- */

/* The time an entry is stamped with, and the merge's horizon: CLOCK_MONOTONIC, which the
 * kernel keeps rising across CPUs, read after every earlier instruction. */
static inline uint64_t stats_clock(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* No later instruction starts before the clock read before it is done. */
static inline void stats_clock_fence(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_lfence();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb" ::: "memory");
#endif
    atomic_thread_fence(memory_order_seq_cst);
}

/*
 * After the store that says a log is stamping (or the exchange entering a new
 * log), before the clock read: the store seen by every core first, so a merger
 * whose clock read comes after this one's sees it. x86's locked exchange drains
 * the store buffer and the clock read is ordered after it; on aarch64 the
 * exchange's store may still be in flight when the counter is read (the vDSO's
 * isb waits for no store): a dsb waits for it.
 */
static inline void stats_stamp_fence(void)
{
#if defined(__aarch64__)
    __asm__ __volatile__("dsb ish" ::: "memory");
#endif
}

/* Which d[] entries an entry keeps as bytes and as counts. */
static const int entry_bytes[4] = {OPS_ALLOCATED_BYTES, OPS_ACTIVE_BYTES, OPS_REQUESTED_BYTES,
                                   OPS_INACTIVE_SPLIT_BYTES};
static const int entry_counts[4] = {OPS_ALLOCATION, OPS_ACTIVE, OPS_INACTIVE_SPLIT, OPS_OVERSIZE};

void stats_entry_fill(stats_entry_t *e, int type, const int64_t d[OPS_COUNT],
                      const int8_t sign[OPS_COUNT])
{
    unsigned up = 0;
    for (int i = 0; i < 4; i++) {
        int kb = entry_bytes[i], kc = entry_counts[i];
        e->bytes[i] = d[kb];
        e->counts[i] = (int8_t)d[kc]; /* blocks: a few at most */
        /* as ops_add: a known sign says which way, else the amount's */
        up |= (unsigned)(sign[kb] > 0 || (!sign[kb] && d[kb] > 0)) << i |
              (unsigned)(sign[kc] > 0 || (!sign[kc] && d[kc] > 0)) << (i + 4);
    }
    e->up = (uint8_t)up;
    e->type = type;
}

/*
 * One entry into the table (stats lock held): every statistic moved by the
 * entry's amount for it, in straight-line code with no branch on the entry
 * (whether an operation allocates or frees is as random as the workload). The
 * same values as ops_apply_mode(t, NULL, OPS_LOCKED, type, d, sign) with the
 * producer's d and sign (sign[k], where known, d[k]'s sign: ops_apply): that
 * one skips a statistic whose amount and sign are 0 and this one moves it by
 * 0, and a peak is never below its value (raised with it, reset to it), so
 * peaks taken as maxima at every statistic change nothing where the update
 * lowers or keeps the value. OPS_OVERSIZE has the ALL entry only; the others
 * their kind's entry and the ALL entry's peak of the two kinds' sum.
 */
static inline __attribute__((always_inline)) void entry_apply(ops_table_t *t,
                                                              const stats_entry_t *e)
{
    int type = e->type;
    unsigned up = e->up;
    int64_t amount[OPS_COUNT];
    uint64_t raise[OPS_COUNT]; /* all ones if the update raises the statistic */
    for (int i = 0; i < 4; i++) {
        amount[entry_bytes[i]] = e->bytes[i];
        amount[entry_counts[i]] = e->counts[i];
        raise[entry_bytes[i]] = 0 - (uint64_t)(up >> i & 1);
        raise[entry_counts[i]] = 0 - (uint64_t)(up >> (i + 4) & 1);
    }
    int64_t *cur = t->cur[type], *peak = t->peak[type];
    ops_count_t *n = t->n[type];
    for (int k = 0; k < OPS_OVERSIZE; k++) {
        int64_t a = amount[k], c = cur[k] + a;
        uint64_t r = raise[k];
        cur[k] = c;
        peak[k] = c > peak[k] ? c : peak[k];
        n[k].allocated += (int64_t)((uint64_t)a & r);
        n[k].freed -= (int64_t)((uint64_t)a & ~r);
        int64_t all = t->cur[CCA_STAT_SMALL_POOL][k] + t->cur[CCA_STAT_LARGE_POOL][k];
        int64_t *pa = &t->peak[CCA_STAT_ALL][k];
        *pa = all > *pa ? all : *pa;
    }
    int64_t a = amount[OPS_OVERSIZE], c = t->cur[CCA_STAT_ALL][OPS_OVERSIZE] + a;
    uint64_t r = raise[OPS_OVERSIZE];
    t->cur[CCA_STAT_ALL][OPS_OVERSIZE] = c;
    int64_t *po = &t->peak[CCA_STAT_ALL][OPS_OVERSIZE];
    *po = c > *po ? c : *po;
    t->n[CCA_STAT_ALL][OPS_OVERSIZE].allocated += (int64_t)((uint64_t)a & r);
    t->n[CCA_STAT_ALL][OPS_OVERSIZE].freed -= (int64_t)((uint64_t)a & ~r);
}

void stats_entry_apply(ops_table_t *t, const stats_entry_t *e) /* the tests' way in */
{
    entry_apply(t, e);
}

/*
 * Why the merge is exact. A producer sets its log's stamping word with an
 * atomic exchange (every earlier store visible), then reads the clock, writes
 * the entry, publishes the tail and clears stamping. The merger reads the
 * clock (now), fences, then for each log waits while stamping is set and
 * reads the tail. An entry it does not see was stamped after the merger found
 * stamping clear, so after now: every entry made up to now is merged, in time
 * order, and no later one is; the next merge takes the entries after now. A
 * log is entered in the table before its first entry is stamped, and the
 * merger reads the table after now, so it misses no log either. Entries of one
 * log rise in time (the pool's lock orders them, and a tie is moved past the
 * last time).
 */
void stats_merge(cca_device_t *dev)
{
    ops_table_t *t = dev->ops;
    if (atomic_load_explicit(&t->log_count, memory_order_relaxed) == 0)
        return;
    uint64_t now = stats_clock();
    stats_clock_fence();
    /* (a log entered after this load gets its first entry's time after now) */
    uint32_t n = atomic_load_explicit(&t->log_count, memory_order_acquire);
    struct stats_run *run = t->runs;
    uint32_t live = 0;
    for (uint32_t i = 0; i < n; i++) {
        stats_log_t *l = atomic_load_explicit(&t->logs[i], memory_order_acquire);
        if (!l)
            continue;
        for (unsigned spins = 0; atomic_load_explicit(&l->stamping, memory_order_acquire); spins++)
            cca_spin_backoff(spins);
        uint64_t tail = atomic_load_explicit(&l->tail, memory_order_acquire);
        uint64_t h = atomic_load_explicit(&l->head, memory_order_relaxed);
        if (tail == h)
            continue;
        /* its entries up to now (they rise in time) */
        uint64_t e = tail;
        while (e > h && l->e[(e - 1) % STATS_LOG_ENTRIES].time > now)
            e--;
        if (e == h)
            continue;
        for (uint64_t k = h; k < e && k < h + 8; k++) /* the lines come from the producer's core */
            __builtin_prefetch(&l->e[k % STATS_LOG_ENTRIES], 0);
        run[live] = (struct stats_run){l, h, e, l->e[h % STATS_LOG_ENTRIES].time};
        live++;
    }
    /* a merge of the sorted runs: the run with the earliest head goes on until its next
     * entry comes after the second earliest head (equal times: operations at the same
     * moment, either order) */
    uint64_t merged = 0;
    while (live > 0) {
        uint32_t best = 0;
        uint64_t best_time = UINT64_MAX, limit = UINT64_MAX;
        for (uint32_t i = 0; i < live; i++) {
            uint64_t ti = run[i].time;
            if (ti < best_time) {
                limit = best_time;
                best = i;
                best_time = ti;
            } else if (ti < limit) {
                limit = ti;
            }
        }
        struct stats_run *r = &run[best];
        stats_log_t *l = r->log;
        uint64_t h = r->head, stop = r->end, next = best_time;
        do {
            __builtin_prefetch(&l->e[(h + 8) % STATS_LOG_ENTRIES], 0);
            entry_apply(t, &l->e[h % STATS_LOG_ENTRIES]);
            h++;
            merged++;
        } while (h < stop && (next = l->e[h % STATS_LOG_ENTRIES].time) <= limit);
        r->head = h;
        r->time = next;
        if (h == stop) {
            atomic_store_explicit(&l->head, h, memory_order_release);
            *r = run[--live];
        }
    }
    t->merged += merged;
}

/*
 * Whether the clock can stamp entries: fine enough that two operations one
 * after the other read different times, and cheap (read in user space).
 * Otherwise no pool logs, and updates go into the table under the stats lock.
 * Asked once per process.
 */
static _Atomic int clock_usable; /* 0: not asked yet, 1: yes, 2: no */

void stats_clock_set_usable(int usable)
{
    atomic_store_explicit(&clock_usable, usable, memory_order_relaxed);
}

bool stats_clock_reads_fine(const uint64_t *reads, size_t n)
{
    if (n < 2)
        return false;
    size_t quick = 0;
    for (size_t i = 1; i < n; i++) {
        if (reads[i] <= reads[i - 1])
            return false; /* a tick longer than a read: two operations could share a time */
        quick += reads[i] - reads[i - 1] < 500;
    }
    /* under 500 ns a read for most reads (the median): a read the thread was preempted
     * across takes milliseconds, and refused for it the clock would stay refused */
    return quick * 2 > n - 1;
}

static bool stats_clock_usable(void)
{
    int u = atomic_load_explicit(&clock_usable, memory_order_relaxed);
    if (u)
        return u == 1;
    /* clock_getres says 1 ns wherever high-resolution timers are on, whatever the counter's
     * tick: every read in a row must differ from the one before it instead */
    enum { READS = 256 };
    uint64_t reads[READS];
    for (int i = 0; i < READS; i++)
        reads[i] = stats_clock();
    bool ok = stats_clock_reads_fine(reads, READS);
    atomic_store_explicit(&clock_usable, ok ? 1 : 2, memory_order_relaxed);
    return ok;
}

/* sp's log, made and entered in a free slot of the device's table the first time it
 * logs (sp's lock held; no other lock: a merger may hold the stats lock and wait for an
 * entry of this thread's); NULL: no memory or no slot, sp uses the stats lock instead. */
static stats_log_t *stats_log_get(cca_stream_pool_t *sp)
{
    if (sp->log_slot == -2)
        return NULL;
    ops_table_t *t = sp->device->ops;
    sp->log_slot = -2;
    if (!stats_clock_usable())
        return NULL;
    stats_log_t *l = aligned_alloc(64, sizeof(*l));
    if (!l)
        return NULL;
    memset(l, 0, sizeof(*l));
    for (uint32_t i = 0; i < STATS_LOG_SLOTS; i++) {
        stats_log_t *none = NULL;
        if (!atomic_compare_exchange_strong_explicit(&t->logs[i], &none, l, memory_order_seq_cst,
                                                     memory_order_relaxed))
            continue;
        uint32_t n = atomic_load_explicit(&t->log_count, memory_order_relaxed);
        while (n <= i && !atomic_compare_exchange_weak_explicit(&t->log_count, &n, i + 1,
                                                                memory_order_seq_cst,
                                                                memory_order_relaxed)) {
        }
        sp->log_slot = (int)i;
        sp->log = l;
        return l;
    }
    free(l);
    return NULL;
}

void stats_log_release(cca_stream_pool_t *sp)
{
    if (!sp->log)
        return;
    cca_device_t *dev = sp->device;
    /* its last entries into the table first: a merge takes those stamped before it reads the
     * clock, so the clock first passes the last one (a tie moves an entry on) */
    for (unsigned spins = 0; stats_clock() <= sp->log->last_time; spins++)
        cca_spin_backoff(spins);
    stats_lock_merged(dev);
    atomic_store_explicit(&dev->ops->logs[sp->log_slot], NULL, memory_order_relaxed);
    stats_unlock(dev);
    free(sp->log);
    sp->log = NULL;
    sp->log_slot = -1;
}

/* Room in l for one more entry: merge when half full, and wait for a merge when full. */
static void stats_log_room(cca_device_t *dev, stats_log_t *l, uint64_t tail)
{
    l->head_seen = atomic_load_explicit(&l->head, memory_order_acquire);
    if (tail - l->head_seen < STATS_LOG_ENTRIES) {
        if (tail - l->head_seen >= STATS_LOG_ENTRIES / 2 && stats_try_lock(dev)) {
            stats_merge(dev);
            stats_unlock(dev);
            l->head_seen = atomic_load_explicit(&l->head, memory_order_acquire);
        }
        return;
    }
    /* full: a merge takes every entry made before it looks, so this thread's own; one
     * stamped past the clock (a tie moved on) waits for the clock to pass it */
    for (unsigned spins = 0; tail - l->head_seen >= STATS_LOG_ENTRIES; spins++) {
        if (spins)
            cca_spin_backoff(spins);
        stats_lock_merged(dev);
        stats_unlock(dev);
        l->head_seen = atomic_load_explicit(&l->head, memory_order_acquire);
    }
}

void stats_log_append(cca_stream_pool_t *sp, int type, ops_delta_t delta, const int8_t sign[OPS_COUNT])
{
    const int64_t *d = delta.v;
    cca_device_t *dev = sp->device;
    stats_log_t *l = sp->log;
    if (!l)
        l = stats_log_get(sp);
    if (!l) { /* no log: the update applied in the table, at the merge's time */
        stats_lock_merged(dev);
        ops_apply_mode(dev->ops, NULL, OPS_LOCKED, type, d, sign);
        stats_unlock(dev);
        return;
    }
    uint64_t tail = atomic_load_explicit(&l->tail, memory_order_relaxed);
    if (tail - l->head_seen >= STATS_LOG_ENTRIES / 2)
        stats_log_room(dev, l, tail); /* after it: tail - head_seen < STATS_LOG_ENTRIES */
    atomic_exchange_explicit(&l->stamping, 1, memory_order_seq_cst);
    stats_stamp_fence();
    uint64_t time = stats_clock();
    if (time <= l->last_time)
        time = l->last_time + 1;
    l->last_time = time;
    stats_entry_t *e = &l->e[tail % STATS_LOG_ENTRIES];
    e->time = time;
    stats_entry_fill(e, type, d, sign);
    atomic_store_explicit(&l->tail, tail + 1, memory_order_release);
    atomic_store_explicit(&l->stamping, 0, memory_order_release);
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
    stats_lock_merged(dev);
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
    stats_lock_merged(dev);
    cca_device_stats_t table; /* private pools' operations, kept in the device's table */
    memset(&table, 0, sizeof(table));
    stats_fill_ops(dev, &table);
    stats_add_ops(&sum, &table);
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
    size_t mss = cca_state->settings->max_split_size;
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
    stats_lock_merged(dev);
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
    stats_lock_merged(dev);
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

