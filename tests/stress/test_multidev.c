/*
 * test_multidev.c - per-device allocators used at once from threads on
 * several simulated devices (4 devices, backed memory): each worker sets its
 * own current device and allocates there on its streams with cca_malloc;
 * blocks go through one shared queue, so most are freed by a thread of
 * another device; some are recorded on other streams first. Meanwhile
 * workers enable peer access between devices, copy blocks to a block of
 * another device (cca_memcpy_peer_async) and read statistics. Each block's
 * pattern (and each copy) is checked before its free. At the end: the
 * invariants hold, every device's statistics balance, the backend holds
 * nothing. The same run with backend:cudaMallocAsync. Fixed-seed PRNGs, no
 * sleeps. STRESS_OPS overrides the operations per thread.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "device.h"
#include "harness.h"
#include "runtime.h"

#define DEVICES 4
#define THREADS 12
#define STREAMS 4
#define QUEUE_CAP 96
#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;

typedef struct item {
    unsigned char *ptr;
    size_t size;
    int device;
    uint64_t token;
} item_t;

static struct {
    pthread_mutex_t lock;
    item_t items[QUEUE_CAP];
    size_t count;
} queue = {.lock = PTHREAD_MUTEX_INITIALIZER};

static atomic_uint_fast64_t ops_done, bad_patterns, errors, cross_device_frees, copies;
static int ops_per_thread = 1500;

static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static cca_stream_t stream_of(int device, int i)
{
    return i == 0 ? NULL : (cca_stream_t)(uintptr_t)(0x100000 * (size_t)(device + 1) + 0x1000 * (size_t)i);
}

static void pattern(const item_t *it, bool write)
{
    size_t n = it->size < 8 * KiB ? it->size : 4 * KiB;
    for (size_t i = 0; i < n; i++) {
        unsigned char v = (unsigned char)(it->token >> ((i & 7) * 8)) ^ (unsigned char)i;
        if (write) {
            it->ptr[i] = v;
        } else if (it->ptr[i] != v) {
            atomic_fetch_add(&bad_patterns, 1);
            printf("  block %p of device %d corrupted\n", (void *)it->ptr, it->device);
            return;
        }
    }
}

static void count_error(const char *what)
{
    atomic_fetch_add(&errors, 1);
    printf("  %s failed: %s\n", what, cca_last_error()->message);
}

static void check_and_free(const item_t *it, int my_device, uint64_t *rng)
{
    pattern(it, false);
    if (rng_next(rng) % 5 == 0 &&
        cca_record_stream(it->ptr, stream_of(my_device, (int)(rng_next(rng) % STREAMS))) != CCA_OK)
        count_error("record_stream");
    if (cca_free(it->ptr) != CCA_OK)
        count_error("free");
    if (it->device != my_device)
        atomic_fetch_add(&cross_device_frees, 1);
}

static size_t pick_size(uint64_t *rng)
{
    uint64_t r = rng_next(rng) % 100;
    if (r < 65)
        return 1 + rng_next(rng) % (16 * KiB);
    if (r < 90)
        return 16 * KiB + rng_next(rng) % MiB;
    return MiB + rng_next(rng) % (12 * MiB);
}

static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    int device = id % DEVICES;
    uint64_t rng = 0xd15c0000ull + (uint64_t)id;
    if (cca_set_device(device) != CCA_OK)
        count_error("set_device");
    for (int op = 0; op < ops_per_thread; op++) {
        uint64_t r = rng_next(&rng) % 100;
        cca_stream_t stream = stream_of(device, (int)(rng_next(&rng) % STREAMS));
        if (r < 50) {
            item_t it = {NULL, pick_size(&rng), device, rng_next(&rng)};
            if (cca_malloc((void **)&it.ptr, it.size, stream) != CCA_OK) {
                count_error("malloc");
                continue;
            }
            pattern(&it, true);
            pthread_mutex_lock(&queue.lock);
            bool queued = queue.count < QUEUE_CAP;
            if (queued)
                queue.items[queue.count++] = it;
            pthread_mutex_unlock(&queue.lock);
            if (!queued)
                check_and_free(&it, device, &rng);
        } else if (r < 90) {
            item_t it = {0};
            pthread_mutex_lock(&queue.lock);
            if (queue.count) {
                size_t i = rng_next(&rng) % queue.count;
                it = queue.items[i];
                queue.items[i] = queue.items[--queue.count];
            }
            pthread_mutex_unlock(&queue.lock);
            if (it.ptr)
                check_and_free(&it, device, &rng);
        } else if (r < 94) {
            /* copy a fresh block of ours into a new block of another device */
            int other = (int)((device + 1 + rng_next(&rng) % (DEVICES - 1)) % DEVICES);
            item_t src = {NULL, 4 * KiB, device, rng_next(&rng)};
            item_t dst = {NULL, 4 * KiB, other, src.token};
            if (cca_enable_peer_access(other, device) != CCA_OK)
                count_error("enable_peer_access");
            if (cca_malloc((void **)&src.ptr, src.size, stream) != CCA_OK) {
                count_error("malloc");
                continue;
            }
            if (cca_malloc_device((void **)&dst.ptr, dst.size, other, NULL) != CCA_OK) {
                count_error("malloc_device");
                cca_free(src.ptr);
                continue;
            }
            pattern(&src, true);
            if (cca_memcpy_peer_async(dst.ptr, other, src.ptr, device, src.size, stream) != CCA_OK)
                count_error("memcpy_peer_async");
            pattern(&dst, false);
            atomic_fetch_add(&copies, 1);
            check_and_free(&src, device, &rng);
            check_and_free(&dst, device, &rng);
        } else if (r < 96) {
            if (cca_empty_cache() != CCA_OK)
                count_error("empty_cache");
        } else {
            cca_device_stats_t s;
            int d = (int)(rng_next(&rng) % DEVICES);
            if (cca_get_device_stats(d, &s) != CCA_OK)
                count_error("get_device_stats");
            else if (s.allocated_bytes[CCA_STAT_ALL].current > s.reserved_bytes[CCA_STAT_ALL].current)
                atomic_fetch_add(&errors, 1);
            int peers[DEVICES];
            size_t n = 0;
            if (cca_peer_access_list(d, peers, DEVICES, &n) != CCA_OK || n >= DEVICES)
                count_error("peer_access_list");
        }
        atomic_fetch_add(&ops_done, 1);
    }
    return NULL;
}

static void run(const char *settings)
{
    const char *env = getenv("STRESS_OPS");
    if (env && atoi(env) > 0)
        ops_per_thread = atoi(env) / 2 > 0 ? atoi(env) / 2 : 1;
    atomic_store(&ops_done, 0);
    atomic_store(&bad_patterns, 0);
    atomic_store(&errors, 0);
    atomic_store(&cross_device_frees, 0);
    atomic_store(&copies, 0);
    cca_sim_config_t cfg = {0};
    cfg.devices = DEVICES;
    cfg.total_memory = 16ull << 30;
    cfg.backed = true;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        HARNESS_FAIL("setup: %s", cca_last_error()->message);
        return;
    }
    pthread_t workers[THREADS];
    for (int i = 0; i < THREADS; i++)
        pthread_create(&workers[i], NULL, worker, (void *)(intptr_t)i);
    for (int i = 0; i < THREADS; i++)
        pthread_join(workers[i], NULL);
    char why[512];
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("after the threads: %s", why);
    uint64_t rng = 7;
    while (queue.count) {
        item_t it = queue.items[--queue.count];
        check_and_free(&it, 0, &rng);
    }
    expect_ok(cca_empty_cache());
    if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
        HARNESS_FAIL("at the end: %s", why);
    for (int d = 0; d < DEVICES; d++) {
        cca_device_stats_t s;
        expect_ok(cca_get_device_stats(d, &s));
        expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.reserved_bytes[CCA_STAT_ALL].current, 0);
        expect_eq_i64(s.allocation[CCA_STAT_ALL].allocated, s.allocation[CCA_STAT_ALL].freed);
        int peers[DEVICES];
        size_t n = 0;
        expect_ok(cca_peer_access_list(d, peers, DEVICES, &n));
        expect_true(n > 0); /* every device was copied from */
    }
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    for (int d = 0; d < DEVICES; d++)
        expect_eq_u64(u.device_bytes[d], 0);
    expect_eq_u64(u.live_allocations, 0);
    expect_eq_u64(u.live_events, 0);
    expect_eq_u64(atomic_load(&bad_patterns), 0);
    expect_eq_u64(atomic_load(&errors), 0);
    expect_eq_u64(atomic_load(&ops_done), (uint64_t)THREADS * (uint64_t)ops_per_thread);
    expect_true(atomic_load(&cross_device_frees) > 0);
    printf("multidev (%s): %d threads on %d devices, %llu operations, %llu frees on another "
           "device, %llu peer copies\n",
           settings[0] ? settings : "native", THREADS, DEVICES,
           (unsigned long long)atomic_load(&ops_done),
           (unsigned long long)atomic_load(&cross_device_frees),
           (unsigned long long)atomic_load(&copies));
    cca_shutdown();
}

TEST(native_allocators_on_four_devices)
{
    run("");
}

TEST(cuda_malloc_async_on_four_devices)
{
    run("backend:cudaMallocAsync");
}

/*
 * The invariant checker (which locks every device and every stream pool) in a
 * loop on one thread while the main thread makes the first stream pool of
 * device 1, device 0's only pool in solo mode: making it ends solo mode, which
 * takes device 0's pool lock under device 1's lock. The checker took device 0's
 * lock and pools, then waited for device 1's lock: a deadlock (under
 * CCA_DEBUG_LEVEL=3, where the checker runs after every call), caught here by
 * the alarm. It now takes every device's lock before any pool's.
 */
static atomic_int checker_stop, checker_rounds;

static void *checker_loop(void *arg)
{
    (void)arg;
    char why[256];
    while (!atomic_load(&checker_stop)) {
        if (alloc_check_invariants(why, sizeof(why)) != CCA_OK)
            atomic_fetch_add(&errors, 1);
        atomic_fetch_add(&checker_rounds, 1);
    }
    return NULL;
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char m[] = "checker_beside_a_second_devices_first_pool: no progress in 120 s\n";
    ssize_t w = write(2, m, sizeof(m) - 1);
    (void)w;
    _exit(1);
}

TEST(checker_beside_a_second_devices_first_pool)
{
    signal(SIGALRM, on_alarm);
    alarm(120);
    atomic_store(&errors, 0);
    for (int round = 0; round < 100; round++) {
        cca_sim_config_t cfg = {0};
        cfg.devices = 2;
        cfg.total_memory = 1ull << 30;
        expect_ok(cca_sim_create(&cfg, &sim));
        expect_ok(cca_init_with_backend(sim, ""));
        void *p = NULL, *q = NULL;
        expect_ok(cca_malloc_device(&p, 4 * KiB, 0, NULL)); /* device 0's pool: solo mode */
        atomic_store(&checker_stop, 0);
        atomic_store(&checker_rounds, 0);
        pthread_t t;
        expect_true(pthread_create(&t, NULL, checker_loop, NULL) == 0);
        while (atomic_load(&checker_rounds) == 0) /* the checker under way */
            ;
        expect_ok(cca_malloc_device(&q, 4 * KiB, 1, NULL)); /* device 1's first pool */
        atomic_store(&checker_stop, 1);
        pthread_join(t, NULL);
        expect_ok(cca_free(q));
        expect_ok(cca_free(p));
        cca_shutdown();
    }
    alarm(0);
    expect_eq_u64(atomic_load(&errors), 0);
}

int main(void)
{
    RUN(checker_beside_a_second_devices_first_pool);
    RUN(native_allocators_on_four_devices);
    RUN(cuda_malloc_async_on_four_devices);
    return harness_done();
}
