/*
 * test_host_threads.c - the pinned host allocator under concurrency (run
 * under ThreadSanitizer too): its free lists, pointer map, block states and
 * active statistics share one lock, so every statistics snapshot is
 * consistent (allocated - freed == current, peak >= current, peaks never
 * fall without a reset) while threads allocate, record streams, free,
 * release blocks over pinned_max_cached_size and empty the cache; of two
 * threads freeing one pointer at once exactly one succeeds; and the peaks
 * stay exact when some blocks go back to the system at free.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "harness.h"
#include "host.h"
#include "settings.h"

#define THREADS 6
#define STEPS 20000
#define KiB ((size_t)1024)

typedef struct fixture {
    cca_backend_t *be;
    host_alloc_t *h;
} fixture_t;

static bool fx_open(fixture_t *f, size_t max_cached)
{
    cca_sim_config_t cfg = {0}; /* events complete at once */
    cca_settings_t s;
    settings_default(&s);
    s.pinned_max_cached_size = max_cached;
    f->be = NULL;
    f->h = NULL;
    if (cca_sim_create(&cfg, &f->be) != CCA_OK) {
        HARNESS_FAIL("cca_sim_create: %s", cca_last_error()->message);
        return false;
    }
    if (host_create(f->be, &s, &f->h) != CCA_OK) {
        HARNESS_FAIL("host_create: %s", cca_last_error()->message);
        f->be->destroy(f->be->ctx);
        return false;
    }
    return true;
}

static cca_host_stats_t stats(host_alloc_t *h)
{
    cca_host_stats_t st;
    memset(&st, 0, sizeof(st));
    (void)host_get_stats(h, &st);
    return st;
}

/* Empty the cache (collecting events) until nothing is active; then check and close. */
static void fx_close(fixture_t *f)
{
    uint64_t deadline = cca_now_ns() + 10ull * 1000000000ull;
    while (stats(f->h).active_requests.current != 0 && cca_now_ns() < deadline)
        expect_ok(host_empty_cache(f->h));
    cca_host_stats_t st = stats(f->h);
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.active_bytes.current, 0);
    expect_ok(host_empty_cache(f->h));
    expect_eq_i64(stats(f->h).allocations.current, 0);
    expect_true(host_is_valid(f->h));
    host_destroy(f->h);
    cca_sim_usage_t u;
    memset(&u, 0, sizeof(u));
    cca_sim_usage(f->be, &u);
    expect_eq_u64(u.live_host, 0);
    expect_eq_u64(u.live_events, 0);
    f->be->destroy(f->be->ctx);
}

static unsigned next_rand(unsigned *seed)
{
    *seed = *seed * 1103515245u + 12345u;
    return *seed >> 8;
}

/* ------------------------------------------------------------------------ */

typedef struct mix_worker {
    host_alloc_t *h;
    unsigned seed;
    int errors;
} mix_worker_t;

static atomic_int mix_running;

/* Up to 4 blocks held at once, sizes 1 B .. 256 KiB; a quarter used on a stream. */
static void *mix_main(void *arg)
{
    mix_worker_t *w = arg;
    void *held[4] = {0};
    for (int i = 0; i < STEPS; i++) {
        unsigned r = next_rand(&w->seed);
        unsigned slot = r % 4;
        if (held[slot]) {
            if (host_release_ptr(w->h, held[slot]) != CCA_OK)
                w->errors++;
            held[slot] = NULL;
            continue;
        }
        size_t size = (size_t)1 + (next_rand(&w->seed) % (256 * KiB));
        if (host_malloc(w->h, &held[slot], size) != CCA_OK || !held[slot]) {
            w->errors++;
            continue;
        }
        ((unsigned char *)held[slot])[size - 1] = (unsigned char)r;
        if (r % 4 == 0 &&
            host_record_event(w->h, (char *)held[slot] + size / 2,
                              (cca_stream_t)(uintptr_t)(0x1000 + r % 3)) != CCA_OK)
            w->errors++;
    }
    for (int slot = 0; slot < 4; slot++)
        if (held[slot] && host_release_ptr(w->h, held[slot]) != CCA_OK)
            w->errors++;
    return NULL;
}

/* Snapshots while the workers run: each one consistent, the peaks never falling. */
static void *snapshot_main(void *arg)
{
    mix_worker_t *w = arg;
    int64_t last_peak_requests = 0, last_peak_bytes = 0;
    for (unsigned n = 0; atomic_load(&mix_running); n++) {
        cca_host_stats_t st = stats(w->h);
        const cca_stat_t *rq = &st.active_requests, *by = &st.active_bytes;
        if (rq->allocated - rq->freed != rq->current || by->allocated - by->freed != by->current)
            w->errors++;
        if (rq->current < 0 || by->current < rq->current || rq->peak < rq->current ||
            by->peak < by->current)
            w->errors++;
        if (rq->peak < last_peak_requests || by->peak < last_peak_bytes)
            w->errors++;
        last_peak_requests = rq->peak;
        last_peak_bytes = by->peak;
        if (n % 64 == 0 && host_empty_cache(w->h) != CCA_OK)
            w->errors++;
    }
    return NULL;
}

TEST(consistent_snapshots_under_mixed_load)
{
    fixture_t f;
    if (!fx_open(&f, 128 * KiB)) /* 256 KiB blocks go back to the system at free */
        return;
    mix_worker_t w[THREADS + 1];
    pthread_t t[THREADS + 1];
    atomic_store(&mix_running, 1);
    for (int i = 0; i <= THREADS; i++) {
        w[i] = (mix_worker_t){f.h, 77u + (unsigned)i * 7919u, 0};
        pthread_create(&t[i], NULL, i == THREADS ? snapshot_main : mix_main, &w[i]);
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    atomic_store(&mix_running, 0);
    pthread_join(t[THREADS], NULL);
    for (int i = 0; i <= THREADS; i++)
        expect_eq_i64(w[i].errors, 0);
    cca_host_stats_t st = stats(f.h);
    expect_true(st.active_requests.allocated > 0);
    expect_true(st.num_host_free > 0); /* the size limit and empty_cache gave blocks back */
    fx_close(&f);
}

/* ------------------------------------------------------------------------ */

#define RACE_ROUNDS 2000

typedef struct race {
    host_alloc_t *h;
    pthread_barrier_t barrier;
    void *_Atomic ptr;
    atomic_int ok, invalid, other;
} race_t;

static void *race_main(void *arg)
{
    race_t *x = arg;
    for (int round = 0; round < RACE_ROUNDS; round++) {
        pthread_barrier_wait(&x->barrier); /* ptr set */
        cca_status_t st = host_release_ptr(x->h, atomic_load(&x->ptr));
        if (st == CCA_OK)
            atomic_fetch_add(&x->ok, 1);
        else if (st == CCA_ERR_INVALID_POINTER)
            atomic_fetch_add(&x->invalid, 1);
        else
            atomic_fetch_add(&x->other, 1);
        pthread_barrier_wait(&x->barrier); /* both done */
    }
    return NULL;
}

TEST(double_free_race_has_one_winner)
{
    fixture_t f;
    if (!fx_open(&f, 64 * KiB)) /* the 128 KiB rounds give the block back at free */
        return;
    race_t x;
    memset(&x, 0, sizeof(x));
    x.h = f.h;
    pthread_barrier_init(&x.barrier, NULL, 3);
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, race_main, &x);
    int bad = 0;
    for (int round = 0; round < RACE_ROUNDS; round++) {
        void *p = NULL;
        if (host_malloc(f.h, &p, round % 2 ? 128 * KiB : 4 * KiB) != CCA_OK)
            bad++;
        atomic_store(&x.ptr, p);
        pthread_barrier_wait(&x.barrier);
        pthread_barrier_wait(&x.barrier);
        if (stats(f.h).active_requests.current != 0)
            bad++;
    }
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    pthread_barrier_destroy(&x.barrier);
    expect_eq_i64(bad, 0);
    expect_eq_i64(atomic_load(&x.ok), RACE_ROUNDS);
    expect_eq_i64(atomic_load(&x.invalid), RACE_ROUNDS);
    expect_eq_i64(atomic_load(&x.other), 0);
    cca_host_stats_t st = stats(f.h);
    expect_eq_i64(st.active_requests.allocated, RACE_ROUNDS);
    expect_eq_i64(st.active_requests.freed, RACE_ROUNDS);
    expect_eq_i64(st.active_requests.peak, 1);
    fx_close(&f);
}

/* ------------------------------------------------------------------------ */

#define PEAK_THREADS 8
#define PEAK_ROUNDS 200

typedef struct peak_worker {
    host_alloc_t *h;
    pthread_barrier_t *barrier;
    size_t size;
    int errors;
} peak_worker_t;

static void *peak_main(void *arg)
{
    peak_worker_t *w = arg;
    for (int round = 0; round < PEAK_ROUNDS; round++) {
        void *p = NULL;
        if (host_malloc(w->h, &p, w->size) != CCA_OK)
            w->errors++;
        pthread_barrier_wait(w->barrier); /* every thread holds its block */
        if (host_release_ptr(w->h, p) != CCA_OK)
            w->errors++;
        pthread_barrier_wait(w->barrier);
    }
    return NULL;
}

/* Each round every thread holds one block of its own size at a barrier; the
 * larger half of them go back to the system at free. The peaks are the sums. */
TEST(exact_peaks_with_blocks_given_back)
{
    fixture_t f;
    if (!fx_open(&f, 64 * KiB))
        return;
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, PEAK_THREADS);
    peak_worker_t w[PEAK_THREADS];
    pthread_t t[PEAK_THREADS];
    int64_t bytes = 0;
    for (int i = 0; i < PEAK_THREADS; i++) {
        w[i] = (peak_worker_t){f.h, &barrier, (size_t)8 * KiB << i, 0};
        bytes += (int64_t)(8 * KiB) << i;
        pthread_create(&t[i], NULL, peak_main, &w[i]);
    }
    for (int i = 0; i < PEAK_THREADS; i++) {
        pthread_join(t[i], NULL);
        expect_eq_i64(w[i].errors, 0);
    }
    pthread_barrier_destroy(&barrier);
    cca_host_stats_t st = stats(f.h);
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.active_bytes.current, 0);
    expect_eq_i64(st.active_requests.peak, PEAK_THREADS);
    expect_eq_i64(st.active_bytes.peak, bytes);
    expect_eq_i64(st.active_requests.allocated, PEAK_THREADS * PEAK_ROUNDS);
    expect_eq_i64(st.active_bytes.freed, bytes * PEAK_ROUNDS);
    /* 8, 16, 32 and 64 KiB stay cached; 128 KiB .. 1 MiB went back at every free */
    expect_eq_i64(st.allocations.current, 4);
    expect_eq_i64(st.num_host_free, (PEAK_THREADS - 4) * PEAK_ROUNDS);
    fx_close(&f);
}

int main(void)
{
    RUN(consistent_snapshots_under_mixed_load);
    RUN(double_free_race_has_one_winner);
    RUN(exact_peaks_with_blocks_given_back);
    return harness_done();
}
