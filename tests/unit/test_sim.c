/*
 * test_sim.c - the simulated backend, driven directly through its function
 * table: addresses, capacity, events, faults, memory modes, VMM, host memory,
 * IPC, leak accounting and concurrent use.
 */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>

#include "harness.h"
#include "internal.h"

#define GiB CCA_GiB
#define MiB CCA_MiB

static cca_backend_t *make(const cca_sim_config_t *cfg)
{
    cca_backend_t *b = NULL;
    cca_status_t st = cca_sim_create(cfg, &b);
    if (st != CCA_OK) {
        printf("  cca_sim_create: %s: %s\n", cca_status_str(st), cca_last_error()->message);
        exit(1);
    }
    return b;
}

static void *xmalloc(cca_backend_t *b, int device, size_t size)
{
    void *p = NULL;
    expect_ok(b->malloc(b->ctx, device, size, &p));
    return p;
}

static void expect_no_leaks(cca_backend_t *b)
{
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    for (int d = 0; d < 16; d++)
        expect_eq_u64(u.device_bytes[d], 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(u.live_reservations, 0);
    expect_eq_u64(u.live_handles, 0);
    expect_eq_u64(u.live_host, 0);
}

/* ---- creation ---------------------------------------------------------------- */

TEST(create_defaults)
{
    cca_backend_t *b = make(NULL);
    int n = 0;
    expect_eq_str(b->name, "sim");
    expect_ok(b->device_count(b->ctx, &n));
    expect_eq_i64(n, 1);
    cca_device_props_t props;
    expect_ok(b->device_props(b->ctx, 0, &props));
    expect_eq_u64(props.total_memory, 80 * GiB);
    expect_contains(props.name, "simulated");
    size_t g = 0;
    expect_ok(b->vmm_granularity(b->ctx, 0, &g));
    expect_eq_u64(g, 2 * MiB);
    b->destroy(b->ctx);
}

TEST(create_rejects_bad_config)
{
    cca_backend_t *b = NULL;
    cca_sim_config_t cfg = {0};
    cfg.devices = 17;
    expect_status(cca_sim_create(&cfg, &b), CCA_ERR_INVALID_ARGUMENT);
    cfg.devices = -1;
    expect_status(cca_sim_create(&cfg, &b), CCA_ERR_INVALID_ARGUMENT);
    cfg.devices = 1;
    cfg.granularity = 3000;
    expect_status(cca_sim_create(&cfg, &b), CCA_ERR_INVALID_ARGUMENT);
    cfg.granularity = 0;
    uint64_t list[] = {0x10000000};
    cfg.backed = true;
    cfg.addresses = list;
    cfg.address_count = 1;
    expect_status(cca_sim_create(&cfg, &b), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "backed");
    cfg.backed = false;
    list[0] = 0;
    expect_status(cca_sim_create(&cfg, &b), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_create(NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_ptr(b, NULL);
}

TEST(current_device_is_per_thread)
{
    cca_sim_config_t cfg = {.devices = 4};
    cca_backend_t *b = make(&cfg);
    int d = -1;
    expect_ok(b->get_device(b->ctx, &d));
    expect_eq_i64(d, 0);
    expect_ok(b->set_device(b->ctx, 3));
    expect_ok(b->get_device(b->ctx, &d));
    expect_eq_i64(d, 3);
    expect_status(b->set_device(b->ctx, 4), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->set_device(b->ctx, -1), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->get_device(b->ctx, &d));
    expect_eq_i64(d, 3);
    /* a second backend has its own current device */
    cca_backend_t *b2 = make(&cfg);
    expect_ok(b2->get_device(b2->ctx, &d));
    expect_eq_i64(d, 0);
    b2->destroy(b2->ctx);
    b->destroy(b->ctx);
}

static void *get_device_thread(void *arg)
{
    cca_backend_t *b = arg;
    int d = -1;
    b->get_device(b->ctx, &d);
    return (void *)(intptr_t)d;
}

TEST(current_device_new_thread_starts_at_zero)
{
    cca_sim_config_t cfg = {.devices = 2};
    cca_backend_t *b = make(&cfg);
    expect_ok(b->set_device(b->ctx, 1));
    pthread_t t;
    void *ret = NULL;
    pthread_create(&t, NULL, get_device_thread, b);
    pthread_join(t, &ret);
    expect_eq_i64((intptr_t)ret, 0);
    b->destroy(b->ctx);
}

/* ---- addresses -------------------------------------------------------------- */

static void alloc_sequence(uint64_t out[8])
{
    cca_sim_config_t cfg = {.devices = 2};
    cca_backend_t *b = make(&cfg);
    void *p[8];
    size_t sizes[8] = {1000, 2 * MiB, 512, 3 * MiB + 1, 100, 20 * MiB, 1, 4096};
    for (int i = 0; i < 6; i++)
        p[i] = xmalloc(b, i & 1, sizes[i]);
    expect_ok(b->free(b->ctx, 1, p[1]));
    expect_ok(b->free(b->ctx, 0, p[2]));
    p[6] = xmalloc(b, 0, sizes[6]);
    p[7] = xmalloc(b, 1, sizes[7]);
    for (int i = 0; i < 8; i++)
        out[i] = (uint64_t)(uintptr_t)p[i];
    b->destroy(b->ctx);
}

TEST(deterministic_addresses)
{
    uint64_t a[8], b[8];
    alloc_sequence(a);
    alloc_sequence(b);
    for (int i = 0; i < 8; i++)
        expect_eq_u64(a[i], b[i]);
    /* alignment: 2 MiB for sizes >= 2 MiB, 512 bytes otherwise */
    expect_eq_u64(a[1] % (2 * MiB), 0);
    expect_eq_u64(a[3] % (2 * MiB), 0);
    expect_eq_u64(a[5] % (2 * MiB), 0);
    for (int i = 0; i < 8; i++)
        expect_eq_u64(a[i] % 512, 0);
    /* each device has its own range: device 0 below device 1 */
    expect_true(a[0] < a[1]);
    expect_true(a[0] >= 0x7f0000000000ull);
    /* freed ranges are reused: the 1-byte block lands where the 512-byte one was */
    expect_eq_u64(a[6], a[2]);
    expect_eq_u64(a[7], a[1]);
}

TEST(deterministic_no_overlap_first_fit)
{
    cca_backend_t *b = make(NULL);
    void *x = xmalloc(b, 0, 1000);  /* 1024 bytes at the window start */
    void *y = xmalloc(b, 0, 512);
    expect_eq_u64((uintptr_t)y - (uintptr_t)x, 1024);
    void *big = xmalloc(b, 0, 2 * MiB);
    expect_eq_u64((uintptr_t)big - (uintptr_t)x, 2 * MiB); /* next 2 MiB boundary */
    void *z = xmalloc(b, 0, 100); /* first fit: the gap after y */
    expect_eq_u64((uintptr_t)z - (uintptr_t)y, 512);
    expect_ok(b->free(b->ctx, 0, x));
    expect_ok(b->free(b->ctx, 0, y));
    expect_ok(b->free(b->ctx, 0, z));
    /* everything below big merged back: 1.5 MiB fits at the start again */
    void *w = xmalloc(b, 0, MiB + MiB / 2);
    expect_eq_ptr(w, x);
    expect_ok(b->free(b->ctx, 0, w));
    expect_ok(b->free(b->ctx, 0, big));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(long_run_reuses_address_space)
{
    /* 10000 x 40 GiB = 400 TiB would overflow a 1 TiB window without reuse */
    cca_backend_t *b = make(NULL);
    void *first = xmalloc(b, 0, 40 * GiB);
    expect_ok(b->free(b->ctx, 0, first));
    for (int i = 0; i < 10000; i++) {
        void *p = NULL;
        expect_ok(b->malloc(b->ctx, 0, 40 * GiB, &p));
        expect_eq_ptr(p, first);
        expect_ok(b->free(b->ctx, 0, p));
    }
    b->destroy(b->ctx);
}

TEST(address_list_in_order)
{
    uint64_t list[] = {0x7f1234000000ull, 0x7f1200000000ull, 0x10000000ull};
    cca_sim_config_t cfg = {.devices = 2, .addresses = list, .address_count = 3};
    cca_backend_t *b = make(&cfg);
    list[0] = 0xdead; /* the list was copied */
    expect_eq_u64((uintptr_t)xmalloc(b, 0, 4 * MiB), 0x7f1234000000ull);
    expect_eq_u64((uintptr_t)xmalloc(b, 1, 1000), 0x7f1200000000ull);
    void *r = NULL;
    expect_ok(b->vmm_reserve(b->ctx, 0, 64 * MiB, &r));
    expect_eq_u64((uintptr_t)r, 0x10000000ull);
    uint64_t more[] = {0x20000000ull};
    expect_ok(cca_sim_push_addresses(b, more, 1));
    expect_eq_u64((uintptr_t)xmalloc(b, 0, 100), 0x20000000ull);
    /* exhausted: the deterministic rule again */
    void *p = xmalloc(b, 0, 100);
    expect_true((uintptr_t)p >= 0x7f0000000000ull);
    b->destroy(b->ctx);
}

TEST(address_list_exhaustion_avoids_list_ranges)
{
    /* the list takes the start of device 0's window; the rule must skip it */
    uint64_t list[] = {0x7f0000000000ull, 0x7f0000400000ull};
    cca_sim_config_t cfg = {.addresses = list, .address_count = 2};
    cca_backend_t *b = make(&cfg);
    void *a = xmalloc(b, 0, 2 * MiB);
    void *c = xmalloc(b, 0, 1000);
    expect_eq_u64((uintptr_t)a, 0x7f0000000000ull);
    expect_eq_u64((uintptr_t)c, 0x7f0000400000ull);
    void *d = xmalloc(b, 0, 2 * MiB); /* the hole between them */
    expect_eq_u64((uintptr_t)d, 0x7f0000200000ull);
    void *e = xmalloc(b, 0, 512); /* after c's 1000 bytes, 512-aligned */
    expect_eq_u64((uintptr_t)e, 0x7f0000400000ull + 1024);
    /* after freeing a list range it can be reused by the rule */
    expect_ok(b->free(b->ctx, 0, a));
    void *f = xmalloc(b, 0, 2 * MiB);
    expect_eq_u64((uintptr_t)f, 0x7f0000000000ull);
    b->destroy(b->ctx);
}

TEST(address_list_entry_across_windows)
{
    /* device 1's window starts 1 TiB after device 0's: an entry straddling the
     * boundary is carved out of both */
    const uint64_t w1 = 0x7f0000000000ull + ((uint64_t)1 << 40);
    uint64_t list[] = {w1 - 2 * MiB};
    cca_sim_config_t cfg = {.devices = 2, .addresses = list, .address_count = 1};
    cca_backend_t *b = make(&cfg);
    void *a = xmalloc(b, 0, 4 * MiB);
    expect_eq_u64((uintptr_t)a, list[0]);
    void *c = xmalloc(b, 1, 2 * MiB);
    expect_eq_u64((uintptr_t)c, w1 + 2 * MiB);
    expect_ok(b->free(b->ctx, 0, a));
    void *d = xmalloc(b, 1, 2 * MiB); /* the freed part of device 1's window is reused */
    expect_eq_u64((uintptr_t)d, w1);
    expect_ok(b->free(b->ctx, 1, c));
    expect_ok(b->free(b->ctx, 1, d));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(address_list_overlap_fails)
{
    cca_backend_t *b = make(NULL);
    void *a = xmalloc(b, 0, 4 * MiB);
    uint64_t list[] = {(uint64_t)(uintptr_t)a + 2 * MiB};
    expect_ok(cca_sim_push_addresses(b, list, 1));
    void *p = NULL;
    expect_status(b->malloc(b->ctx, 0, 1000, &p), CCA_ERR_BACKEND);
    expect_contains(cca_last_error()->message, "overlaps");
    expect_eq_ptr(p, NULL);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.live_allocations, 1);
    expect_eq_u64(u.device_bytes[0], 4 * MiB);
    /* the entry was not consumed: after freeing a it succeeds */
    expect_ok(b->free(b->ctx, 0, a));
    expect_eq_u64((uintptr_t)xmalloc(b, 0, 1000), list[0]);
    /* push rejects 0 and NULL */
    uint64_t zero = 0;
    expect_status(cca_sim_push_addresses(b, &zero, 1), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_push_addresses(b, NULL, 2), CCA_ERR_INVALID_ARGUMENT);
    b->destroy(b->ctx);
}

TEST(address_list_rejected_in_backed_mode)
{
    cca_sim_config_t cfg = {.backed = true};
    cca_backend_t *b = make(&cfg);
    uint64_t list[] = {0x10000000ull};
    expect_status(cca_sim_push_addresses(b, list, 1), CCA_ERR_INVALID_ARGUMENT);
    b->destroy(b->ctx);
}

/* An address source: hands out the entries of a fixed list two at a time, then says it ended. */
typedef struct source_state {
    const uint64_t *list;
    size_t count, next, calls;
} source_state_t;

static bool source_two(void *ctx, uint64_t *out, size_t cap, size_t *got)
{
    source_state_t *s = ctx;
    s->calls++;
    *got = 0;
    while (*got < 2 && *got < cap && s->next < s->count)
        out[(*got)++] = s->list[s->next++];
    return s->next < s->count || *got;
}

TEST(address_source_grows_the_list)
{
    static const uint64_t list[] = {0x10000000ull, 0x20000000ull, 0x30000000ull};
    source_state_t src = {list, 3, 0, 0};
    cca_backend_t *b = make(NULL);
    expect_ok(cca_sim_set_address_source(b, source_two, &src));
    /* asked only when the list runs out: the first call brings two entries */
    expect_eq_u64((uintptr_t)xmalloc(b, 0, 4 * MiB), list[0]);
    expect_eq_u64(src.calls, 1);
    expect_eq_u64((uintptr_t)xmalloc(b, 0, 100), list[1]);
    expect_eq_u64(src.calls, 1);
    void *r = NULL;
    expect_ok(b->vmm_reserve(b->ctx, 0, 64 * MiB, &r));
    expect_eq_u64((uintptr_t)r, list[2]);
    /* ended (nothing more, false): the rule from then on, the source never asked again */
    void *p = xmalloc(b, 0, 100);
    expect_true((uintptr_t)p >= 0x7f0000000000ull);
    size_t calls = src.calls;
    xmalloc(b, 0, 100);
    expect_eq_u64(src.calls, calls);
    /* the peak of device bytes: 4 MiB + 100 + 100 + 100 (the reservation is not memory) */
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.device_peak_bytes[0], 4 * MiB + 300);
    expect_ok(b->free(b->ctx, 0, p));
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.device_peak_bytes[0], 4 * MiB + 300);
    expect_eq_u64(u.device_bytes[0], 4 * MiB + 200);
    b->destroy(b->ctx);
    /* a backed device has no address list: refused; not a simulated backend: refused */
    cca_sim_config_t cfg = {.backed = true};
    b = make(&cfg);
    expect_status(cca_sim_set_address_source(b, source_two, &src), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_sim_set_address_source(b, NULL, NULL));
    b->destroy(b->ctx);
}

TEST(free_unknown_pointer)
{
    cca_sim_config_t cfg = {.devices = 2};
    cca_backend_t *b = make(&cfg);
    void *p = xmalloc(b, 0, 4096);
    expect_status(b->free(b->ctx, 0, (char *)p + 512), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "not a live allocation");
    expect_status(b->free(b->ctx, 1, p), CCA_ERR_INVALID_ARGUMENT); /* wrong device */
    expect_status(b->free(b->ctx, 5, p), CCA_ERR_INVALID_ARGUMENT); /* bad device */
    expect_ok(b->free(b->ctx, 0, NULL));                          /* as cudaFree(NULL) */
    expect_ok(b->free(b->ctx, 0, p));
    expect_status(b->free(b->ctx, 0, p), CCA_ERR_INVALID_ARGUMENT); /* double free */
    void *q = NULL;
    expect_status(b->malloc(b->ctx, 0, 0, &q), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->malloc(b->ctx, 2, 1, &q), CCA_ERR_INVALID_ARGUMENT);
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* ---- capacity ---------------------------------------------------------------- */

TEST(memory_cap_boundary)
{
    cca_sim_config_t cfg = {.total_memory = 1 * GiB, .memory_cap = 100 * MiB};
    cca_backend_t *b = make(&cfg);
    size_t free_b = 0, total = 0;
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 100 * MiB);
    expect_eq_u64(total, 1 * GiB);
    void *a = xmalloc(b, 0, 60 * MiB);
    void *p = NULL;
    expect_status(b->malloc(b->ctx, 0, 40 * MiB + 1, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "out of memory");
    expect_eq_i64(cca_last_error()->backend_code, 2);
    expect_eq_ptr(p, NULL);
    void *c = xmalloc(b, 0, 40 * MiB); /* exactly to the cap */
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 0);
    expect_status(b->malloc(b->ctx, 0, 1, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(b->free(b->ctx, 0, a)); /* free restores */
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 60 * MiB);
    a = xmalloc(b, 0, 60 * MiB);
    /* set_cap at run time: lower than used gives free 0, raise it again */
    expect_ok(cca_sim_set_cap(b, 0, 50 * MiB));
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 0);
    expect_status(b->malloc(b->ctx, 0, 1, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_ok(cca_sim_set_cap(b, 0, 0)); /* 0 = the total memory */
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 1 * GiB - 100 * MiB);
    expect_ok(cca_sim_set_cap(b, 0, 4 * GiB)); /* above total: total wins */
    expect_ok(b->mem_get_info(b->ctx, 0, &free_b, &total));
    expect_eq_u64(free_b, 1 * GiB - 100 * MiB);
    expect_status(b->malloc(b->ctx, 0, 1 * GiB, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_status(b->malloc(b->ctx, 0, SIZE_MAX, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_status(cca_sim_set_cap(b, 1, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->free(b->ctx, 0, a));
    expect_ok(b->free(b->ctx, 0, c));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(caps_are_per_device)
{
    cca_sim_config_t cfg = {.devices = 3, .total_memory = 8 * GiB};
    cca_backend_t *b = make(&cfg);
    expect_ok(cca_sim_set_cap(b, 1, 1 * GiB));
    void *p = NULL;
    expect_status(b->malloc(b->ctx, 1, 2 * GiB, &p), CCA_ERR_OUT_OF_MEMORY);
    void *a = xmalloc(b, 2, 8 * GiB);
    size_t f = 1, t = 0;
    expect_ok(b->mem_get_info(b->ctx, 2, &f, &t));
    expect_eq_u64(f, 0);
    expect_ok(b->mem_get_info(b->ctx, 0, &f, &t));
    expect_eq_u64(f, 8 * GiB);
    expect_status(b->mem_get_info(b->ctx, 3, &f, &t), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->free(b->ctx, 2, a));
    b->destroy(b->ctx);
}

TEST(address_only_80g_device)
{
    cca_backend_t *b = make(NULL);
    void *p[80];
    for (int i = 0; i < 80; i++)
        p[i] = xmalloc(b, 0, 1 * GiB);
    void *q = NULL;
    expect_status(b->malloc(b->ctx, 0, 1, &q), CCA_ERR_OUT_OF_MEMORY);
    for (int i = 1; i < 80; i++)
        expect_eq_u64((uintptr_t)p[i] - (uintptr_t)p[i - 1], 1 * GiB);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.device_bytes[0], 80 * GiB);
    expect_eq_u64(u.live_allocations, 80);
    for (int i = 0; i < 80; i++)
        expect_ok(b->free(b->ctx, 0, p[i]));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(backed_memory_is_writable)
{
    cca_sim_config_t cfg = {.backed = true, .total_memory = 256 * MiB};
    cca_backend_t *b = make(&cfg);
    size_t sizes[] = {1, 513, 4096, 3 * MiB + 7};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        unsigned char *p = xmalloc(b, 0, sizes[i]);
        expect_eq_u64((uintptr_t)p % 512, 0);
        memset(p, 0xa5, sizes[i]);
        expect_eq_u64(p[sizes[i] - 1], 0xa5);
        expect_ok(b->free(b->ctx, 0, p));
    }
    void *p = NULL;
    expect_status(b->malloc(b->ctx, 0, 257 * MiB, &p), CCA_ERR_OUT_OF_MEMORY);
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* ---- events ----------------------------------------------------------------- */

#define S1 ((cca_stream_t)(uintptr_t)0x1000)
#define S2 ((cca_stream_t)(uintptr_t)0x2000)

TEST(automatic_events)
{
    cca_backend_t *b = make(NULL);
    cca_event_t e = NULL;
    expect_ok(b->event_create(b->ctx, 0, &e));
    expect_ok(b->event_query(b->ctx, 0, e)); /* never recorded: complete */
    expect_ok(b->event_record(b->ctx, 0, e, S1));
    expect_ok(b->event_query(b->ctx, 0, e));
    expect_eq_u64(cca_sim_pending_events(b), 0);
    expect_ok(b->event_synchronize(b->ctx, 0, e));
    expect_ok(b->event_destroy(b->ctx, 0, e));
    expect_status(b->event_destroy(b->ctx, 0, e), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->event_query(b->ctx, 0, (cca_event_t)(uintptr_t)0x1234),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(manual_events_per_stream)
{
    cca_sim_config_t cfg = {.manual_events = true, .devices = 2};
    cca_backend_t *b = make(&cfg);
    cca_event_t e1, e2, e3, e4;
    expect_ok(b->event_create(b->ctx, 0, &e1));
    expect_ok(b->event_create(b->ctx, 0, &e2));
    expect_ok(b->event_create(b->ctx, 0, &e3));
    expect_ok(b->event_create(b->ctx, 1, &e4));
    expect_ok(b->event_query(b->ctx, 0, e1)); /* never recorded */
    expect_ok(b->event_record(b->ctx, 0, e1, S1));
    expect_ok(b->event_record(b->ctx, 0, e2, NULL));
    expect_ok(b->event_record(b->ctx, 0, e3, S1));
    expect_ok(b->event_record(b->ctx, 1, e4, S1));
    expect_eq_u64(cca_sim_pending_events(b), 4);
    expect_status(b->event_query(b->ctx, 0, e1), CCA_ERR_NOT_READY);
    expect_status(b->event_query(b->ctx, 0, e2), CCA_ERR_NOT_READY);
    /* completing S1 of device 0 leaves the default stream and device 1 */
    expect_ok(cca_sim_complete_stream(b, 0, S1, false));
    expect_ok(b->event_query(b->ctx, 0, e1));
    expect_ok(b->event_query(b->ctx, 0, e3));
    expect_status(b->event_query(b->ctx, 0, e2), CCA_ERR_NOT_READY);
    expect_status(b->event_query(b->ctx, 1, e4), CCA_ERR_NOT_READY);
    expect_eq_u64(cca_sim_pending_events(b), 2);
    /* the wrong device is not this event */
    expect_status(b->event_query(b->ctx, 1, e2), CCA_ERR_INVALID_ARGUMENT);
    /* all streams of device 0 */
    expect_ok(b->event_record(b->ctx, 0, e1, S2));
    expect_ok(cca_sim_complete_stream(b, 0, NULL, true));
    expect_ok(b->event_query(b->ctx, 0, e2));
    expect_ok(b->event_query(b->ctx, 0, e1));
    expect_status(b->event_query(b->ctx, 1, e4), CCA_ERR_NOT_READY);
    /* -1 with all: every device */
    expect_ok(cca_sim_complete_stream(b, -1, NULL, true));
    expect_ok(b->event_query(b->ctx, 1, e4));
    expect_eq_u64(cca_sim_pending_events(b), 0);
    expect_status(cca_sim_complete_stream(b, -1, NULL, false), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_complete_stream(b, 2, NULL, true), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->event_destroy(b->ctx, 0, e1));
    expect_ok(b->event_destroy(b->ctx, 0, e2));
    expect_ok(b->event_destroy(b->ctx, 0, e3));
    expect_ok(b->event_destroy(b->ctx, 1, e4));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(manual_events_synchronize)
{
    cca_sim_config_t cfg = {.manual_events = true};
    cca_backend_t *b = make(&cfg);
    cca_event_t e[4];
    for (int i = 0; i < 4; i++)
        expect_ok(b->event_create(b->ctx, 0, &e[i]));
    expect_ok(b->event_record(b->ctx, 0, e[0], S1));
    expect_ok(b->event_record(b->ctx, 0, e[1], S1));
    expect_ok(b->event_record(b->ctx, 0, e[2], S1));
    expect_ok(b->event_record(b->ctx, 0, e[3], S2));
    /* event_synchronize completes that event and the earlier ones on its stream */
    expect_ok(b->event_synchronize(b->ctx, 0, e[1]));
    expect_ok(b->event_query(b->ctx, 0, e[0]));
    expect_ok(b->event_query(b->ctx, 0, e[1]));
    expect_status(b->event_query(b->ctx, 0, e[2]), CCA_ERR_NOT_READY);
    expect_status(b->event_query(b->ctx, 0, e[3]), CCA_ERR_NOT_READY);
    /* stream_synchronize: that stream only */
    expect_ok(b->stream_synchronize(b->ctx, 0, S2));
    expect_ok(b->event_query(b->ctx, 0, e[3]));
    expect_status(b->event_query(b->ctx, 0, e[2]), CCA_ERR_NOT_READY);
    /* re-recording re-arms, and moves the event to the end of its new stream */
    expect_ok(b->event_record(b->ctx, 0, e[0], S2));
    expect_ok(b->event_record(b->ctx, 0, e[2], S2)); /* moved off S1 */
    expect_status(b->event_query(b->ctx, 0, e[0]), CCA_ERR_NOT_READY);
    expect_ok(cca_sim_complete_stream(b, 0, S1, false));
    expect_status(b->event_query(b->ctx, 0, e[2]), CCA_ERR_NOT_READY);
    expect_eq_u64(cca_sim_pending_events(b), 2);
    /* device_synchronize completes everything */
    expect_ok(b->device_synchronize(b->ctx, 0));
    expect_eq_u64(cca_sim_pending_events(b), 0);
    expect_ok(b->event_query(b->ctx, 0, e[2]));
    /* cudaFree synchronizes the device too */
    expect_ok(b->event_record(b->ctx, 0, e[1], S1));
    void *p = xmalloc(b, 0, 100);
    expect_status(b->event_query(b->ctx, 0, e[1]), CCA_ERR_NOT_READY);
    expect_ok(b->free(b->ctx, 0, p));
    expect_ok(b->event_query(b->ctx, 0, e[1]));
    /* destroying a pending event is fine */
    expect_ok(b->event_record(b->ctx, 0, e[3], S1));
    expect_ok(b->event_destroy(b->ctx, 0, e[3]));
    expect_eq_u64(cca_sim_pending_events(b), 0);
    for (int i = 0; i < 3; i++)
        expect_ok(b->event_destroy(b->ctx, 0, e[i]));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* Timed events: a record completes lag ticks later unless its stream is kept
 * manual; lag 0 completes at once; synchronisation still completes at once. */
TEST(timed_events)
{
    cca_sim_config_t plain = {0};
    cca_backend_t *a = make(&plain);
    expect_status(cca_sim_time_events(a, 2), CCA_ERR_INVALID_ARGUMENT); /* manual mode only */
    a->destroy(a->ctx);
    cca_sim_config_t cfg = {.manual_events = true};
    cca_backend_t *b = make(&cfg);
    cca_event_t e[3];
    for (int i = 0; i < 3; i++)
        expect_ok(b->event_create(b->ctx, 0, &e[i]));
    expect_ok(cca_sim_time_events(b, 2));
    expect_ok(cca_sim_keep_manual(b, 0, S2));
    expect_ok(b->event_record(b->ctx, 0, e[0], S1));
    expect_ok(b->event_record(b->ctx, 0, e[1], S2));
    cca_sim_tick(b, 1);
    expect_ok(b->event_record(b->ctx, 0, e[2], S1));
    expect_status(b->event_query(b->ctx, 0, e[0]), CCA_ERR_NOT_READY);
    cca_sim_tick(b, 1); /* e[0] due */
    expect_ok(b->event_query(b->ctx, 0, e[0]));
    expect_status(b->event_query(b->ctx, 0, e[2]), CCA_ERR_NOT_READY);
    cca_sim_tick(b, 5);
    expect_ok(b->event_query(b->ctx, 0, e[2]));
    expect_status(b->event_query(b->ctx, 0, e[1]), CCA_ERR_NOT_READY); /* kept manual */
    expect_ok(cca_sim_complete_stream(b, 0, S2, false));
    expect_ok(b->event_query(b->ctx, 0, e[1]));
    /* re-recording pushes the answer back; synchronisation completes at once */
    expect_ok(b->event_record(b->ctx, 0, e[0], S1));
    expect_status(b->event_query(b->ctx, 0, e[0]), CCA_ERR_NOT_READY);
    expect_ok(b->event_synchronize(b->ctx, 0, e[0]));
    expect_ok(b->event_query(b->ctx, 0, e[0]));
    /* lag 0: at once */
    expect_ok(cca_sim_time_events(b, 0));
    expect_ok(b->event_record(b->ctx, 0, e[0], S1));
    expect_ok(b->event_query(b->ctx, 0, e[0]));
    expect_eq_u64(cca_sim_pending_events(b), 0);
    for (int i = 0; i < 3; i++)
        expect_ok(b->event_destroy(b->ctx, 0, e[i]));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(capture_status)
{
    cca_backend_t *b = make(NULL);
    int s = -1;
    expect_ok(b->stream_capture_status(b->ctx, 0, S1, &s));
    expect_eq_i64(s, CCA_CAPTURE_NONE);
    expect_ok(cca_sim_set_capturing(b, S1, true));
    expect_ok(cca_sim_set_capturing(b, S1, true));
    expect_ok(b->stream_capture_status(b->ctx, 0, S1, &s));
    expect_eq_i64(s, CCA_CAPTURE_ACTIVE);
    expect_ok(b->stream_capture_status(b->ctx, 0, S2, &s));
    expect_eq_i64(s, CCA_CAPTURE_NONE);
    expect_ok(cca_sim_set_capturing(b, S1, false));
    expect_ok(b->stream_capture_status(b->ctx, 0, S1, &s));
    expect_eq_i64(s, CCA_CAPTURE_NONE);
    expect_ok(cca_sim_set_capturing(b, S2, true)); /* left on: destroy frees it */
    cca_backend_t fake = {0};
    expect_status(cca_sim_set_capturing(&fake, S1, true), CCA_ERR_INVALID_ARGUMENT);
    b->destroy(b->ctx);
}

/* ---- fault injection --------------------------------------------------------- */

TEST(fault_nth_once)
{
    cca_backend_t *b = make(NULL);
    expect_ok(cca_sim_inject_fault(b, CCA_OP_MALLOC, 3, false, CCA_ERR_OUT_OF_MEMORY));
    void *p[4] = {0};
    expect_ok(b->malloc(b->ctx, 0, 100, &p[0]));
    expect_ok(b->malloc(b->ctx, 0, 100, &p[1]));
    expect_status(b->malloc(b->ctx, 0, 100, &p[2]), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "malloc");
    expect_contains(cca_last_error()->message, "injected fault");
    expect_eq_ptr(p[2], NULL);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.live_allocations, 2);
    expect_eq_u64(u.device_bytes[0], 200);
    expect_ok(b->malloc(b->ctx, 0, 100, &p[3]));
    expect_eq_u64(cca_sim_call_count(b, CCA_OP_MALLOC), 4);
    /* addresses are unchanged by the failed call: p[3] goes where p[2] would have */
    expect_eq_u64((uintptr_t)p[3] - (uintptr_t)p[1], 512);
    for (int i = 0; i < 4; i++)
        expect_ok(b->free(b->ctx, 0, p[i] ? p[i] : NULL));
    expect_eq_u64(cca_sim_call_count(b, CCA_OP_FREE), 4);
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(fault_persistent_and_clear)
{
    cca_backend_t *b = make(NULL);
    cca_event_t e;
    expect_ok(cca_sim_inject_fault(b, CCA_OP_EVENT_CREATE, 2, true, CCA_ERR_BACKEND));
    expect_ok(b->event_create(b->ctx, 0, &e));
    cca_event_t x = NULL;
    for (int i = 0; i < 5; i++)
        expect_status(b->event_create(b->ctx, 0, &x), CCA_ERR_BACKEND);
    expect_eq_ptr(x, NULL);
    expect_eq_u64(cca_sim_call_count(b, CCA_OP_EVENT_CREATE), 6);
    cca_sim_clear_faults(b);
    expect_ok(b->event_create(b->ctx, 0, &x));
    expect_ok(b->event_destroy(b->ctx, 0, x));
    /* nth == 0 removes one fault */
    expect_ok(cca_sim_inject_fault(b, CCA_OP_EVENT_DESTROY, 1, true, CCA_ERR_BACKEND));
    expect_ok(cca_sim_inject_fault(b, CCA_OP_EVENT_DESTROY, 0, false, CCA_OK));
    expect_ok(b->event_destroy(b->ctx, 0, e));
    /* a fault on free leaves the allocation live */
    void *p = xmalloc(b, 0, 100);
    expect_ok(cca_sim_inject_fault(b, CCA_OP_FREE, 1, false, CCA_ERR_BACKEND));
    expect_status(b->free(b->ctx, 0, p), CCA_ERR_BACKEND);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.live_allocations, 1);
    expect_ok(b->free(b->ctx, 0, p));
    /* bad arguments */
    expect_status(cca_sim_inject_fault(b, CCA_OP_COUNT, 1, false, CCA_ERR_BACKEND),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_inject_fault(b, CCA_OP_MALLOC, 1, false, CCA_OK),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_inject_fault(NULL, CCA_OP_MALLOC, 1, false, CCA_ERR_BACKEND),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(fault_every_op_counts)
{
    /* each operation fails once when injected, whatever its arguments */
    cca_sim_config_t cfg = {.manual_events = true};
    cca_backend_t *b = make(&cfg);
    for (int op = 0; op < CCA_OP_COUNT; op++) {
        expect_ok(cca_sim_inject_fault(b, (cca_backend_op_t)op, 1, false, CCA_ERR_BACKEND));
        expect_eq_u64(cca_sim_call_count(b, (cca_backend_op_t)op), 0);
    }
    void *p = NULL;
    size_t f, t, g;
    int s;
    cca_event_t e = NULL;
    cca_phys_handle_t h = 0;
    cca_ipc_handle_t ih;
    void *ctx = b->ctx;
    expect_status(b->malloc(ctx, 0, 1, &p), CCA_ERR_BACKEND);
    expect_status(b->free(ctx, 0, NULL), CCA_ERR_BACKEND);
    expect_status(b->mem_get_info(ctx, 0, &f, &t), CCA_ERR_BACKEND);
    expect_status(b->stream_synchronize(ctx, 0, NULL), CCA_ERR_BACKEND);
    expect_status(b->device_synchronize(ctx, 0), CCA_ERR_BACKEND);
    expect_status(b->event_create(ctx, 0, &e), CCA_ERR_BACKEND);
    expect_status(b->event_destroy(ctx, 0, e), CCA_ERR_BACKEND);
    expect_status(b->event_record(ctx, 0, e, NULL), CCA_ERR_BACKEND);
    expect_status(b->event_query(ctx, 0, e), CCA_ERR_BACKEND);
    expect_status(b->event_synchronize(ctx, 0, e), CCA_ERR_BACKEND);
    expect_status(b->stream_capture_status(ctx, 0, NULL, &s), CCA_ERR_BACKEND);
    expect_status(b->vmm_granularity(ctx, 0, &g), CCA_ERR_BACKEND);
    expect_status(b->vmm_reserve(ctx, 0, 2 * MiB, &p), CCA_ERR_BACKEND);
    expect_status(b->vmm_free(ctx, 0, p, 2 * MiB), CCA_ERR_BACKEND);
    expect_status(b->vmm_create(ctx, 0, 2 * MiB, &h), CCA_ERR_BACKEND);
    expect_status(b->vmm_release(ctx, 0, h), CCA_ERR_BACKEND);
    expect_status(b->vmm_map(ctx, 0, p, 2 * MiB, h), CCA_ERR_BACKEND);
    expect_status(b->vmm_unmap(ctx, 0, p, 2 * MiB), CCA_ERR_BACKEND);
    expect_status(b->vmm_set_access(ctx, 0, p, 2 * MiB), CCA_ERR_BACKEND);
    expect_status(b->host_alloc(ctx, 64, &p), CCA_ERR_BACKEND);
    expect_status(b->host_free(ctx, p), CCA_ERR_BACKEND);
    expect_status(b->host_register(ctx, &g, sizeof(g), &p), CCA_ERR_BACKEND);
    expect_status(b->host_unregister(ctx, &g), CCA_ERR_BACKEND);
    expect_status(b->ipc_get_handle(ctx, 0, p, &ih), CCA_ERR_BACKEND);
    expect_status(b->ipc_open(ctx, 0, &ih, &p), CCA_ERR_BACKEND);
    expect_status(b->ipc_close(ctx, 0, p), CCA_ERR_BACKEND);
    int can = 0;
    uint64_t v = 0;
    cca_stream_t st = NULL;
    expect_status(b->can_access_peer(ctx, 0, 0, &can), CCA_ERR_BACKEND);
    expect_status(b->enable_peer_access(ctx, 0, 0), CCA_ERR_BACKEND);
    expect_status(b->memcpy_peer_async(ctx, p, 0, p, 0, 0, NULL), CCA_ERR_BACKEND);
    expect_status(b->stream_create(ctx, 0, &st), CCA_ERR_BACKEND);
    expect_status(b->stream_destroy(ctx, 0, st), CCA_ERR_BACKEND);
    expect_status(b->stream_wait_event(ctx, 0, st, e), CCA_ERR_BACKEND);
    expect_status(b->malloc_async(ctx, 0, 1, NULL, &p), CCA_ERR_BACKEND);
    expect_status(b->free_async(ctx, 0, p, NULL), CCA_ERR_BACKEND);
    expect_status(b->mempool_trim(ctx, 0, 0), CCA_ERR_BACKEND);
    expect_status(b->mempool_get_attr(ctx, 0, CCA_MEMPOOL_USED_CURRENT, &v), CCA_ERR_BACKEND);
    expect_status(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_RELEASE_THRESHOLD, 0), CCA_ERR_BACKEND);
    expect_status(b->mempool_set_access(ctx, 0, 0), CCA_ERR_BACKEND);
    expect_status(b->ipc_event_create(ctx, 0, &e), CCA_ERR_BACKEND);
    expect_status(b->ipc_event_get_handle(ctx, 0, e, &ih), CCA_ERR_BACKEND);
    expect_status(b->ipc_event_open(ctx, 0, &ih, &e), CCA_ERR_BACKEND);
    uint64_t cid = 0;
    const cca_graph_node_t *terms = NULL;
    expect_status(b->stream_capture_info(ctx, 0, NULL, &s, &cid, &terms, &f), CCA_ERR_BACKEND);
    expect_status(b->graph_node_dependencies(ctx, 0, NULL, NULL, &f), CCA_ERR_BACKEND);
    int fd = -1;
    expect_status(b->vmm_export(ctx, 0, h, &fd), CCA_ERR_BACKEND);
    expect_status(b->vmm_import(ctx, 0, fd, &h), CCA_ERR_BACKEND);
    expect_eq_i64(fd, -1);
    expect_eq_ptr(p, NULL);
    expect_eq_ptr(st, NULL);
    for (int op = 0; op < CCA_OP_COUNT; op++) {
        expect_eq_u64(cca_sim_call_count(b, (cca_backend_op_t)op), 1);
        expect_contains(cca_backend_op_name((cca_backend_op_t)op), "");
    }
    expect_eq_str(cca_backend_op_name(CCA_OP_VMM_MAP), "vmm_map");
    expect_eq_str(cca_backend_op_name(CCA_OP_COUNT), "unknown");
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* ---- VMM ---------------------------------------------------------------------- */

TEST(vmm_lifecycle)
{
    cca_sim_config_t cfg = {.total_memory = 64 * MiB};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *base = NULL;
    expect_ok(b->vmm_reserve(ctx, 0, 1 * GiB, &base)); /* reserving costs no memory */
    expect_eq_u64((uintptr_t)base % (2 * MiB), 0);
    cca_phys_handle_t h1, h2, h3;
    expect_ok(b->vmm_create(ctx, 0, 4 * MiB, &h1));
    expect_ok(b->vmm_create(ctx, 0, 2 * MiB, &h2));
    size_t f, t;
    expect_ok(b->mem_get_info(ctx, 0, &f, &t));
    expect_eq_u64(f, 58 * MiB);
    expect_status(b->vmm_create(ctx, 0, 60 * MiB, &h3), CCA_ERR_OUT_OF_MEMORY);
    char *p = base;
    expect_ok(b->vmm_map(ctx, 0, p, 4 * MiB, h1));
    expect_ok(b->vmm_map(ctx, 0, p + 4 * MiB, 2 * MiB, h2));
    expect_ok(b->vmm_set_access(ctx, 0, p, 6 * MiB));
    expect_ok(b->vmm_set_access(ctx, 0, p + 2 * MiB, 2 * MiB)); /* inside one mapping */
    /* release while mapped: memory stays until the unmap */
    expect_ok(b->vmm_release(ctx, 0, h1));
    expect_ok(b->mem_get_info(ctx, 0, &f, &t));
    expect_eq_u64(f, 58 * MiB);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.live_handles, 1);
    expect_eq_u64(u.live_reservations, 1);
    expect_ok(b->vmm_unmap(ctx, 0, p, 6 * MiB)); /* two mappings at once */
    expect_ok(b->mem_get_info(ctx, 0, &f, &t));
    expect_eq_u64(f, 62 * MiB);
    expect_ok(b->vmm_release(ctx, 0, h2));
    expect_ok(b->vmm_free(ctx, 0, base, 1 * GiB));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(vmm_misuse)
{
    cca_sim_config_t cfg = {.devices = 2};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *base = NULL, *x = NULL;
    const size_t G2 = 2 * MiB;
    expect_status(b->vmm_reserve(ctx, 0, G2 + 512, &x), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_reserve(ctx, 0, 0, &x), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_reserve(ctx, 0, 16 * MiB, &base));
    char *p = base;
    cca_phys_handle_t h, small, other_dev;
    expect_status(b->vmm_create(ctx, 0, 1000, &h), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_create(ctx, 0, 4 * MiB, &h));
    expect_ok(b->vmm_create(ctx, 0, G2, &small));
    expect_ok(b->vmm_create(ctx, 1, G2, &other_dev));
    /* map: outside a reservation, crossing its end, misaligned, bad handle, too small */
    expect_status(b->vmm_map(ctx, 0, p + 16 * MiB, G2, h), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p + 14 * MiB, 4 * MiB, h), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p + 4096, G2, h), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p, G2 + 4096, h), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p, G2, 12345), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p, 4 * MiB, small), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p, G2, other_dev), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 1, p, G2, other_dev), CCA_ERR_INVALID_ARGUMENT);
    /* overlap */
    expect_ok(b->vmm_map(ctx, 0, p + G2, 4 * MiB, h));
    expect_status(b->vmm_map(ctx, 0, p, 4 * MiB, small), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_map(ctx, 0, p + 4 * MiB, G2, small), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_map(ctx, 0, p, G2, small));
    /* set_access over an unmapped part */
    expect_status(b->vmm_set_access(ctx, 0, p, 8 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_set_access(ctx, 0, p + 8 * MiB, G2), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_set_access(ctx, 0, p, 6 * MiB));
    /* unmap must match mapped ranges */
    expect_status(b->vmm_unmap(ctx, 0, p + G2, G2), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_unmap(ctx, 0, p, 8 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_unmap(ctx, 0, p + 6 * MiB, G2), CCA_ERR_INVALID_ARGUMENT);
    /* free with live mappings, wrong size, unknown */
    expect_status(b->vmm_free(ctx, 0, base, 16 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_unmap(ctx, 0, p, 6 * MiB));
    expect_status(b->vmm_free(ctx, 0, base, 8 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_free(ctx, 0, p + G2, 14 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_free(ctx, 1, base, 16 * MiB), CCA_ERR_INVALID_ARGUMENT);
    /* release twice / unknown / wrong device */
    expect_status(b->vmm_release(ctx, 1, h), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_release(ctx, 0, h));
    expect_status(b->vmm_release(ctx, 0, h), CCA_ERR_INVALID_ARGUMENT);
    /* a released handle cannot be mapped */
    expect_status(b->vmm_map(ctx, 0, p, G2, h), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->vmm_release(ctx, 0, small));
    expect_ok(b->vmm_release(ctx, 1, other_dev));
    expect_ok(b->vmm_free(ctx, 0, base, 16 * MiB));
    expect_status(b->vmm_free(ctx, 0, base, 16 * MiB), CCA_ERR_INVALID_ARGUMENT);
    /* a malloc'd block is not a reservation */
    void *m = xmalloc(b, 0, 4 * MiB);
    expect_status(b->vmm_map(ctx, 0, m, G2, h), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->vmm_free(ctx, 0, m, 4 * MiB), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->free(ctx, 0, m));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(vmm_backed_writable)
{
    cca_sim_config_t cfg = {.backed = true, .total_memory = 64 * MiB};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *base = NULL;
    expect_ok(b->vmm_reserve(ctx, 0, 32 * MiB, &base));
    cca_phys_handle_t h;
    expect_ok(b->vmm_create(ctx, 0, 4 * MiB, &h));
    char *p = (char *)base + 8 * MiB;
    expect_ok(b->vmm_map(ctx, 0, p, 4 * MiB, h));
    expect_ok(b->vmm_set_access(ctx, 0, p, 4 * MiB));
    memset(p, 0x5a, 4 * MiB);
    expect_eq_u64((unsigned char)p[4 * MiB - 1], 0x5a);
    expect_ok(b->vmm_unmap(ctx, 0, p, 4 * MiB));
    /* mapped again: the old contents are gone (MADV_DONTNEED) */
    expect_ok(b->vmm_map(ctx, 0, p, 4 * MiB, h));
    expect_eq_u64((unsigned char)p[0], 0);
    expect_ok(b->vmm_unmap(ctx, 0, p, 4 * MiB));
    expect_ok(b->vmm_release(ctx, 0, h));
    expect_ok(b->vmm_free(ctx, 0, base, 32 * MiB));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

static sigjmp_buf segv_jump;

static void on_segv(int sig)
{
    (void)sig;
    siglongjmp(segv_jump, 1);
}

TEST(vmm_backed_unmapped_is_inaccessible)
{
    cca_sim_config_t cfg = {.backed = true};
    cca_backend_t *b = make(&cfg);
    void *base = NULL;
    expect_ok(b->vmm_reserve(b->ctx, 0, 4 * MiB, &base));
    struct sigaction sa, old_segv, old_bus;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_segv;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &old_segv);
    sigaction(SIGBUS, &sa, &old_bus);
    volatile int faulted = 0;
    if (sigsetjmp(segv_jump, 1) == 0)
        *(volatile char *)base = 1;
    else
        faulted = 1;
    sigaction(SIGSEGV, &old_segv, NULL);
    sigaction(SIGBUS, &old_bus, NULL);
    expect_true(faulted);
    expect_ok(b->vmm_free(b->ctx, 0, base, 4 * MiB));
    b->destroy(b->ctx);
}

TEST(vmm_reserve_from_list_and_rule)
{
    cca_sim_config_t cfg = {.granularity = 4 * MiB};
    cca_backend_t *b = make(&cfg);
    void *a = NULL, *c = NULL;
    void *small = xmalloc(b, 0, 512);
    expect_ok(b->vmm_reserve(b->ctx, 0, 8 * MiB, &a));
    expect_eq_u64((uintptr_t)a % (4 * MiB), 0);
    expect_true((uintptr_t)a >= (uintptr_t)small + 512);
    void *m = xmalloc(b, 0, 2 * MiB); /* does not land inside the reservation */
    expect_true((uintptr_t)m >= (uintptr_t)a + 8 * MiB || (uintptr_t)m + 2 * MiB <= (uintptr_t)a);
    uint64_t list[] = {(uint64_t)(uintptr_t)a + 4 * MiB};
    expect_ok(cca_sim_push_addresses(b, list, 1));
    expect_status(b->vmm_reserve(b->ctx, 0, 4 * MiB, &c), CCA_ERR_BACKEND); /* overlaps */
    expect_ok(b->vmm_free(b->ctx, 0, a, 8 * MiB));
    expect_ok(b->vmm_reserve(b->ctx, 0, 4 * MiB, &c));
    expect_eq_u64((uintptr_t)c, list[0]);
    expect_ok(b->vmm_free(b->ctx, 0, c, 4 * MiB));
    expect_ok(b->free(b->ctx, 0, small));
    expect_ok(b->free(b->ctx, 0, m));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* ---- host memory and IPC --------------------------------------------------------- */

TEST(host_memory)
{
    cca_backend_t *b = make(NULL);
    void *ctx = b->ctx;
    void *h = NULL;
    expect_ok(b->host_alloc(ctx, 10000, &h));
    memset(h, 1, 10000);
    expect_status(b->host_alloc(ctx, 0, &h), CCA_ERR_INVALID_ARGUMENT);
    char buf[256];
    void *dev = NULL;
    expect_ok(b->host_register(ctx, buf, sizeof(buf), &dev));
    expect_eq_ptr(dev, buf);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.live_host, 2);
    expect_status(b->host_register(ctx, buf, sizeof(buf), &dev), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->host_register(ctx, h, 100, &dev), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->host_register(ctx, NULL, 100, &dev), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->host_free(ctx, buf), CCA_ERR_INVALID_ARGUMENT);  /* registered */
    expect_status(b->host_unregister(ctx, h), CCA_ERR_INVALID_ARGUMENT); /* allocated */
    expect_status(b->host_unregister(ctx, buf + 1), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->host_unregister(ctx, buf));
    expect_status(b->host_unregister(ctx, buf), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->host_free(ctx, h));
    expect_status(b->host_free(ctx, h), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->host_free(ctx, NULL));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(ipc_handles)
{
    cca_sim_config_t cfg = {.devices = 2};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *p = xmalloc(b, 1, 4 * MiB);
    cca_ipc_handle_t ih, bad;
    expect_status(b->ipc_get_handle(ctx, 0, p, &ih), CCA_ERR_INVALID_ARGUMENT); /* wrong device */
    expect_status(b->ipc_get_handle(ctx, 1, (char *)p + 512, &ih), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->ipc_get_handle(ctx, 1, p, &ih));
    void *q = NULL;
    expect_ok(b->ipc_open(ctx, 1, &ih, &q));
    expect_eq_ptr(q, p);
    expect_ok(b->ipc_open(ctx, 0, &ih, &q)); /* opened twice, from a peer */
    expect_ok(b->ipc_close(ctx, 1, q));
    expect_ok(b->ipc_close(ctx, 0, q));
    expect_status(b->ipc_close(ctx, 1, q), CCA_ERR_INVALID_ARGUMENT);
    /* corrupt handles */
    for (size_t i = 0; i < 48; i += 5) {
        bad = ih;
        bad.bytes[i] ^= 0x40;
        expect_status(b->ipc_open(ctx, 1, &bad, &q), CCA_ERR_INVALID_ARGUMENT);
    }
    memset(&bad, 0, sizeof(bad));
    expect_status(b->ipc_open(ctx, 1, &bad, &q), CCA_ERR_INVALID_ARGUMENT);
    /* another backend's handle */
    cca_backend_t *b2 = make(&cfg);
    void *p2 = xmalloc(b2, 1, 4 * MiB);
    expect_eq_ptr(p2, p); /* same deterministic address, but not the same allocation */
    expect_status(b2->ipc_open(b2->ctx, 1, &ih, &q), CCA_ERR_INVALID_ARGUMENT);
    b2->destroy(b2->ctx);
    /* stale: freed and reallocated at the same address */
    expect_ok(b->free(ctx, 1, p));
    void *again = xmalloc(b, 1, 4 * MiB);
    expect_eq_ptr(again, p);
    expect_status(b->ipc_open(ctx, 1, &ih, &q), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->free(ctx, 1, again));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

/* ---- several devices, streams, the stream-ordered pool --------------------------------- */

TEST(peers_and_streams)
{
    cca_sim_config_t cfg = {.devices = 3, .backed = true, .manual_events = true};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    int can = -1;
    expect_ok(b->can_access_peer(ctx, 0, 2, &can));
    expect_eq_i64(can, 1);
    expect_ok(b->can_access_peer(ctx, 1, 1, &can));
    expect_eq_i64(can, 0);
    expect_status(b->can_access_peer(ctx, 0, 3, &can), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->enable_peer_access(ctx, 0, 2));
    expect_ok(b->enable_peer_access(ctx, 0, 2)); /* already enabled: success */
    expect_status(b->enable_peer_access(ctx, 1, 1), CCA_ERR_INVALID_ARGUMENT);
    char *x = xmalloc(b, 0, 4096), *y = xmalloc(b, 2, 4096);
    memset(x, 0x3c, 4096);
    expect_ok(b->memcpy_peer_async(ctx, y, 2, x, 0, 4096, NULL));
    expect_eq_u64(y[4095], 0x3c);
    cca_stream_t s1 = NULL, s2 = NULL;
    expect_ok(b->stream_create(ctx, 1, &s1));
    expect_ok(b->stream_create(ctx, 1, &s2));
    expect_true(s1 != s2 && s1 != NULL);
    cca_event_t e = NULL;
    expect_ok(b->event_create(ctx, 0, &e));
    expect_ok(b->event_record(ctx, 0, e, NULL));
    expect_ok(b->stream_wait_event(ctx, 1, s1, e)); /* an event of another device */
    expect_ok(b->event_destroy(ctx, 0, e));
    expect_status(b->stream_wait_event(ctx, 1, s1, e), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->stream_destroy(ctx, 0, s1), CCA_ERR_INVALID_ARGUMENT); /* wrong device */
    expect_ok(b->stream_destroy(ctx, 1, s1));
    expect_status(b->stream_destroy(ctx, 1, s1), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->stream_destroy(ctx, 1, s2));
    /* interprocess events: a handle of one, opened as a new event */
    cca_event_t ie = NULL, plain = NULL, opened = NULL;
    cca_ipc_handle_t eh, bad;
    expect_ok(b->ipc_event_create(ctx, 1, &ie));
    expect_ok(b->event_create(ctx, 1, &plain));
    expect_ok(b->event_record(ctx, 1, ie, NULL));
    expect_ok(b->ipc_event_get_handle(ctx, 1, ie, &eh));
    expect_status(b->ipc_event_get_handle(ctx, 1, plain, &bad), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->ipc_event_get_handle(ctx, 0, ie, &bad), CCA_ERR_INVALID_ARGUMENT);
    bad = eh;
    bad.bytes[9] ^= 4;
    expect_status(b->ipc_event_open(ctx, 1, &bad, &opened), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->ipc_event_open(ctx, 1, &eh, &opened));
    expect_true(opened != NULL && opened != ie);
    expect_ok(b->event_query(ctx, 1, opened));
    expect_ok(b->event_destroy(ctx, 1, opened));
    expect_ok(b->event_destroy(ctx, 1, ie));
    expect_ok(b->event_destroy(ctx, 1, plain));
    expect_ok(b->free(ctx, 0, x));
    expect_ok(b->free(ctx, 2, y));
    b->destroy(ctx);
    cca_sim_config_t none = {.devices = 2, .no_peer_access = true};
    b = make(&none);
    expect_ok(b->can_access_peer(b->ctx, 0, 1, &can));
    expect_eq_i64(can, 0);
    expect_status(b->enable_peer_access(b->ctx, 0, 1), CCA_ERR_NOT_SUPPORTED);
    expect_status(b->mempool_set_access(b->ctx, 0, 1), CCA_ERR_NOT_SUPPORTED);
    b->destroy(b->ctx);
}

static uint64_t pool_attr(cca_backend_t *b, int device, cca_mempool_attr_t a)
{
    uint64_t v = 0;
    expect_ok(b->mempool_get_attr(b->ctx, device, a, &v));
    return v;
}

TEST(stream_ordered_pool_model)
{
    cca_sim_config_t cfg = {.devices = 2, .total_memory = 64 * MiB};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *p = NULL, *q = NULL;
    cca_sim_usage_t u;
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RELEASE_THRESHOLD), 0); /* CUDA's default */
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC), 1);
    /* grows in 2 MiB granules, counted in the device's memory */
    expect_ok(b->malloc_async(ctx, 0, 3 * MiB, NULL, &p));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 4 * MiB);
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_USED_CURRENT), 3 * MiB);
    expect_ok(cca_sim_usage(b, &u));
    expect_eq_u64(u.device_bytes[0], 4 * MiB);
    /* served from what the pool holds */
    expect_ok(b->malloc_async(ctx, 0, MiB, NULL, &q));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 4 * MiB);
    expect_status(b->free(ctx, 0, q), CCA_ERR_INVALID_ARGUMENT); /* not from malloc */
    expect_ok(b->free_async(ctx, 0, q, NULL));
    expect_status(b->free_async(ctx, 0, q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->free_async(ctx, 0, p, NULL));
    /* kept until a synchronisation, then released down to the threshold */
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 4 * MiB);
    expect_ok(b->stream_synchronize(ctx, 0, NULL));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 0);
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_HIGH), 4 * MiB);
    /* a threshold keeps memory across synchronisations; trim gives it back */
    expect_ok(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_RELEASE_THRESHOLD, UINT64_MAX));
    expect_ok(b->malloc_async(ctx, 0, 10 * MiB, NULL, &p));
    expect_ok(b->free_async(ctx, 0, p, NULL));
    expect_ok(b->device_synchronize(ctx, 0));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 10 * MiB);
    expect_ok(b->malloc_async(ctx, 0, 3 * MiB, NULL, &p));
    expect_ok(b->mempool_trim(ctx, 0, 0));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_RESERVED_CURRENT), 4 * MiB); /* not below use */
    /* the device's cap */
    expect_status(b->malloc_async(ctx, 0, 62 * MiB, NULL, &q), CCA_ERR_OUT_OF_MEMORY);
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_USED_CURRENT), 3 * MiB);
    /* high-water marks reset to the current values, and only with 0 */
    expect_status(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_USED_HIGH, 5), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_USED_HIGH, 0));
    expect_eq_u64(pool_attr(b, 0, CCA_MEMPOOL_USED_HIGH), 3 * MiB);
    expect_status(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_USED_CURRENT, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->mempool_set_attr(ctx, 0, CCA_MEMPOOL_REUSE_ALLOW_OPPORTUNISTIC, 2),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->mempool_get_attr(ctx, 0, CCA_MEMPOOL_ATTR_COUNT, &(uint64_t){0}),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_status(b->free_async(ctx, 1, p, NULL), CCA_ERR_INVALID_ARGUMENT); /* wrong device */
    expect_ok(b->free_async(ctx, 0, p, NULL));
    expect_ok(b->mempool_trim(ctx, 0, 0));
    expect_no_leaks(b);
    b->destroy(ctx);
}

/* ---- destroy with leaks, threads ---------------------------------------------------- */

TEST(destroy_releases_leaked_resources)
{
    /* LeakSanitizer checks that nothing here outlives destroy */
    cca_sim_config_t cfg = {.backed = true, .manual_events = true, .devices = 2};
    cca_backend_t *b = make(&cfg);
    void *ctx = b->ctx;
    void *p, *h, *base;
    cca_event_t e;
    cca_phys_handle_t ph;
    expect_ok(b->malloc(ctx, 1, 12345, &p));
    expect_ok(b->host_alloc(ctx, 999, &h));
    expect_ok(b->event_create(ctx, 0, &e));
    expect_ok(b->event_record(ctx, 0, e, S1));
    expect_ok(b->vmm_reserve(ctx, 0, 8 * MiB, &base));
    expect_ok(b->vmm_create(ctx, 0, 2 * MiB, &ph));
    expect_ok(b->vmm_map(ctx, 0, base, 2 * MiB, ph));
    cca_ipc_handle_t ih;
    void *q;
    expect_ok(b->ipc_get_handle(ctx, 1, p, &ih));
    expect_ok(b->ipc_open(ctx, 1, &ih, &q));
    b->destroy(ctx);
    cca_backend_t *b2 = make(NULL);
    expect_ok(b2->malloc(b2->ctx, 0, 1 * GiB, &p));
    expect_ok(b2->vmm_reserve(b2->ctx, 0, 1 * GiB, &base));
    b2->destroy(b2->ctx);
}

#define THREADS 8
#define ROUNDS 2000

typedef struct worker_arg {
    cca_backend_t *b;
    int id;
    int failures;
} worker_arg_t;

static void *worker(void *argp)
{
    worker_arg_t *arg = argp;
    cca_backend_t *b = arg->b;
    void *live[16] = {0};
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(arg->id + 1);
    cca_event_t e;
    if (b->event_create(b->ctx, 0, &e) != CCA_OK)
        arg->failures++;
    for (int i = 0; i < ROUNDS; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        int slot = (int)(rng % 16);
        if (live[slot]) {
            /* the first and last byte hold the owner's tag: nobody else wrote here */
            unsigned char *p = live[slot];
            if (p[0] != arg->id)
                arg->failures++;
            if (b->free(b->ctx, 0, p) != CCA_OK)
                arg->failures++;
            live[slot] = NULL;
        } else {
            size_t size = 1 + (size_t)(rng >> 20) % (3 * MiB);
            if (b->malloc(b->ctx, 0, size, &live[slot]) != CCA_OK) {
                arg->failures++;
                continue;
            }
            ((unsigned char *)live[slot])[0] = (unsigned char)arg->id;
            ((unsigned char *)live[slot])[size - 1] = (unsigned char)arg->id;
        }
        b->event_record(b->ctx, 0, e, (cca_stream_t)(uintptr_t)(arg->id + 1));
        if (b->event_query(b->ctx, 0, e) != CCA_OK)
            arg->failures++;
    }
    for (int i = 0; i < 16; i++)
        if (live[i] && b->free(b->ctx, 0, live[i]) != CCA_OK)
            arg->failures++;
    if (b->event_destroy(b->ctx, 0, e) != CCA_OK)
        arg->failures++;
    return NULL;
}

static void run_threads(cca_backend_t *b)
{
    pthread_t t[THREADS];
    worker_arg_t args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (worker_arg_t){b, i, 0};
        pthread_create(&t[i], NULL, worker, &args[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        expect_eq_i64(args[i].failures, 0);
    }
    expect_eq_u64(cca_sim_call_count(b, CCA_OP_EVENT_CREATE), THREADS);
    expect_no_leaks(b);
}

TEST(threads_backed)
{
    cca_sim_config_t cfg = {.backed = true};
    cca_backend_t *b = make(&cfg);
    run_threads(b);
    b->destroy(b->ctx);
}

/* address-only addresses are not dereferenceable: check for overlaps instead */
typedef struct range_arg {
    cca_backend_t *b;
    uint64_t starts[ROUNDS];
    uint64_t sizes[ROUNDS];
    int failures;
} range_arg_t;

static void *range_worker(void *argp)
{
    range_arg_t *arg = argp;
    for (int i = 0; i < ROUNDS; i++) {
        void *p = NULL;
        size_t size = 512 + (size_t)(i * 7919 % 4096) * 1024;
        if (arg->b->malloc(arg->b->ctx, 0, size, &p) != CCA_OK)
            arg->failures++;
        arg->starts[i] = (uint64_t)(uintptr_t)p;
        arg->sizes[i] = size;
    }
    return NULL;
}

static int cmp_u64_pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

TEST(threads_address_only_no_overlap)
{
    cca_backend_t *b = make(NULL);
    static range_arg_t args[THREADS];
    pthread_t t[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i].b = b;
        args[i].failures = 0;
        pthread_create(&t[i], NULL, range_worker, &args[i]);
    }
    static uint64_t all[THREADS * ROUNDS][2];
    size_t n = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        expect_eq_i64(args[i].failures, 0);
        for (int j = 0; j < ROUNDS; j++) {
            all[n][0] = args[i].starts[j];
            all[n][1] = args[i].sizes[j];
            n++;
        }
    }
    qsort(all, n, sizeof(all[0]), cmp_u64_pair);
    int overlaps = 0;
    for (size_t i = 1; i < n; i++)
        if (all[i - 1][0] + all[i - 1][1] > all[i][0])
            overlaps++;
    expect_eq_i64(overlaps, 0);
    for (size_t i = 0; i < n; i++)
        expect_ok(b->free(b->ctx, 0, (void *)(uintptr_t)all[i][0]));
    expect_no_leaks(b);
    b->destroy(b->ctx);
}

TEST(not_a_sim_backend)
{
    cca_backend_t fake;
    memset(&fake, 0, sizeof(fake));
    cca_sim_usage_t u;
    expect_status(cca_sim_usage(&fake, &u), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_set_cap(&fake, 0, 0), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_complete_stream(&fake, 0, NULL, true), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_sim_set_address_source(&fake, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(cca_sim_call_count(&fake, CCA_OP_MALLOC), 0);
    expect_eq_u64(cca_sim_pending_events(&fake), 0);
}

int main(void)
{
    RUN(create_defaults);
    RUN(create_rejects_bad_config);
    RUN(current_device_is_per_thread);
    RUN(current_device_new_thread_starts_at_zero);
    RUN(deterministic_addresses);
    RUN(deterministic_no_overlap_first_fit);
    RUN(long_run_reuses_address_space);
    RUN(address_list_in_order);
    RUN(address_list_exhaustion_avoids_list_ranges);
    RUN(address_list_entry_across_windows);
    RUN(address_list_overlap_fails);
    RUN(address_list_rejected_in_backed_mode);
    RUN(address_source_grows_the_list);
    RUN(free_unknown_pointer);
    RUN(memory_cap_boundary);
    RUN(caps_are_per_device);
    RUN(address_only_80g_device);
    RUN(backed_memory_is_writable);
    RUN(automatic_events);
    RUN(manual_events_per_stream);
    RUN(manual_events_synchronize);
    RUN(timed_events);
    RUN(capture_status);
    RUN(fault_nth_once);
    RUN(fault_persistent_and_clear);
    RUN(fault_every_op_counts);
    RUN(vmm_lifecycle);
    RUN(vmm_misuse);
    RUN(vmm_backed_writable);
    RUN(vmm_backed_unmapped_is_inaccessible);
    RUN(vmm_reserve_from_list_and_rule);
    RUN(host_memory);
    RUN(ipc_handles);
    RUN(peers_and_streams);
    RUN(stream_ordered_pool_model);
    RUN(destroy_releases_leaked_resources);
    RUN(threads_backed);
    RUN(threads_address_only_no_overlap);
    RUN(not_a_sim_backend);
    return harness_done();
}
