/*
 * plan.c - compact_memory's planned placement.
 *
 * Best fit places each request as it comes. In a loop whose large blocks of
 * one step take, at the next step, parts of the range a larger block of the
 * step used (GPT-2's activation checkpoints and its fp32 logits), the
 * growth for that block moves granules from the holes below to the top of
 * its run at every step, and the layout drifts (docs/compact-memory.md,
 * "Limits": the conveyor). Knowing the lifetimes, one placement repeated
 * every step holds the loop at its live peak with nothing to map once made
 * (scripts/periodic_plan_bound.py). This file finds such a loop and makes
 * that placement:
 *
 * - Each large request of a default pool (compact_memory on) is recorded:
 *   its rounded size, and once freed, the number of large requests made by
 *   then (its death). A hash of the last PLAN_WINDOW sizes finds where the
 *   same sizes came before; the distance is the candidate period, kept for
 *   as long as each request's size is the one a period before.
 * - Once the sizes have repeated for two periods and growths of the pool
 *   moved granules in both with the limit at its cap (a loop the limit's
 *   raises could not settle), the first of them is planned if at least 7/8
 *   of its blocks were freed within a period: each of those is given the
 *   lowest offset free over its lifetime taken round the period, in three
 *   orders (largest first, most bytes times lifetime first, longest lived
 *   first), the lowest placement kept (the others keep going by best fit),
 *   if it is
 *   within 1% of the loop's own live peak, counting what is live at the
 *   phase it starts from (the phase with the fewest bytes live: a loop with
 *   no quiet phase is not planned). The plan's range, found when it starts,
 *   is the unmapped top of one of the pool's segments, or a new segment.
 * - A request whose size is its phase's is then served at its offset if the
 *   place is free, its granules mapped there if they are not (moving free
 *   granules, as a growth does). At the start the whole range is mapped at
 *   once, as far as the limit allows. Other growths lend the range's free
 *   granules only when the rest of the cache cannot cover them. Anything
 *   else goes by best fit. After the first planned step the places are
 *   mapped and stay so: the loop maps and unmaps nothing.
 * - A period with more than an eighth of its requests missing their place
 *   (another size, or the place taken) drops the plan; a new one may be made
 *   after four periods. cca_empty_cache forgets the record (a new phase).
 *
 * Everything here runs under the pool's lock; mapping takes the device lock
 * first, as a growth does.
 */
#include "device.h"

#include <stdlib.h>
#include <string.h>

#define PLAN_RING 8192u             /* large requests remembered (a power of two) */
#define PLAN_MAX_PERIOD (PLAN_RING / 2)
#define PLAN_MIN_PERIOD 16u
#define PLAN_WINDOW 16u             /* sizes a repeat is found from */
#define PLAN_TABLE 16384u           /* hashed windows (a power of two) */
#define PLAN_RECENT 8               /* blocks placed last: where a search starts */
#define PLAN_LIVE UINT32_MAX
#define PLAN_NONE SIZE_MAX
#define PLAN_RETRY_PERIODS 4        /* after a dropped plan, periods before the next */
#define PLAN_OVER_PEAK 1            /* percent a placement may take over the loop's live peak */

typedef struct plan_rec {
    size_t size;         /* rounded size */
    uint64_t moves;      /* the pool's growths that moved granules, before this request */
    uint32_t death;      /* requests made by its free; PLAN_LIVE while live */
} plan_rec_t;

struct cca_plan {
    uint32_t serial;               /* large requests recorded so far */
    uint32_t period;               /* candidate period, 0: none */
    uint32_t run;                  /* requests in a row of the size one period before */
    uint32_t retry_at;             /* no plan before this serial */
    uint64_t moves;                /* the pool's growths that moved granules */
    uint32_t table[PLAN_TABLE];    /* window hash -> serial + 1 of its last request */
    plan_rec_t ring[PLAN_RING];
    /* the plan */
    bool active;
    uint32_t origin;               /* serial of a request of phase 0 */
    uint32_t start;                /* serial of the first request served (of the phase with the
                                      fewest bytes of the loop live before it) */
    uint32_t len;                  /* its period */
    size_t *off;                   /* per phase: offset from base, PLAN_NONE: best fit */
    size_t *psize;                 /* per phase: the size planned */
    cca_segment_t *seg;
    uintptr_t base;
    size_t height;
    bool prepared;                 /* the range mapped at the start, as far as it could be */
    uint32_t misses;               /* in the current period */
    cca_block_t *recent[PLAN_RECENT];
    unsigned recent_next;
    /* counts (cca_memory_stats_extra) */
    uint64_t plans, placed, missed;
};

static _Atomic bool plans_off, plans_forced; /* tests (plan_test_off, plan_test_force) */

void plan_test_off(bool off)
{
    atomic_store(&plans_off, off);
}

void plan_test_force(bool on)
{
    atomic_store(&plans_forced, on);
}

static cca_plan_t *plan_of(cca_pool_t *pool)
{
    if (!pool->plan)
        pool->plan = calloc(1, sizeof(cca_plan_t));
    return pool->plan;
}

static void plan_drop(cca_plan_t *p)
{
    free(p->off);
    free(p->psize);
    p->off = p->psize = NULL;
    p->active = false;
    p->seg = NULL;
    memset(p->recent, 0, sizeof(p->recent));
}

void plan_reset(cca_pool_t *pool)
{
    cca_plan_t *p = pool->plan;
    if (!p)
        return;
    plan_drop(p);
    p->period = p->run = 0;
    p->retry_at = 0;
    memset(p->table, 0, sizeof(p->table));
}

void plan_delete(cca_pool_t *pool)
{
    if (!pool->plan)
        return;
    plan_drop(pool->plan);
    free(pool->plan);
    pool->plan = NULL;
}

bool plan_range(const cca_pool_t *pool, const cca_segment_t *seg, uintptr_t *lo, uintptr_t *hi)
{
    const cca_plan_t *p = pool->plan;
    if (!p || !p->active || p->seg != seg)
        return false;
    *lo = p->base;
    *hi = p->base + p->height;
    return true;
}

void plan_segment_gone(cca_pool_t *pool, const cca_segment_t *seg)
{
    cca_plan_t *p = pool->plan;
    if (p && p->active && p->seg == seg) {
        plan_drop(p);
        p->retry_at = p->serial + PLAN_RETRY_PERIODS * p->len;
    }
}

void plan_count(const cca_pool_t *pool, uint64_t *plans, uint64_t *placed, uint64_t *missed)
{
    const cca_plan_t *p = pool->plan;
    if (!p)
        return;
    *plans += p->plans;
    *placed += p->placed;
    *missed += p->missed;
}

void plan_note_moved(cca_pool_t *pool)
{
    if (pool->plan)
        pool->plan->moves++;
}

/* ---- the record and the period ------------------------------------------------------ */

static const plan_rec_t *rec_at(const cca_plan_t *p, uint32_t serial)
{
    return &p->ring[serial & (PLAN_RING - 1)];
}

static uint64_t window_hash(const cca_plan_t *p, uint32_t last)
{
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (uint32_t i = 0; i < PLAN_WINDOW; i++) {
        h ^= rec_at(p, last - i)->size;
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    return h;
}

static bool window_equal(const cca_plan_t *p, uint32_t a, uint32_t b)
{
    for (uint32_t i = 0; i < PLAN_WINDOW; i++)
        if (rec_at(p, a - i)->size != rec_at(p, b - i)->size)
            return false;
    return true;
}

/* The distance back to the last time the PLAN_WINDOW sizes ending at serial t came, 0: none
 * in reach. Enters t's window. */
static uint32_t repeat_distance(cca_plan_t *p, uint32_t t)
{
    if (t + 1 < 2 * PLAN_WINDOW)
        return 0;
    uint32_t *slot = &p->table[window_hash(p, t) & (PLAN_TABLE - 1)];
    uint32_t d = 0;
    if (*slot) {
        uint32_t s = *slot - 1;
        if (t - s >= PLAN_MIN_PERIOD && t - s <= PLAN_MAX_PERIOD && window_equal(p, s, t))
            d = t - s;
    }
    *slot = t + 1;
    return d;
}

/* ---- making a plan ------------------------------------------------------------------ */

typedef struct plan_item {
    uint32_t phase, life;
    size_t size, off;
} plan_item_t;

/* The orders tried: largest first, then largest in bytes times lifetime, then longest
 * lived; the lowest placement is kept (random loops of sizes and lifetimes: each order
 * lowest in some) */
static int by_size(const void *a, const void *b)
{
    const plan_item_t *x = a, *y = b;
    if (x->size != y->size)
        return x->size > y->size ? -1 : 1;
    return x->phase < y->phase ? -1 : x->phase > y->phase;
}

static int by_area(const void *a, const void *b)
{
    const plan_item_t *x = a, *y = b;
    double ax = (double)x->size * x->life, ay = (double)y->size * y->life;
    if (ax != ay)
        return ax > ay ? -1 : 1;
    return by_size(a, b);
}

static int by_life(const void *a, const void *b)
{
    const plan_item_t *x = a, *y = b;
    if (x->life != y->life)
        return x->life > y->life ? -1 : 1;
    return by_size(a, b);
}

/* Whether two blocks' lifetimes, taken round a period of n requests, meet. */
static bool lives_meet(const plan_item_t *a, const plan_item_t *b, uint32_t n)
{
    uint32_t d = (b->phase + n - a->phase) % n; /* b's birth after a's */
    return d < a->life || (n - d) % n < b->life;
}

/* Offsets for items in their order, each the lowest free over its lifetime (by: room for
 * count indices, the items placed so far kept in the order of their offsets, so that each
 * item is one pass over them). Returns the height. */
static size_t place_in_order(plan_item_t *items, size_t count, uint32_t n, size_t *by)
{
    size_t height = 0;
    for (size_t i = 0; i < count; i++) {
        size_t off = 0;
        for (size_t j = 0; j < i; j++) {
            const plan_item_t *q = &items[by[j]];
            if (!lives_meet(&items[i], q, n))
                continue;
            if (q->off >= off + items[i].size)
                break; /* a gap below it */
            if (q->off + q->size > off)
                off = q->off + q->size;
        }
        items[i].off = off;
        if (off + items[i].size > height)
            height = off + items[i].size;
        size_t at = i; /* (after those at its offset or below) */
        while (at > 0 && items[by[at - 1]].off > off)
            at--;
        memmove(by + at + 1, by + at, (i - at) * sizeof(*by));
        by[at] = i;
    }
    return height;
}

/*
 * Plan the period of n requests: offsets into items, the lowest placement of the orders
 * tried. Returns the height, or 0 if nothing is planned or no host memory.
 */
static size_t place_items(plan_item_t *items, size_t count, uint32_t n)
{
    static int (*const orders[])(const void *, const void *) = {by_size, by_area, by_life};
    size_t *by = malloc((count ? count : 1) * sizeof(*by));
    plan_item_t *best = malloc((count ? count : 1) * sizeof(*best));
    size_t height = 0;
    for (size_t o = 0; by && best && count && o < sizeof(orders) / sizeof(orders[0]); o++) {
        qsort(items, count, sizeof(*items), orders[o]);
        size_t h = place_in_order(items, count, n, by);
        if (!height || h < height) {
            height = h;
            memcpy(best, items, count * sizeof(*items));
        }
    }
    if (height)
        memcpy(items, best, count * sizeof(*items));
    free(by);
    free(best);
    return height;
}

/*
 * The phase before whose request the fewest bytes of the period's blocks are live: where the
 * plan starts, so that the blocks still live in the old layout are fewest and the granules
 * the plan maps can be taken from it (a start anywhere else maps the plan beside them).
 * *peak: the most bytes of them live at once, *quiet: those live before the phase found. 0
 * and 0 without host memory.
 */
static uint32_t quiet_phase(const plan_item_t *items, size_t count, uint32_t n, size_t *peak,
                            size_t *quiet)
{
    int64_t *delta = calloc(n + 1, sizeof(*delta)), *born = calloc(n, sizeof(*born));
    *peak = *quiet = 0;
    if (!delta || !born) {
        free(delta);
        free(born);
        return 0;
    }
    int64_t live = 0;
    for (size_t i = 0; i < count; i++) {
        /* live during the requests of phases b .. b + life - 1, round the period */
        uint32_t b = items[i].phase, to = (b + items[i].life) % n;
        int64_t sz = (int64_t)items[i].size;
        delta[b] += sz;
        delta[to] -= sz;
        if (to <= b) /* (wraps: live at phase 0 too) */
            live += sz;
        born[b] += sz;
    }
    uint32_t best = 0;
    int64_t least = INT64_MAX, most = 0;
    for (uint32_t k = 0; k < n; k++) {
        live += delta[k];
        if (live > most)
            most = live;
        if (live - born[k] < least) {
            least = live - born[k];
            best = k;
        }
    }
    free(delta);
    free(born);
    *peak = (size_t)most;
    *quiet = (size_t)least;
    return best;
}

/*
 * Plan the period of p->period requests that started two periods before serial now (each of
 * those freed within a period by now); its range is found when it starts (plan_place).
 * False: no plan (host memory, a placement too high).
 */
static bool plan_make(cca_plan_t *p, const cca_block_t *block, uint32_t now)
{
    uint32_t n = p->period, origin = now - 2 * n;
    if (!block->segment->es || !block->segment->es->compact)
        return false;
    plan_item_t *items = malloc(n * sizeof(*items));
    size_t *off = malloc(n * sizeof(*off)), *psize = malloc(n * sizeof(*psize));
    bool ok = items && off && psize;
    size_t count = 0, height = 0;
    uint32_t first = 0;
    if (ok) {
        for (uint32_t k = 0; k < n; k++) {
            const plan_rec_t *r = rec_at(p, origin + k);
            off[k] = PLAN_NONE;
            psize[k] = r->size;
            if (r->death != PLAN_LIVE && r->death - (origin + k) < n)
                items[count++] = (plan_item_t){k, r->death - (origin + k), r->size, 0};
        }
        /* a loop's step: (almost) every block of it freed within the step (a layer's requests
         * repeat too, but its activations outlive them) */
        if (count * 8 < (size_t)n * 7)
            count = 0;
        size_t peak = 0, quiet = 0;
        first = quiet_phase(items, count, n, &peak, &quiet);
        height = count ? place_items(items, count, n) : 0;
        /* a placement far above the loop's own peak would hold more than moving does; so
         * would the step into it, where the blocks live at its start stay in the old layout
         * beside the whole range (a loop with no quiet phase) */
        if (height + quiet > peak + peak / 100 * PLAN_OVER_PEAK)
            height = 0;
    }
    if (!height) {
        free(items);
        free(off);
        free(psize);
        return false;
    }
    for (size_t i = 0; i < count; i++)
        off[items[i].phase] = items[i].off;
    free(items);
    plan_drop(p);
    p->off = off;
    p->psize = psize;
    p->origin = origin;
    p->len = n;
    p->start = now + (first + n - (now - origin) % n) % n;
    p->seg = NULL;
    p->base = 0;
    p->height = height;
    p->misses = 0;
    p->prepared = false;
    p->active = true;
    p->plans++;
    return true;
}

void plan_note_alloc(cca_device_t *dev, cca_pool_t *pool, cca_block_t *block, size_t rsize)
{
    (void)dev;
    cca_plan_t *p = plan_of(pool);
    if (!p)
        return; /* no host memory: the pool goes by best fit */
    if (p->serial >= UINT32_MAX - 2 * PLAN_RING) { /* a restart long before the count wraps */
        plan_reset(pool);
        p->serial = 0;
    }
    uint32_t t = p->serial++;
    plan_rec_t *r = &p->ring[t & (PLAN_RING - 1)];
    r->size = rsize;
    r->death = PLAN_LIVE;
    r->moves = p->moves;
    block->plan_serial = t + 1;
    uint32_t d = repeat_distance(p, t);
    if (p->period && t >= p->period && rec_at(p, t - p->period)->size == rsize) {
        p->run++;
    } else {
        p->period = d;
        p->run = d ? PLAN_WINDOW : 0;
    }
    uint32_t n = p->period;
    if (p->active || !n || p->run < 2 * n || p->run % n || p->serial < p->retry_at)
        return;
    /* two periods alike: plan the first if growths moved granules in each */
    uint32_t now = p->serial;
    uint64_t m0 = rec_at(p, now - 2 * n)->moves, m1 = rec_at(p, now - n)->moves;
    bool moving = (m1 > m0 && p->moves > m1) || atomic_load_explicit(&plans_forced, memory_order_relaxed);
    if (moving && !atomic_load_explicit(&plans_off, memory_order_relaxed))
        plan_make(p, block, now);
}

void plan_note_free(cca_block_t *block)
{
    cca_plan_t *p = block->pool->plan;
    uint32_t t = block->plan_serial - 1;
    block->plan_serial = 0;
    if (!p)
        return;
    if (t < p->serial && p->serial - t <= PLAN_RING) /* (a tag from before a restart: t above) */
        p->ring[t & (PLAN_RING - 1)].death = p->serial;
    for (int i = 0; i < PLAN_RECENT; i++)
        if (p->recent[i] == block)
            p->recent[i] = NULL;
}

/* ---- serving the plan --------------------------------------------------------------- */

static bool free_space(const cca_block_t *b)
{
    return !b->allocated && !b->event_count && !b->stream_use_count && !b->aliased &&
           (b->in_bin || !b->mapped);
}

/* The block of p's segment holding addr: from the placed block nearest it, or the start. */
static cca_block_t *plan_find(const cca_plan_t *p, uintptr_t addr)
{
    cca_block_t *b = p->seg->head;
    uintptr_t best = UINTPTR_MAX;
    for (int i = 0; i < PLAN_RECENT; i++) {
        cca_block_t *r = p->recent[i];
        if (!r)
            continue;
        uintptr_t dist = r->addr > addr ? r->addr - addr : addr - r->addr;
        if (dist < best) {
            best = dist;
            b = r;
        }
    }
    while (b && b->addr > addr)
        b = b->prev;
    while (b && b->addr + b->size <= addr)
        b = b->next;
    return b;
}

/* Whether [addr, addr + size) is free address space from c on; *unmapped: partly unmapped. */
static bool range_free(const cca_block_t *c, uintptr_t addr, size_t size, bool *unmapped)
{
    *unmapped = false;
    if (!c || c->addr > addr)
        return false;
    for (const cca_block_t *b = c; b; b = b->next) {
        if (!free_space(b))
            return false;
        if (!b->mapped)
            *unmapped = true;
        if (b->addr + b->size >= addr + size)
            return true;
    }
    return false;
}

static void plan_miss(cca_plan_t *p)
{
    p->misses++;
    p->missed++;
}

/* Run map under the device lock, taken first (sp's lock released and taken again). A
 * failure is the plan's, which the request then goes on from by best fit: the thread's
 * last-error record is left as it was. */
static cca_status_t with_device_lock(cca_device_t *dev, cca_pool_t *pool, cca_plan_t *p, uintptr_t addr,
                                     size_t size, bool within_limit)
{
    cca_stream_pool_t *sp = pool->owner;
    const cca_error_t saved = *cca_last_error();
    cca_spin_unlock(&sp->lock);
    pthread_mutex_lock(&dev->lock);
    pool_lock(sp);
    cca_status_t st = CCA_ERR_INTERNAL; /* (the place taken meanwhile) */
    bool unmapped;
    if (p->active && !p->seg) {
        /* the plan's start: the unmapped top of one of the pool's segments, or a new one */
        if (compact_plan_range(dev, pool, size, &p->seg, &p->base) != CCA_OK) {
            plan_drop(p); /* (no address space: not again at once) */
            p->retry_at = p->serial + PLAN_RETRY_PERIODS * p->len;
        }
        addr = p->base;
    }
    cca_block_t *c = p->active ? plan_find(p, addr) : NULL;
    if (c && range_free(c, addr, size, &unmapped))
        st = compact_map_range(dev, pool, c, addr, size, within_limit);
    if (st == CCA_OK && !dev->exact_stats) {
        cca_device_stats_t sample; /* sample the peaks, as a growth does */
        stats_read_held(dev, &sample, sp);
    }
    pthread_mutex_unlock(&dev->lock);
    if (st != CCA_OK)
        cca_error_restore(&saved);
    return st;
}

cca_status_t plan_place(cca_device_t *dev, cca_pool_t *pool, size_t rsize, size_t size, cca_block_t **out)
{
    *out = NULL;
    cca_plan_t *p = pool->plan;
    if (!p || !p->active)
        return CCA_OK;
    if ((int32_t)(p->serial - p->start) < 0)
        return CCA_OK; /* (the plan starts at its quiet phase) */
    if (!p->prepared) {
        /* its range (the device lock taken first); then the whole range mapped at once, as far
         * as granules moved and the limit's room go: one map and the old layout's unmaps,
         * rather than a map at each place's first request (a failure leaves those places to
         * their requests) */
        p->prepared = true;
        with_device_lock(dev, pool, p, 0, p->height, true);
        if (!p->active)
            return CCA_OK;
    }
    uint32_t k = (p->serial - p->origin) % p->len;
    if ((p->serial - p->start) % p->len == 0) {
        /* a new period: the plan stays while its last one placed most of its requests */
        if (p->misses > p->len / 8) {
            plan_drop(p);
            p->retry_at = p->serial + PLAN_RETRY_PERIODS * p->len;
            return CCA_OK;
        }
        p->misses = 0;
    }
    if (p->psize[k] != rsize) {
        plan_miss(p);
        return CCA_OK;
    }
    if (p->off[k] == PLAN_NONE)
        return CCA_OK;
    if (!p->seg)
        return CCA_OK; /* another thread of the stream is finding the range (with_device_lock,
                        * this lock released while it waits for the device lock): best fit */
    uintptr_t addr = p->base + p->off[k];
    bool unmapped;
    if (!range_free(plan_find(p, addr), addr, rsize, &unmapped)) {
        plan_miss(p);
        return CCA_OK;
    }
    if (unmapped) {
        /* map its granules, the device lock taken first (as a growth) */
        cca_status_t st = with_device_lock(dev, pool, p, addr, rsize, false);
        if (st != CCA_OK || !p->active) {
            /* (a failed map leaves what it mapped cached: best fit goes on from there) */
            if (p->active)
                plan_miss(p);
            return CCA_OK;
        }
    }
    cca_block_t *c = plan_find(p, addr);
    if (!range_free(c, addr, rsize, &unmapped) || unmapped) {
        plan_miss(p);
        return CCA_OK;
    }
    /* c: a free block holding [addr, addr + rsize), in its bin */
    bins_remove(&pool->bins, c);
    cca_block_t *front = NULL;
    if (c->addr < addr) {
        front = pool_block_new(pool, c->segment, c->addr, addr - c->addr);
        if (!front) {
            bins_insert(&pool->bins, c);
            plan_miss(p);
            return CCA_OK; /* (best fit needs no struct for an exact fit; else it fails too) */
        }
        pool_split_front(pool, front, c);
    }
    cca_status_t st = alloc_take_block(dev, pool, &c, rsize, size, c->size > rsize ? 1 : 0);
    if (st != CCA_OK) {
        if (front) { /* c is back in its bin: one free block again */
            bins_remove(&pool->bins, c);
            bins_insert(&pool->bins, pool_join_front(pool, front));
        }
        return st;
    }
    p->placed++;
    p->recent[p->recent_next++ % PLAN_RECENT] = c;
    *out = c;
    return CCA_OK;
}
