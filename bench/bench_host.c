/*
 * bench_host.c - CPU benchmark of the pinned host caching allocator on the
 * simulated backend: the cached allocate + free pair, the same from several
 * threads, and the first (uncached) allocation in register mode, which on the
 * simulated backend measures malloc + the parallel page pre-fault.
 *
 *   bench_host [--quick] [--backend sim|cuda]
 *     --quick: a tenth of the pairs, no 1 GiB allocations.
 * Ends with one line per cached pair size, as bench_gpu prints its figures:
 *   RESULT cca pinned_pair size=512 ns_per_pair=41.2   ("cca-sim" on sim)
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "host.h"
#include "settings.h"

/* The core defines cca_init; this stand-in only lets the benchmark link without it. */
__attribute__((weak)) cca_status_t cca_init(void)
{
    return CCA_OK;
}

#define MiB ((size_t)1024 * 1024)

static bool use_cuda; /* --backend cuda: real pinned memory */

static cca_backend_t *make_backend(void)
{
    cca_sim_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cca_backend_t *be = NULL;
    if (use_cuda) {
        if (cca_cuda_create(&be) != CCA_OK) {
            fprintf(stderr, "cca_cuda_create: %s\n", cca_last_error()->message);
            return NULL;
        }
        return be;
    }
    if (cca_sim_create(&cfg, &be) != CCA_OK) {
        fprintf(stderr, "cca_sim_create: %s\n", cca_last_error()->message);
        return NULL;
    }
    return be;
}

/* Nanoseconds per cached host_malloc + host_free pair of size bytes, after 1000 warm-up
 * pairs (as the anchor's pair_latency warms up). */
static double pair_ns(host_alloc_t *h, size_t size, long iterations)
{
    void *p;
    for (int i = 0; i < 1000; i++)
        if (host_malloc(h, &p, size) != CCA_OK || host_release_ptr(h, p) != CCA_OK)
            return -1;
    uint64_t t0 = cca_now_ns();
    for (long i = 0; i < iterations; i++) {
        if (host_malloc(h, &p, size) != CCA_OK)
            return -1;
        host_release_ptr(h, p);
    }
    return (double)(cca_now_ns() - t0) / (double)iterations;
}

typedef struct pair_job {
    host_alloc_t *h;
    size_t size;
    long iterations;
    double ns;
} pair_job_t;

static void *pair_thread(void *arg)
{
    pair_job_t *job = arg;
    job->ns = pair_ns(job->h, job->size, job->iterations);
    return NULL;
}

/* Total pairs per second of nthreads threads, each on its own size class. */
static double threaded_mpairs(host_alloc_t *h, int nthreads, long iterations)
{
    pthread_t t[64];
    pair_job_t jobs[64];
    uint64_t t0 = cca_now_ns();
    for (int i = 0; i < nthreads; i++) {
        jobs[i] = (pair_job_t){h, (size_t)4096 << (i % 8), iterations, 0};
        pthread_create(&t[i], NULL, pair_thread, &jobs[i]);
    }
    for (int i = 0; i < nthreads; i++)
        pthread_join(t[i], NULL);
    double seconds = (double)(cca_now_ns() - t0) / 1e9;
    return (double)nthreads * (double)iterations / seconds / 1e6;
}

/* Milliseconds of the first allocation of size bytes on a fresh allocator. */
static double first_alloc_ms(bool reg, size_t threads, size_t size)
{
    cca_backend_t *be = make_backend();
    if (!be)
        return -1;
    cca_settings_t s;
    settings_default(&s);
    s.pinned_use_cuda_host_register = reg;
    s.pinned_num_register_threads = threads;
    host_alloc_t *h;
    double ms = -1;
    if (host_create(be, &s, &h) != CCA_OK)
        goto out_backend;
    void *p;
    uint64_t t0 = cca_now_ns();
    if (host_malloc(h, &p, size) == CCA_OK) {
        ms = (double)(cca_now_ns() - t0) / 1e6;
        host_release_ptr(h, p);
    } else {
        fprintf(stderr, "host_malloc(%zu): %s\n", size, cca_last_error()->message);
    }
    host_destroy(h);
out_backend:
    be->destroy(be->ctx);
    return ms;
}

int main(int argc, char **argv)
{
    bool quick = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc)
            use_cuda = !strcmp(argv[++i], "cuda");
        else {
            fprintf(stderr, "usage: %s [--quick] [--backend sim|cuda]\n", argv[0]);
            return 2;
        }
    }
    cca_backend_t *be = make_backend();
    if (!be)
        return 1;
    cca_settings_t s;
    settings_default(&s);
    host_alloc_t *h;
    if (host_create(be, &s, &h) != CCA_OK) {
        fprintf(stderr, "host_create: %s\n", cca_last_error()->message);
        return 1;
    }
    printf(use_cuda ? "pinned host allocator, CUDA backend\n\n"
                    : "pinned host allocator, simulated backend (CPU only)\n\n");
    printf("| cached alloc + free pair | ns |\n|---|---|\n");
    const size_t sizes[] = {512, 1 * MiB, 64 * MiB};
    const char *names[] = {"512 B", "1 MiB", "64 MiB"};
    double pair[3];
    for (int i = 0; i < 3; i++) {
        pair[i] = pair_ns(h, sizes[i], quick ? 200000 : 2000000);
        printf("| %s | %.1f |\n", names[i], pair[i]);
    }
    printf("\n| threads, cached pairs (each its own size) | M pairs/s total |\n|---|---|\n");
    const int thread_counts[] = {1, 4, 8};
    for (int i = 0; i < 3; i++)
        printf("| %d | %.2f |\n", thread_counts[i], threaded_mpairs(h, thread_counts[i], 500000));
    host_destroy(h);
    be->destroy(be->ctx);

    printf("\n| first allocation | host_alloc | register, 1 thread | register, 8 threads |\n"
           "|---|---|---|---|\n");
    const size_t first[] = {1 * MiB, 64 * MiB, 1024 * MiB};
    const char *first_names[] = {"1 MiB", "64 MiB", "1 GiB"};
    for (int i = 0; i < (quick ? 2 : 3); i++)
        printf("| %s | %.2f ms | %.2f ms | %.2f ms |\n", first_names[i],
               first_alloc_ms(false, 1, first[i]), first_alloc_ms(true, 1, first[i]),
               first_alloc_ms(true, 8, first[i]));
    /* the same pairs as result lines, for scripts/gpu-check.sh's table */
    for (int i = 0; i < 3; i++)
        printf("RESULT %s pinned_pair size=%zu ns_per_pair=%.1f\n", use_cuda ? "cca" : "cca-sim",
               sizes[i], pair[i]);
    printf("\n(host_alloc on the simulated backend is an untouched posix_memalign; register mode\n"
           "measures malloc + page pre-fault, the part cca does itself.)\n");
    return 0;
}
