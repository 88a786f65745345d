/*
 * test_compact.c - compact_memory:True on the simulated backend: the
 * setting and its rule with expandable_segments, device-granularity granules
 * for both pools, free granules in the middle of a segment lent to the
 * growth of another stream's and of the other kind's segment (reserved
 * memory does not grow), a steady loop whose peak stays after its first
 * steps, the same sequences without the mode as the control,
 * the fragmentation figures of cca_cache_info and the out-of-memory message,
 * and the planned placement of a loop that keeps moving granules (plan.c).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "plan.h"
#include "plan_loop.h"
#include "runtime.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

static cca_backend_t *sim;

static void setup_events(const char *settings, size_t memory, bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = memory ? memory : 8ull << 30;
    cfg.manual_events = manual_events;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK) {
        printf("cannot create sim backend: %s\n", cca_last_error()->message);
        exit(1);
    }
    if (cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot init: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static void setup_with(const char *settings, size_t memory)
{
    setup_events(settings, memory, false);
}

static cca_device_stats_t stats(void)
{
    cca_device_stats_t s;
    cca_get_device_stats(0, &s);
    return s;
}

static int64_t reserved(void)
{
    return stats().reserved_bytes[CCA_STAT_ALL].current;
}

/* The end of a test whose blocks are all freed: empty_cache gives back every byte, then shutdown. */
static void ends_empty(void)
{
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    cca_shutdown();
}

static void *xmalloc(size_t size, cca_stream_t stream)
{
    void *p = NULL;
    cca_status_t st = cca_malloc(&p, size, stream);
    if (st != CCA_OK)
        printf("  cca_malloc(%zu) failed: %s\n", size, cca_last_error()->message);
    return p;
}

static int64_t extra_stat(const char *key);
static uint64_t calls(cca_backend_op_t op);

static bool invariants_hold(void)
{
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK) {
        printf("  invariants: %s\n", why);
        return false;
    }
    cca_sim_usage_t u;
    memset(&u, 0, sizeof(u));
    cca_sim_usage(sim, &u);
    if ((int64_t)u.device_bytes[0] != reserved()) {
        printf("  backend holds %zu bytes, reserved_bytes says %lld\n", u.device_bytes[0],
               (long long)reserved());
        return false;
    }
    return true;
}

TEST(compact_setting_implies_expandable)
{
    setup_with("compact_memory:True", 0);
    expect_true(cca_state->settings->compact_memory);
    expect_true(cca_state->settings->expandable_segments);
    /* turning expandable segments off while the mode is on is refused, unchanged settings */
    expect_status(cca_set_settings("expandable_segments:False"), CCA_ERR_BAD_SETTINGS);
    expect_contains(cca_last_error()->message, "compact_memory");
    expect_true(cca_state->settings->expandable_segments);
    expect_ok(cca_set_settings("compact_memory:False,expandable_segments:False"));
    expect_true(!cca_state->settings->expandable_segments);
    expect_status(cca_set_settings("compact_memory:yes"), CCA_ERR_BAD_SETTINGS);
    cca_shutdown();
    setup_with("", 0);
    expect_true(!cca_state->settings->compact_memory);
    expect_true(!cca_state->settings->expandable_segments);
    cca_shutdown();
}

TEST(compact_granules_are_the_device_granularity)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(3 * MiB + 512 * 1024, NULL); /* PyTorch's expandable mode maps 20 MiB */
    expect_true(a != NULL);
    expect_eq_i64(reserved(), (int64_t)(4 * MiB));
    void *b = xmalloc(1 * MiB, NULL); /* small pool: the large piece left is only 512 KiB */
    expect_eq_i64(reserved(), (int64_t)(6 * MiB));
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_SMALL_POOL].current, (int64_t)(2 * MiB));
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(b);
    cca_shutdown();
}

/*
 * The rest of a granule is taken under get_free_block's oversize rule: a
 * piece of at least max_split_size (possible where the device's granule is
 * larger than 2 MiB) is kept whole for a request of that size, as best fit
 * keeps it, and the small pool maps its own. Before, the small request
 * split the 54 MiB piece.
 */
TEST(compact_small_requests_leave_oversize_rests_whole)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cfg.total_memory = 8ull << 30;
    cfg.granularity = 64 * MiB;
    cca_shutdown();
    expect_ok(cca_sim_create(&cfg, &sim));
    expect_ok(cca_init_with_backend(sim, "compact_memory:True,max_split_size_mb:40"));
    void *a = xmalloc(10 * MiB, NULL); /* one 64 MiB granule: [10, 64 MiB) free, no whole granule */
    void *b = xmalloc(1000, NULL);
    expect_true(b != NULL);
    expect_true((uintptr_t)b < (uintptr_t)a || (uintptr_t)b >= (uintptr_t)a + 64 * MiB);
    expect_eq_i64(stats().allocation[CCA_STAT_SMALL_POOL].current, 1);
    void *c = xmalloc(50 * MiB, NULL); /* an oversize request takes the piece whole */
    expect_eq_u64((uintptr_t)c - (uintptr_t)a, 10 * MiB);
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(b);
    cca_free(c);
    ends_empty();
}

/*
 * A small request the small pool cannot serve without mapping takes a free
 * piece of its stream's large pool that holds no whole granule (the rest of
 * a granule a live large block keeps mapped): nothing is mapped, the block
 * counts in the large pool's statistics, and its free gives the piece back
 * whole. A piece with a whole granule in it is left to growth; other streams'
 * pieces are not taken; without the mode the small pool maps as PyTorch's.
 */
TEST(compact_small_requests_take_the_rest_of_a_large_granule)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(3 * MiB, NULL); /* a 4 MiB run: 1 MiB of its last granule free */
    cca_device_stats_t before = stats();
    void *b = xmalloc(1000, NULL);
    expect_true(b != NULL);
    expect_eq_i64(reserved(), (int64_t)(4 * MiB));
    expect_true((uintptr_t)b >= (uintptr_t)a + 3 * MiB && (uintptr_t)b < (uintptr_t)a + 4 * MiB);
    cca_device_stats_t after = stats();
    expect_eq_i64(after.allocation[CCA_STAT_LARGE_POOL].current -
                      before.allocation[CCA_STAT_LARGE_POOL].current, 1);
    expect_eq_i64(after.allocation[CCA_STAT_SMALL_POOL].current, 0);
    expect_eq_i64(after.requested_bytes[CCA_STAT_ALL].current, (int64_t)(3 * MiB + 1000));
    void *c = xmalloc(1000, S1); /* another stream: its own small pool maps */
    expect_eq_i64(reserved(), (int64_t)(6 * MiB));
    expect_true(invariants_hold());
    cca_free(b);
    size_t cached = 0, largest = 0;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_eq_u64(largest, 2 * MiB - 1024); /* c's granule, less c */
    expect_eq_u64(cached, 1 * MiB + 2 * MiB - 1024); /* and a's piece, whole again */
    cca_free(a);
    cca_free(c);
    expect_true(invariants_hold());
    cca_shutdown();
    /* a free piece holding a whole granule is growth's to move, never taken */
    setup_with("compact_memory:True", 0);
    void *d = xmalloc(3 * MiB, NULL), *e = xmalloc(5 * MiB, NULL); /* 8 MiB, no free tail */
    cca_free(d); /* [0, 3 MiB) free: granule 0 whole */
    void *g = xmalloc(1000, NULL);
    expect_true((uintptr_t)g < (uintptr_t)d || (uintptr_t)g >= (uintptr_t)d + 3 * MiB);
    expect_eq_i64(stats().allocation[CCA_STAT_SMALL_POOL].current, 1);
    expect_eq_i64(reserved(), (int64_t)(8 * MiB)); /* granule 0 moved to the small pool */
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_true(invariants_hold());
    cca_free(e);
    cca_free(g);
    cca_shutdown();
    /* without the mode (expandable segments alone), the small pool maps its own */
    setup_with("expandable_segments:True", 0);
    a = xmalloc(3 * MiB, NULL);
    b = xmalloc(1000, NULL);
    expect_eq_i64(stats().allocation[CCA_STAT_SMALL_POOL].current, 1);
    expect_eq_i64(stats().reserved_bytes[CCA_STAT_SMALL_POOL].current, (int64_t)(2 * MiB));
    cca_free(a);
    cca_free(b);
    cca_shutdown();
}

/*
 * A hole in the middle of the default stream's large segment, then growth of
 * S1's large pool and of the default stream's small pool: with the mode the
 * hole's granules move there and reserved memory stays; without it, it grows.
 */
static int64_t hole_then_growth(const char *settings, const char *later, uint64_t *unmaps)
{
    setup_with(settings, 0);
    void *a = xmalloc(10 * MiB, NULL);
    void *b = xmalloc(10 * MiB, NULL);
    void *c = xmalloc(10 * MiB, NULL);
    cca_free(b); /* five free granules between a and c */
    if (later)
        expect_ok(cca_set_settings(later));
    int64_t before = reserved();
    uint64_t frees_before = (uint64_t)stats().num_device_free;
    void *d = xmalloc(6 * MiB, S1);  /* another stream */
    void *e = xmalloc(1000, NULL);   /* the other kind */
    void *f = xmalloc(1000, S2);     /* another stream's other kind */
    expect_true(d && e && f);
    expect_true(invariants_hold());
    *unmaps = (uint64_t)stats().num_device_free - frees_before;
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    expect_eq_str(extra[3].key, "cca.compact_moves");
    if (cca_state->settings->compact_memory) {
        expect_true(extra[3].value >= 1);
        expect_eq_i64(extra[2].value, (int64_t)(10 * MiB)); /* the hole's five granules */
    } else {
        expect_eq_i64(extra[3].value, 0);
    }
    int64_t grown = reserved() - before;
    cca_free(a);
    cca_free(c);
    cca_free(d);
    cca_free(e);
    cca_free(f);
    expect_true(invariants_hold());
    cca_shutdown();
    return grown;
}

TEST(compact_lends_a_hole_to_other_streams_and_kinds)
{
    uint64_t unmaps = 0;
    int64_t grown = hole_then_growth("compact_memory:True", NULL, &unmaps);
    expect_eq_i64(grown, 0);       /* 6 MiB + two 2 MiB small granules = the five granules of the hole */
    expect_true(unmaps >= 1);       /* the hole was unmapped to move */
    /* the control: new memory for each growth (a 12 MiB large granule, the
       smallest even segment size above 10, and two small ones) */
    grown = hole_then_growth("expandable_segments:True,large_segment_size_mb:12", NULL, &unmaps);
    expect_eq_i64(grown, (int64_t)(16 * MiB));
    expect_eq_u64(unmaps, 0);
    /* turned off at run time: nothing moves any more (expandable segments stay on) */
    grown = hole_then_growth("compact_memory:True", "compact_memory:False", &unmaps);
    expect_eq_i64(grown, (int64_t)(24 * MiB)); /* a 20 MiB large granule for S1, two small ones */
    expect_eq_u64(unmaps, 0);
}

TEST(compact_keeps_the_growing_run)
{
    /* the free block at the end of the segment is where the growth goes: not lent to itself */
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(10 * MiB, NULL);
    void *b = xmalloc(4 * MiB, NULL);
    cca_free(b); /* free tail: 4 MiB mapped */
    void *c = xmalloc(9 * MiB, NULL); /* grows from the free tail */
    expect_true(c != NULL);
    expect_eq_u64((uintptr_t)c, (uintptr_t)a + 10 * MiB);
    expect_eq_i64(reserved(), (int64_t)(20 * MiB));
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(c);
    cca_shutdown();
}

/* A training-like step on one stream: activations of varying sizes, freed in another order. */
static void step(void)
{
    static const size_t sizes[] = {12 * MiB, 3 * MiB, 700 * 1024, 25 * MiB, 5 * MiB, 40000, 9 * MiB};
    void *p[7];
    for (int i = 0; i < 7; i++)
        p[i] = xmalloc(sizes[i], NULL);
    cca_free(p[1]);
    cca_free(p[4]);
    void *q = xmalloc(7 * MiB, NULL);
    for (int i = 6; i >= 0; i--)
        if (i != 1 && i != 4)
            cca_free(p[i]);
    cca_free(q);
}

/*
 * A steady loop: after its first steps (each granule moved raises the limit
 * below which growth takes new memory, so the moves a step needs again stop)
 * its peak reserved stays and a step maps and unmaps nothing.
 */
TEST(compact_steady_loop_stays_bounded)
{
    setup_with("compact_memory:True", 0);
    for (int i = 0; i < 12; i++)
        step();
    cca_device_stats_t s0 = stats();
    expect_true(extra_stat("cca.compact_moves") > 0);
    for (int i = 0; i < 20; i++)
        step();
    cca_device_stats_t s1 = stats();
    expect_eq_i64(s1.num_device_alloc - s0.num_device_alloc, 0);
    expect_eq_i64(s1.num_device_free - s0.num_device_free, 0);
    expect_eq_i64(s1.reserved_bytes[CCA_STAT_ALL].peak, s0.reserved_bytes[CCA_STAT_ALL].peak);
    /* the control: plain expandable segments reserve more for the same loop */
    int64_t compact_peak = s1.reserved_bytes[CCA_STAT_ALL].peak;
    expect_true(invariants_hold());
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    setup_with("expandable_segments:True", 0);
    for (int i = 0; i < 25; i++)
        step();
    expect_true(stats().reserved_bytes[CCA_STAT_ALL].peak > compact_peak);
    cca_shutdown();
}

/* Maps of steps [from, to) of a plan_loop of seed 4 (48 requests, a quiet phase), with plans
 * made or not; *ratio: peak reserved / peak requested at the end. */
static int64_t loop_maps(bool plans, int from, int to, double *ratio)
{
    setup_with("compact_memory:True", 16ull << 30);
    plan_test_off(!plans);
    plan_loop_t l;
    plan_loop_init(&l, 4, 48, 1, NULL);
    int64_t maps = 0;
    for (int step = 0; step < to; step++) {
        int64_t before = stats().num_device_alloc;
        expect_ok(plan_loop_step(&l));
        if (step >= from)
            maps += stats().num_device_alloc - before;
    }
    cca_device_stats_t s = stats();
    *ratio = (double)s.reserved_bytes[CCA_STAT_ALL].peak / (double)s.requested_bytes[CCA_STAT_ALL].peak;
    expect_true(invariants_hold());
    plan_loop_end(&l);
    plan_test_off(false);
    return maps;
}

TEST(compact_plan_settles_a_loop_that_keeps_moving)
{
    /* the control: best fit at the limit's cap moves granules at every step */
    double control = 0, planned = 0;
    int64_t moving = loop_maps(false, 15, 30, &control);
    expect_true(moving >= 15);
    expect_eq_i64(extra_stat("cca.compact_plans"), 0);
    cca_shutdown();
    /* planned: one plan, every later step served at its places, nothing mapped */
    int64_t settled = loop_maps(true, 15, 30, &planned);
    expect_eq_i64(settled, 0);
    expect_eq_i64(extra_stat("cca.compact_plans"), 1);
    expect_true(extra_stat("cca.compact_planned_allocations") >= 15 * 48);
    expect_eq_i64(extra_stat("cca.compact_plan_misses"), 0);
    expect_true(planned <= control + 0.001); /* and no more memory than moving took */
    expect_true(planned <= 1.0201);
    ends_empty();
}

TEST(compact_plan_drops_when_the_loop_changes)
{
    double ratio;
    loop_maps(true, 0, 12, &ratio);
    expect_eq_i64(extra_stat("cca.compact_plans"), 1);
    int64_t placed = extra_stat("cca.compact_planned_allocations");
    expect_true(placed > 0);
    /* another loop on the same stream: its sizes miss their phases, the plan goes after a
     * period and nothing is placed at the old places from then on */
    plan_loop_t other;
    plan_loop_init(&other, 9, 48, 1, NULL);
    for (int step = 0; step < 3; step++)
        expect_ok(plan_loop_step(&other));
    int64_t missed = extra_stat("cca.compact_plan_misses");
    expect_true(missed > 48 / 8);
    int64_t after_drop = extra_stat("cca.compact_planned_allocations");
    expect_true(after_drop - placed <= 48);
    expect_ok(plan_loop_step(&other));
    expect_eq_i64(extra_stat("cca.compact_planned_allocations"), after_drop);
    expect_eq_i64(extra_stat("cca.compact_plan_misses"), missed);
    expect_true(invariants_hold());
    plan_loop_end(&other);
    ends_empty();
}

TEST(compact_plan_forgotten_at_empty_cache)
{
    double ratio;
    loop_maps(true, 0, 12, &ratio);
    expect_eq_i64(extra_stat("cca.compact_plans"), 1);
    plan_loop_t l;
    plan_loop_init(&l, 4, 48, 1, NULL);
    expect_ok(cca_empty_cache()); /* a new phase: the plan and its record go */
    int64_t placed = extra_stat("cca.compact_planned_allocations");
    for (int step = 0; step < 2; step++)
        expect_ok(plan_loop_step(&l));
    expect_eq_i64(extra_stat("cca.compact_planned_allocations"), placed);
    expect_true(invariants_hold());
    plan_loop_end(&l);
    ends_empty();
}

TEST(compact_plan_only_for_the_default_pools_large_requests)
{
    /* the same loop scaled under 1 MiB (small requests) never gets a plan */
    setup_with("compact_memory:True", 16ull << 30);
    plan_loop_t l;
    plan_loop_init(&l, 4, 48, 1024, NULL);
    for (int step = 0; step < 20; step++)
        expect_ok(plan_loop_step(&l));
    expect_eq_i64(extra_stat("cca.compact_plans"), 0);
    plan_loop_end(&l);
    ends_empty();
}

/* One live block at a time on the default stream, its size going round 2 to 17 MiB, plans
 * forced, until one is made (a sixth round at most); returns the last block, still live. */
static void *planned_sizes_loop(void)
{
    enum { N = 16 };
    plan_test_force(true);
    void *live = NULL;
    for (int t = 0; t < 6 * N && extra_stat("cca.compact_plans") == 0; t++) {
        cca_free(live);
        live = xmalloc((size_t)(2 + t % N) * MiB, NULL);
        expect_true(live != NULL);
    }
    plan_test_force(false);
    expect_eq_i64(extra_stat("cca.compact_plans"), 1);
    return live;
}

/*
 * The plan's start maps its range as far as the room under the limit goes. Where the
 * reserved bytes are past the limit (here small pools of many streams, a granule each for a
 * few bytes), the room is none once the granules below the range are lent to it, and the
 * unmapped run they leave joins the range's unmapped block: nothing is mapped then. Before,
 * that block, starting below the range, was given a map of no granules, which the backend
 * refuses (an invalid argument left as the thread's last error by a request that worked).
 */
TEST(compact_plan_start_without_room_maps_nothing)
{
    setup_with("compact_memory:True", 0);
    enum { STREAMS = 40 };
    void *small[STREAMS];
    for (int i = 0; i < STREAMS; i++)
        small[i] = xmalloc(512, (cca_stream_t)(uintptr_t)(0x10000 + 0x100 * (size_t)i));
    void *a = xmalloc(4 * MiB, NULL); /* below the loop: its segment stays */
    void *live = planned_sizes_loop();
    /* the plan starts at the next request (every phase as quiet): another size */
    cca_free(live);
    cca_clear_error();
    uint64_t access = calls(CCA_OP_VMM_SET_ACCESS);
    live = xmalloc(3 * MiB + 512 * 1024, NULL);
    expect_true(live != NULL);
    expect_eq_i64(cca_last_error()->status, CCA_OK); /* no backend call failed on the way */
    expect_eq_u64(calls(CCA_OP_VMM_SET_ACCESS) - access, 1); /* the request's own growth */
    expect_eq_i64(extra_stat("cca.compact_plan_misses"), 1);
    expect_true(invariants_hold());
    cca_free(live);
    cca_free(a);
    for (int i = 0; i < STREAMS; i++)
        cca_free(small[i]);
    ends_empty();
}

/*
 * The plan's start maps its range at once; where that map fails, the request goes by best
 * fit and succeeds, and the failure the plan met is not the caller's: the thread's last
 * error record is left as it was. Before, the allocation succeeded with the map's failure
 * in the record.
 */
TEST(compact_plan_failed_map_leaves_no_error)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(4 * MiB, NULL); /* below the loop: its segment stays */
    void *live = planned_sizes_loop();
    cca_free(live);
    /* the plan starts at the next request: its first map fails */
    cca_clear_error();
    uint64_t maps = calls(CCA_OP_VMM_MAP);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_MAP, 1, false, CCA_ERR_BACKEND));
    live = xmalloc(3 * MiB + 512 * 1024, NULL);
    expect_true(live != NULL);
    expect_true(calls(CCA_OP_VMM_MAP) - maps >= 2); /* the plan's, failed; the request's own */
    expect_eq_i64(cca_last_error()->status, CCA_OK);
    expect_true(invariants_hold());
    cca_sim_clear_faults(sim);
    cca_free(live);
    cca_free(a);
    ends_empty();
}

/* A request of the loop's start phase on its own thread (the plan's start: its range found
 * and mapped under the device lock). */
typedef struct plan_request {
    size_t size;
    void *ptr;
    cca_status_t st;
    _Atomic bool done;
} plan_request_t;

static void *plan_request(void *arg)
{
    plan_request_t *r = arg;
    r->st = cca_malloc(&r->ptr, r->size, NULL);
    atomic_store(&r->done, true);
    return NULL;
}

/*
 * The plan's start finds its range under the device lock, the stream pool's lock released
 * while it waits for it. A request of the same stream on another thread meanwhile finds the
 * plan started but its range not yet there: it goes by best fit. Before, it looked for its
 * place in the range's segment, still NULL (a crash).
 */
TEST(compact_plan_range_not_yet_found_goes_by_best_fit)
{
    setup_with("compact_memory:True", 0);
    plan_test_force(true);
    enum { N = 16 };
    void *a = xmalloc(4 * MiB, NULL);
    void *live = NULL;
    int t = 0;
    for (; t < 6 * N && extra_stat("cca.compact_plans") == 0; t++) {
        cca_free(live);
        live = xmalloc((size_t)(2 + t % N) * MiB, NULL);
    }
    plan_test_force(false);
    expect_eq_i64(extra_stat("cca.compact_plans"), 1);
    cca_free(live);
    /* the plan starts at the next request (every phase as quiet), held at the device lock */
    cca_device_t *dev = &cca_state->devices[0];
    plan_request_t first = {.size = (size_t)(2 + t % N) * MiB}, second = first;
    pthread_t ta, tb;
    pthread_mutex_lock(&dev->lock);
    pthread_create(&ta, NULL, plan_request, &first);
    for (int i = 0; i < 200 && !atomic_load(&first.done); i++)
        usleep(1000);
    expect_true(!atomic_load(&first.done)); /* waiting for the device lock */
    pthread_create(&tb, NULL, plan_request, &second);
    for (int i = 0; i < 2000 && !atomic_load(&second.done); i++)
        usleep(1000);
    expect_true(atomic_load(&second.done)); /* served from the cache, no wait */
    pthread_mutex_unlock(&dev->lock);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    expect_ok(first.st);
    expect_ok(second.st);
    expect_true(invariants_hold());
    cca_free(first.ptr);
    cca_free(second.ptr);
    cca_free(a);
    ends_empty();
}

TEST(compact_fragmentation_in_oom_message)
{
    setup_with("compact_memory:True", 64 * MiB);
    void *a = xmalloc(20 * MiB, NULL);
    void *b = xmalloc(1 * MiB + 1, NULL);
    void *c = xmalloc(20 * MiB, NULL);
    cca_free(b);
    size_t cached = 0, largest = 0;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_true(cached >= 1 * MiB);
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    expect_eq_str(extra[0].key, "cca.cached_free_bytes");
    expect_eq_i64(extra[0].value, (int64_t)cached);
    expect_eq_str(extra[9].key, "cca.largest_free_bytes");
    expect_eq_i64(extra[9].value, (int64_t)largest);
    expect_status(cca_memory_stats_extra(0, extra, 2), CCA_ERR_INVALID_ARGUMENT);
    void *d = NULL;
    expect_status(cca_malloc(&d, 100 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "largest free piece");
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(c);
    cca_shutdown();
}

/*
 * A large growth takes a large segment's hole before the small pool's free
 * granule (made later, so first in the device's list): the small pool keeps
 * it for its next allocation, which then maps nothing.
 */
TEST(compact_takes_the_growths_own_kind_first)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(4 * MiB, NULL), *b = xmalloc(4 * MiB, NULL), *c = xmalloc(4 * MiB, NULL);
    cca_free(b);                    /* a hole of two granules in the large segment */
    void *x = xmalloc(1000, NULL);  /* the small segment's one granule */
    cca_free(x);
    int64_t before = reserved();
    void *d = xmalloc(2 * MiB, S1); /* a large growth of one granule */
    expect_true(d != NULL);
    expect_eq_i64(reserved(), before);
    int64_t maps = stats().num_device_alloc;
    void *y = xmalloc(1000, NULL);  /* the small granule is still there */
    expect_true(y != NULL);
    expect_eq_i64(stats().num_device_alloc, maps);
    expect_eq_i64(reserved(), before);
    expect_true(invariants_hold());
    void *ptrs[] = {a, c, d, y};
    for (size_t i = 0; i < 4; i++)
        cca_free(ptrs[i]);
    cca_shutdown();
}

/*
 * A growth whose own segment goes while it lends: S1's segment holds an
 * unmapped head (lent before) and one free block beyond the growth's run;
 * lending that block leaves nothing mapped, so the segment is released, and
 * the growth continues in a new one (one granule of new memory).
 */
TEST(compact_growth_outlives_its_released_segment)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(8 * MiB, S1), *b = xmalloc(4 * MiB, S1);
    cca_free(a);
    void *d = xmalloc(8 * MiB, S2); /* a's four granules move to S2 */
    expect_true(d != NULL);
    cca_free(b);                    /* S1: [unmapped 8 MiB][free 4 MiB][unmapped] */
    int64_t before = reserved();
    void *e = xmalloc(6 * MiB, S1); /* grows from the head; b's granules lent, the segment goes */
    expect_true(e != NULL);
    expect_eq_i64(reserved(), before + (int64_t)(2 * MiB));
    expect_true(invariants_hold());
    cca_free(d);
    cca_free(e);
    ends_empty();
}

static uint64_t calls(cca_backend_op_t op)
{
    return cca_sim_call_count(sim, op);
}

/* One of cca's own keys beside PyTorch's, by name. */
static int64_t extra_stat(const char *key)
{
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    for (size_t i = 0; i < CCA_MEMORY_STATS_EXTRA_COUNT; i++)
        if (!strcmp(extra[i].key, key))
            return extra[i].value;
    printf("  no key %s\n", key);
    expect_true(false);
    return -1;
}

/*
 * Events complete only when the test says (the GPU still working): holes in
 * S1's and S2's segments are not known done, so a growth on another stream
 * does not wait: it maps new memory, moves nothing, and leaves one event
 * recorded on each stream (no synchronisation of any kind). Once the test
 * completes the streams, the next growths see the events complete and take
 * the holes, reserved memory unchanged.
 */
TEST(compact_takes_new_memory_while_granules_are_pending)
{
    setup_events("compact_memory:True", 0, true);
    cca_stream_t s3 = (cca_stream_t)(uintptr_t)0x3000;
    void *a1 = xmalloc(10 * MiB, S1), *b1 = xmalloc(10 * MiB, S1), *c1 = xmalloc(10 * MiB, S1);
    void *a2 = xmalloc(10 * MiB, S2), *b2 = xmalloc(10 * MiB, S2), *c2 = xmalloc(10 * MiB, S2);
    cca_free(b1);
    cca_free(b2); /* a hole of five granules in each stream's segment, work pending */
    int64_t before = reserved();
    uint64_t unmaps = calls(CCA_OP_VMM_UNMAP), esyncs = calls(CCA_OP_EVENT_SYNCHRONIZE);
    uint64_t ssyncs = calls(CCA_OP_STREAM_SYNCHRONIZE), dsyncs = calls(CCA_OP_DEVICE_SYNCHRONIZE);
    void *d = xmalloc(10 * MiB, s3);
    expect_true(d != NULL);
    expect_eq_i64(reserved(), before + (int64_t)(10 * MiB)); /* new memory, no wait */
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 0);
    expect_eq_u64(cca_sim_pending_events(sim), 2);            /* one record per stream */
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 1);
    expect_eq_i64(extra_stat("cca.compact_moves"), 0);
    expect_true(invariants_hold());
    /* still pending: the records in flight are not made again, nothing moves */
    uint64_t records = calls(CCA_OP_EVENT_RECORD);
    void *e = xmalloc(2 * MiB, s3);
    expect_eq_u64(calls(CCA_OP_EVENT_RECORD), records);
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 0);
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 2);
    /* the streams' work completes: the holes move, reserved stays */
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    before = reserved();
    void *f = xmalloc(20 * MiB, s3);
    expect_true(f != NULL);
    expect_eq_i64(reserved(), before);
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 10);
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 2);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    /* never a wait on the way */
    expect_eq_u64(calls(CCA_OP_EVENT_SYNCHRONIZE), esyncs);
    expect_eq_u64(calls(CCA_OP_STREAM_SYNCHRONIZE), ssyncs);
    expect_eq_u64(calls(CCA_OP_DEVICE_SYNCHRONIZE), dsyncs);
    expect_eq_i64(extra_stat("cca.compact_syncs"), 0);
    expect_true(invariants_hold());
    void *ptrs[] = {a1, c1, a2, c2, d, e, f};
    for (size_t i = 0; i < 7; i++)
        cca_free(ptrs[i]);
    cca_shutdown();
}

/*
 * A hole freed after the stream's event was recorded is not taken on that
 * event's word: once the event completes, the first hole moves and the
 * second stays (a new record covers it); it moves only after that record
 * completes too.
 */
TEST(compact_later_frees_are_not_covered_by_an_older_event)
{
    setup_events("compact_memory:True", 0, true);
    cca_stream_t s3 = (cca_stream_t)(uintptr_t)0x3000;
    void *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *c = xmalloc(4 * MiB, S1);
    void *d = xmalloc(4 * MiB, S1), *e = xmalloc(4 * MiB, S1);
    cca_free(b);
    void *x = xmalloc(4 * MiB, s3); /* records an event on S1, pending: new memory */
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 1);
    cca_free(d); /* after the record: the event says nothing about it */
    expect_ok(cca_sim_complete_stream(sim, 0, NULL, true));
    uint64_t unmaps = calls(CCA_OP_VMM_UNMAP);
    int64_t before = reserved();
    void *y = xmalloc(4 * MiB, s3); /* b's hole moves; d's waits for the new record */
    expect_true(y != NULL);
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 2);
    expect_eq_i64(reserved(), before);
    expect_eq_u64(cca_sim_pending_events(sim), 1);
    void *z = xmalloc(4 * MiB, s3); /* the record for d still pending: new memory */
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 2);
    expect_eq_i64(reserved(), before + (int64_t)(4 * MiB));
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 2);
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    void *w = xmalloc(4 * MiB, s3); /* now d's hole moves */
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 4);
    expect_eq_i64(reserved(), before + (int64_t)(4 * MiB));
    expect_eq_u64(calls(CCA_OP_EVENT_SYNCHRONIZE), 0);
    expect_eq_u64(calls(CCA_OP_STREAM_SYNCHRONIZE), 0);
    expect_eq_u64(calls(CCA_OP_DEVICE_SYNCHRONIZE), 0);
    expect_true(invariants_hold());
    void *ptrs[] = {a, c, e, x, y, z, w};
    for (size_t i = 0; i < 7; i++)
        cca_free(ptrs[i]);
    cca_shutdown();
}

/*
 * Only where an event call fails does the growth path synchronise: the
 * stream (counted in cca.compact_syncs), after which its holes move.
 */
TEST(compact_synchronises_the_stream_only_when_an_event_call_fails)
{
    setup_events("compact_memory:True", 0, true);
    cca_stream_t s3 = (cca_stream_t)(uintptr_t)0x3000;
    void *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *c = xmalloc(4 * MiB, S1);
    cca_free(b);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_EVENT_RECORD, 1, false, CCA_ERR_BACKEND));
    int64_t before = reserved();
    void *x = xmalloc(4 * MiB, s3);
    expect_true(x != NULL);
    expect_eq_i64(reserved(), before); /* b's hole moved after the stream's synchronisation */
    expect_eq_u64(calls(CCA_OP_STREAM_SYNCHRONIZE), 1);
    expect_eq_i64(extra_stat("cca.compact_syncs"), 1);
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 0);
    expect_true(invariants_hold());
    cca_sim_clear_faults(sim);
    void *ptrs[] = {a, c, x};
    for (size_t i = 0; i < 3; i++)
        cca_free(ptrs[i]);
    cca_shutdown();
}

/* A compact device whose physical handles are shared memory (ipc_shared): a
 * handle mapped at two addresses shows the same bytes at both. */
/* devices simulated devices of 1 GiB under compact_memory (manual_events: events complete only
 * when told; ipc_shared: backed by shareable memory files). */
static void setup_devices(int devices, bool manual_events, bool ipc_shared)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = devices;
    cfg.total_memory = 1ull << 30;
    cfg.manual_events = manual_events;
    cfg.ipc_shared = ipc_shared;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK ||
        cca_init_with_backend(sim, "compact_memory:True") != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static void setup_shared(void)
{
    setup_devices(1, true, true);
}

static bool all_bytes(const unsigned char *p, size_t n, unsigned char v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return false;
    return true;
}

/*
 * S1's own growth maps a hole of S1's segment whose work is still pending:
 * the same handles are mapped at the growth's address (no backend unmap, one
 * granule created for the rest), reserved memory counts them once, the old
 * address keeps its mapping and data for the work queued on it, and nothing
 * allocates there. Once S1's event has completed, the next growth unmaps the
 * old mappings and may use the address space again. Never a wait.
 */
TEST(compact_aliases_pending_granules_of_its_own_stream)
{
    setup_shared();
    cca_device_t *dev = &cca_state->devices[0];
    unsigned char *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *c = xmalloc(4 * MiB, S1);
    memset(b, 0x5a, 4 * MiB); /* the work queued on b */
    cca_free(b);
    int64_t before = reserved();
    uint64_t unmaps = calls(CCA_OP_VMM_UNMAP), creates = calls(CCA_OP_VMM_CREATE);
    unsigned char *d = xmalloc(6 * MiB, S1);
    expect_true(d != NULL);
    expect_eq_i64(reserved(), before + (int64_t)(2 * MiB)); /* b's two granules, one new */
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 1);
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 0);    /* b's mappings stay */
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB);
    expect_eq_u64(dev->compact_aliased_bytes, 4 * MiB);
    expect_eq_i64(extra_stat("cca.compact_aliased_bytes"), (int64_t)(4 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 0);
    expect_true(all_bytes(b, 4 * MiB, 0x5a));               /* old address: data intact */
    expect_true(all_bytes(d, 4 * MiB, 0x5a));               /* the same memory, moved */
    d[0] = 0x11;
    expect_true(b[2 * MiB] == 0x11 || b[0] == 0x11);       /* one handle, two addresses */
    expect_true(invariants_hold());
    /* S1 still behind: another growth neither unmaps the old range nor maps there */
    void *e = xmalloc(4 * MiB, S1);
    expect_true(e != NULL && ((uintptr_t)e + 4 * MiB <= (uintptr_t)b || (uintptr_t)e >= (uintptr_t)b + 4 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 0);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB);
    expect_true(invariants_hold());
    /* S1's work done: the next growth unmaps the old mappings first */
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    void *f = xmalloc(2 * MiB, S1);
    expect_true(f != NULL);
    expect_eq_u64(calls(CCA_OP_VMM_UNMAP) - unmaps, 2);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 0);
    expect_true(invariants_hold());
    expect_eq_u64(calls(CCA_OP_EVENT_SYNCHRONIZE), 0);
    expect_eq_u64(calls(CCA_OP_STREAM_SYNCHRONIZE), 0);
    expect_eq_u64(calls(CCA_OP_DEVICE_SYNCHRONIZE), 0);
    void *ptrs[] = {a, c, d, e, f};
    for (size_t i = 0; i < 5; i++)
        cca_free(ptrs[i]);
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_handles, 0);
    expect_eq_u64(u.live_reservations, 0);
    cca_shutdown();
}

/* Whether device may access every granule of [p, p + size) (the simulator's access bits). */
static bool access_all(const void *p, size_t size, int device)
{
    for (size_t at = 0; at < size; at += 2 * MiB) {
        bool has = false;
        if (cca_sim_vmm_has_access(sim, (const char *)p + at, device, &has) != CCA_OK || !has)
            return false;
    }
    return true;
}

/*
 * Device 1 may access device 0's memory (cca_enable_peer_access(1, 0)): the
 * granules a growth moves from another stream's hole, and those it aliases
 * from its own stream's pending ones, are mapped at their new address with
 * access for device 1 too, as every other growth's (PyTorch's addPeer covers
 * the ranges mapped before, each map the ones after).
 */
TEST(compact_moved_and_aliased_granules_keep_peer_access)
{
    /* a move: the hole's work is done (events complete at once) */
    setup_devices(2, false, false);
    void *a = xmalloc(10 * MiB, NULL), *b = xmalloc(10 * MiB, NULL), *c = xmalloc(10 * MiB, NULL);
    expect_true(access_all(a, 10 * MiB, 0));
    expect_false(access_all(a, 10 * MiB, 1)); /* no peer yet */
    expect_ok(cca_enable_peer_access(1, 0));
    expect_true(access_all(a, 10 * MiB, 1) && access_all(c, 10 * MiB, 1));
    cca_free(b);
    void *d = xmalloc(6 * MiB, S1); /* another stream: the hole's granules move there */
    expect_true(d != NULL);
    expect_true(extra_stat("cca.compact_moves") >= 1);
    expect_true(access_all(d, 6 * MiB, 0) && access_all(d, 6 * MiB, 1));
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(c);
    cca_free(d);
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);

    /* an alias: S1's own pending granules mapped again at its growth */
    setup_devices(2, true, false);
    cca_device_t *dev = &cca_state->devices[0];
    expect_ok(cca_enable_peer_access(1, 0));
    a = xmalloc(4 * MiB, S1);
    b = xmalloc(4 * MiB, S1);
    c = xmalloc(4 * MiB, S1);
    cca_free(b); /* S1's work on it pending */
    d = xmalloc(6 * MiB, S1);
    expect_true(d != NULL);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB);
    expect_true(access_all(d, 6 * MiB, 0) && access_all(d, 6 * MiB, 1));
    expect_true(invariants_hold());
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    cca_free(a);
    cca_free(c);
    cca_free(d);
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    cca_shutdown();
}

/*
 * Below the alias limit (the most reserved after a growth plus the bytes
 * aliased since, or 1 % over peak requested) a growth takes new memory
 * rather than alias its stream's pending granules: an alias saves nothing
 * the program has not already held and costs maps at every step it repeats.
 * Past the limit it aliases only the granules that would go beyond it, and
 * they raise the limit: the same growth again maps new memory.
 */
TEST(compact_aliases_only_past_the_alias_limit)
{
    setup_shared();
    cca_device_t *dev = &cca_state->devices[0];
    void *x = xmalloc(20 * MiB, S1); /* the program's peak so far: 20 MiB */
    cca_free(x);
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    expect_ok(cca_empty_cache());
    dev->compact_requested = dev->compact_high = 20 * MiB; /* as before empty_cache restarted them */
    expect_eq_i64(reserved(), 0);
    void *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *c = xmalloc(4 * MiB, S1);
    cca_free(b); /* pending on S1 */
    uint64_t creates = calls(CCA_OP_VMM_CREATE);
    void *d = xmalloc(6 * MiB, S1); /* 12 + 6 MiB: under 20, new memory */
    expect_true(d != NULL);
    expect_eq_i64(reserved(), (int64_t)(18 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 3);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 0);
    expect_eq_i64(extra_stat("cca.compact_moves"), 0);
    expect_eq_i64(extra_stat("cca.compact_aliased_bytes"), 0);
    void *e = xmalloc(6 * MiB, S1); /* 18 + 6 MiB passes 20.2: b's two granules, one new */
    expect_true(e != NULL);
    expect_eq_i64(reserved(), (int64_t)(20 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 4);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_true(invariants_hold());
    /* the limit is kept across a reset of the peaks, raised by the bytes aliased */
    expect_ok(cca_reset_peak_stats(0));
    expect_eq_u64(dev->compact_high, 24 * MiB);
    /* d's 6 MiB free, pending: 20 + 8 MiB passes the raised limit by 4 MiB, so two
     * of d's granules are aliased and two are new (at 20.2 MiB: three aliased) */
    cca_free(d);
    creates = calls(CCA_OP_VMM_CREATE);
    void *g = xmalloc(8 * MiB, S1);
    expect_true(g != NULL);
    expect_eq_i64(reserved(), (int64_t)(24 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 2);
    expect_eq_i64(extra_stat("cca.compact_aliased_bytes"), (int64_t)(8 * MiB));
    expect_eq_u64(dev->compact_high, 28 * MiB);
    expect_true(invariants_hold());
    void *ptrs[] = {a, c, e, g};
    for (size_t i = 0; i < 4; i++)
        cca_free(ptrs[i]);
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    expect_true(invariants_hold());
    cca_shutdown();
}

/*
 * Free granules known done move only past the same limit: below it a growth
 * maps new memory, which stays (a loop settles instead of moving the same
 * granules at every step); past it, only the granules that would take
 * reserved bytes over it move.
 */
TEST(compact_moves_only_past_the_limit)
{
    setup_with("compact_memory:True", 0);
    cca_device_t *dev = &cca_state->devices[0];
    void *x = xmalloc(20 * MiB, NULL); /* the program's peak so far: 20 MiB */
    cca_free(x);
    expect_ok(cca_empty_cache());
    dev->compact_requested = dev->compact_high = 20 * MiB; /* as before empty_cache restarted them */
    expect_eq_i64(reserved(), 0);
    void *a = xmalloc(4 * MiB, NULL), *b = xmalloc(4 * MiB, NULL), *c = xmalloc(4 * MiB, NULL);
    cca_free(b); /* two free granules, known done at once */
    uint64_t creates = calls(CCA_OP_VMM_CREATE);
    void *d = xmalloc(6 * MiB, NULL); /* 12 + 6 MiB: under 20.2, new memory, nothing moves */
    expect_true(d != NULL);
    expect_eq_i64(reserved(), (int64_t)(18 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 3);
    expect_eq_i64(extra_stat("cca.compact_moves"), 0);
    uint64_t unmaps = (uint64_t)stats().num_device_free;
    void *e = xmalloc(6 * MiB, NULL); /* 18 + 6 MiB passes 20.2 by 3.8: b's two granules move */
    expect_true(e != NULL);
    expect_eq_i64(reserved(), (int64_t)(20 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 4);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_moved_bytes"), (int64_t)(4 * MiB));
    expect_true((uint64_t)stats().num_device_free > unmaps);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 0);
    expect_true(invariants_hold());
    void *ptrs[] = {a, c, d, e};
    for (size_t i = 0; i < 4; i++)
        cca_free(ptrs[i]);
    ends_empty();
}

/*
 * A block that would take one granule more at the start of its free block
 * than it needs starts at the next granule, where the bytes skipped are at
 * most a quarter granule and the free block is at least twice what the
 * block and they take: once its neighbours are gone it keeps only its own
 * granules mapped. Without the shift (or where the free block is too
 * small for it) a 4 MiB block at 1.75 MiB keeps three granules.
 */
TEST(compact_block_starts_at_a_granule_where_that_saves_one)
{
    for (int big = 0; big < 2; big++) {
        setup_with("compact_memory:True", 0);
        void *x = xmalloc(1792 * 1024, NULL); /* [0, 1.75 MiB) */
        void *y = xmalloc(12 * MiB, NULL);    /* [1.75, 13.75 MiB) */
        cca_free(y);                          /* [1.75, 14 MiB) free */
        size_t zsize = big ? 6 * MiB : 4 * MiB; /* 6: 2 x (0.25 + 6) passes 12.25, no shift */
        void *z = xmalloc(zsize, NULL);
        expect_true(z != NULL);
        expect_eq_u64((uintptr_t)z - (uintptr_t)x, big ? 1792 * 1024 : 2 * MiB);
        expect_true(invariants_hold());
        cca_free(x); /* x and the bytes skipped: granule 0 free whole */
        expect_ok(cca_empty_cache());
        expect_eq_i64(reserved(), (int64_t)(big ? 8 * MiB : 4 * MiB)); /* z's granules */
        expect_true(invariants_hold());
        cca_free(z);
        expect_ok(cca_empty_cache());
        expect_eq_i64(reserved(), 0);
        cca_shutdown();
    }
}

/*
 * The shift is an optimisation only: where the block struct it takes for
 * the skipped bytes was the one the split needed (the stream pool's last
 * spare) and the host has no other, the block is placed where it was, not
 * refused. Before, the allocation failed with out of host memory although
 * it needed no more structs than without the shift.
 */
TEST(compact_shift_never_costs_an_allocation_its_host_memory)
{
    setup_with("compact_memory:True", 0);
    void *x = xmalloc(1792 * 1024, NULL); /* [0, 1.75 MiB) */
    void *y = xmalloc(12 * MiB, NULL);    /* [1.75, 13.75 MiB) */
    cca_free(y);                          /* merged with the rest: its struct now a spare */
    pool_test_fail_host_alloc(1);         /* no struct beyond the spares */
    void *z = NULL;
    cca_status_t st = cca_malloc(&z, 4 * MiB, NULL);
    pool_test_fail_host_alloc(0);
    expect_ok(st);
    expect_eq_u64((uintptr_t)z - (uintptr_t)x, 1792 * 1024); /* unshifted */
    expect_true(invariants_hold());
    cca_free(z);
    cca_free(x);
    ends_empty();
}

/*
 * A growth's run that starts in a free block and runs into another one
 * (free block, unmapped hole, free block) keeps only the bytes it grows
 * into: the granules of the second free block above the run are lent to
 * it, and the hole is filled from them (reserved bytes unchanged). Before,
 * a free block the run touched was left whole and the hole mapped new
 * memory.
 */
TEST(compact_lends_the_granules_above_the_growths_run)
{
    setup_with("compact_memory:True", 0);
    compact_test_limit(true); /* every growth moves the free granules known done */
    void *a = xmalloc(2 * MiB, NULL), *f = xmalloc(20 * MiB, NULL), *h = xmalloc(4 * MiB, NULL);
    void *g = xmalloc(20 * MiB, NULL), *b = xmalloc(2 * MiB, NULL);
    cca_free(h);
    expect_ok(cca_empty_cache()); /* h's two granules unmapped: a hole between f and g */
    cca_free(f);
    cca_free(g);
    expect_eq_i64(reserved(), (int64_t)(44 * MiB));
    uint64_t creates = calls(CCA_OP_VMM_CREATE);
    void *c = xmalloc(30 * MiB, NULL); /* from f's start, over the hole, into g */
    expect_true(c == f);
    expect_eq_i64(reserved(), (int64_t)(44 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 0);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_moved_bytes"), (int64_t)(4 * MiB));
    expect_true(invariants_hold());
    compact_test_limit(false);
    cca_free(a);
    cca_free(b);
    cca_free(c);
    ends_empty();
}

/*
 * cca_empty_cache starts the limit again from what the program holds: a
 * phase after it that needs less than the one before (inference after
 * training) is held to its own needs and not given the earlier phase's
 * reserve to grow into; until the requested peak changes, the earlier peak
 * does not count. Before (the limit kept across empty_cache), the same
 * sequence mapped d's 6 MiB new and reserved 18 MiB.
 */
TEST(compact_empty_cache_restarts_the_limit)
{
    setup_with("compact_memory:True", 0);
    void *x = xmalloc(20 * MiB, NULL); /* an earlier phase's peak: 20 MiB */
    cca_free(x);
    expect_ok(cca_empty_cache());
    expect_eq_i64(reserved(), 0);
    void *a = xmalloc(4 * MiB, NULL), *b = xmalloc(4 * MiB, NULL), *c = xmalloc(4 * MiB, NULL);
    cca_free(b); /* two free granules, known done at once */
    uint64_t creates = calls(CCA_OP_VMM_CREATE);
    void *d = xmalloc(6 * MiB, NULL); /* 12 + 6 MiB passes the phase's 12 MiB: b's granules move */
    expect_true(d != NULL);
    expect_eq_i64(reserved(), (int64_t)(14 * MiB));
    expect_eq_u64(calls(CCA_OP_VMM_CREATE) - creates, 1);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_moved_bytes"), (int64_t)(4 * MiB));
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(c);
    cca_free(d);
    ends_empty();
}

/*
 * However far aliases and moves have raised the limit, it stays within 2% of
 * the most bytes requested (or six granules, where more): past that, free
 * granules known done move rather than new memory being mapped.
 */
TEST(compact_limit_stays_within_two_percent_of_the_requested_peak)
{
    setup_with("compact_memory:True", 0);
    cca_device_t *dev = &cca_state->devices[0];
    void *x = xmalloc(400 * MiB, NULL); /* the program's peak so far: 400 MiB */
    cca_free(x);
    expect_ok(cca_empty_cache());
    dev->compact_requested = dev->compact_high = 400 * MiB; /* as before empty_cache restarted them */
    void *a = xmalloc(200 * MiB, NULL), *b = xmalloc(200 * MiB, NULL);
    cca_free(a); /* 100 free granules, known done at once */
    dev->compact_high = 1000 * MiB; /* as earlier needs that did not come back would leave it */
    void *c = xmalloc(300 * MiB, NULL);
    expect_true(c != NULL);
    /* the cap is 408 MiB: 700 - 408 = 292 MiB past it, so a's 200 MiB move, 100 are new */
    expect_eq_i64(reserved(), (int64_t)(500 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_moved_bytes"), (int64_t)(200 * MiB));
    expect_true(invariants_hold());
    cca_free(b);
    cca_free(c);
    expect_ok(cca_empty_cache());
    cca_shutdown();
    /* a small program: the cap is six granules (12 MiB) over its peak, not 2% */
    setup_with("compact_memory:True", 0);
    dev = &cca_state->devices[0];
    x = xmalloc(20 * MiB, NULL);
    cca_free(x);
    expect_ok(cca_empty_cache());
    dev->compact_requested = dev->compact_high = 20 * MiB; /* as before empty_cache restarted them */
    void *d = xmalloc(4 * MiB, NULL), *e = xmalloc(8 * MiB, NULL), *f = xmalloc(4 * MiB, NULL);
    cca_free(e); /* four free granules, known done */
    dev->compact_high = 1000 * MiB;
    void *g = xmalloc(10 * MiB, NULL); /* 16 + 10 MiB: under 32, new memory */
    expect_eq_i64(reserved(), (int64_t)(26 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 0);
    void *h = xmalloc(10 * MiB, NULL); /* 26 + 10 MiB passes 32 by 4: two of e's granules move */
    expect_eq_i64(reserved(), (int64_t)(32 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(extra_stat("cca.compact_moved_bytes"), (int64_t)(4 * MiB));
    expect_true(invariants_hold());
    void *ptrs[] = {d, f, g, h};
    for (size_t i = 0; i < 4; i++)
        cca_free(ptrs[i]);
    ends_empty();
}

/*
 * Under compact_memory the memory fraction is checked against the granules a
 * growth maps, moved ones counted where they go: near the cap a 3 MiB request
 * maps 4 MiB and fits, where PyTorch's 20 MiB alloc_size would not; a growth
 * the cap refuses is an out-of-memory error, and reserved bytes never pass
 * the cap.
 */
TEST(compact_fraction_counts_the_granules_mapped)
{
    setup_with("compact_memory:True", 1024 * MiB);
    expect_ok(cca_set_memory_fraction(30.0 / 1024.0, 0)); /* 30 MiB allowed */
    void *a = xmalloc(24 * MiB, NULL);
    expect_true(a != NULL);
    void *b = xmalloc(3 * MiB, NULL); /* 24 + 4 MiB: under 30 (24 + 20 would not be) */
    expect_true(b != NULL);
    expect_eq_i64(reserved(), (int64_t)(28 * MiB));
    void *c = NULL;
    /* b's granules end with 1 MiB free: 4 MiB more need two granules, 28 + 4 > 30 */
    expect_status(cca_malloc(&c, 4 * MiB, NULL), CCA_ERR_OUT_OF_MEMORY);
    expect_true(reserved() <= (int64_t)(30 * MiB));
    cca_free(b); /* 4 MiB free, known done: a growth over it moves its granules */
    void *d = xmalloc(2 * MiB, NULL);
    expect_true(d != NULL);
    expect_true(reserved() <= (int64_t)(30 * MiB));
    expect_true(invariants_hold());
    cca_free(a);
    cca_free(d);
    ends_empty();
}

/*
 * A growth that lends granules from several free runs makes room for an
 * orphan record of every handle it lends as it lends them: with no host
 * memory for more records the growth fails cleanly (nothing lent outlives the
 * call, everything accounted), where before the handles lent could stay lent
 * past the call and the next growth, of any stream, mapped them.
 */
TEST(compact_lends_no_handle_it_cannot_give_back)
{
    setup_with("compact_memory:True", 0);
    compact_test_limit(true); /* every growth moves the free granules known done */
    void *p[7];
    p[0] = xmalloc(4 * MiB, NULL);
    p[1] = xmalloc(4 * MiB, NULL);
    cca_free(p[0]); /* a first move: the orphan records get their first room (16) */
    p[0] = xmalloc(6 * MiB, NULL);
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    p[6] = xmalloc(4 * MiB, NULL); /* the moved granules' old place */
    p[2] = xmalloc(20 * MiB, NULL), p[3] = xmalloc(2 * MiB, NULL);
    p[4] = xmalloc(20 * MiB, NULL), p[5] = xmalloc(2 * MiB, NULL);
    expect_true((uintptr_t)p[3] == (uintptr_t)p[2] + 20 * MiB); /* the two runs apart */
    cca_free(p[2]);
    cca_free(p[4]); /* two runs of ten free granules */
    int64_t before = reserved();
    expandable_test_fail_orphan_room(true);
    /* the growth lends from both runs (20 handles), then its first map fails: every handle
     * lent goes back (with the room made as they were lent; before, the records for 20 did
     * not fit the 16 made by the first move and the handles stayed lent) */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_MAP, 1, true, CCA_ERR_BACKEND));
    void *q = NULL;
    cca_status_t st = cca_malloc(&q, 40 * MiB, NULL);
    expect_status(st, CCA_ERR_OUT_OF_MEMORY); /* the map's failure, then the OOM path's */
    cca_sim_clear_faults(sim);
    expect_true(invariants_hold()); /* no handle lent past the call, bytes accounted */
    expandable_test_fail_orphan_room(false);
    if (st == CCA_OK)
        cca_free(q);
    q = xmalloc(40 * MiB, NULL);
    expect_true(q != NULL);
    expect_true(reserved() <= before + (int64_t)(40 * MiB));
    expect_true(invariants_hold());
    compact_test_limit(false);
    cca_free(q);
    for (int i = 0; i < 7; i++)
        if (i != 2 && i != 4)
            cca_free(p[i]);
    ends_empty();
}

/*
 * Under the limit a growth maps new memory; where the device has none to give
 * (here the simulated device's capacity), it moves the free granules known done instead,
 * before the out-of-memory path releases every cached block.
 */
TEST(compact_moves_under_the_limit_when_the_device_is_full)
{
    setup_with("compact_memory:True", 64 * MiB);
    void *x = xmalloc(20 * MiB, NULL); /* the limit: 20.2 MiB */
    cca_free(x);
    expect_ok(cca_empty_cache());
    void *a = xmalloc(4 * MiB, NULL), *b = xmalloc(4 * MiB, NULL), *c = xmalloc(4 * MiB, NULL);
    cca_free(b);
    expect_ok(cca_sim_set_cap(sim, 0, 14 * MiB)); /* the device: room for one more granule */
    void *d = xmalloc(6 * MiB, NULL);
    expect_true(d != NULL);
    expect_eq_i64(reserved(), (int64_t)(14 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_eq_i64(stats().num_alloc_retries, 0); /* no release of the cache */
    expect_eq_i64(stats().num_ooms, 0);
    expect_true(invariants_hold());
    void *ptrs[] = {a, c, d};
    for (size_t i = 0; i < 3; i++)
        cca_free(ptrs[i]);
    ends_empty();
}

/*
 * Another stream's pending granules are never aliased (its work is not
 * ordered before the growth's); empty_cache waits for the owner stream and
 * unmaps the old mappings of a block still aliased; shutdown unmaps them
 * too (nothing left in the backend).
 */
TEST(compact_aliases_only_its_own_stream_and_settles_at_empty_cache)
{
    setup_events("compact_memory:True", 0, true);
    cca_device_t *dev = &cca_state->devices[0];
    void *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *c = xmalloc(4 * MiB, S1);
    cca_free(b);
    int64_t before = reserved();
    void *x = xmalloc(4 * MiB, S2); /* S1's hole pending: new memory, no alias */
    expect_eq_i64(reserved(), before + (int64_t)(4 * MiB));
    expect_eq_u64((uint64_t)dev->aliased_bytes, 0);
    expect_eq_i64(extra_stat("cca.compact_pending_growths"), 1);
    void *y = xmalloc(6 * MiB, S1); /* S1's own growth aliases it */
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB);
    expect_true(invariants_hold());
    uint64_t unmaps = calls(CCA_OP_VMM_UNMAP);
    expect_ok(cca_empty_cache());   /* waits for S1, unmaps the old mappings */
    expect_eq_u64((uint64_t)dev->aliased_bytes, 0);
    expect_true(calls(CCA_OP_VMM_UNMAP) - unmaps >= 2);
    expect_true(invariants_hold());
    cca_free(y);
    void *z = xmalloc(2 * MiB, S1);
    cca_free(z);
    cca_free(a);                    /* a hole pending again, aliased by the next growth */
    void *w = xmalloc(10 * MiB, S1);
    expect_true(w != NULL && dev->aliased_bytes > 0);
    expect_true(invariants_hold());
    (void)c;
    (void)x;
    (void)w;
    cca_shutdown();                 /* the old mappings go with the rest */
}

/*
 * A growth of S1 that aliases S1's pending hole x and then fails on a later
 * map of the same growth keeps x's handles mapped in a cached block, merged
 * with a free block known done: that block counts as returned at the map, so
 * another stream's growth leaves it alone while S1's work on x's old address
 * may be queued (before, it took them, and S2's writes reached x).
 */
TEST(compact_failed_growth_keeps_aliased_handles_from_other_streams)
{
    setup_shared();
    cca_device_t *dev = &cca_state->devices[0];
    unsigned char *x = xmalloc(4 * MiB, S1);
    void *a = xmalloc(4 * MiB, S1), *b = xmalloc(4 * MiB, S1), *f = xmalloc(4 * MiB, S1);
    cca_free(b);
    void *s2a = xmalloc(4 * MiB, S2);            /* records S1's event (covers b): new memory */
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    void *s2b = xmalloc(4 * MiB, S2);            /* b's granules move: [x][a][hole][f] */
    cca_free(f);
    void *s2d = xmalloc(2 * MiB, S2);            /* records S1's event (covers f): new memory */
    expect_ok(cca_sim_complete_stream(sim, 0, S1, false));
    memset(x, 0x5a, 4 * MiB);                    /* S1's work on x, still queued */
    cca_free(x);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_CREATE, 1, false, CCA_ERR_BACKEND));
    void *p = NULL;
    expect_true(cca_malloc(&p, 10 * MiB, S1) != CCA_OK); /* aliases x into the hole, then fails */
    cca_sim_clear_faults(sim);
    expect_eq_u64((uint64_t)dev->aliased_bytes, 4 * MiB); /* x aliased: S1's work pending */
    unsigned char *s2c = xmalloc(8 * MiB, S2);
    expect_true(s2c != NULL);
    memset(s2c, 0x11, 8 * MiB);                  /* S2's work on its new block */
    expect_eq_u64(x[0], 0x5a);                   /* x's old address: S1's data, untouched */
    expect_true(invariants_hold());
    void *ptrs[] = {a, s2a, s2b, s2c, s2d};
    for (size_t i = 0; i < 5; i++)
        cca_free(ptrs[i]);
    cca_shutdown();
}

/*
 * A growth that takes every granule of another stream's segment empties its
 * reservation; where freeing that reservation fails, the growth still goes on
 * with the granules taken (the empty reservation stays, freed by the next
 * empty_cache), as it would without the move (before, the growth failed with
 * the backend's error and the granules it had taken were released).
 */
TEST(compact_growth_survives_a_failed_free_of_an_emptied_reservation)
{
    setup_with("compact_memory:True", 0);
    void *a = xmalloc(8 * MiB, S1);
    cca_free(a); /* S1's segment: four free granules, known done */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_FREE, 1, false, CCA_ERR_BACKEND));
    void *b = xmalloc(8 * MiB, S2); /* 8 + 8 MiB passes the limit: the four granules move */
    cca_sim_clear_faults(sim);
    expect_true(b != NULL);
    expect_eq_u64(calls(CCA_OP_VMM_FREE), 1);
    expect_eq_i64(reserved(), (int64_t)(8 * MiB));
    expect_eq_i64(extra_stat("cca.compact_moves"), 1);
    expect_true(invariants_hold());
    cca_free(b);
    expect_ok(cca_empty_cache()); /* the emptied reservation goes too */
    expect_eq_i64(reserved(), 0);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_reservations, 0);
    expect_eq_u64(u.live_handles, 0);
    cca_shutdown();
}

int main(void)
{
    cca_register_output(NULL, NULL);
    RUN(compact_setting_implies_expandable);
    RUN(compact_granules_are_the_device_granularity);
    RUN(compact_small_requests_take_the_rest_of_a_large_granule);
    RUN(compact_small_requests_leave_oversize_rests_whole);
    RUN(compact_lends_a_hole_to_other_streams_and_kinds);
    RUN(compact_keeps_the_growing_run);
    RUN(compact_steady_loop_stays_bounded);
    RUN(compact_plan_settles_a_loop_that_keeps_moving);
    RUN(compact_plan_drops_when_the_loop_changes);
    RUN(compact_plan_forgotten_at_empty_cache);
    RUN(compact_plan_only_for_the_default_pools_large_requests);
    RUN(compact_plan_start_without_room_maps_nothing);
    RUN(compact_plan_range_not_yet_found_goes_by_best_fit);
    RUN(compact_plan_failed_map_leaves_no_error);
    RUN(compact_fragmentation_in_oom_message);
    RUN(compact_takes_the_growths_own_kind_first);
    RUN(compact_growth_outlives_its_released_segment);
    RUN(compact_takes_new_memory_while_granules_are_pending);
    RUN(compact_later_frees_are_not_covered_by_an_older_event);
    RUN(compact_synchronises_the_stream_only_when_an_event_call_fails);
    RUN(compact_aliases_pending_granules_of_its_own_stream);
    RUN(compact_moved_and_aliased_granules_keep_peer_access);
    RUN(compact_aliases_only_past_the_alias_limit);
    RUN(compact_moves_only_past_the_limit);
    RUN(compact_limit_stays_within_two_percent_of_the_requested_peak);
    RUN(compact_empty_cache_restarts_the_limit);
    RUN(compact_block_starts_at_a_granule_where_that_saves_one);
    RUN(compact_shift_never_costs_an_allocation_its_host_memory);
    RUN(compact_lends_the_granules_above_the_growths_run);
    RUN(compact_moves_under_the_limit_when_the_device_is_full);
    RUN(compact_fraction_counts_the_granules_mapped);
    RUN(compact_lends_no_handle_it_cannot_give_back);
    RUN(compact_aliases_only_its_own_stream_and_settles_at_empty_cache);
    RUN(compact_failed_growth_keeps_aliased_handles_from_other_streams);
    RUN(compact_growth_survives_a_failed_free_of_an_emptied_reservation);
    return harness_done();
}
