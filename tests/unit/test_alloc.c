/*
 * test_alloc.c - the device caching allocator's rules, one by one, on the
 * simulated backend: rounding, pools, best fit, splitting and merging,
 * oversize blocks, record_stream events, the OOM sequence, GC, memory
 * fraction, statistics, the summary, empty_cache and misuse.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device.h"
#include "harness.h"
#include "host.h"
#include "ptrmap.h"
#include "runtime.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

static cca_backend_t *sim;

/* Bring cca up on a fresh simulated device. */
static void setup(const char *settings, size_t memory, bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = memory ? memory : 8ull << 30;
    cfg.manual_events = manual_events;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK) {
        printf("cannot create sim backend: %s\n", cca_last_error()->message);
        exit(1);
    }
    if (cca_init_with_backend(sim, settings ? settings : "") != CCA_OK) {
        printf("cannot init: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static cca_device_stats_t stats(int device)
{
    cca_device_stats_t s;
    cca_get_device_stats(device, &s);
    return s;
}

static void *xmalloc(size_t size, cca_stream_t stream)
{
    void *p = NULL;
    cca_status_t st = cca_malloc(&p, size, stream);
    if (st != CCA_OK)
        printf("  cca_malloc(%zu) failed: %s\n", size, cca_last_error()->message);
    return p;
}

#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

TEST(rounding_default)
{
    cca_settings_t s;
    settings_default(&s);
    expect_eq_u64(alloc_round_size(&s, 1), 512);
    expect_eq_u64(alloc_round_size(&s, 512), 512);
    expect_eq_u64(alloc_round_size(&s, 513), 1024);
    expect_eq_u64(alloc_round_size(&s, 1000000), 1000448);
    expect_eq_u64(alloc_round_size(&s, 3 * MiB + 1), 3 * MiB + 512);
}

TEST(rounding_power2_divisions)
{
    cca_settings_t s;
    settings_default(&s);
    expect_ok(settings_parse(&s, "roundup_power2_divisions:4", CCA_SRC_ARGUMENT));
    /* 1200 lies in [1024, 2048): divisions at 1280, 1536, 1792; but 1200 <= 512*4 -> 512 rounding */
    expect_eq_u64(alloc_round_size(&s, 1200), 1536);
    /* 5000 in [4096, 8192): step 1024 -> 5120 */
    expect_eq_u64(alloc_round_size(&s, 5000), 5120);
    /* 1 MiB + 1 in [1 MiB, 2 MiB): step 256 KiB */
    expect_eq_u64(alloc_round_size(&s, MiB + 1), MiB + 256 * KiB);
    expect_eq_u64(alloc_round_size(&s, 4 * MiB), 4 * MiB); /* power of two stays */
    settings_default(&s);
    expect_ok(settings_parse(&s, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", CCA_SRC_ARGUMENT));
    /* 600 MiB + 1: interval 512 -> 2 divisions: round to 768 MiB */
    expect_eq_u64(alloc_round_size(&s, 600 * MiB + 1), 768 * MiB);
    /* 1.5 GiB + 1: interval 1024 -> 4 divisions (step 256 MiB) -> 1792 MiB */
    expect_eq_u64(alloc_round_size(&s, 1536 * MiB + 1), 1792 * MiB);
    /* 3 GiB + 1: interval 2048 -> 8 divisions (step 256 MiB) -> 3.25 GiB */
    expect_eq_u64(alloc_round_size(&s, 3072 * MiB + 1), 3328 * MiB);
    /* 300 MiB: divisions 1 -> plain 512 B rounding */
    expect_eq_u64(alloc_round_size(&s, 300 * MiB + 1), 300 * MiB + 512);
}

TEST(segment_sizes)
{
    cca_settings_t s;
    settings_default(&s);
    expect_eq_u64(alloc_segment_size(&s, 512), 2 * MiB);
    expect_eq_u64(alloc_segment_size(&s, MiB), 2 * MiB);
    expect_eq_u64(alloc_segment_size(&s, MiB + 512), 20 * MiB);
    expect_eq_u64(alloc_segment_size(&s, 10 * MiB - 512), 20 * MiB);
    expect_eq_u64(alloc_segment_size(&s, 10 * MiB), 10 * MiB);
    expect_eq_u64(alloc_segment_size(&s, 11 * MiB + 1), 12 * MiB);
    expect_ok(settings_parse(&s, "large_segment_size_mb:40", CCA_SRC_ARGUMENT));
    expect_eq_u64(alloc_segment_size(&s, 2 * MiB), 40 * MiB);
}

TEST(size_zero_and_huge)
{
    setup(NULL, 0, false);
    void *p = (void *)1;
    expect_ok(cca_malloc(&p, 0, NULL));
    expect_eq_ptr(p, NULL);
    expect_status(cca_malloc(&p, (size_t)1 << 60, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "more than 1EB");
    expect_status(cca_malloc(NULL, 10, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_malloc_device(&p, 10, 5, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_malloc_device(&p, 10, -1, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(stats(0).allocation[CCA_STAT_ALL].current, 0);
}

TEST(small_and_large_pools)
{
    setup(NULL, 0, false);
    void *a = xmalloc(MiB, NULL);     /* small: <= 1 MiB */
    void *b = xmalloc(MiB + 1, NULL); /* large */
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].current, 1);
    expect_eq_i64(s.allocation[CCA_STAT_LARGE_POOL].current, 1);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_SMALL_POOL].current, 2 * MiB);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_LARGE_POOL].current, 20 * MiB);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, MiB + MiB + 512);
    expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, 2 * MiB + 1);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 2);
    expect_eq_i64(s.num_device_alloc, 2);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 22 * MiB);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, 2 * MiB + 512);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].freed, 2 * MiB + 512);
}

TEST(split_reuse_and_merge)
{
    setup(NULL, 0, false);
    char *a = xmalloc(4 * KiB, NULL);
    char *b = xmalloc(4 * KiB, NULL);
    char *c = xmalloc(4 * KiB, NULL);
    /* one 2 MiB small segment, carved front to back */
    expect_eq_ptr(b, a + 4 * KiB);
    expect_eq_ptr(c, b + 4 * KiB);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 12 * KiB);
    /* free the middle: a separate inactive split block */
    expect_ok(cca_free(b));
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 2);
    /* same size on the same stream reuses it (best fit: exact hole) */
    char *d = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(d, b);
    expect_ok(cca_free(d));
    expect_ok(cca_free(a));
    /* a and b merged: a 2-block hole of 8 KiB; c still allocated */
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 2);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 4 * KiB);
    char *e = xmalloc(8 * KiB, NULL);
    expect_eq_ptr(e, a);
    expect_ok(cca_free(e));
    expect_ok(cca_free(c));
    s = stats(0);
    /* everything merged back into one unsplit block */
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 0);
    size_t total = 0, largest = 0;
    expect_ok(cca_cache_info(0, &total, &largest));
    expect_eq_u64(total, 2 * MiB);
    expect_eq_u64(largest, 2 * MiB);
}

/* The statistics of the whole device, with the invariant checker run first. */
static cca_device_stats_t checked_stats(void)
{
    char why[256];
    cca_status_t st = alloc_check_invariants(why, sizeof(why));
    if (st != CCA_OK)
        printf("  invariants: %s\n", why);
    expect_ok(st);
    return stats(0);
}

/*
 * A freed block whose only free neighbour is above it is held back from
 * merging until the pool is used otherwise; everything seen from outside is
 * the merged pool: statistics at once, cache_info and the checker (which
 * merge it first), and the next allocations land where PyTorch puts them.
 */
TEST(held_free_is_the_merge)
{
    setup(NULL, 0, false);
    char *a = xmalloc(4 * KiB, NULL);
    char *b = xmalloc(4 * KiB, NULL);
    expect_ok(cca_free(b)); /* below: a (allocated), above: the free rest */
    cca_device_stats_t s = stats(0); /* no merge forced yet */
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 4 * KiB);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 4 * KiB);
    /* the pair: the same block back, the statistics of a split */
    char *c = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(c, b);
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 8 * KiB);
    expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].allocated, 3);
    expect_eq_i64(s.allocation[CCA_STAT_SMALL_POOL].freed, 1);
    expect_ok(cca_free(c));
    size_t total = 0, largest = 0;
    expect_ok(cca_cache_info(0, &total, &largest)); /* sees the merged block */
    expect_eq_u64(total, 2 * MiB - 4 * KiB);
    expect_eq_u64(largest, 2 * MiB - 4 * KiB);
    s = checked_stats();
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);

    /* best fit elsewhere: an exact 4 KiB hole below beats the merged block */
    char *x = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(x, b);
    char *y = xmalloc(4 * KiB, NULL);
    char *h = xmalloc(4 * KiB, NULL);
    expect_ok(cca_free(x)); /* a hole between a and y: merged with nothing */
    expect_ok(cca_free(h)); /* held: y below, the free rest above */
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 2);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 8 * KiB);
    char *p = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(p, x);
    char *q = xmalloc(4 * KiB, NULL); /* now the merged block is the best fit */
    expect_eq_ptr(q, h);
    checked_stats();

    /* another size: the held block merged, then split at its address */
    expect_ok(cca_free(q));
    char *r = xmalloc(8 * KiB, NULL);
    expect_eq_ptr(r, h);
    s = checked_stats();
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 20 * KiB);

    /* another free merges the held one first: a run of frees ends in one block */
    expect_ok(cca_free(r));
    expect_ok(cca_free(p));
    expect_ok(cca_free(y));
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 4 * KiB);
    expect_ok(cca_free(a)); /* a's upper neighbour is free, its lower one absent */
    s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 0);
    expect_ok(cca_empty_cache()); /* releases the segment: the held block merged first */
    s = checked_stats();
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);

    /* large pool: 3 MiB blocks of a 20 MiB segment, the rest above split off */
    char *l1 = xmalloc(3 * MiB, NULL);
    char *l2 = xmalloc(3 * MiB, NULL);
    expect_ok(cca_free(l2));
    char *l3 = xmalloc(3 * MiB, NULL);
    expect_eq_ptr(l3, l2);
    expect_ok(cca_free(l3));
    /* a free on another stream's pool leaves this one's held block alone */
    void *o = xmalloc(4 * KiB, S1);
    expect_ok(cca_free(o));
    char *l4 = xmalloc(3 * MiB, NULL);
    expect_eq_ptr(l4, l2);
    s = checked_stats();
    expect_eq_i64(s.inactive_split[CCA_STAT_LARGE_POOL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_LARGE_POOL].current, 14 * MiB);
    expect_ok(cca_free(l4));
    expect_ok(cca_free(l1));
    s = checked_stats();
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
}

/*
 * One script of allocations and frees, with a statistics read after every
 * step (a read merges a held-back block and applies its statistics) or with
 * none: the statistics at the end must be the same in every field.
 */
static void run_pairs_script(const char *settings, bool read_each, cca_device_stats_t *out)
{
    setup(settings, 0, false);
    enum { SLOTS = 12 };
    void *slot[SLOTS] = {0};
    static const size_t sizes[] = {513, 1024, 700, 1000, 4 * KiB, 3 * MiB, 3 * MiB - 100, 40 * MiB, 600};
    uint64_t x = 12345;
    for (int i = 0; i < 2000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((x >> 33) % SLOTS);
        size_t size = sizes[(x >> 20) % (sizeof(sizes) / sizeof(sizes[0]))];
        cca_stream_t stream = k < 8 ? NULL : S1;
        if (slot[k]) {
            expect_ok(cca_free(slot[k]));
            slot[k] = NULL;
            if (k % 3 == 0) /* the same slot again at once: the cached pair */
                slot[k] = xmalloc(size, stream);
        } else {
            slot[k] = xmalloc(size, stream);
        }
        if (read_each)
            (void)stats(0);
    }
    for (int k = 0; k < SLOTS; k++)
        if (slot[k] && k % 2)
            expect_ok(cca_free(slot[k]));
    *out = stats(0);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
}

TEST(held_statistics_equal_merged)
{
    const char *modes[] = {"", "exact_peak_stats:False", "max_split_size_mb:20",
                           "roundup_power2_divisions:4", "expandable_segments:True",
                           "compact_memory:True"};
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        cca_device_stats_t each, none;
        run_pairs_script(modes[m], true, &each);
        run_pairs_script(modes[m], false, &none);
        /* peaks too, but in the relaxed mode, whose peaks are sampled (at reads among others) */
        bool peaks = strcmp(modes[m], "exact_peak_stats:False") != 0;
        const cca_stat_t *a = each.allocation, *b = none.allocation;
        size_t differing = 0;
        for (size_t i = 0; i < 9 * CCA_STAT_TYPES; i++) /* allocation ... requested_bytes */
            if (a[i].current != b[i].current || a[i].allocated != b[i].allocated ||
                a[i].freed != b[i].freed || (peaks && a[i].peak != b[i].peak)) {
                if (!differing)
                    printf("  settings \"%s\": statistic %zu: %lld/%lld/%lld/%lld read each step, "
                           "%lld/%lld/%lld/%lld not\n", modes[m], i, (long long)a[i].current,
                           (long long)a[i].peak, (long long)a[i].allocated, (long long)a[i].freed,
                           (long long)b[i].current, (long long)b[i].peak, (long long)b[i].allocated,
                           (long long)b[i].freed);
                differing++;
            }
        differing += memcmp(&each.oversize_allocations, &none.oversize_allocations,
                            sizeof(cca_stat_t)) != 0 && peaks;
        differing += each.num_device_alloc != none.num_device_alloc;
        expect_eq_u64(differing, 0);
        expect_ne_u64((uint64_t)none.allocation[CCA_STAT_ALL].allocated, 0);
    }
}

/*
 * One stream's script of allocations, cached pairs, record_stream uses and
 * bad frees, in solo mode (one stream pool guards the pointer map: the
 * cached pair's free finds its block as the pool's last one, without the
 * map) or with the map's shards (every free through the map): every address
 * and every error must be the same, and the statistics at the end.
 */
enum { SOLO_STEPS = 3000 };
/* How a run meets the shards' mode: never, from the start, halfway (solo mode's blocks
 * moved to their shards), or halfway with no host memory for the shards' first buckets
 * (the blocks left in the solo table, found there by the shards' lookups). */
enum { SOLO_ONLY, SHARDS_AT_START, SHARDS_HALFWAY, SHARDS_HALFWAY_NO_MEMORY };

static void run_solo_script(const char *settings, int solo_mode, uintptr_t *addrs, cca_device_stats_t *out)
{
    bool solo = solo_mode == SOLO_ONLY;
    setup(settings, 0, false);
    enum { SLOTS = 10 };
    char *slot[SLOTS] = {0};
    static const size_t sizes[] = {512, 513, 1024, 4 * KiB, 3 * MiB, 3 * MiB - 100, 12 * MiB, 600};
    void *first = xmalloc(512, NULL); /* the stream pool */
    expect_true(ptrmap_solo(cca_state->ptrmap) != NULL);
    if (solo_mode == SHARDS_AT_START)
        ptrmap_pool_made(cca_state->ptrmap, NULL); /* as a second pool would: the shards' mode */
    expect_true((ptrmap_solo(cca_state->ptrmap) != NULL) == (solo_mode != SHARDS_AT_START));
    uint64_t x = 777;
    size_t left = 0; /* blocks left in the solo table as solo mode ended */
    for (int i = 0; i < SOLO_STEPS; i++) {
        if (i == SOLO_STEPS / 2 && solo_mode >= SHARDS_HALFWAY) {
            struct cca_ptrmap *m = cca_state->ptrmap;
            size_t live = 1; /* first, and the slots' blocks (a held one leaves the map) */
            for (int k = 0; k < SLOTS; k++)
                live += slot[k] != NULL;
            expect_true(m->shards[PTRMAP_SOLO].count >= live);
            ptrmap_test_spill_no_memory(solo_mode == SHARDS_HALFWAY_NO_MEMORY);
            ptrmap_pool_made(m, NULL);
            ptrmap_test_spill_no_memory(false);
            left = m->shards[PTRMAP_SOLO].count;
            expect_eq_u64(ptrmap_count(m, NULL), live);
            expect_eq_u64(left, solo_mode == SHARDS_HALFWAY ? 0 : live);
            expect_true((m->shards[PTRMAP_SOLO].cap == 0) == (left == 0)); /* emptied: freed */
        }
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int k = (int)((x >> 33) % SLOTS);
        size_t size = sizes[(x >> 20) % (sizeof(sizes) / sizeof(sizes[0]))];
        if (slot[k]) {
            if ((x >> 40) % 7 == 0)
                expect_status(cca_free(slot[k] + 256), CCA_ERR_INVALID_POINTER); /* inside */
            if ((x >> 40) % 7 == 1)
                expect_ok(cca_record_stream(slot[k], S1)); /* freed through its event */
            expect_ok(cca_free(slot[k]));
            if ((x >> 40) % 5 == 0)
                expect_status(cca_free(slot[k]), CCA_ERR_INVALID_POINTER); /* twice */
            slot[k] = NULL;
            if (k % 2 == 0) /* the same slot again at once: the cached pair */
                slot[k] = xmalloc(size, NULL);
        } else {
            slot[k] = xmalloc(size, NULL);
        }
        addrs[i] = (uintptr_t)slot[k];
        if ((x >> 50) % 97 == 0)
            (void)stats(0); /* a read merges the held block */
    }
    expect_true((ptrmap_solo(cca_state->ptrmap) != NULL) == solo);
    if (solo_mode == SHARDS_HALFWAY_NO_MEMORY) /* freed since: taken from the solo table */
        expect_true(cca_state->ptrmap->shards[PTRMAP_SOLO].count < left);
    for (int k = 0; k < SLOTS; k++)
        if (slot[k] && k % 3)
            expect_ok(cca_free(slot[k]));
    expect_ok(cca_free(first));
    *out = stats(0);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
}

/* Statistics of two runs that differ (allocation ... requested_bytes, all pools: currents,
 * counts, and peaks unless sampled), plus the backend allocations. */
static size_t stats_differing(const cca_device_stats_t *x, const cca_device_stats_t *y, bool peaks)
{
    const cca_stat_t *p = x->allocation, *q = y->allocation;
    size_t differing = 0;
    for (size_t i = 0; i < 9 * CCA_STAT_TYPES; i++)
        differing += p[i].current != q[i].current || p[i].allocated != q[i].allocated ||
                     p[i].freed != q[i].freed || (peaks && p[i].peak != q[i].peak);
    return differing + (x->num_device_alloc != y->num_device_alloc);
}

/* Addresses (n of each run) and statistics of two runs of one script under settings that
 * differ; peaks compared unless the relaxed mode sampled them. */
static size_t runs_differing(const uintptr_t *a, const uintptr_t *b, size_t n, const cca_device_stats_t *x,
                             const cca_device_stats_t *y, const char *settings)
{
    size_t differing = 0;
    for (size_t i = 0; i < n; i++)
        differing += a[i] != b[i];
    return differing + stats_differing(x, y, strcmp(settings, "exact_peak_stats:False") != 0);
}

TEST(solo_pair_free_equals_the_map_path)
{
    const char *modes[] = {"", "exact_peak_stats:False", "max_split_size_mb:20", "expandable_segments:True"};
    static uintptr_t a[SOLO_STEPS], b[SOLO_STEPS];
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        cca_device_stats_t solo, shards;
        run_solo_script(modes[m], SOLO_ONLY, a, &solo);
        expect_ne_u64((uint64_t)solo.allocation[CCA_STAT_ALL].allocated, 0);
        for (int how = SHARDS_AT_START; how <= SHARDS_HALFWAY_NO_MEMORY; how++) {
            run_solo_script(modes[m], how, b, &shards);
            expect_eq_u64(runs_differing(a, b, SOLO_STEPS, &solo, &shards, modes[m]), 0);
            expect_eq_i64(solo.allocation[CCA_STAT_ALL].current, shards.allocation[CCA_STAT_ALL].current);
        }
    }
}

/*
 * Runs of cached pairs whose statistics updates repeat the last one exactly
 * are counted later (pool->again_n): the same script with a statistics read
 * after every step (each read counts them and makes the next pair's update a
 * full one) must end with every statistic equal; peaks reset and counts
 * reset between runs, pairs of another size, of the other pool, and of a
 * block whose request changes break the runs.
 */
static void run_repeats_script(const char *settings, bool read_each, cca_device_stats_t *at, cca_device_stats_t *out)
{
    setup(settings, 0, false);
    char *below = xmalloc(4 * KiB, NULL);
    char *big_below = xmalloc(3 * MiB, NULL);
    static const struct { size_t size; int times; } runs[] = {
        {4 * KiB, 50}, {4 * KiB - 100, 3}, {8 * KiB, 20}, {3 * MiB, 30}, {4 * KiB, 40},
        {3 * MiB - 512, 5}, {512, 25}, {4 * KiB, 10}, {24 * MiB, 6}, /* oversize under a split cap: never held */
    };
    for (int r = 0; r < 3; r++) {
        for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
            for (int t = 0; t < runs[i].times; t++) {
                void *p = xmalloc(runs[i].size, NULL);
                if (t == runs[i].times / 2 && i % 3 == 0)
                    expect_ok(cca_reset_peak_stats(0)); /* the run's next update in full again */
                if (t == runs[i].times - 1)
                    *at++ = stats(0); /* the run's repeats counted (a read in both scripts) */
                expect_ok(cca_free(p));
                if (read_each)
                    (void)stats(0);
            }
        }
        if (r == 1)
            expect_ok(cca_reset_accumulated_stats(0));
    }
    expect_ok(cca_free(below));
    expect_ok(cca_free(big_below));
    *out = stats(0);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
}

TEST(held_repeats_counted_later)
{
    const char *modes[] = {"", "exact_peak_stats:False", "max_split_size_mb:20"};
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        enum { AT = 3 * 9 + 1 };
        static cca_device_stats_t each_at[AT], none_at[AT];
        run_repeats_script(modes[m], true, each_at, &each_at[AT - 1]);
        run_repeats_script(modes[m], false, none_at, &none_at[AT - 1]);
        cca_device_stats_t none = none_at[AT - 1];
        bool peaks = strcmp(modes[m], "exact_peak_stats:False") != 0;
        size_t differing = 0;
        for (int k = 0; k < AT; k++) { /* after every run, and at the end */
            const cca_stat_t *a = each_at[k].allocation, *b = none_at[k].allocation;
            for (size_t i = 0; i < 9 * CCA_STAT_TYPES; i++)
                differing += a[i].current != b[i].current || a[i].allocated != b[i].allocated ||
                             a[i].freed != b[i].freed || (peaks && a[i].peak != b[i].peak);
            differing += each_at[k].oversize_allocations.allocated !=
                         none_at[k].oversize_allocations.allocated;
        }
        expect_eq_u64(differing, 0);
        /* the last round's pairs (counts reset after the second round), the two blocks' frees */
        expect_eq_i64(none.allocation[CCA_STAT_ALL].allocated, 189);
        expect_eq_i64(none.allocation[CCA_STAT_ALL].freed, 191);
        if (m == 2) /* max_split_size_mb:20: the 24 MiB pairs are oversize */
            expect_eq_i64(none.oversize_allocations.allocated, 6);
        expect_eq_i64(none.allocation[CCA_STAT_ALL].current, 0);
    }
}

/*
 * The express pair (cca_malloc / cca_free tried first on the thread's last
 * stream pool): the same script with the history recording every call's
 * context (which keeps every call off the express paths) must hand out the
 * same addresses and end with the same statistics. The script mixes runs of
 * pairs of several sizes in both pools, a second stream (the pointer map
 * leaves solo mode: no express free), record_stream (its events complete at
 * the end), peak resets and a double free of a held block; and, between a
 * repeated pair's allocation and free, record_stream, a statistics read,
 * another block of the pool freed before or after, empty_cache, a second free.
 */
static const char *express_context(void *arg)
{
    (void)arg;
    return "ctx";
}

static void run_express_script(const char *settings, bool context, uintptr_t *addrs, cca_device_stats_t *out)
{
    setup(settings, 0, true); /* events complete when the script says (below) */
    if (context)
        expect_ok(cca_record_history(true, express_context, NULL, 64, CCA_RECORD_CONTEXT_ALL));
    size_t n = 0;
    /* repeats of a held block's update: not with its statistics applied at the free
     * (expandable), nor for blocks that max_split_size keeps from being held */
    bool repeats = !strstr(settings, "expandable") && !strstr(settings, "max_split");
    char *below = xmalloc(4 * KiB, NULL);
    addrs[n++] = (uintptr_t)below;
    static const struct { size_t size; int times; cca_stream_t stream; } runs[] = {
        {4 * KiB, 40, NULL}, {4 * KiB - 100, 3, NULL}, {3 * MiB, 40, NULL}, {512, 25, NULL},
        {8 * KiB, 10, S1}, {4 * KiB, 10, NULL}, {3 * MiB, 5, S1}, {512, 10, NULL},
    };
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        for (int t = 0; t < runs[i].times; t++) {
            void *p = xmalloc(runs[i].size, runs[i].stream);
            addrs[n++] = (uintptr_t)p;
            if (t == 7 && i == 0) { /* the express state is set up (the first stream pool) */
                cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], NULL);
                expect_true(sp && sp->small.held == NULL && sp->small.last_alloc &&
                            sp->small.last_alloc->addr == (uintptr_t)p);
            }
            if (t == runs[i].times / 2 && i % 3 == 1)
                expect_ok(cca_reset_peak_stats(0));
            if (t == 5 && i == 5)
                expect_ok(cca_record_stream(p, S2));
            /* between a repeated pair's allocation and its free (solo mode, both pools),
             * whatever the free's shortcut for the block of the last repeat must see */
            bool solo_run = i == 0 || i == 2;
            bool between = solo_run && t >= 12 && t % 4 == 0;
            if (between && repeats) { /* p is the block of the pair's last repeat */
                cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], NULL);
                expect_true(sp->again_pool != NULL && sp->rehold != NULL &&
                            sp->rehold->addr == (uintptr_t)p);
            }
            if (between && t == 12)
                expect_ok(cca_record_stream(p, S2)); /* its free waits for an event */
            if (between && t == 20) {
                cca_device_stats_t read; /* a reader flushes the pool's repeats */
                expect_ok(cca_get_device_stats(0, &read));
            }
            if (between && (t == 24 || t == 28)) { /* another block, freed before or after */
                void *q = xmalloc(i == 0 ? 1 * KiB : 5 * MiB, NULL);
                addrs[n++] = (uintptr_t)q;
                if (t == 28) {
                    expect_ok(cca_free(p));
                    p = NULL;
                }
                expect_ok(cca_free(q));
            }
            if (between && t == 32)
                expect_ok(cca_empty_cache());
            if (p)
                expect_ok(cca_free(p));
            if (between && t == 16) { /* the free of the last repeat's block, twice */
                cca_clear_error();
                expect_status(cca_free(p), CCA_ERR_INVALID_POINTER);
            }
            if (t == 8 && i == 0) {
                cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], NULL);
                /* held and ready for the express allocation (which a recorded context keeps
                 * cca_malloc off), but for a block of an expandable segment, whose statistics
                 * are applied at its free */
                bool expandable = strstr(settings, "expandable") != NULL;
                expect_true(sp->small.held != NULL);
                expect_true(atomic_load(&sp->small.express) == (expandable ? NULL : sp->small.held));
                cca_clear_error();
                expect_status(cca_free(p), CCA_ERR_INVALID_POINTER); /* a double free: refused */
            }
        }
    }
    expect_ok(cca_free(below));
    expect_ok(cca_sim_complete_stream(sim, 0, S2, true));
    expect_ok(cca_empty_cache()); /* the blocks whose events are over return */
    *out = stats(0);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    if (context)
        expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
}

TEST(express_pair_equals_the_locked_path)
{
    const char *modes[] = {"", "exact_peak_stats:False", "max_split_size_mb:20", "expandable_segments:True",
                           "garbage_collection_threshold:0.5,per_process_memory_fraction:0.9"};
    enum { STEPS = 1 + 40 + 3 + 40 + 25 + 10 + 10 + 5 + 10 + 4 };
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        static uintptr_t a[STEPS], b[STEPS];
        cca_device_stats_t fast, locked;
        run_express_script(modes[m], false, a, &fast);
        run_express_script(modes[m], true, b, &locked);
        expect_eq_u64(runs_differing(a, b, STEPS, &fast, &locked, modes[m]), 0);
        expect_eq_i64(fast.allocation[CCA_STAT_ALL].allocated, STEPS);
        expect_eq_i64(fast.allocation[CCA_STAT_ALL].current, 0);
    }
}

/*
 * The repeat's paths (free_repeat, malloc_express) leave the work to the
 * others while history is recorded: every pair made while the pool is set up
 * for a repeat is in the history, allocation and both free entries.
 */
TEST(express_pair_keeps_the_history)
{
    const char *modes[] = {"", "exact_peak_stats:False"};
    for (int m = 0; m < 2; m++) {
        setup(modes[m], 0, false);
        for (int i = 0; i < 10; i++) /* the pool set up for repeats */
            expect_ok(cca_free(xmalloc(4 * KiB, NULL)));
        cca_stream_pool_t *sp = pool_stream_get(&cca_state->devices[0], NULL);
        expect_true(sp && sp->again_pool == &sp->small && sp->small.held != NULL &&
                    atomic_load(&sp->small.express) == sp->small.held);
        expect_ok(cca_record_history(true, NULL, NULL, 1000, CCA_RECORD_CONTEXT_NEVER));
        uintptr_t first = 0;
        for (int i = 0; i < 20; i++) {
            void *p = xmalloc(4 * KiB, NULL);
            if (i == 0)
                first = (uintptr_t)p;
            expect_eq_u64((uintptr_t)p, first); /* the held block, every time */
            expect_ok(cca_free(p));
        }
        cca_trace_entry_t *e = NULL;
        size_t n = 0, counts[3] = {0};
        expect_ok(cca_history_get(&e, &n));
        for (size_t i = 0; i < n; i++)
            if (e[i].action <= CCA_TRACE_FREE_COMPLETED && e[i].addr == first && e[i].size == 4 * KiB)
                counts[e[i].action]++;
        cca_history_free(e);
        expect_eq_u64(counts[CCA_TRACE_ALLOC], 20);
        expect_eq_u64(counts[CCA_TRACE_FREE_REQUESTED], 20);
        expect_eq_u64(counts[CCA_TRACE_FREE_COMPLETED], 20);
        expect_ok(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER));
        expect_eq_i64(stats(0).allocation[CCA_STAT_ALL].allocated, 30);
    }
}

/* Pairs from a thread other than the one the stream pool's lock is biased to. */
static void *pairs_elsewhere(void *arg)
{
    uintptr_t *addrs = arg;
    for (int i = 0; i < 40; i++) {
        void *p = xmalloc(i < 20 ? 4 * KiB : 3 * MiB, NULL);
        addrs[i] = (uintptr_t)p;
        expect_ok(cca_free(p));
    }
    return NULL;
}

/*
 * The express paths enter the pool's lock without waiting: as the thread its
 * bias belongs to, or by the lock word once another thread has revoked it.
 * Pairs of a second thread on the first thread's stream, then of the first
 * again, each repeat the same block, and the statistics count every pair.
 */
TEST(express_pair_from_another_thread)
{
    const char *modes[] = {"", "exact_peak_stats:False"};
    for (int m = 0; m < 2; m++) {
        setup(modes[m], 0, false);
        void *mine = xmalloc(4 * KiB, NULL); /* this thread makes the stream pool */
        expect_ok(cca_free(mine));
        static uintptr_t addrs[40];
        pthread_t t;
        expect_true(pthread_create(&t, NULL, pairs_elsewhere, addrs) == 0);
        pthread_join(t, NULL);
        for (int i = 1; i < 40; i++)
            expect_eq_u64(addrs[i], addrs[i < 20 ? 0 : 20]);
        for (int i = 0; i < 10; i++) {
            void *p = xmalloc(4 * KiB, NULL);
            expect_eq_u64((uintptr_t)p, addrs[0]);
            expect_ok(cca_free(p));
        }
        cca_device_stats_t s = stats(0);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 51);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
        char why[256];
        expect_ok(alloc_check_invariants(why, sizeof(why)));
    }
}

/* A held-back free whose merge raises inactive_split_bytes to its peak, taken again at once. */
TEST(held_free_peak_in_between)
{
    const char *modes[] = {"", "exact_peak_stats:False"};
    for (int m = 0; m < 2; m++) {
        setup(modes[m], 0, false);
        char *a1 = xmalloc(1 * MiB, NULL); /* a full small segment: 1 MiB + 512 KiB + 512 KiB */
        char *a2 = xmalloc(512 * KiB, NULL);
        char *a3 = xmalloc(512 * KiB, NULL);
        char *b = xmalloc(4 * KiB, NULL); /* a second segment, 2 MiB - 4 KiB of it free */
        expect_ok(cca_free(a3));          /* + 512 KiB inactive */
        expect_ok(cca_free(a2));          /* held: merged with a3, + 512 KiB more */
        char *again = xmalloc(512 * KiB, NULL);
        expect_eq_ptr(again, a2);
        cca_device_stats_t s = stats(0);
        for (int t = 0; t < 2; t++) {
            cca_stat_t *ib = &s.inactive_split_bytes[t ? CCA_STAT_SMALL_POOL : CCA_STAT_ALL];
            expect_eq_i64(ib->current, (int64_t)(2 * MiB + 512 * KiB - 4 * KiB));
            if (m == 0) /* the relaxed mode samples its peaks */
                expect_eq_i64(ib->peak, (int64_t)(3 * MiB - 4 * KiB));
        }
        expect_eq_i64(s.requested_bytes[CCA_STAT_ALL].current, (int64_t)(1 * MiB + 512 * KiB + 4 * KiB));
        expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 5);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 2);
        expect_ok(cca_free(again));
        expect_ok(cca_free(a1));
        expect_ok(cca_free(b));
        s = stats(0);
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    }
}

/* A hole made while the held block was out (its next free holds it again) beats it. */
TEST(held_fit_sees_a_new_hole)
{
    setup(NULL, 0, false);
    char *x = xmalloc(4 * KiB, NULL);
    char *a = xmalloc(4 * KiB, NULL);
    char *h = xmalloc(4 * KiB, NULL);
    for (int i = 0; i < 3; i++) { /* the cached pair, h each time */
        expect_ok(cca_free(h));
        char *again = xmalloc(4 * KiB, NULL);
        expect_eq_ptr(again, h);
    }
    expect_ok(cca_free(x)); /* an exact hole below, a and h still allocated */
    expect_ok(cca_free(h)); /* held again: h was handed out last */
    char *p = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(p, x); /* best fit: the exact hole, not the merged block at h */
    char *q = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(q, h);
    expect_ok(cca_free(p));
    expect_ok(cca_free(q));
    expect_ok(cca_free(a));
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 8);
}

/*
 * While one stream pool guards the pointer map (solo mode), the held block stays
 * in the map, not allocated: every lookup misses it, a free of it is a double
 * free, and a second stream pool takes it out of the map.
 */
TEST(held_block_in_the_map)
{
    setup(NULL, 0, false);
    char *a = xmalloc(4 * KiB, NULL);
    char *h = xmalloc(4 * KiB, NULL);
    expect_true(ptrmap_solo(cca_state->ptrmap) != NULL);
    expect_ok(cca_free(h));
    cca_stream_pool_t *sp = pool_of_lock(ptrmap_solo(cca_state->ptrmap));
    expect_true(sp->small.held && sp->small.held->addr == (uintptr_t)h && sp->small.held_in_map);
    /* held, in the map, not live: no base allocation, at it or inside it, and no message
     * naming it as the block a pointer lies in (the lookup by range once found it) */
    void *held_base = NULL;
    size_t held_size = 0;
    expect_status(cca_get_base_allocation(h, &held_base, &held_size), CCA_ERR_INVALID_POINTER);
    expect_status(cca_get_base_allocation(h + 100, &held_base, &held_size), CCA_ERR_INVALID_POINTER);
    expect_true(held_base == NULL && held_size == 0);
    expect_status(cca_record_stream(h + 256, S1), CCA_ERR_INVALID_POINTER);
    expect_true(strstr(cca_last_error()->message, "inside the block") == NULL);
    expect_true(sp->small.held && sp->small.held_in_map); /* still held: nothing changed */
    expect_status(cca_free(h), CCA_ERR_INVALID_POINTER);      /* a double free */
    expect_status(cca_free(h + 512), CCA_ERR_INVALID_POINTER);
    expect_status(cca_record_stream(h, S1), CCA_ERR_INVALID_POINTER);
    void *base = NULL;
    size_t size = 0;
    expect_status(cca_get_base_allocation(h, &base, &size), CCA_ERR_INVALID_POINTER);
    cca_device_stats_t s = stats(0); /* merges the held block (and takes it out of the map) */
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 1);
    expect_true(!sp->small.held && !sp->small.held_in_map);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));

    /* held again, then a second stream pool ends solo mode: out of the map */
    char *h2 = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(h2, h);
    expect_ok(cca_free(h2));
    expect_true(sp->small.held_in_map);
    void *other = xmalloc(4 * KiB, S1);
    expect_true(ptrmap_solo(cca_state->ptrmap) == NULL);
    expect_true(!sp->small.held_in_map);
    expect_status(cca_free(h2), CCA_ERR_INVALID_POINTER);
    char *h3 = xmalloc(4 * KiB, NULL); /* the shards' mode from here */
    expect_eq_ptr(h3, h);
    expect_ok(cca_free(h3));
    expect_status(cca_free(h3), CCA_ERR_INVALID_POINTER);
    expect_ok(cca_free(other));
    expect_ok(cca_free(a));
    s = stats(0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 5);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 5);
    expect_ok(alloc_check_invariants(why, sizeof(why)));
}

/*
 * In an expandable segment the cached pair holds the block back too: its
 * statistics at once, with inactive_split left alone as PyTorch leaves it for
 * expandable blocks, the same block back for the next request of its size,
 * and a growth (which needs the pool as PyTorch has it) merges it first.
 */
TEST(held_in_an_expandable_segment)
{
    setup("expandable_segments:True", 0, false);
    char *a = xmalloc(4 * KiB, NULL);
    char *h = xmalloc(4 * KiB, NULL);
    expect_ok(cca_free(h));
    cca_stream_pool_t *sp = pool_of_lock(ptrmap_solo(cca_state->ptrmap));
    expect_true(sp->small.held && sp->small.held->addr == (uintptr_t)h);
    expect_true(sp->small.held->segment->es != NULL);
    expect_true(sp->small.held->free_tick != 0); /* compact_memory's readiness sees the free */
    char *c = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(c, h);
    expect_ok(cca_free(c));
    expect_true(sp->small.held != NULL);
    void *big = xmalloc(3 * MiB, NULL); /* the large pool: the small one keeps its held block */
    char *d = xmalloc(8 * KiB, NULL); /* another size: h merged first, then best fit's split */
    expect_true(sp->small.held == NULL);
    expect_eq_ptr(d, h);
    cca_device_stats_t s = checked_stats();
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 3);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 5);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, (int64_t)(12 * KiB + 3 * MiB));
    expect_ok(cca_free(d));
    expect_ok(cca_free(big));
    expect_ok(cca_free(a));
    s = checked_stats();
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.active_bytes[CCA_STAT_ALL].current, 0);
}

/*
 * A held block of an expandable segment is given back as it is only where
 * PyTorch's expandable best fit would pick the merged block: here a 3 MiB
 * hole that cannot grow comes after the merged block (whose unmapped tail
 * lets it grow far), so PyTorch's best fit moves on to the hole.
 */
TEST(held_in_an_expandable_segment_yields_to_best_fit)
{
    setup("expandable_segments:True", 0, false);
    char *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = xmalloc(1 * MiB, NULL); /* the small pool's first two granules */
    char *a = xmalloc(4 * KiB, NULL);
    char *h = xmalloc(4 * KiB, NULL);
    for (int i = 0; i < 3; i++)
        expect_ok(cca_free(p[i])); /* a 3 MiB hole, p[3] above it */
    expect_ok(cca_free(h));
    cca_stream_pool_t *sp = pool_of_lock(ptrmap_solo(cca_state->ptrmap));
    expect_true(sp->small.held && sp->small.held->addr == (uintptr_t)h);
    char *x = xmalloc(4 * KiB, NULL);
    expect_eq_ptr(x, p[0]);
    checked_stats();
    expect_ok(cca_free(x));
    expect_ok(cca_free(a));
    expect_ok(cca_free(p[3]));
    cca_device_stats_t s = checked_stats();
    expect_eq_i64(s.allocation[CCA_STAT_ALL].current, 0);
}

/* A block returned by its last event (not by the program's free) may be held too; its
 * statistics are applied at once, and the next request of its size takes it back. */
TEST(held_after_its_event)
{
    setup(NULL, 0, true);
    char *a = xmalloc(4 * KiB, S1);
    char *h = xmalloc(4 * KiB, S1);
    expect_ok(cca_record_stream(h, S2));
    expect_ok(cca_free(h)); /* waits for S2 */
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.active[CCA_STAT_ALL].current, 2);
    expect_ok(cca_sim_complete_stream(sim, 0, S2, false));
    char *again = xmalloc(4 * KiB, S1); /* reclaims h (held), then gets it back */
    expect_eq_ptr(again, h);
    s = stats(0);
    expect_eq_i64(s.active[CCA_STAT_ALL].current, 2);
    expect_eq_i64(s.active[CCA_STAT_ALL].freed, 1);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 3);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 1);
    expect_eq_i64(s.inactive_split_bytes[CCA_STAT_ALL].current, 2 * MiB - 8 * KiB);
    char why[256];
    expect_ok(alloc_check_invariants(why, sizeof(why)));
    expect_ok(cca_free(again)); /* the program's free: held, back again */
    char *third = xmalloc(4 * KiB, S1);
    expect_eq_ptr(third, h);
    expect_ok(cca_free(third));
    expect_ok(cca_free(a));
    s = stats(0);
    expect_eq_i64(s.active[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, 4);
    expect_eq_i64(s.allocation[CCA_STAT_ALL].freed, 4);
    expect_ok(alloc_check_invariants(why, sizeof(why)));
}

TEST(best_fit_ties_by_address)
{
    setup(NULL, 0, false);
    /* holes of 8 KiB at two places, and a 4 KiB hole between */
    char *p[7];
    size_t sizes[7] = {8 * KiB, 4 * KiB, 8 * KiB, 4 * KiB, 8 * KiB, 4 * KiB, 4 * KiB};
    for (int i = 0; i < 7; i++)
        p[i] = xmalloc(sizes[i], NULL);
    expect_ok(cca_free(p[4])); /* 8 KiB hole, higher address */
    expect_ok(cca_free(p[0])); /* 8 KiB hole, lowest address */
    expect_ok(cca_free(p[2])); /* 8 KiB hole, middle */
    /* best fit for 6 KiB: an 8 KiB hole (smallest that fits), lowest address first */
    char *q = xmalloc(6 * KiB, NULL);
    expect_eq_ptr(q, p[0]);
    char *r = xmalloc(6 * KiB, NULL);
    expect_eq_ptr(r, p[2]);
    /* a 2 KiB request takes the 2 KiB remainder left by q (smallest fit) */
    char *t = xmalloc(2 * KiB, NULL);
    expect_eq_ptr(t, p[0] + 6 * KiB);
}

TEST(streams_do_not_share_blocks)
{
    setup(NULL, 0, false);
    void *a = xmalloc(4 * KiB, S1);
    expect_ok(cca_free(a));
    void *b = xmalloc(4 * KiB, S2);
    expect_ne_u64((uintptr_t)a, (uintptr_t)b);
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 2);
    void *c = xmalloc(4 * KiB, S1);
    expect_eq_ptr(c, a);
}

TEST(large_split_rule)
{
    setup(NULL, 0, false);
    /* 3 MiB in a 20 MiB segment: remainder 17 MiB > 1 MiB is split off */
    char *a = xmalloc(3 * MiB, NULL);
    char *b = xmalloc(3 * MiB, NULL);
    expect_eq_ptr(b, a + 3 * MiB);
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 1);
    /* 19.5 MiB request in a fresh 20 MiB segment: remainder 0.5 MiB is not split */
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    char *c = xmalloc(19 * MiB + 512 * KiB, NULL);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 20 * MiB);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 1);
    expect_ok(cca_free(c));
}

TEST(oversize_rules)
{
    setup("max_split_size_mb:40", 0, false);
    /* a 50 MiB block is oversize: never split, counted */
    void *a = xmalloc(50 * MiB, NULL);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.oversize_allocations.current, 1);
    expect_eq_i64(s.oversize_segments.current, 1);
    expect_eq_i64(s.max_split_size, 40 * MiB);
    expect_ok(cca_free(a));
    /* a small-ish large request must not take the oversize cached block */
    void *b = xmalloc(30 * MiB, NULL);
    expect_ne_u64((uintptr_t)b, (uintptr_t)a);
    expect_eq_i64(stats(0).segment[CCA_STAT_ALL].current, 2);
    /* an oversize request may take it if within max_non_split_rounding (20 MiB) */
    void *c = xmalloc(45 * MiB, NULL);
    expect_eq_ptr(c, a);
    expect_ok(cca_free(c));
    /* but not if it would waste 20 MiB or more */
    void *d = xmalloc(41 * MiB, NULL);
    expect_eq_ptr(c, a);
    expect_ok(cca_free(d));
    expect_ok(cca_free(b));
    s = stats(0);
    expect_eq_i64(s.oversize_allocations.current, 0);
    expect_eq_i64(s.oversize_allocations.allocated, 3);
}

TEST(record_stream_events)
{
    setup(NULL, 0, true);
    char *a = xmalloc(4 * KiB, S1);
    expect_ok(cca_record_stream(a, S2));
    expect_ok(cca_record_stream(a, S1)); /* the allocation stream: no-op */
    expect_ok(cca_free(a));
    cca_device_stats_t s = stats(0);
    /* freed by the program, still active until S2's work completes */
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.active_bytes[CCA_STAT_ALL].current, 4 * KiB);
    expect_eq_u64(cca_sim_pending_events(sim), 1);
    char *b = xmalloc(4 * KiB, S1);
    expect_ne_u64((uintptr_t)b, (uintptr_t)a);
    expect_ok(cca_sim_complete_stream(sim, 0, S2, false));
    char *c = xmalloc(4 * KiB, S1); /* the next allocation reclaims it */
    expect_eq_ptr(c, a);
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 2);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_CREATE), 1);
    /* the event is reused from the pool */
    expect_ok(cca_record_stream(c, S2));
    expect_ok(cca_free(c));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_EVENT_CREATE), 1);
    expect_ok(cca_free(b));
}

TEST(events_complete_out_of_order)
{
    setup(NULL, 0, true);
    cca_stream_t s3 = (cca_stream_t)(uintptr_t)0x3000;
    char *a = xmalloc(4 * KiB, S1);
    char *b = xmalloc(4 * KiB, S1);
    expect_ok(cca_record_stream(a, S2));
    expect_ok(cca_record_stream(b, s3));
    expect_ok(cca_record_stream(b, S2));
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_eq_u64(cca_sim_pending_events(sim), 3);
    /* s3 completes first: b still waits for S2 */
    expect_ok(cca_sim_complete_stream(sim, 0, s3, false));
    expect_ok(alloc_process_events());
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 2);
    expect_ok(cca_sim_complete_stream(sim, 0, S2, false));
    expect_ok(alloc_process_events());
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.active[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.inactive_split[CCA_STAT_ALL].current, 0);
}

TEST(empty_cache_returns_everything)
{
    setup(NULL, 0, true);
    void *p[20];
    for (int i = 0; i < 20; i++)
        p[i] = xmalloc((size_t)(i + 1) * 700 * KiB, i % 2 ? S1 : S2);
    expect_ok(cca_record_stream(p[3], NULL));
    for (int i = 0; i < 20; i++)
        expect_ok(cca_free(p[i]));
    expect_ok(cca_empty_cache());
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.num_sync_all_streams, 1);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.device_bytes[0], 0);
    expect_eq_u64(u.live_allocations, 0);
}

TEST(empty_cache_keeps_split_segments)
{
    setup(NULL, 0, false);
    void *a = xmalloc(4 * KiB, NULL);
    void *b = xmalloc(4 * MiB, NULL);
    expect_ok(cca_free(b));
    expect_ok(cca_empty_cache());
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 2 * MiB);
    expect_ok(cca_free(a));
    expect_ok(cca_empty_cache());
    expect_eq_i64(stats(0).reserved_bytes[CCA_STAT_ALL].current, 0);
}

static int callback_calls;
static void *callback_victim;
static bool free_callback(void *arg)
{
    (void)arg;
    callback_calls++;
    if (callback_victim) {
        cca_free(callback_victim);
        callback_victim = NULL;
        return true;
    }
    return false;
}

TEST(free_memory_callbacks_run_first)
{
    setup(NULL, 0, false);
    callback_calls = 0;
    void *a = xmalloc(4 * KiB, NULL);
    callback_victim = a;
    expect_ok(cca_register_free_memory_callback(free_callback, NULL));
    /* the pool has no free 2 MiB-class block: the callback runs before a new segment */
    void *b = xmalloc(3 * MiB, NULL);
    expect_eq_i64(callback_calls, 1);
    expect_true(b != NULL);
    callback_victim = NULL;
}

static int observer_calls;
static size_t observer_size, observer_total;
static void oom_observer(int device, size_t alloc_size, size_t total, size_t device_free, void *arg)
{
    (void)device;
    (void)device_free;
    (void)arg;
    observer_calls++;
    observer_size = alloc_size;
    observer_total = total;
}

TEST(oom_sequence_and_message)
{
    setup(NULL, 64 * MiB, false);
    observer_calls = 0;
    expect_ok(cca_attach_oom_observer(oom_observer, NULL));
    void *a = xmalloc(30 * MiB, NULL);
    void *b = xmalloc(30 * MiB, NULL);
    expect_ok(cca_free(a));
    /* 40 MiB: no block fits; the device has 4 MiB left; releasing a's cached
     * segment makes room: one retry */
    void *c = xmalloc(34 * MiB, NULL);
    expect_true(c != NULL);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_alloc_retries, 1);
    expect_eq_i64(s.num_sync_all_streams, 1);
    expect_eq_i64(s.num_device_free, 1);
    expect_eq_i64(s.num_ooms, 0);
    /* now a real OOM */
    void *d = NULL;
    expect_status(cca_malloc(&d, 40 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    const char *msg = cca_last_error()->message;
    expect_contains(msg, "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which");
    expect_contains(msg, "Of the allocated memory 64.00 MiB is allocated by cca, and 0 bytes is reserved by cca but unallocated.");
    expect_eq_i64(stats(0).num_ooms, 1);
    expect_eq_i64(observer_calls, 1);
    expect_eq_u64(observer_size, 40 * MiB);
    expect_eq_u64(observer_total, 64 * MiB);
    /* the allocator stays usable */
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    d = xmalloc(40 * MiB, NULL);
    expect_true(d != NULL);
    expect_ok(cca_free(d));
}

TEST(memory_fraction_cap)
{
    setup(NULL, 1024 * MiB, false);
    expect_status(cca_set_memory_fraction(1.5, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_set_memory_fraction(0.25, 0)); /* 256 MiB allowed */
    void *a = xmalloc(200 * MiB, NULL);
    void *b = NULL;
    expect_status(cca_malloc(&b, 100 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "256.00 MiB allowed; ");
    /* the backend was never asked beyond the cap */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 1);
    expect_ok(cca_free(a));
    expect_ok(cca_empty_cache());
    b = xmalloc(100 * MiB, NULL);
    expect_true(b != NULL);
    /* device 1 is not capped */
    void *c = NULL;
    expect_ok(cca_malloc_device(&c, 900 * MiB, 1, NULL));
}

/* per_process_memory_fraction set back to 0 at run time lifts the limit (0: none). */
TEST(run_time_fraction_zero_lifts_the_cap)
{
    setup(NULL, 1024 * MiB, false);
    expect_ok(cca_set_settings("per_process_memory_fraction:0.25"));
    void *a = NULL;
    expect_status(cca_malloc(&a, 600 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_set_settings("per_process_memory_fraction:0"));
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_ok(cca_malloc(&a, 600 * MiB, NULL));
    expect_ok(cca_free(a));
}

TEST(oversize_release_before_full_release)
{
    setup("max_split_size_mb:20", 100 * MiB, false);
    void *a = xmalloc(30 * MiB, NULL);
    void *b = xmalloc(30 * MiB, NULL);
    void *small = xmalloc(4 * KiB, NULL);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    /* 50 MiB: cached oversize blocks don't fit; 38 MiB free on the device;
     * release_available_cached_blocks frees both 30 MiB blocks; no full release */
    void *c = xmalloc(50 * MiB, NULL);
    expect_true(c != NULL);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_alloc_retries, 0);
    expect_eq_i64(s.num_sync_all_streams, 0);
    expect_eq_i64(s.num_device_free, 2);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_SMALL_POOL].current, 2 * MiB);
    expect_ok(cca_free(small));
    expect_ok(cca_free(c));
}

TEST(garbage_collection_by_age)
{
    setup("garbage_collection_threshold:0.5", 1024 * MiB, false);
    expect_ok(cca_set_memory_fraction(0.5, 0)); /* 512 MiB allowed, gc above 256 MiB */
    void *old1 = xmalloc(100 * MiB, NULL);
    void *old2 = xmalloc(120 * MiB, NULL);
    expect_ok(cca_free(old1));
    expect_ok(cca_free(old2));
    /* age the cached blocks with lookups that miss */
    void *x = xmalloc(130 * MiB, NULL); /* reserved now 350 MiB > 256 MiB */
    expect_ok(cca_free(x));
    void *young = xmalloc(90 * MiB, NULL); /* reuses old1 (100 MiB fits best) */
    (void)young;
    /* the next segment allocation triggers gc: reserved 350 > 256 -> reclaim
     * the oldest unsplit blocks until >= 94 MiB are freed */
    /* ages: old2 3 lookups, x 2 (old1 is split: not collectable); the mean is
     * 2.5, so old2 (120 MiB >= the 94 MiB needed) goes and x stays */
    void *y = xmalloc(200 * MiB, NULL);
    expect_true(y != NULL);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_device_free, 1);
    expect_eq_i64(s.num_alloc_retries, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 430 * (int64_t)MiB);
    size_t cached = 0, largest = 0;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_eq_u64(cached, 140 * MiB);
    expect_eq_u64(largest, 130 * MiB);
}

TEST(misuse)
{
    setup(NULL, 0, false);
    int local;
    expect_status(cca_free(&local), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "was not allocated by cca");
    char *a = xmalloc(4096, NULL);
    expect_status(cca_free(a + 16), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "inside the block");
    expect_status(cca_record_stream(&local, S1), CCA_ERR_INVALID_POINTER);
    cca_device_stats_t before = stats(0);
    expect_ok(cca_free(a));
    expect_status(cca_free(a), CCA_ERR_INVALID_POINTER);
    cca_device_stats_t after = stats(0);
    expect_eq_i64(after.allocation[CCA_STAT_ALL].current, before.allocation[CCA_STAT_ALL].current - 1);
    expect_ok(cca_free(NULL));
    expect_status(cca_cache_info(7, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_get_device_stats(-1, &after), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_empty_cache());
    expect_status(cca_free(a), CCA_ERR_INVALID_POINTER); /* after empty_cache */
}

TEST(base_allocation)
{
    setup(NULL, 0, false);
    char *a = xmalloc(4096, NULL);
    char *b = xmalloc(8192, NULL);
    void *base = NULL;
    size_t size = 0;
    expect_ok(cca_get_base_allocation(b, &base, &size));
    expect_eq_ptr(base, a);
    expect_eq_u64(size, 2 * MiB);
    expect_ok(cca_get_base_allocation(b + 100, &base, &size));
    expect_eq_ptr(base, a);
}

TEST(reset_stats)
{
    setup(NULL, 0, false);
    void *a = xmalloc(MiB, NULL);
    expect_ok(cca_free(a));
    expect_ok(cca_reset_peak_stats(0));
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].peak, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].peak, 2 * MiB);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].allocated, MiB);
    expect_ok(cca_reset_accumulated_stats(0));
    s = stats(0);
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].allocated, 0);
    expect_eq_i64(s.num_device_alloc, 0);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 2 * MiB);
}

TEST(memory_stats_keys)
{
    setup(NULL, 0, false);
    cca_stat_entry_t e[CCA_MEMORY_STATS_COUNT];
    void *a = xmalloc(3 * MiB, NULL);
    expect_ok(cca_memory_stats(0, e, CCA_MEMORY_STATS_COUNT));
    for (int i = 1; i < CCA_MEMORY_STATS_COUNT; i++)
        expect_true(strcmp(e[i - 1].key, e[i].key) < 0);
    expect_eq_str(e[0].key, "active.all.allocated");
    int found = 0;
    for (int i = 0; i < CCA_MEMORY_STATS_COUNT; i++) {
        if (!strcmp(e[i].key, "reserved_bytes.large_pool.current")) {
            expect_eq_i64(e[i].value, 20 * MiB);
            found++;
        }
        if (!strcmp(e[i].key, "max_split_size")) {
            expect_eq_i64(e[i].value, -1);
            found++;
        }
    }
    expect_eq_i64(found, 2);
    expect_ok(cca_free(a));
}

TEST(summary_text)
{
    setup(NULL, 0, false);
    void *a = xmalloc(3 * MiB, NULL);
    char *text = NULL;
    expect_ok(cca_memory_summary(0, false, &text));
    expect_contains(text, "|                  cca CUDA memory summary, device ID 0                     |\n");
    expect_contains(text, "| Allocated memory      |   3072 KiB |   3072 KiB |   3072 KiB |      0 B   |\n");
    expect_contains(text, "| GPU reserved memory   |  20480 KiB |  20480 KiB |  20480 KiB |      0 B   |\n");
    expect_contains(text, "| Allocations           |       1    |       1    |       1    |       0    |\n");
    free(text);
    expect_ok(cca_memory_summary(0, true, &text));
    expect_true(strstr(text, "from large pool") == NULL);
    free(text);
    expect_ok(cca_free(a));
}

TEST(uncached_mode)
{
    setenv("CCA_NO_CACHING", "1", 1);
    setup(NULL, 0, false);
    unsetenv("CCA_NO_CACHING");
    void *a = xmalloc(1000, NULL);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 1);
    expect_ok(cca_free(a));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_FREE), 1);
    void *b = xmalloc(1000, NULL);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 2);
    expect_status(cca_free((char *)b + 1), CCA_ERR_INVALID_POINTER);
    expect_ok(cca_free(b));
    expect_status(cca_free(b), CCA_ERR_INVALID_POINTER);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_device_alloc, 2);
    expect_eq_i64(s.num_device_free, 2);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
}

/* The uncached mode never reaches the express paths: after a caching session's pairs
 * (the thread's pool cache filled, its pool holding a block back), a new state in the
 * uncached mode sends every pair of the same size to the backend. */
TEST(uncached_pairs_after_caching_ones)
{
    setup(NULL, 0, false);
    for (int i = 0; i < 20; i++)
        expect_ok(cca_free(xmalloc(1000, NULL)));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 1);
    setenv("CCA_NO_CACHING", "1", 1);
    setup(NULL, 0, false);
    unsetenv("CCA_NO_CACHING");
    for (int i = 0; i < 50; i++) {
        void *p = xmalloc(1000, NULL);
        expect_true(p != NULL);
        expect_ok(cca_free(p));
    }
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_MALLOC), 50);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_FREE), 50);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_device_alloc, 50);
    expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
}

TEST(backend_fault_is_clean)
{
    setup(NULL, 0, false);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_MALLOC, 1, false, CCA_ERR_BACKEND));
    void *a = NULL;
    expect_status(cca_malloc(&a, 4096, NULL), CCA_ERR_BACKEND);
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(s.num_ooms, 0);
    a = xmalloc(4096, NULL);
    expect_true(a != NULL);
}

TEST(run_time_settings)
{
    setup(NULL, 0, false);
    expect_ok(cca_set_settings("max_split_size_mb:100"));
    expect_eq_i64(stats(0).max_split_size, 100 * MiB);
    expect_status(cca_set_settings("max_split_size_mb:1"), CCA_ERR_BAD_SETTINGS);
    expect_eq_i64(stats(0).max_split_size, 100 * MiB);
    expect_status(cca_set_settings("backend:cudaMallocAsync"), CCA_ERR_NOT_SUPPORTED);
}

/* Settings the pinned allocator cannot take (its event thread does not start) change
 * nothing, on the device side either. */
TEST(run_time_settings_refused_by_the_host_side_change_nothing)
{
    setup(NULL, 1024 * MiB, false);
    host_test_fail_background_start(true);
    expect_status(cca_set_settings("max_split_size_mb:100,per_process_memory_fraction:0.25,"
                                   "pinned_use_background_threads:True"),
                  CCA_ERR_BACKEND);
    host_test_fail_background_start(false);
    expect_eq_i64(stats(0).max_split_size, -1); /* none */
    double f = -1;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 1.0);
    expect_false(cca_state->settings.pinned_use_background_threads);
    void *a = xmalloc(600 * MiB, NULL);
    expect_ok(cca_free(a));
    expect_ok(cca_set_settings("max_split_size_mb:100,pinned_use_background_threads:True"));
    expect_eq_i64(stats(0).max_split_size, 100 * MiB);
    expect_true(cca_state->settings.pinned_use_background_threads);
}

#define SETTING_ROUNDS 2000

static atomic_int settings_lost; /* changes of one thread undone by the other's */

/* (max_non_split_rounding_mb: a key the other thread's strings do not reset, as
 * max_split_size_mb would be, PyTorch's parseArgs) */
static void *set_split_sizes(void *arg)
{
    (void)arg;
    for (int i = 0; i < SETTING_ROUNDS; i++) {
        char text[64];
        int mb = 100 + i % 2;
        snprintf(text, sizeof(text), "max_non_split_rounding_mb:%d", mb);
        if (cca_set_settings(text) != CCA_OK ||
            cca_state->settings.max_non_split_rounding != (size_t)mb * MiB)
            atomic_fetch_add(&settings_lost, 1);
    }
    return NULL;
}

static void *set_fractions(void *arg)
{
    (void)arg;
    for (int i = 0; i < SETTING_ROUNDS; i++) {
        double want = i % 2 ? 0.5 : 0.75, f = 0;
        if (cca_set_settings(i % 2 ? "per_process_memory_fraction:0.5"
                                   : "per_process_memory_fraction:0.75") != CCA_OK ||
            cca_get_memory_fraction(0, &f) != CCA_OK || f != want)
            atomic_fetch_add(&settings_lost, 1);
    }
    return NULL;
}

/* Two threads changing different keys at once: each keeps its own change. Before, each call
 * read the settings, then stored them whole, so one thread's call undid the other's change
 * made in between. */
TEST(run_time_settings_from_two_threads)
{
    setup(NULL, 1024 * MiB, false);
    atomic_store(&settings_lost, 0);
    pthread_t a, b;
    pthread_create(&a, NULL, set_split_sizes, NULL);
    pthread_create(&b, NULL, set_fractions, NULL);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    expect_eq_i64(atomic_load(&settings_lost), 0);
    expect_eq_u64(cca_state->settings.max_non_split_rounding, 101 * MiB);
    double f = 0;
    expect_ok(cca_get_memory_fraction(0, &f));
    expect_true(f == 0.5);
}

static void expect_valid(void)
{
    (void)checked_stats();
}

/*
 * The OOM retry's synchronisation of pending events gives back a block of the
 * requesting pool itself, held back from merging (the pool's last allocation,
 * its upper neighbour free): the release must merge it (PyTorch's free_block),
 * so its whole 20 MiB segment goes back and the retry succeeds. Before, the
 * release skipped the merge for the pool whose lock the caller held, released
 * nothing, and the allocation ran out of memory.
 */
TEST(oom_retry_releases_a_block_of_the_requesting_pool)
{
    setup(NULL, 64 * MiB, true);
    char *a = xmalloc(4 * MiB, S1); /* a 20 MiB segment: a, then 16 MiB free */
    expect_ok(cca_record_stream(a, S2));
    expect_ok(cca_free(a)); /* waits for S2's event */
    void *b = NULL;
    expect_ok(cca_malloc(&b, 50 * MiB, S1)); /* 20 + 50 > 64: the retry frees the segment */
    cca_device_stats_t s = stats(0);
    expect_eq_i64(s.num_alloc_retries, 1);
    expect_eq_i64(s.num_ooms, 0);
    expect_eq_i64(s.num_device_free, 1);
    expect_ok(cca_free(b));
    expect_valid();
}

/*
 * Each stream's events are processed on their own (PyTorch keeps a list per
 * stream): with 17 other streams waiting, an 18th's completed event still
 * gives its block back. Before, past 16 waiting streams every later event
 * counted as not done without being asked, and the next allocation took a
 * new segment.
 */
TEST(events_of_many_waiting_streams)
{
    setup(NULL, 0, true);
    void *p[17];
    for (int i = 0; i < 17; i++) {
        p[i] = xmalloc(4 * KiB, S1);
        expect_ok(cca_record_stream(p[i], (cca_stream_t)(uintptr_t)(0x10000 + 0x100 * i)));
    }
    for (int i = 0; i < 17; i++)
        expect_ok(cca_free(p[i])); /* 17 events pending on 17 other streams */
    cca_stream_t s18 = (cca_stream_t)(uintptr_t)0x90000;
    char *x = xmalloc(30 * MiB, S1);
    expect_ok(cca_record_stream(x, s18));
    expect_ok(cca_free(x));
    expect_ok(cca_sim_complete_stream(sim, 0, s18, false)); /* x's only event is done */
    char *y = xmalloc(30 * MiB, S1); /* the events processed: y reuses x's block */
    expect_eq_ptr(y, x);
    expect_eq_i64(stats(0).segment[CCA_STAT_LARGE_POOL].current, 1);
    expect_ok(cca_free(y));
    expect_valid();
}

/*
 * A free whose stream event cannot be recorded, and whose stream cannot be
 * synchronised instead either, reports the failure and keeps the block back:
 * it waits on an entry with no event until its stream's synchronisation
 * succeeds. Before, it went back to the pool at once and the next allocation
 * got it while S2's work might still use it.
 */
TEST(free_keeps_block_back_when_record_and_sync_fail)
{
    setup(NULL, 0, true);
    char *a = xmalloc(4 * KiB, S1);
    expect_ok(cca_record_stream(a, S2));
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_EVENT_RECORD, 1, false, CCA_ERR_BACKEND));
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_STREAM_SYNCHRONIZE, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_free(a), CCA_ERR_BACKEND);
    cca_sim_clear_faults(sim);
    cca_device_t *dev = &cca_state->devices[0];
    expect_eq_u64(atomic_load(&dev->pending_event_count), 1); /* kept back, no event */
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 1);
    expect_valid();
    uint64_t syncs = cca_sim_call_count(sim, CCA_OP_STREAM_SYNCHRONIZE);
    char *b = xmalloc(4 * KiB, S1); /* S2 synchronised first, then a is free again */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_STREAM_SYNCHRONIZE), syncs + 1);
    expect_eq_ptr(b, a);
    expect_eq_u64(atomic_load(&dev->pending_event_count), 0);
    expect_ok(cca_free(b));
    expect_valid();
}

/* A block's recorded streams take host memory from its first record_stream on, and
 * again as they outgrow it: refused for want of it, the call records nothing, and the
 * block is freed as if it had never been called (no event); the streams recorded before a
 * refused growth keep their events. */
TEST(record_stream_out_of_host_memory)
{
    setup(NULL, 0, true);
    cca_stream_t s3 = (cca_stream_t)(uintptr_t)0x3000;
    char *a = xmalloc(4 * KiB, S1);
    pool_test_fail_host_alloc(1);
    expect_status(cca_record_stream(a, S2), CCA_ERR_OUT_OF_MEMORY);
    pool_test_fail_host_alloc(0);
    expect_eq_u64(((cca_block_t *)ptrmap_find(cca_state->ptrmap, (uintptr_t)a, false))->stream_use_count, 0);
    expect_ok(cca_free(a)); /* no stream to wait for: free at once */
    expect_eq_u64(cca_sim_pending_events(sim), 0);
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 0);
    expect_valid();
    char *b = xmalloc(4 * KiB, S1);
    expect_ok(cca_record_stream(b, S2));
    expect_ok(cca_record_stream(b, s3)); /* two fit the first array */
    cca_stream_t s4 = (cca_stream_t)(uintptr_t)0x4000;
    pool_test_fail_host_alloc(1);
    expect_status(cca_record_stream(b, s4), CCA_ERR_OUT_OF_MEMORY);
    pool_test_fail_host_alloc(0);
    expect_ok(cca_free(b));
    expect_eq_u64(cca_sim_pending_events(sim), 2); /* S2's and s3's, not s4's */
    expect_ok(cca_sim_complete_stream(sim, 0, S2, false));
    expect_ok(cca_sim_complete_stream(sim, 0, s3, false));
    expect_ok(alloc_process_events());
    expect_eq_i64(stats(0).active[CCA_STAT_ALL].current, 0);
    expect_valid();
}

int main(void)
{
    RUN(rounding_default);
    RUN(rounding_power2_divisions);
    RUN(segment_sizes);
    RUN(size_zero_and_huge);
    RUN(small_and_large_pools);
    RUN(split_reuse_and_merge);
    RUN(held_free_is_the_merge);
    RUN(held_statistics_equal_merged);
    RUN(solo_pair_free_equals_the_map_path);
    RUN(held_repeats_counted_later);
    RUN(express_pair_equals_the_locked_path);
    RUN(express_pair_keeps_the_history);
    RUN(express_pair_from_another_thread);
    RUN(held_free_peak_in_between);
    RUN(held_fit_sees_a_new_hole);
    RUN(held_block_in_the_map);
    RUN(held_in_an_expandable_segment);
    RUN(held_in_an_expandable_segment_yields_to_best_fit);
    RUN(held_after_its_event);
    RUN(best_fit_ties_by_address);
    RUN(streams_do_not_share_blocks);
    RUN(large_split_rule);
    RUN(oversize_rules);
    RUN(record_stream_events);
    RUN(record_stream_out_of_host_memory);
    RUN(events_complete_out_of_order);
    RUN(empty_cache_returns_everything);
    RUN(empty_cache_keeps_split_segments);
    RUN(free_memory_callbacks_run_first);
    RUN(oom_sequence_and_message);
    RUN(memory_fraction_cap);
    RUN(run_time_fraction_zero_lifts_the_cap);
    RUN(oversize_release_before_full_release);
    RUN(garbage_collection_by_age);
    RUN(misuse);
    RUN(base_allocation);
    RUN(reset_stats);
    RUN(memory_stats_keys);
    RUN(summary_text);
    RUN(uncached_mode);
    RUN(uncached_pairs_after_caching_ones);
    RUN(backend_fault_is_clean);
    RUN(run_time_settings);
    RUN(run_time_settings_refused_by_the_host_side_change_nothing);
    RUN(run_time_settings_from_two_threads);
    cca_shutdown();
    RUN(oom_retry_releases_a_block_of_the_requesting_pool);
    RUN(events_of_many_waiting_streams);
    RUN(free_keeps_block_back_when_record_and_sync_fail);
    return harness_done();
}
