/*
 * test_host.c - the pinned host caching allocator on the simulated backend:
 * rounding and size classes, reuse only after events complete, the round
 * threshold, the cached-size limit, the reserve segment, both slow paths,
 * statistics, empty_cache, misuse, fault injection, threads, and the
 * background event thread.
 */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#include "harness.h"
#include "host.h"
#include "settings.h"

/*
 * The public cca_host_* functions call cca_init(), which the core defines.
 * Where this test links without the core, this stand-in makes the global
 * instance the only thing initialised; the core's definition wins otherwise.
 */
static bool init_stub_used;
__attribute__((weak)) cca_status_t cca_init(void)
{
    init_stub_used = true;
    return CCA_OK;
}

#define S1 ((cca_stream_t)(uintptr_t)0x1001)
#define S2 ((cca_stream_t)(uintptr_t)0x1002)
#define S3 ((cca_stream_t)(uintptr_t)0x1003)
#define KiB ((size_t)1024)
#define MiB ((size_t)1024 * 1024)

typedef struct fixture {
    cca_backend_t *be;
    host_alloc_t *h;
} fixture_t;

static cca_settings_t defaults(void)
{
    cca_settings_t s;
    settings_default(&s);
    return s;
}

static bool fx_open_events(fixture_t *f, const cca_settings_t *s, bool manual_events)
{
    cca_sim_config_t cfg = {0};
    cfg.manual_events = manual_events;
    f->be = NULL;
    f->h = NULL;
    if (cca_sim_create(&cfg, &f->be) != CCA_OK) {
        HARNESS_FAIL("cca_sim_create: %s", cca_last_error()->message);
        return false;
    }
    if (host_create(f->be, s, &f->h) != CCA_OK) {
        HARNESS_FAIL("host_create: %s", cca_last_error()->message);
        f->be->destroy(f->be->ctx);
        return false;
    }
    return true;
}

static bool fx_open(fixture_t *f, const cca_settings_t *s)
{
    return fx_open_events(f, s, true);
}

static cca_sim_usage_t usage(fixture_t *f)
{
    cca_sim_usage_t u;
    memset(&u, 0, sizeof(u));
    cca_sim_usage(f->be, &u);
    return u;
}

/* Destroy the allocator and check that it gave every host block and event back. */
static void fx_close(fixture_t *f)
{
    expect_true(host_is_valid(f->h));
    host_destroy(f->h);
    cca_sim_usage_t u = usage(f);
    expect_eq_u64(u.live_host, 0);
    expect_eq_u64(u.live_events, 0);
    f->be->destroy(f->be->ctx);
}

static cca_host_stats_t stats(fixture_t *f)
{
    cca_host_stats_t st;
    memset(&st, 0, sizeof(st));
    expect_ok(host_get_stats(f->h, &st));
    return st;
}

static uint64_t calls(fixture_t *f, cca_backend_op_t op)
{
    return cca_sim_call_count(f->be, op);
}

static void complete(fixture_t *f, cca_stream_t stream)
{
    expect_ok(cca_sim_complete_stream(f->be, 0, stream, false));
}

#define expect_stat(s, cur, pk, alloc, fr)     \
    do {                                       \
        expect_eq_i64((s).current, (cur));     \
        expect_eq_i64((s).peak, (pk));         \
        expect_eq_i64((s).allocated, (alloc)); \
        expect_eq_i64((s).freed, (fr));        \
    } while (0)

/* ------------------------------------------------------------------------ */

TEST(size_zero_huge_and_null)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p = (void *)&f;
    expect_ok(host_malloc(f.h, &p, 0));
    expect_eq_ptr(p, NULL);
    expect_status(host_malloc(f.h, &p, (size_t)1 << 60), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "1 EB");
    expect_status(host_malloc(f.h, &p, SIZE_MAX), CCA_ERR_INVALID_ARGUMENT);
    expect_status(host_malloc(f.h, NULL, 16), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(host_release_ptr(f.h, NULL));
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 0);
    cca_host_stats_t st = stats(&f);
    expect_stat(st.allocations, 0, 0, 0, 0);
    fx_close(&f);
}

TEST(power_of_two_rounding_and_classes)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *a, *b, *c, *d, *one;
    expect_ok(host_malloc(f.h, &a, 1000));
    memset(a, 0xab, 1024); /* the whole rounded block is usable */
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.active_bytes.current, 1024);
    expect_eq_i64(st.allocated_bytes.current, 1024);

    expect_ok(host_release_ptr(f.h, a));
    expect_ok(host_malloc(f.h, &b, 513)); /* 1024 class: the cached block */
    expect_eq_ptr(b, a);
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 1);

    expect_ok(host_release_ptr(f.h, b));
    expect_ok(host_malloc(f.h, &c, 512)); /* 512 class: the 1024 block is not taken */
    expect_ne_u64((uintptr_t)c, (uintptr_t)a);
    expect_ok(host_malloc(f.h, &d, 1025)); /* 2048 class */
    expect_ne_u64((uintptr_t)d, (uintptr_t)a);
    expect_ok(host_malloc(f.h, &one, 1)); /* PyTorch has no minimum block size */
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 4);
    st = stats(&f);
    expect_eq_i64(st.allocated_bytes.current, 1024 + 512 + 2048 + 1);
    expect_eq_i64(st.active_bytes.current, 512 + 2048 + 1);
    expect_eq_i64(st.active_requests.current, 3);
    expect_ok(host_release_ptr(f.h, c));
    expect_ok(host_release_ptr(f.h, d));
    expect_ok(host_release_ptr(f.h, one));
    fx_close(&f);
}

TEST(free_list_is_lifo)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *a, *b, *c;
    expect_ok(host_malloc(f.h, &a, 4096));
    expect_ok(host_malloc(f.h, &b, 4096));
    expect_ok(host_release_ptr(f.h, a));
    expect_ok(host_release_ptr(f.h, b));
    expect_ok(host_malloc(f.h, &c, 4000));
    expect_eq_ptr(c, b);
    expect_ok(host_malloc(f.h, &c, 4000));
    expect_eq_ptr(c, a);
    expect_ok(host_release_ptr(f.h, a));
    expect_ok(host_release_ptr(f.h, b));
    fx_close(&f);
}

TEST(reuse_only_after_events_complete)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p, *q, *r;
    expect_ok(host_malloc(f.h, &p, 64 * KiB));
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_u64(cca_sim_pending_events(f.be), 1);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.active_requests.current, 1); /* waiting on its event */

    expect_ok(host_malloc(f.h, &q, 64 * KiB));
    expect_ne_u64((uintptr_t)q, (uintptr_t)p);
    expect_ok(host_release_ptr(f.h, q)); /* no stream recorded: cached at once */
    expect_ok(host_malloc(f.h, &r, 64 * KiB));
    expect_eq_ptr(r, q);

    complete(&f, S1);
    /* completion is noticed at the next allocation */
    st = stats(&f);
    expect_eq_i64(st.active_requests.current, 2);
    void *again;
    expect_ok(host_malloc(f.h, &again, 64 * KiB));
    expect_eq_ptr(again, p);
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 2);
    st = stats(&f);
    expect_eq_i64(st.active_requests.current, 2);
    expect_ok(host_release_ptr(f.h, again));
    expect_ok(host_release_ptr(f.h, r));
    fx_close(&f);
}

/*
 * A block a stream capture used (cca_host_record_event while its stream is captured) is read
 * by every replay of the graph: its free keeps it, never handed out again nor given back by
 * empty_cache (counted active, as PyTorch counts the captured blocks it keeps), until the
 * allocator goes. So is a block freed while a stream it was used on is captured. Blocks used
 * outside a capture are reused as before.
 */
TEST(captured_use_keeps_the_block)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *kept, *plain, *p;
    expect_ok(host_malloc(f.h, &kept, 64 * KiB));
    expect_ok(host_malloc(f.h, &plain, 64 * KiB));
    expect_ok(host_record_event(f.h, plain, S2));
    expect_ok(cca_sim_set_capturing(f.be, S1, true));
    expect_ok(host_record_event(f.h, (char *)kept + 100, S1)); /* an interior pointer */
    expect_ok(cca_sim_set_capturing(f.be, S1, false));
    uint64_t records = calls(&f, CCA_OP_EVENT_RECORD);
    expect_ok(host_release_ptr(f.h, kept));
    expect_eq_u64(calls(&f, CCA_OP_EVENT_RECORD), records); /* no event: nothing can say the graph is done */
    expect_ok(host_release_ptr(f.h, plain));
    complete(&f, S2);
    for (int i = 0; i < 4; i++) { /* plain comes back, kept never */
        expect_ok(host_malloc(f.h, &p, 64 * KiB));
        expect_ne_u64((uintptr_t)p, (uintptr_t)kept);
        if (i == 0)
            expect_eq_ptr(p, plain);
        expect_ok(host_release_ptr(f.h, p));
    }
    expect_ok(host_empty_cache(f.h));
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.allocations.current, 1); /* the kept block alone */
    expect_eq_i64(st.allocated_bytes.current, (int64_t)(64 * KiB));
    expect_eq_i64(st.active_requests.current, 1);
    expect_true(host_is_valid(f.h));
    /* it is freed: a second free and a new use are refused */
    expect_eq_i64(host_release_ptr(f.h, kept), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "already freed");
    expect_eq_i64(host_record_event(f.h, kept, S1), CCA_ERR_INVALID_POINTER);
    /* used before a capture, freed while its stream is captured: no event can tell when the
     * earlier use is done (one recorded there would be the graph's), so it is kept too */
    void *late;
    expect_ok(host_malloc(f.h, &late, 64 * KiB));
    expect_ok(host_record_event(f.h, late, S3));
    expect_ok(cca_sim_set_capturing(f.be, S3, true));
    records = calls(&f, CCA_OP_EVENT_RECORD);
    expect_ok(host_release_ptr(f.h, late));
    expect_eq_u64(calls(&f, CCA_OP_EVENT_RECORD), records);
    expect_ok(cca_sim_set_capturing(f.be, S3, false));
    expect_ok(host_malloc(f.h, &p, 64 * KiB));
    expect_ne_u64((uintptr_t)p, (uintptr_t)late);
    expect_ne_u64((uintptr_t)p, (uintptr_t)kept);
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_i64(stats(&f).active_requests.current, 2);
    expect_true(host_is_valid(f.h));
    fx_close(&f); /* gives them back */
}

TEST(several_streams_per_block)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p, *q;
    expect_ok(host_malloc(f.h, &p, 8 * KiB));
    uint64_t records = calls(&f, CCA_OP_EVENT_RECORD);
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_record_event(f.h, p, S2));
    expect_ok(host_record_event(f.h, p, S1)); /* a set: S1 once */
    expect_ok(host_record_event(f.h, (char *)p + 100, S3)); /* interior pointer */
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_u64(calls(&f, CCA_OP_EVENT_RECORD) - records, 3);
    expect_eq_u64(cca_sim_pending_events(f.be), 3);

    complete(&f, S2);
    complete(&f, S3);
    expect_ok(host_malloc(f.h, &q, 8 * KiB));
    expect_ne_u64((uintptr_t)q, (uintptr_t)p); /* S1 still pending */
    expect_ok(host_release_ptr(f.h, q));

    complete(&f, S1);
    expect_ok(host_malloc(f.h, &q, 8 * KiB));
    expect_ok(host_malloc(f.h, &p, 8 * KiB));
    expect_ok(host_release_ptr(f.h, q));
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 2);
    fx_close(&f);
}

TEST(more_streams_than_inline_slots_and_event_pool)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p;
    expect_ok(host_malloc(f.h, &p, 100));
    for (uintptr_t i = 1; i <= 10; i++)
        expect_ok(host_record_event(f.h, p, (cca_stream_t)i));
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_u64(cca_sim_pending_events(f.be), 10);
    expect_eq_u64(calls(&f, CCA_OP_EVENT_CREATE), 10);
    expect_ok(cca_sim_complete_stream(f.be, 0, NULL, true));

    /* The second round reuses the pooled events. */
    void *q;
    expect_ok(host_malloc(f.h, &q, 100));
    expect_eq_ptr(q, p);
    for (uintptr_t i = 1; i <= 10; i++)
        expect_ok(host_record_event(f.h, q, (cca_stream_t)i));
    expect_ok(host_release_ptr(f.h, q));
    expect_eq_u64(calls(&f, CCA_OP_EVENT_CREATE), 10);
    expect_eq_u64(usage(&f).live_events, 10);
    fx_close(&f); /* pending events are destroyed with the allocator */
}

TEST(round_threshold)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_max_round_threshold = 1 * MiB;
    if (!fx_open(&f, &s))
        return;
    void *small, *big, *edge, *reuse, *other;
    expect_ok(host_malloc(f.h, &small, 1000)); /* below: power of two */
    expect_ok(host_malloc(f.h, &edge, 1 * MiB)); /* at the threshold: power of two */
    expect_ok(host_malloc(f.h, &big, 1 * MiB + 512 * KiB + 1)); /* above: pages */
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.allocated_bytes.current, 1024 + 1 * MiB + 1 * MiB + 512 * KiB + 4096);

    /* A page-rounded block serves a smaller request of its class (2 MiB). */
    expect_ok(host_release_ptr(f.h, big));
    expect_ok(host_malloc(f.h, &reuse, 1 * MiB + 256 * KiB));
    expect_eq_ptr(reuse, big);
    expect_ok(host_release_ptr(f.h, reuse));
    /* ... but not a larger one. */
    expect_ok(host_malloc(f.h, &other, 1 * MiB + 900 * KiB));
    expect_ne_u64((uintptr_t)other, (uintptr_t)big);
    /* Best fit inside the class: the smaller of two cached blocks that fit. */
    expect_ok(host_release_ptr(f.h, other));
    void *fit;
    expect_ok(host_malloc(f.h, &fit, 1 * MiB + 100 * KiB));
    expect_eq_ptr(fit, big);
    expect_true(host_is_valid(f.h));
    expect_ok(host_release_ptr(f.h, fit));
    expect_ok(host_release_ptr(f.h, small));
    expect_ok(host_release_ptr(f.h, edge));
    fx_close(&f);
}

TEST(cached_size_limit)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_max_cached_size = 1 * MiB;
    if (!fx_open(&f, &s))
        return;
    void *big, *small;
    expect_ok(host_malloc(f.h, &big, 2 * MiB));
    expect_ok(host_malloc(f.h, &small, 1 * MiB));
    expect_ok(host_release_ptr(f.h, big)); /* larger than the limit: back to the system */
    expect_ok(host_release_ptr(f.h, small)); /* at the limit: cached */
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.num_host_free, 1);
    expect_stat(st.allocations, 1, 2, 2, 1);
    expect_eq_u64(usage(&f).live_host, 1);

    /* With a pending event, the release waits for it. */
    expect_ok(host_malloc(f.h, &big, 4 * MiB));
    expect_ok(host_record_event(f.h, big, S1));
    expect_ok(host_release_ptr(f.h, big));
    expect_eq_u64(usage(&f).live_host, 2);
    complete(&f, S1);
    expect_ok(host_malloc(f.h, &small, 1 * MiB)); /* processes events */
    expect_eq_u64(usage(&f).live_host, 1);
    st = stats(&f);
    expect_eq_i64(st.num_host_free, 2);
    expect_eq_i64(st.active_requests.current, 1);
    expect_ok(host_release_ptr(f.h, small));
    fx_close(&f);
}

TEST(reserve_segment)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_reserve_segment_size = 1 * MiB;
    if (!fx_open(&f, &s))
        return;
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 0); /* created at first use */
    void *a, *b, *c, *d;
    expect_ok(host_malloc(f.h, &a, 1000));
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 1);
    expect_ok(host_malloc(f.h, &b, 5000)); /* carved after a's page */
    expect_eq_ptr(b, (char *)a + 4096);
    expect_ok(host_malloc(f.h, &c, 512 * KiB));
    expect_eq_ptr(c, (char *)b + 8192);
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 1);
    memset(c, 1, 512 * KiB);
    /* 1 MiB - 12 KiB - 512 KiB left: 512 KiB no longer fits. */
    expect_ok(host_malloc(f.h, &d, 512 * KiB));
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 2);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.num_host_alloc, 2);
    expect_stat(st.allocations, 4, 4, 4, 0);
    expect_eq_i64(st.allocated_bytes.current, 1024 + 8192 + 512 * KiB + 512 * KiB);

    expect_ok(host_release_ptr(f.h, a));
    expect_ok(host_release_ptr(f.h, b));
    expect_ok(host_release_ptr(f.h, c));
    expect_ok(host_release_ptr(f.h, d));
    expect_ok(host_empty_cache(f.h));
    /* Carved blocks stay cached; only d went back. */
    expect_eq_u64(usage(&f).live_host, 1);
    st = stats(&f);
    expect_eq_i64(st.allocations.current, 3);
    expect_eq_i64(st.num_host_free, 1);
    void *again;
    expect_ok(host_malloc(f.h, &again, 700));
    expect_eq_ptr(again, a);
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 2);
    expect_ok(host_release_ptr(f.h, again));
    fx_close(&f); /* the segment goes back at destroy */
}

static void register_mode(size_t threads)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_cuda_host_register = true;
    s.pinned_num_register_threads = threads;
    if (!fx_open(&f, &s))
        return;
    void *p, *tiny, *big;
    expect_ok(host_malloc(f.h, &p, 1 * MiB));
    expect_ok(host_malloc(f.h, &tiny, 100));
    expect_ok(host_malloc(f.h, &big, 3 * MiB)); /* 4 MiB, huge-page aligned */
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 0);
    expect_eq_u64(calls(&f, CCA_OP_HOST_REGISTER), 3);
    expect_eq_u64((uintptr_t)p % 4096, 0);
    expect_eq_u64((uintptr_t)big % (2 * MiB), 0);
    memset(p, 7, 1 * MiB);
    memset(tiny, 7, 128);
    memset(big, 7, 4 * MiB);
    expect_eq_u64(usage(&f).live_host, 3);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.num_host_alloc, 3);
    expect_eq_i64(st.host_alloc_time.count, 3);
    expect_ok(host_release_ptr(f.h, p));
    expect_ok(host_release_ptr(f.h, tiny));
    expect_ok(host_release_ptr(f.h, big));
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(calls(&f, CCA_OP_HOST_UNREGISTER), 3);
    expect_eq_u64(usage(&f).live_host, 0);
    st = stats(&f);
    expect_eq_i64(st.num_host_free, 3);
    expect_eq_i64(st.host_free_time.count, 3);
    fx_close(&f);
}

TEST(register_mode_one_thread)
{
    register_mode(1);
}

TEST(register_mode_eight_threads)
{
    register_mode(8);
}

/* host_register of a backend whose device address differs from the host address. */
static cca_backend_t *real_backend;

static cca_status_t register_elsewhere(void *ctx, void *ptr, size_t size, void **device_ptr)
{
    void *dev = NULL;
    cca_status_t st = real_backend->host_register(ctx, ptr, size, &dev);
    if (st == CCA_OK)
        *device_ptr = (char *)dev + 4096;
    return st;
}

TEST(register_mode_address_mismatch)
{
    cca_sim_config_t cfg = {0};
    if (cca_sim_create(&cfg, &real_backend) != CCA_OK)
        return;
    cca_backend_t wrapped = *real_backend;
    wrapped.host_register = register_elsewhere;
    cca_settings_t s = defaults();
    s.pinned_use_cuda_host_register = true;
    host_alloc_t *h;
    if (host_create(&wrapped, &s, &h) == CCA_OK) {
        void *p = NULL;
        expect_status(host_malloc(h, &p, 64 * KiB), CCA_ERR_NOT_SUPPORTED);
        expect_contains(cca_last_error()->message, "pinned_use_cuda_host_register");
        expect_eq_ptr(p, NULL);
        cca_sim_usage_t u;
        expect_ok(cca_sim_usage(real_backend, &u));
        expect_eq_u64(u.live_host, 0); /* unregistered again (and freed: ASan) */
        cca_host_stats_t st;
        expect_ok(host_get_stats(h, &st));
        expect_stat(st.allocations, 0, 0, 0, 0);
        expect_eq_i64(st.num_host_alloc, 0);
        host_destroy(h);
    }
    real_backend->destroy(real_backend->ctx);
}

TEST(modes_switch_at_run_time)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *a, *b;
    expect_ok(host_malloc(f.h, &a, 64 * KiB));
    s.pinned_use_cuda_host_register = true;
    s.pinned_num_register_threads = 4;
    expect_ok(host_apply_settings(f.h, &s));
    expect_ok(host_malloc(f.h, &b, 128 * KiB));
    expect_eq_u64(calls(&f, CCA_OP_HOST_ALLOC), 1);
    expect_eq_u64(calls(&f, CCA_OP_HOST_REGISTER), 1);
    expect_ok(host_release_ptr(f.h, a));
    expect_ok(host_release_ptr(f.h, b));
    expect_ok(host_empty_cache(f.h)); /* each freed the way it was allocated */
    expect_eq_u64(calls(&f, CCA_OP_HOST_FREE), 1);
    expect_eq_u64(calls(&f, CCA_OP_HOST_UNREGISTER), 1);
    expect_eq_u64(usage(&f).live_host, 0);
    fx_close(&f);
}

TEST(stats_after_each_operation)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *a, *b, *c;
    expect_ok(host_malloc(f.h, &a, 1000));
    cca_host_stats_t st = stats(&f);
    expect_stat(st.allocations, 1, 1, 1, 0);
    expect_stat(st.allocated_bytes, 1024, 1024, 1024, 0);
    expect_stat(st.active_requests, 1, 1, 1, 0);
    expect_stat(st.active_bytes, 1024, 1024, 1024, 0);
    expect_eq_i64(st.num_host_alloc, 1);
    expect_eq_i64(st.num_host_free, 0);
    expect_eq_i64(st.host_alloc_time.count, 1);
    expect_true(st.host_alloc_time.total >= 0);
    expect_true(st.host_alloc_time.min <= st.host_alloc_time.max);

    expect_ok(host_malloc(f.h, &b, 3000));
    st = stats(&f);
    expect_stat(st.allocations, 2, 2, 2, 0);
    expect_stat(st.allocated_bytes, 1024 + 4096, 1024 + 4096, 1024 + 4096, 0);
    expect_stat(st.active_requests, 2, 2, 2, 0);

    expect_ok(host_release_ptr(f.h, a));
    st = stats(&f);
    expect_stat(st.allocations, 2, 2, 2, 0);
    expect_stat(st.active_requests, 1, 2, 2, 1);
    expect_stat(st.active_bytes, 4096, 5120, 5120, 1024);

    expect_ok(host_malloc(f.h, &c, 600)); /* cache hit */
    expect_eq_ptr(c, a);
    st = stats(&f);
    expect_stat(st.allocations, 2, 2, 2, 0);
    expect_stat(st.active_requests, 2, 2, 3, 1);
    expect_stat(st.active_bytes, 5120, 5120, 6144, 1024);
    expect_eq_i64(st.num_host_alloc, 2);

    expect_ok(host_empty_cache(f.h)); /* both in use: nothing to free */
    st = stats(&f);
    expect_eq_i64(st.num_host_free, 0);

    expect_ok(host_release_ptr(f.h, b));
    expect_ok(host_release_ptr(f.h, c));
    expect_ok(host_empty_cache(f.h));
    st = stats(&f);
    expect_stat(st.allocations, 0, 2, 2, 2);
    expect_stat(st.allocated_bytes, 0, 5120, 5120, 5120);
    expect_stat(st.active_requests, 0, 2, 3, 3);
    expect_stat(st.active_bytes, 0, 5120, 6144, 6144);
    expect_eq_i64(st.num_host_free, 2);
    expect_eq_i64(st.host_free_time.count, 2);

    host_reset_peak_stats(f.h);
    st = stats(&f);
    expect_stat(st.allocations, 0, 0, 2, 2);
    expect_stat(st.active_bytes, 0, 0, 6144, 6144);
    expect_eq_i64(st.host_alloc_time.max, 0);
    expect_eq_i64(st.host_alloc_time.count, 2);

    host_reset_accumulated_stats(f.h);
    st = stats(&f);
    expect_stat(st.allocations, 0, 0, 0, 0);
    expect_stat(st.allocated_bytes, 0, 0, 0, 0);
    expect_stat(st.active_requests, 0, 0, 0, 0);
    expect_stat(st.active_bytes, 0, 0, 0, 0);
    expect_eq_i64(st.num_host_alloc, 0);
    expect_eq_i64(st.num_host_free, 0);
    expect_eq_i64(st.host_alloc_time.count, 0);
    expect_eq_i64(st.host_alloc_time.total, 0);
    expect_eq_i64(st.host_free_time.count, 0);

    /* Peaks follow current again after a reset. */
    expect_ok(host_malloc(f.h, &a, 2048));
    st = stats(&f);
    expect_stat(st.allocations, 1, 1, 1, 0);
    expect_stat(st.active_bytes, 2048, 2048, 2048, 0);
    expect_ok(host_release_ptr(f.h, a));
    expect_status(host_get_stats(f.h, NULL), CCA_ERR_INVALID_ARGUMENT);
    fx_close(&f);
}

TEST(empty_cache_returns_everything)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p[40];
    for (int i = 0; i < 40; i++)
        expect_ok(host_malloc(f.h, &p[i], (size_t)(i + 1) * 3000));
    expect_ok(host_record_event(f.h, p[5], S1));
    for (int i = 0; i < 40; i++)
        expect_ok(host_release_ptr(f.h, p[i]));
    expect_ok(host_empty_cache(f.h));
    /* p[5] waits for its event */
    expect_eq_u64(usage(&f).live_host, 1);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.allocations.current, 1);
    complete(&f, S1);
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    st = stats(&f);
    expect_stat(st.allocations, 0, 40, 40, 40);
    expect_eq_i64(st.allocated_bytes.current, 0);
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.active_bytes.current, 0);
    expect_true(host_is_valid(f.h));
    fx_close(&f);
}

TEST(misuse)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    int local;
    void *p;
    expect_ok(host_malloc(f.h, &p, 4096));
    expect_status(host_release_ptr(f.h, &local), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "not allocated by cca");
    expect_status(host_release_ptr(f.h, (char *)p + 8), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "inside the pinned block");
    expect_status(host_record_event(f.h, &local, S1), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "not allocated by cca");
    expect_status(host_record_event(f.h, NULL, S1), CCA_ERR_INVALID_POINTER);
    expect_status(host_record_event(f.h, (char *)p + 4096, S1), CCA_ERR_INVALID_POINTER);
    expect_ok(host_record_event(f.h, (char *)p + 4095, S1));
    expect_ok(host_release_ptr(f.h, p));
    expect_status(host_release_ptr(f.h, p), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "already freed");
    expect_status(host_record_event(f.h, p, S2), CCA_ERR_INVALID_POINTER);
    expect_status(host_record_event(f.h, (char *)p + 1, S2), CCA_ERR_INVALID_POINTER);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.active_requests.current, 1); /* p still waits on S1 */
    expect_eq_i64(st.active_requests.freed, 0);
    complete(&f, S1);
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    fx_close(&f);
}

TEST(fault_host_alloc)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p = NULL;
    expect_ok(cca_sim_inject_fault(f.be, CCA_OP_HOST_ALLOC, 1, false, CCA_ERR_OUT_OF_MEMORY));
    expect_status(host_malloc(f.h, &p, 4096), CCA_ERR_OUT_OF_MEMORY);
    expect_eq_ptr(p, NULL);
    cca_host_stats_t st = stats(&f);
    expect_stat(st.allocations, 0, 0, 0, 0);
    expect_eq_i64(st.num_host_alloc, 0);
    expect_eq_i64(st.active_requests.current, 0);
    expect_ok(host_malloc(f.h, &p, 4096));
    expect_ok(host_release_ptr(f.h, p));
    fx_close(&f);
}

TEST(fault_host_register)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_cuda_host_register = true;
    s.pinned_num_register_threads = 2;
    if (!fx_open(&f, &s))
        return;
    void *p = NULL;
    expect_ok(cca_sim_inject_fault(f.be, CCA_OP_HOST_REGISTER, 1, false, CCA_ERR_BACKEND));
    expect_status(host_malloc(f.h, &p, 64 * KiB), CCA_ERR_BACKEND);
    expect_eq_ptr(p, NULL);
    expect_eq_u64(usage(&f).live_host, 0);
    expect_eq_i64(stats(&f).num_host_alloc, 0);
    expect_ok(host_malloc(f.h, &p, 64 * KiB));
    expect_ok(host_release_ptr(f.h, p));
    /* unregister failing at empty_cache keeps the block cached */
    expect_ok(cca_sim_inject_fault(f.be, CCA_OP_HOST_UNREGISTER, 1, false, CCA_ERR_BACKEND));
    expect_status(host_empty_cache(f.h), CCA_ERR_BACKEND);
    expect_eq_u64(usage(&f).live_host, 1);
    expect_eq_i64(stats(&f).allocations.current, 1);
    expect_true(host_is_valid(f.h));
    void *q;
    expect_ok(host_malloc(f.h, &q, 64 * KiB));
    expect_eq_ptr(q, p);
    expect_ok(host_release_ptr(f.h, q));
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    fx_close(&f);
}

TEST(fault_host_free_at_empty_cache)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p;
    expect_ok(host_malloc(f.h, &p, 4096));
    expect_ok(host_release_ptr(f.h, p));
    expect_ok(cca_sim_inject_fault(f.be, CCA_OP_HOST_FREE, 1, false, CCA_ERR_BACKEND));
    expect_status(host_empty_cache(f.h), CCA_ERR_BACKEND);
    expect_eq_i64(stats(&f).num_host_free, 0);
    expect_eq_u64(usage(&f).live_host, 1);
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    expect_eq_i64(stats(&f).num_host_free, 1);
    fx_close(&f);
}

/* Free fails cleanly when the nth event create/record fails, and can be retried. */
static void event_fault(cca_backend_op_t op)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open(&f, &s))
        return;
    void *p;
    expect_ok(host_malloc(f.h, &p, 4096));
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_record_event(f.h, p, S2));
    expect_ok(cca_sim_inject_fault(f.be, op, 2, false, CCA_ERR_BACKEND));
    expect_status(host_release_ptr(f.h, p), CCA_ERR_BACKEND);
    /* Nothing changed: still allocated, still recorded on both streams. */
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.active_requests.current, 1);
    expect_eq_u64(cca_sim_pending_events(f.be), 1); /* S1's event, back in the pool */
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_u64(usage(&f).live_events, 2);
    void *q;
    expect_ok(host_malloc(f.h, &q, 4096));
    expect_ne_u64((uintptr_t)q, (uintptr_t)p);
    expect_ok(host_release_ptr(f.h, q));
    expect_ok(cca_sim_complete_stream(f.be, 0, NULL, true));
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    expect_eq_u64(usage(&f).live_events, 0); /* pooled events went back too */
    fx_close(&f);
}

TEST(fault_event_create)
{
    event_fault(CCA_OP_EVENT_CREATE);
}

TEST(fault_event_record)
{
    event_fault(CCA_OP_EVENT_RECORD);
}

/*
 * Host memory for the allocator's own records running out in a miss (the
 * block record, then the range array's growth at its 65th block) fails the
 * allocation with CCA_ERR_OUT_OF_MEMORY and keeps nothing: no pinned memory
 * held from the system, no bytes carved from the reserve segment, every
 * statistic as before, and the next allocation gets what the failed one
 * would have had. Before, a carve was lost to the segment for good, and
 * system memory was taken and given back (counted in both directions).
 */
static void records_fault(bool reg, bool reserve)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_cuda_host_register = reg;
    s.pinned_reserve_segment_size = reserve ? 1 * MiB : 0;
    if (!fx_open(&f, &s))
        return;
    void *p[65] = {0};
    for (int i = 0; i < 64; i++) /* the range array's first 64 places taken */
        expect_ok(host_malloc(f.h, &p[i], 4096));
    for (long n = 1; n <= 2; n++) {
        cca_host_stats_t before = stats(&f);
        uint64_t live = usage(&f).live_host;
        void *q = NULL;
        host_test_fail_records(n);
        expect_status(host_malloc(f.h, &q, 4096), CCA_ERR_OUT_OF_MEMORY);
        host_test_fail_records(0);
        expect_contains(cca_last_error()->message, "out of host memory");
        expect_eq_ptr(q, NULL);
        expect_true(host_is_valid(f.h));
        expect_eq_u64(usage(&f).live_host, live);
        cca_host_stats_t after = stats(&f);
        expect_stat(after.allocations, before.allocations.current, before.allocations.peak,
                    before.allocations.allocated, before.allocations.freed);
        expect_stat(after.allocated_bytes, before.allocated_bytes.current,
                    before.allocated_bytes.peak, before.allocated_bytes.allocated,
                    before.allocated_bytes.freed);
        expect_stat(after.active_requests, before.active_requests.current,
                    before.active_requests.peak, before.active_requests.allocated,
                    before.active_requests.freed);
        expect_eq_i64(after.num_host_alloc, before.num_host_alloc);
        expect_eq_i64(after.num_host_free, before.num_host_free);
        expect_eq_i64(after.host_alloc_time.count, before.host_alloc_time.count);
        expect_eq_i64(after.host_free_time.count, before.host_free_time.count);
    }
    expect_ok(host_malloc(f.h, &p[64], 4096));
    if (reserve) /* the carve the failed allocations would have had */
        expect_eq_ptr(p[64], (char *)p[0] + 64 * 4096);
    cca_host_stats_t st = stats(&f);
    expect_stat(st.allocations, 65, 65, 65, 0);
    expect_eq_i64(st.num_host_alloc, reserve ? 1 : 65);
    expect_eq_i64(st.num_host_free, 0);
    for (int i = 0; i < 65; i++)
        expect_ok(host_release_ptr(f.h, p[i]));
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, reserve ? 1 : 0);
    fx_close(&f);
}

TEST(out_of_memory_for_records_keeps_nothing)
{
    records_fault(false, false);
    records_fault(true, false);
    records_fault(false, true);
}

/*
 * A scenario run with the nth call of op failing (once, or from then on):
 * each call ends in success or a clean error, the allocator stays valid,
 * and nothing leaks. Returns true when no fault fired (the loop is done).
 */
static bool fault_scenario(cca_backend_op_t op, uint64_t nth, bool persistent, bool reg)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_cuda_host_register = reg;
    s.pinned_num_register_threads = 2;
    s.pinned_reserve_segment_size = 64 * KiB;
    s.pinned_max_cached_size = 256 * KiB;
    if (!fx_open(&f, &s))
        return true;
    expect_ok(cca_sim_inject_fault(f.be, op, nth, persistent, CCA_ERR_BACKEND));
    uint64_t before = calls(&f, op);
    void *p[6] = {0};
    size_t sizes[6] = {100, 5000, 40 * KiB, 300 * KiB, 1 * MiB, 100};
    int failures = 0;
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < 6; i++) {
            if (host_malloc(f.h, &p[i], sizes[i]) != CCA_OK) {
                failures++;
                p[i] = NULL;
                continue;
            }
            memset(p[i], i, sizes[i]);
            if (host_record_event(f.h, p[i], i % 2 ? S1 : S2) != CCA_OK)
                failures++;
        }
        for (int i = 0; i < 6; i++) {
            if (p[i] && host_release_ptr(f.h, p[i]) != CCA_OK) {
                failures++;
                /* a failed free changes nothing: retry once the fault passed */
                if (!persistent && host_release_ptr(f.h, p[i]) != CCA_OK)
                    HARNESS_FAIL("free retry failed after %s fault %" PRIu64,
                                 cca_backend_op_name(op), nth);
            }
            p[i] = NULL;
        }
        (void)cca_sim_complete_stream(f.be, 0, NULL, true);
        if (host_empty_cache(f.h) != CCA_OK)
            failures++;
        if (!host_is_valid(f.h))
            HARNESS_FAIL("invalid after %s fault %" PRIu64, cca_backend_op_name(op), nth);
    }
    bool fired = calls(&f, op) - before >= nth;
    cca_sim_clear_faults(f.be);
    /* Whatever happened, destroy gives everything back (persistent frees may have failed). */
    fx_close(&f);
    (void)failures;
    return !fired;
}

TEST(fault_loops)
{
    const cca_backend_op_t ops[] = {CCA_OP_HOST_ALLOC,    CCA_OP_HOST_FREE,
                                    CCA_OP_HOST_REGISTER, CCA_OP_HOST_UNREGISTER,
                                    CCA_OP_EVENT_CREATE,  CCA_OP_EVENT_RECORD,
                                    CCA_OP_EVENT_QUERY,   CCA_OP_STREAM_CAPTURE_STATUS};
    for (size_t k = 0; k < sizeof(ops) / sizeof(ops[0]); k++) {
        bool reg = ops[k] == CCA_OP_HOST_REGISTER || ops[k] == CCA_OP_HOST_UNREGISTER;
        for (int persistent = 0; persistent < 2; persistent++) {
            uint64_t nth = 1;
            while (!fault_scenario(ops[k], nth, persistent, reg) && nth < 100)
                nth++;
            expect_true(nth < 100);
        }
    }
}

/* ---- threads ---------------------------------------------------------------- */

#define THREADS 8
#define SLOTS 64
#define STEPS 4000

typedef struct exchange {
    pthread_mutex_t lock;
    void *ptr[SLOTS];
    size_t size[SLOTS];
    unsigned char tag[SLOTS];
} exchange_t;

typedef struct worker {
    host_alloc_t *h;
    exchange_t *x;
    unsigned seed;
    int errors;
} worker_t;

static unsigned next_rand(unsigned *s)
{
    *s = *s * 1103515245u + 12345u;
    return *s >> 8;
}

/* Each step puts a new block into a random slot; the block it displaces
 * (allocated by any thread) is checked and freed here. */
static void *worker_main(void *arg)
{
    worker_t *w = arg;
    for (int step = 0; step < STEPS; step++) {
        size_t size = (size_t)1 << (next_rand(&w->seed) % 17);
        size += next_rand(&w->seed) % size;
        void *p;
        if (host_malloc(w->h, &p, size) != CCA_OK) {
            w->errors++;
            continue;
        }
        unsigned char tag = (unsigned char)next_rand(&w->seed);
        memset(p, tag, size);
        if (host_record_event(w->h, (char *)p + size / 2,
                              (cca_stream_t)(uintptr_t)(1 + next_rand(&w->seed) % 4)) != CCA_OK)
            w->errors++;
        unsigned slot = next_rand(&w->seed) % SLOTS;
        pthread_mutex_lock(&w->x->lock);
        void *old = w->x->ptr[slot];
        size_t old_size = w->x->size[slot];
        unsigned char old_tag = w->x->tag[slot];
        w->x->ptr[slot] = p;
        w->x->size[slot] = size;
        w->x->tag[slot] = tag;
        pthread_mutex_unlock(&w->x->lock);
        if (old) {
            const unsigned char *c = old;
            if (c[0] != old_tag || c[old_size - 1] != old_tag || c[old_size / 2] != old_tag)
                w->errors++;
            if (host_release_ptr(w->h, old) != CCA_OK)
                w->errors++;
        }
    }
    return NULL;
}

static void run_threads(bool background)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_background_threads = background;
    if (!fx_open_events(&f, &s, false)) /* events complete at once */
        return;
    exchange_t x;
    memset(&x, 0, sizeof(x));
    pthread_mutex_init(&x.lock, NULL);
    worker_t w[THREADS];
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) {
        w[i] = (worker_t){f.h, &x, 1234u + (unsigned)i * 7919u, 0};
        pthread_create(&t[i], NULL, worker_main, &w[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        expect_eq_i64(w[i].errors, 0);
    }
    for (int i = 0; i < SLOTS; i++)
        if (x.ptr[i])
            expect_ok(host_release_ptr(f.h, x.ptr[i]));
    pthread_mutex_destroy(&x.lock);
    /* Wait for every event to be collected (by the thread, or here). */
    uint64_t deadline = cca_now_ns() + 10ull * 1000000000ull;
    cca_host_stats_t st = stats(&f);
    while (st.active_requests.current != 0 && cca_now_ns() < deadline) {
        if (!background)
            expect_ok(host_empty_cache(f.h));
        sched_yield();
        st = stats(&f);
    }
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.active_bytes.current, 0);
    expect_eq_i64(st.active_requests.allocated, THREADS * STEPS);
    expect_true(st.num_host_alloc < THREADS * STEPS); /* the cache served most */
    expect_true(host_is_valid(f.h));
    expect_ok(host_empty_cache(f.h));
    expect_eq_u64(usage(&f).live_host, 0);
    expect_eq_i64(stats(&f).allocations.current, 0);
    fx_close(&f);
}

TEST(eight_threads)
{
    run_threads(false);
}

TEST(eight_threads_background)
{
    run_threads(true);
}

/*
 * Exact peaks across threads: each round, every thread takes one block of its
 * own size, all meet at a barrier (so all are live at once), then free; the
 * active peaks must be exactly the round's sum, whatever the interleaving.
 */
typedef struct peak_worker {
    host_alloc_t *h;
    pthread_barrier_t *barrier;
    size_t size;
    int errors;
} peak_worker_t;

#define PEAK_ROUNDS 200

static void *peak_worker_main(void *arg)
{
    peak_worker_t *w = arg;
    for (int round = 0; round < PEAK_ROUNDS; round++) {
        void *p = NULL;
        if (host_malloc(w->h, &p, w->size) != CCA_OK)
            w->errors++;
        pthread_barrier_wait(w->barrier);
        if (host_release_ptr(w->h, p) != CCA_OK)
            w->errors++;
        pthread_barrier_wait(w->barrier);
    }
    return NULL;
}

TEST(exact_peaks_across_threads)
{
    fixture_t f;
    cca_settings_t s = defaults();
    if (!fx_open_events(&f, &s, false))
        return;
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, THREADS);
    peak_worker_t w[THREADS];
    pthread_t t[THREADS];
    int64_t bytes = 0;
    for (int i = 0; i < THREADS; i++) {
        w[i] = (peak_worker_t){f.h, &barrier, (size_t)4096 << i, 0};
        bytes += (int64_t)4096 << i; /* powers of two: the rounded sizes */
        pthread_create(&t[i], NULL, peak_worker_main, &w[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        expect_eq_i64(w[i].errors, 0);
    }
    pthread_barrier_destroy(&barrier);
    cca_host_stats_t st = stats(&f);
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.active_bytes.current, 0);
    expect_eq_i64(st.active_requests.peak, THREADS);
    expect_eq_i64(st.active_bytes.peak, bytes);
    expect_eq_i64(st.active_requests.allocated, THREADS * PEAK_ROUNDS);
    expect_eq_i64(st.active_bytes.allocated, bytes * PEAK_ROUNDS);
    fx_close(&f);
}

/* Poll the statistics (bounded, no sleeps) until active_requests reaches want. */
static bool wait_active(fixture_t *f, int64_t want)
{
    uint64_t deadline = cca_now_ns() + 10ull * 1000000000ull;
    while (cca_now_ns() < deadline) {
        if (stats(f).active_requests.current == want)
            return true;
        sched_yield();
    }
    return false;
}

TEST(background_thread)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_use_background_threads = true;
    if (!fx_open(&f, &s))
        return;
    void *p, *q;
    expect_ok(host_malloc(f.h, &p, 32 * KiB));
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_release_ptr(f.h, p));
    expect_eq_i64(stats(&f).active_requests.current, 1);
    uint64_t queries = calls(&f, CCA_OP_EVENT_QUERY);
    complete(&f, S1);
    /* The thread, not an allocation, makes the block available. */
    expect_true(wait_active(&f, 0));
    expect_true(calls(&f, CCA_OP_EVENT_QUERY) > queries);
    expect_ok(host_malloc(f.h, &q, 32 * KiB));
    expect_eq_ptr(q, p);

    /* Switched off at run time: allocation collects events again. */
    s.pinned_use_background_threads = false;
    expect_ok(host_apply_settings(f.h, &s));
    expect_ok(host_record_event(f.h, q, S2));
    expect_ok(host_release_ptr(f.h, q));
    complete(&f, S2);
    expect_ok(host_malloc(f.h, &q, 32 * KiB));
    expect_eq_ptr(q, p);
    /* And on again, with an event still pending at destroy. */
    s.pinned_use_background_threads = true;
    expect_ok(host_apply_settings(f.h, &s));
    expect_ok(host_record_event(f.h, q, S3));
    expect_ok(host_release_ptr(f.h, q));
    fx_close(&f);
}

/*
 * Settings whose event thread cannot start change nothing: the call fails
 * with CCA_ERR_BACKEND, allocations keep the old rounding threshold and go
 * on collecting completed events themselves. Before, the new settings were
 * stored first, so the allocator ran on half-applied settings, relying on a
 * thread that did not exist (a freed block used on a stream never came back
 * until empty_cache).
 */
TEST(failed_thread_start_changes_no_setting)
{
    fixture_t f;
    cca_settings_t s = defaults();
    s.pinned_max_round_threshold = 1 * MiB;
    if (!fx_open(&f, &s))
        return;
    void *p, *q;
    expect_ok(host_malloc(f.h, &p, 32 * KiB));
    cca_settings_t next = s;
    next.pinned_use_background_threads = true;
    next.pinned_max_round_threshold = 64 * KiB;
    host_test_fail_background_start(true);
    expect_status(host_apply_settings(f.h, &next), CCA_ERR_BACKEND);
    host_test_fail_background_start(false);
    expect_contains(cca_last_error()->message, "event thread");
    /* events are still collected by allocations: the block comes back once S1 is done */
    expect_ok(host_record_event(f.h, p, S1));
    expect_ok(host_release_ptr(f.h, p));
    complete(&f, S1);
    expect_ok(host_malloc(f.h, &q, 32 * KiB));
    expect_eq_ptr(q, p);
    /* the old threshold: 100 KiB + 1 byte still rounds to a power of two */
    int64_t bytes = stats(&f).allocated_bytes.current;
    void *r, *t;
    expect_ok(host_malloc(f.h, &r, 100 * KiB + 1));
    expect_eq_i64(stats(&f).allocated_bytes.current, bytes + (int64_t)(128 * KiB));
    /* the same settings apply once the thread can start: above 64 KiB, pages */
    expect_ok(host_apply_settings(f.h, &next));
    bytes = stats(&f).allocated_bytes.current;
    expect_ok(host_malloc(f.h, &t, 200 * KiB + 1));
    expect_eq_i64(stats(&f).allocated_bytes.current, bytes + (int64_t)(204 * KiB));
    expect_ok(host_release_ptr(f.h, r));
    expect_ok(host_release_ptr(f.h, t));
    expect_ok(host_release_ptr(f.h, q));
    fx_close(&f);
}

TEST(public_functions_on_the_global_instance)
{
    void *p = NULL;
    cca_status_t st = cca_host_malloc(&p, 100);
    if (!init_stub_used) {
        /* The core is linked: cca_init set the global instance up. */
        expect_ok(st);
        expect_ok(cca_host_free(p));
        return;
    }
    expect_status(st, CCA_ERR_NOT_INITIALIZED);
    expect_status(cca_host_free(p), CCA_ERR_NOT_INITIALIZED);
    expect_status(cca_host_empty_cache(), CCA_ERR_NOT_INITIALIZED);

    cca_sim_config_t cfg = {0};
    cfg.manual_events = true;
    cca_backend_t *be;
    if (cca_sim_create(&cfg, &be) != CCA_OK)
        return;
    cca_settings_t s = defaults();
    expect_ok(host_global_init(be, &s));
    expect_status(host_global_init(be, &s), CCA_ERR_BUSY);
    expect_true(host_global() != NULL);
    expect_ok(cca_host_malloc(&p, 100));
    expect_ok(cca_host_record_event((char *)p + 10, S1));
    expect_ok(cca_host_free(p));
    expect_status(cca_host_free(p), CCA_ERR_INVALID_POINTER);
    cca_host_stats_t hs;
    expect_ok(cca_host_get_stats(&hs));
    expect_eq_i64(hs.active_requests.current, 1);
    expect_ok(cca_sim_complete_stream(be, 0, S1, false));
    expect_ok(cca_host_empty_cache());
    expect_ok(cca_host_get_stats(&hs));
    expect_eq_i64(hs.allocations.current, 0);
    expect_ok(cca_host_reset_peak_stats());
    expect_ok(cca_host_reset_accumulated_stats());
    expect_ok(cca_host_get_stats(&hs));
    expect_stat(hs.allocations, 0, 0, 0, 0);
    host_global_shutdown();
    expect_true(host_global() == NULL);
    expect_status(cca_host_malloc(&p, 100), CCA_ERR_NOT_INITIALIZED);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(be, &u));
    expect_eq_u64(u.live_host, 0);
    expect_eq_u64(u.live_events, 0);
    be->destroy(be->ctx);
}

int main(void)
{
    RUN(size_zero_huge_and_null);
    RUN(power_of_two_rounding_and_classes);
    RUN(free_list_is_lifo);
    RUN(reuse_only_after_events_complete);
    RUN(captured_use_keeps_the_block);
    RUN(several_streams_per_block);
    RUN(more_streams_than_inline_slots_and_event_pool);
    RUN(round_threshold);
    RUN(cached_size_limit);
    RUN(reserve_segment);
    RUN(register_mode_one_thread);
    RUN(register_mode_eight_threads);
    RUN(register_mode_address_mismatch);
    RUN(modes_switch_at_run_time);
    RUN(stats_after_each_operation);
    RUN(empty_cache_returns_everything);
    RUN(misuse);
    RUN(fault_host_alloc);
    RUN(fault_host_register);
    RUN(fault_host_free_at_empty_cache);
    RUN(fault_event_create);
    RUN(fault_event_record);
    RUN(out_of_memory_for_records_keeps_nothing);
    RUN(fault_loops);
    RUN(eight_threads);
    RUN(exact_peaks_across_threads);
    RUN(eight_threads_background);
    RUN(background_thread);
    RUN(failed_thread_start_changes_no_setting);
    RUN(public_functions_on_the_global_instance);
    return harness_done();
}
