/*
 * test_misuse.c - every misuse of the API gets its documented status, a
 * message naming the problem, and changes nothing: statistics, simulated
 * backend usage and the allocator's invariants are the same before and
 * after.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "runtime.h"
#include "device.h"
#include "harness.h"

#define MiB ((size_t)1 << 20)
#define S1 ((cca_stream_t)(uintptr_t)0x1000)

static cca_backend_t *sim;
static int cases;

static void setup(void)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 1ull << 30;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, "") != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

/* What must not change. */
typedef struct snapshot {
    cca_device_stats_t dev[2];
    cca_sim_usage_t usage;
    cca_host_stats_t host;
    uint64_t calls[CCA_OP_COUNT];
} snapshot_t;

static void take(snapshot_t *s)
{
    memset(s, 0, sizeof(*s));
    cca_get_device_stats(0, &s->dev[0]);
    cca_get_device_stats(1, &s->dev[1]);
    cca_sim_usage(sim, &s->usage);
    cca_host_get_stats(&s->host);
    for (int op = 0; op < CCA_OP_COUNT; op++)
        s->calls[op] = cca_sim_call_count(sim, (cca_backend_op_t)op);
}

/* Run call; expect status and a message containing needle; nothing changed. */
#define MISUSE(call, want, needle)                                          \
    do {                                                                      \
        snapshot_t before_, after_;                                           \
        take(&before_);                                                       \
        cca_clear_error();                                                    \
        expect_status(call, want);                                            \
        expect_eq_i64(cca_last_error()->status, want);                        \
        expect_contains(cca_last_error()->message, needle);                   \
        take(&after_);                                                        \
        if (memcmp(&before_.dev, &after_.dev, sizeof(before_.dev)))           \
            HARNESS_FAIL("%s changed the device statistics", #call);          \
        if (memcmp(&before_.usage, &after_.usage, sizeof(before_.usage)))     \
            HARNESS_FAIL("%s changed the simulated backend's usage", #call);  \
        if (memcmp(&before_.host, &after_.host, sizeof(before_.host)))        \
            HARNESS_FAIL("%s changed the host statistics", #call);            \
        if (memcmp(before_.calls, after_.calls, sizeof(before_.calls)))       \
            HARNESS_FAIL("%s called the backend", #call);                     \
        char why_[512];                                                       \
        if (alloc_check_invariants(why_, sizeof(why_)) != CCA_OK)             \
            HARNESS_FAIL("%s broke an invariant: %s", #call, why_);           \
        cases++;                                                              \
    } while (0)

TEST(before_init)
{
    cca_shutdown();
    int x;
    expect_status(cca_free(&x), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "not initialised");
    expect_false(cca_is_initialized());
    expect_status(cca_record_stream(&x, S1), CCA_ERR_INVALID_POINTER);
    expect_contains(cca_last_error()->message, "not initialised");
    expect_false(cca_is_initialized());
    expect_status(cca_get_base_allocation(&x, NULL, NULL), CCA_ERR_INVALID_POINTER);
    expect_false(cca_is_initialized());
    expect_ok(alloc_check_invariants(NULL, 0));
    expect_false(cca_is_initialized());
    cases += 3;
}

TEST(device_pointers)
{
    setup();
    void *a, *b;
    expect_ok(cca_malloc(&a, 4096, NULL));
    expect_ok(cca_malloc(&b, 3 * MiB, S1));
    int local;
    MISUSE(cca_free(&local), CCA_ERR_INVALID_POINTER, "was not allocated by cca");
    MISUSE(cca_free((char *)a + 512), CCA_ERR_INVALID_POINTER, "is inside the block");
    MISUSE(cca_free((char *)b + 1), CCA_ERR_INVALID_POINTER, "is inside the block");
    MISUSE(cca_record_stream(&local, S1), CCA_ERR_INVALID_POINTER, "was not allocated by cca");
    MISUSE(cca_record_stream((char *)a + 8, S1), CCA_ERR_INVALID_POINTER, "is inside the block");
    MISUSE(cca_record_stream(NULL, S1), CCA_ERR_INVALID_POINTER, "NULL");
    MISUSE(cca_get_base_allocation(&local, NULL, NULL), CCA_ERR_INVALID_POINTER, "not allocated");
    expect_ok(cca_free(a));
    MISUSE(cca_free(a), CCA_ERR_INVALID_POINTER, "already freed");
    MISUSE(cca_record_stream(a, S1), CCA_ERR_INVALID_POINTER, "already freed");
    expect_ok(cca_empty_cache());
    MISUSE(cca_free(a), CCA_ERR_INVALID_POINTER, "already freed");
    /* freeing NULL is a documented no-op */
    expect_ok(cca_free(NULL));
    expect_ok(cca_free(b));
    MISUSE(cca_free(b), CCA_ERR_INVALID_POINTER, "already freed");
    cca_shutdown();
}

TEST(arguments)
{
    setup();
    void *p = (void *)0x1;
    MISUSE(cca_malloc(NULL, 100, NULL), CCA_ERR_INVALID_ARGUMENT, "ptr is NULL");
    MISUSE(cca_malloc_device(&p, 100, 2, NULL), CCA_ERR_INVALID_ARGUMENT, "device 2 is out of range");
    MISUSE(cca_malloc_device(&p, 100, -1, NULL), CCA_ERR_INVALID_ARGUMENT, "out of range");
    expect_eq_ptr(p, (void *)0x1); /* out-parameter untouched */
    /* 1 EB or more: PyTorch's out-of-memory error */
    MISUSE(cca_malloc(&p, (size_t)1 << 60, NULL), CCA_ERR_OUT_OF_MEMORY, "more than 1EB");
    MISUSE(cca_malloc(&p, SIZE_MAX, NULL), CCA_ERR_OUT_OF_MEMORY, "more than 1EB");
    expect_eq_ptr(p, (void *)0x1);
    MISUSE(cca_set_memory_fraction(1.5, 0), CCA_ERR_INVALID_ARGUMENT, "invalid fraction");
    MISUSE(cca_set_memory_fraction(-0.1, 0), CCA_ERR_INVALID_ARGUMENT, "invalid fraction");
    MISUSE(cca_set_memory_fraction(0.5, 7), CCA_ERR_INVALID_ARGUMENT, "device 7");
    MISUSE(cca_get_device_stats(5, NULL), CCA_ERR_INVALID_ARGUMENT, "device 5");
    MISUSE(cca_get_device_stats(0, NULL), CCA_ERR_INVALID_ARGUMENT, "stats is NULL");
    MISUSE(cca_cache_info(9, NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "device 9");
    MISUSE(cca_memory_stats(0, NULL, 0), CCA_ERR_INVALID_ARGUMENT, "122");
    MISUSE(cca_mem_get_info(-3, NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "device -3");
    MISUSE(cca_register_free_memory_callback(NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "NULL");
    /* size 0: success with NULL, nothing allocated */
    snapshot_t before, after;
    take(&before);
    expect_ok(cca_malloc(&p, 0, NULL));
    expect_eq_ptr(p, NULL);
    take(&after);
    expect_true(!memcmp(&before.dev, &after.dev, sizeof(before.dev)));
    cases++;
    cca_shutdown();
}

TEST(settings_strings)
{
    setup();
    const cca_settings_t *before = cca_state->settings;
    cca_settings_t saved = *before;
    MISUSE(cca_set_settings("max_split_size_mb:abc"), CCA_ERR_BAD_SETTINGS, "max_split_size_mb");
    MISUSE(cca_set_settings("no_such_key:1"), CCA_ERR_BAD_SETTINGS, "no_such_key");
    MISUSE(cca_set_settings("garbage_collection_threshold:1.5"), CCA_ERR_BAD_SETTINGS,
           "garbage_collection_threshold");
    MISUSE(cca_set_settings("roundup_power2_divisions:3"), CCA_ERR_BAD_SETTINGS,
           "roundup_power2_divisions");
    MISUSE(cca_set_settings("max_split_size_mb:20,,"), CCA_ERR_BAD_SETTINGS, "");
    MISUSE(cca_set_settings("expandable_segments:Maybe"), CCA_ERR_BAD_SETTINGS, "expandable_segments");
    MISUSE(cca_set_settings("compact_memory:Maybe"), CCA_ERR_BAD_SETTINGS, "compact_memory");
    MISUSE(cca_set_settings("compact_memory:True,expandable_segments:False"), CCA_ERR_BAD_SETTINGS,
           "compact_memory needs expandable segments");
    expect_true(cca_state->settings == before); /* no new settings object either */
    expect_true(!memcmp(&saved, cca_state->settings, sizeof(saved)));
    /* annotations' fields (the history recorded, so that a refusal is not a no-op) */
    expect_status(cca_record_history(true, NULL, NULL, 16, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    const char *keys[2] = {"name", ""}, *values[2] = {"step", "x"};
    MISUSE(cca_record_annotation_fields(keys, values, 2), CCA_ERR_INVALID_ARGUMENT, "key 1 is empty");
    MISUSE(cca_record_annotation_fields(keys, NULL, 1), CCA_ERR_INVALID_ARGUMENT, "values is NULL");
    MISUSE(cca_record_annotation(NULL), CCA_ERR_INVALID_ARGUMENT, "name is NULL");
    MISUSE(cca_push_compile_context(NULL), CCA_ERR_INVALID_ARGUMENT, "context is NULL");
    MISUSE(cca_set_user_metadata(NULL), CCA_ERR_INVALID_ARGUMENT, "metadata is NULL");
    MISUSE(cca_get_user_metadata(NULL), CCA_ERR_INVALID_ARGUMENT, "metadata is NULL");
    cca_trace_entry_t *entries = NULL;
    size_t n = 0;
    expect_status(cca_history_get(&entries, &n), CCA_OK);
    expect_eq_u64(n, 0); /* nothing recorded by the refused calls */
    cca_history_free(entries);
    expect_status(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER), CCA_OK);
    char *text = NULL;
    expect_status(cca_settings_describe("max_split_size_mb:", &text), CCA_ERR_BAD_SETTINGS);
    expect_eq_ptr(text, NULL);
    cases++;
    cca_shutdown();
}

TEST(devices_and_processes)
{
    setup();
    char *p = NULL;
    int x = 0;
    size_t n;
    bool can;
    expect_ok(cca_malloc((void **)&p, MiB, NULL));
    cca_ipc_mem_handle_t h, bad;
    memset(&bad, 0, sizeof(bad));
    MISUSE(cca_enable_peer_access(0, 0), CCA_ERR_INVALID_ARGUMENT, "its own peer");
    MISUSE(cca_enable_peer_access(0, 2), CCA_ERR_INVALID_ARGUMENT, "device 2");
    MISUSE(cca_can_access_peer(-1, 0, &can), CCA_ERR_INVALID_ARGUMENT, "device -1");
    MISUSE(cca_peer_access_list(0, NULL, 2, &n), CCA_ERR_INVALID_ARGUMENT, "peers");
    MISUSE(cca_memcpy_peer_async(p, 0, NULL, 1, 64, NULL), CCA_ERR_INVALID_ARGUMENT, "src");
    MISUSE(cca_ipc_get_handle(&x, NULL, &h), CCA_ERR_INVALID_POINTER, "not allocated");
    MISUSE(cca_ipc_get_handle(p + 512, NULL, &h), CCA_ERR_INVALID_POINTER, "inside the block");
    MISUSE(cca_ipc_get_handle(p, NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "handle");
    MISUSE(cca_ipc_open(&bad, NULL, (void **)&p, NULL), CCA_ERR_INVALID_ARGUMENT, "not a cca IPC handle");
    MISUSE(cca_ipc_close(&x), CCA_ERR_INVALID_POINTER, "not opened");
    MISUSE(cca_ipc_release_handle(&bad), CCA_ERR_INVALID_ARGUMENT, "not a cca IPC handle");
    MISUSE(cca_ipc_release_handle(NULL), CCA_ERR_INVALID_ARGUMENT, "NULL");
    unsigned char buf[CCA_IPC_HANDLE_SIZE + 8];
    void *q = NULL;
    MISUSE(cca_ipc_handle_size(p, NULL), CCA_ERR_INVALID_ARGUMENT, "size");
    MISUSE(cca_ipc_handle_size(&x, &n), CCA_ERR_INVALID_POINTER, "not allocated");
    MISUSE(cca_ipc_get_handle_bytes(p, NULL, buf, CCA_IPC_HANDLE_SIZE - 1, &n),
           CCA_ERR_INVALID_ARGUMENT, "the handle takes 224 bytes");
    MISUSE(cca_ipc_open_bytes(buf, 10, NULL, (void **)&p, NULL), CCA_ERR_INVALID_ARGUMENT,
           "not a cca IPC handle");
    MISUSE(cca_ipc_open_bytes(NULL, 10, NULL, (void **)&p, NULL), CCA_ERR_INVALID_ARGUMENT, "NULL");
    MISUSE(cca_ipc_release_handle_bytes(bad.bytes, sizeof(bad.bytes)), CCA_ERR_INVALID_ARGUMENT,
           "not a cca IPC handle");
    expect_ok(cca_ipc_get_handle_bytes(p, NULL, buf, sizeof(buf), &n));
    expect_eq_u64(n, CCA_IPC_HANDLE_SIZE);
    MISUSE(cca_ipc_open_bytes(buf, n + 8, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT,
           "padded");
    expect_ok(cca_ipc_release_handle_bytes(buf, n));
    expect_ok(cca_free(p));
    cca_shutdown();
}

/* cca_init_with_backend while initialised: BUSY, and the backend it was given is destroyed
 * (cca owns it on every return), unless it is the one cca runs on. */
static cca_backend_t counted_backend;
static void (*counted_destroy_next)(void *ctx);
static int counted_destroys;
static void counted_destroy(void *ctx)
{
    counted_destroys++;
    counted_destroy_next(ctx);
}

TEST(init_while_initialised)
{
    setup();
    cca_sim_config_t cfg = {0};
    cfg.devices = 1;
    cca_backend_t *other = NULL;
    expect_ok(cca_sim_create(&cfg, &other));
    counted_backend = *other;
    counted_destroy_next = other->destroy;
    counted_backend.destroy = counted_destroy;
    counted_destroys = 0;
    MISUSE(cca_init_with_backend(&counted_backend, ""), CCA_ERR_BUSY, "already initialised");
    expect_eq_i64(counted_destroys, 1);
    MISUSE(cca_init_with_backend(sim, "expandable_segments:True"), CCA_ERR_BUSY,
           "already initialised");
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, NULL)); /* still running on sim, with its settings */
    expect_ok(cca_free(p));
    cca_shutdown();
    expect_eq_i64(counted_destroys, 1);
}

/* A handle's reference is released once: a second release (fixed or serialized form), with
 * another handle of the block still out, is refused and must not let the block's free
 * complete under the other handle's process; so is a release after the close-less free. */
TEST(repeated_ipc_releases)
{
    setup();
    char *p = NULL, *q = NULL;
    size_t n = 0, pending = 0;
    expect_ok(cca_malloc((void **)&p, MiB, NULL));
    cca_ipc_mem_handle_t first;
    unsigned char second[CCA_IPC_HANDLE_SIZE];
    expect_ok(cca_ipc_get_handle(p, NULL, &first));
    expect_ok(cca_ipc_get_handle_bytes(p, NULL, second, sizeof(second), &n));
    expect_ok(cca_ipc_release_handle(&first));
    MISUSE(cca_ipc_release_handle(&first), CCA_ERR_INVALID_ARGUMENT, "released already");
    MISUSE(cca_ipc_release_handle_bytes(first.bytes, sizeof(first.bytes)),
           CCA_ERR_INVALID_ARGUMENT, "released already");
    /* the second handle still holds the block: its free waits, its memory is not reused */
    expect_ok(cca_free(p));
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 1);
    MISUSE(cca_ipc_release_handle(&first), CCA_ERR_INVALID_ARGUMENT, "released already");
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 1);
    expect_ok(cca_malloc((void **)&q, MiB, NULL));
    expect_true(q != p);
    expect_ok(cca_ipc_release_handle_bytes(second, n));
    MISUSE(cca_ipc_release_handle_bytes(second, n), CCA_ERR_INVALID_ARGUMENT, "released already");
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    /* the block's free completed: its handles name nothing now */
    MISUSE(cca_ipc_release_handle(&first), CCA_ERR_INVALID_ARGUMENT, "released already");
    MISUSE(cca_ipc_release_handle_bytes(second, n), CCA_ERR_INVALID_ARGUMENT, "released already");
    expect_ok(cca_free(q));
    cca_shutdown();
}

/* Pointers into expandable segments: blocks, unmapped space, after unmapping. */
TEST(expandable_pointers)
{
    setup();
    expect_ok(cca_set_settings("expandable_segments:True"));
    void *a, *b;
    expect_ok(cca_malloc(&a, 5 * MiB, NULL));
    expect_ok(cca_malloc(&b, 1000, S1));
    MISUSE(cca_free((char *)a + 512), CCA_ERR_INVALID_POINTER, "is inside the block");
    MISUSE(cca_free((char *)a + 20 * MiB), CCA_ERR_INVALID_POINTER, "not allocated by cca");
    MISUSE(cca_free((char *)a + 100 * MiB), CCA_ERR_INVALID_POINTER, "not allocated by cca");
    MISUSE(cca_record_stream((char *)a + 30 * MiB, S1), CCA_ERR_INVALID_POINTER, "not allocated");
    /* PyTorch refuses to share expandable memory between processes */
    MISUSE(cca_get_base_allocation(a, NULL, NULL), CCA_ERR_NOT_SUPPORTED, "expandable_segments");
    MISUSE(cca_get_base_allocation((char *)a + 4096, NULL, NULL), CCA_ERR_NOT_SUPPORTED,
           "expandable_segments");
    /* IPC of expandable blocks needs shareable physical memory (ipc_shared mode) */
    cca_ipc_mem_handle_t h;
    expect_status(cca_ipc_get_handle(a, NULL, &h), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "expandable_segments:True cannot be shared");
    expect_ok(cca_free(a));
    MISUSE(cca_free(a), CCA_ERR_INVALID_POINTER, "already freed");
    expect_ok(cca_empty_cache()); /* a's granule is unmapped, its reservation freed */
    MISUSE(cca_free(a), CCA_ERR_INVALID_POINTER, "already freed");
    MISUSE(cca_record_stream(a, S1), CCA_ERR_INVALID_POINTER, "already freed");
    expect_ok(cca_free(b));
    MISUSE(cca_free(b), CCA_ERR_INVALID_POINTER, "already freed");
    expect_ok(cca_empty_cache());
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_reservations + u.live_handles + u.device_bytes[0], 0);
}

TEST(host_pointers)
{
    setup();
    void *h = NULL, *p = (void *)0x1;
    expect_ok(cca_host_malloc(&h, 10000));
    int local;
    MISUSE(cca_host_malloc(NULL, 10), CCA_ERR_INVALID_ARGUMENT, "ptr is NULL");
    MISUSE(cca_host_malloc(&p, (size_t)1 << 60), CCA_ERR_INVALID_ARGUMENT, "1 EB");
    expect_eq_ptr(p, (void *)0x1);
    MISUSE(cca_host_free(&local), CCA_ERR_INVALID_POINTER, "cca_host_free");
    MISUSE(cca_host_free((char *)h + 16), CCA_ERR_INVALID_POINTER, "cca_host_free");
    MISUSE(cca_host_record_event(&local, S1), CCA_ERR_INVALID_POINTER, "not allocated");
    MISUSE(cca_host_record_event(NULL, S1), CCA_ERR_INVALID_POINTER, "NULL");
    MISUSE(cca_host_get_stats(NULL), CCA_ERR_INVALID_ARGUMENT, "NULL");
    /* a device pointer is not a host pointer, and the other way round */
    void *d;
    expect_ok(cca_malloc(&d, 4096, NULL));
    MISUSE(cca_host_free(d), CCA_ERR_INVALID_POINTER, "cca_host_free");
    MISUSE(cca_free(h), CCA_ERR_INVALID_POINTER, "not allocated by cca");
    expect_ok(cca_free(d));
    expect_ok(cca_host_free(h));
    MISUSE(cca_host_free(h), CCA_ERR_INVALID_POINTER, "already freed");
    expect_ok(cca_host_free(NULL));
    cca_shutdown();
}

/* A pool's own allocator that is never asked for memory here. */
static void *never_alloc(size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)size, (void)device, (void)stream, (void)ctx;
    return NULL;
}
static cca_status_t never_free(void *ptr, size_t size, int device, cca_stream_t stream, void *ctx)
{
    (void)ptr, (void)size, (void)device, (void)stream, (void)ctx;
    return CCA_OK;
}

TEST(private_pools)
{
    setup();
    cca_mempool_id_t g = {1, 0}, none = {0, 0}, unknown = {9, 9};
    int uc;
    cca_pool_state_t *state;
    cca_checkpoint_delta_t delta;
    MISUSE(cca_end_allocate_to_pool(0, g), CCA_ERR_BUSY, "not routing");
    MISUSE(cca_release_pool(0, unknown), CCA_ERR_INVALID_ARGUMENT, "no private pool");
    MISUSE(cca_pool_use_count(0, unknown, &uc), CCA_ERR_INVALID_ARGUMENT, "no private pool");
    MISUSE(cca_pool_set_use_on_oom(0, unknown, true), CCA_ERR_INVALID_ARGUMENT, "no private pool");
    MISUSE(cca_pool_get_checkpoint(0, unknown, &state), CCA_ERR_INVALID_ARGUMENT, "no private pool");
    MISUSE(cca_pool_create(0, none), CCA_ERR_INVALID_ARGUMENT, "default pools");
    MISUSE(cca_begin_allocate_thread_to_pool(0, none), CCA_ERR_INVALID_ARGUMENT, "default pools");
    MISUSE(cca_pool_create(5, g), CCA_ERR_INVALID_ARGUMENT, "out of range");
    MISUSE(cca_begin_allocate_to_pool(0, g, NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "filter is NULL");
    MISUSE(cca_pool_set_checkpoint(0, NULL, &delta), CCA_ERR_INVALID_ARGUMENT, "required");
    MISUSE(cca_pool_set_allocator(0, unknown, never_alloc, never_free, NULL), CCA_ERR_INVALID_ARGUMENT,
           "no private pool");
    MISUSE(cca_pool_set_allocator(0, none, never_alloc, never_free, NULL), CCA_ERR_INVALID_ARGUMENT,
           "default pools");
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, S1));
    MISUSE(cca_pool_set_allocator(0, g, never_alloc, NULL, NULL), CCA_ERR_INVALID_ARGUMENT, "neither");
    MISUSE(cca_begin_allocate_stream_to_pool(0, g, S1), CCA_ERR_BUSY, "already routing");
    MISUSE(cca_release_pool(0, g), CCA_ERR_BUSY, "still routed");
    MISUSE(cca_pool_get_checkpoint(0, g, &state), CCA_ERR_BUSY, "route");
    expect_ok(cca_end_allocate_to_pool(0, g));
    expect_ok(cca_release_pool(0, g));
    MISUSE(cca_release_pool(0, g), CCA_ERR_BUSY, "already released");
    MISUSE(cca_begin_allocate_stream_to_pool(0, g, S1), CCA_ERR_BUSY, "released");
    MISUSE(cca_pool_create(0, g), CCA_ERR_BUSY, "released");
    MISUSE(cca_pool_set_allocator(0, g, never_alloc, never_free, NULL), CCA_ERR_BUSY, "released");
    expect_ok(cca_empty_cache());
    MISUSE(cca_release_pool(0, g), CCA_ERR_INVALID_ARGUMENT, "no private pool");
    cca_shutdown();
}

int main(void)
{
    RUN(before_init);
    RUN(device_pointers);
    RUN(arguments);
    RUN(settings_strings);
    RUN(expandable_pointers);
    RUN(host_pointers);
    RUN(devices_and_processes);
    RUN(repeated_ipc_releases);
    RUN(init_while_initialised);
    RUN(private_pools);
    printf("misuse cases: %d\n", cases);
    return harness_done();
}
