/*
 * bench_gpu.c - the anchor benchmark's workloads (anchor/bench_anchor.cpp)
 * through cca's public API, so cca's figures sit beside PyTorch's,
 * cudaMallocAsync's and cudaMalloc's from the same run:
 *   pair_latency    alloc + free of one size on one stream (cache hits);
 *   random_1thread  512 slots, log-uniform sizes in [512 B, 8 MiB], seed 42;
 *   random_generator_only  the same steps' draws and slot bookkeeping with no
 *                   allocator call: the part of every allocator's random
 *                   figure that is the benchmark's own;
 *   threads=T       T threads on T non-blocking streams, 64 slots each,
 *                   sizes up to 4 MiB, seeds 1000 + t; total M ops/s, the
 *                   first pass (the streams' first segments from the backend
 *                   included, as the anchor times it);
 *   threads_warm=T  the same threads run the same steps again once every
 *                   thread finished the first pass (its blocks freed, its
 *                   segments cached): the allocator without the backend's
 *                   first-touch allocations.
 * The random sequence is the anchor's (anchor_rng.h). Every figure is
 * printed as the anchor prints it, with the allocator named "cca":
 *   RESULT cca pair_latency size=512 ns_per_pair=41.2
 *
 * Beside the pairs, the same pairs through glibc's malloc + free in the same
 * run ("RESULT glibc pair_latency ..."), and cca's pair over glibc's:
 *   # cpu pair ratio size=512 cca/glibc=3.12
 * and, for 512 B, each side's best of 7 rounds taken in turn (one round moves
 * with the host; the best of several much less):
 *   RESULT cca pair_latency_best size=512 rounds=7 ns_per_pair=11.9
 *   RESULT glibc pair_latency_best size=512 rounds=7 ns_per_pair=6.4
 *   # cpu pair ratio, best of 7 rounds each, size=512 cca/glibc=1.86
 * Where a 512 B pair's time goes: the pair with the device named
 * (cca_malloc_device: no question for the current device), and on CUDA the
 * cost of one such question, as cca asks it (cuCtxGetCurrent) and as
 * cudaGetDevice answers it:
 *   RESULT cca pair_latency_named_device size=512 ns_per_pair=30.1
 *   RESULT cuda cuCtxGetCurrent ns=8.7
 *   RESULT cuda cudaGetDevice ns=44.6
 *
 * Usage: bench_gpu [--backend cuda|sim] [--quick] [--devices N] [--name LABEL]
 *   --backend sim  runs on cca's simulated device (CPU-only figures); the
 *                  name printed is then "cca-sim".
 *   --quick        a tenth of the iterations (a smoke run).
 *   --devices N    the threads=T workloads spread their threads over N
 *                  devices (thread t on device t % N), each with its own
 *                  allocator: how per-device allocators scale together.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, clock_gettime, aligned_alloc under -std=c11 */
#endif
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__has_include)
#if __has_include(<cuda_runtime_api.h>) && !defined(CCA_BENCH_NO_CUDA)
#include <cuda_runtime_api.h>
#define BENCH_HAVE_CUDA 1
#endif
#endif

#include "anchor_rng.h"
#include "cca.h"

static const char *allocator_name = "cca";
static bool use_cuda;
static long scale_div = 1; /* --quick divides iteration counts */
static int device_count = 1; /* --devices: threads spread over this many devices */

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void die(const char *what, cca_status_t st)
{
    fprintf(stderr, "bench_gpu: %s failed: %s: %s\n", what, cca_status_str(st),
            cca_last_error()->message);
    exit(1);
}

/* A stream for a workload on device: a non-blocking CUDA stream, or a distinct handle on sim. */
static cca_stream_t stream_create(int index, int device)
{
#ifdef BENCH_HAVE_CUDA
    if (use_cuda) {
        cudaStream_t s;
        cudaError_t err = cudaSetDevice(device);
        if (err == cudaSuccess)
            err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
        if (err != cudaSuccess) {
            fprintf(stderr, "bench_gpu: cudaStreamCreateWithFlags: %s\n", cudaGetErrorString(err));
            exit(1);
        }
        return (cca_stream_t)s;
    }
#endif
    (void)device;
    return (cca_stream_t)(uintptr_t)(0x1000 + 0x10 * (uintptr_t)index);
}

static void stream_destroy(cca_stream_t s)
{
#ifdef BENCH_HAVE_CUDA
    if (use_cuda) {
        cudaStreamSynchronize((cudaStream_t)s);
        cudaStreamDestroy((cudaStream_t)s);
    }
#endif
    (void)s;
}

/* cca_malloc, or with device >= 0 cca_malloc_device on it (no question for the current device). */
static inline void *alloc_or_die(size_t size, cca_stream_t s, int device)
{
    void *p = NULL;
    cca_status_t st = device < 0 ? cca_malloc(&p, size, s) : cca_malloc_device(&p, size, device, s);
    if (st != CCA_OK)
        die("cca_malloc", st);
    return p;
}

static inline void free_or_die(void *p)
{
    cca_status_t st = cca_free(p);
    if (st != CCA_OK)
        die("cca_free", st);
}

/* ns per alloc + free of size on stream s (device: as alloc_or_die), after 1000 warm-up pairs. */
static double pair_latency(size_t size, cca_stream_t s, int device, long n)
{
    for (int i = 0; i < 1000; i++)
        free_or_die(alloc_or_die(size, s, device));
    double t0 = now_ns();
    for (long i = 0; i < n; i++)
        free_or_die(alloc_or_die(size, s, device));
    return (now_ns() - t0) / (double)n;
}

#ifdef BENCH_HAVE_CUDA
/* ns per question for the calling thread's device: cudaGetDevice, and the driver's
 * cuCtxGetCurrent (through the runtime's entry point: nothing links libcuda). */
static void device_query_costs(long n)
{
    volatile int sink_device;
    void *volatile sink_ctx;
    int d = 0;
    double t0 = now_ns();
    for (long i = 0; i < n; i++) {
        cudaGetDevice(&d);
        sink_device = d;
    }
    (void)sink_device;
    printf("RESULT cuda cudaGetDevice ns=%.1f\n", (now_ns() - t0) / (double)n);
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuCtxGetCurrent", &fn, cudaEnableDefault, &found);
#endif
    if (err == cudaSuccess && found == cudaDriverEntryPointSuccess && fn) {
        int (*get_current)(void **) = NULL;
        memcpy(&get_current, &fn, sizeof(fn));
        void *ctx = NULL;
        t0 = now_ns();
        for (long i = 0; i < n; i++) {
            get_current(&ctx);
            sink_ctx = ctx;
        }
        (void)sink_ctx;
        printf("RESULT cuda cuCtxGetCurrent ns=%.1f\n", (now_ns() - t0) / (double)n);
    }
}
#endif

/* ns per glibc malloc + free of size, measured as pair_latency measures cca. */
static double glibc_pair_latency(size_t size, long n)
{
    void *volatile sink;
    for (int i = 0; i < 1000; i++) {
        sink = malloc(size);
        free(sink);
    }
    double t0 = now_ns();
    for (long i = 0; i < n; i++) {
        sink = malloc(size);
        free(sink);
    }
    return (now_ns() - t0) / (double)n;
}

/*
 * The anchor's random workload; ns per step. Live blocks are freed after timing.
 * draws_only: the same draws and slot bookkeeping with no allocator call (a slot
 * holds its size instead), the part of any allocator's figure that is the
 * benchmark's own.
 */
static double random_workload(cca_stream_t s, int slots, long steps, size_t max_size,
                              unsigned seed, bool draws_only)
{
    mt64_t rng;
    mt64_seed(&rng, seed);
    const mt64_log_sizes_t sizes = mt64_log_sizes(max_size);
    void **live = calloc((size_t)slots, sizeof(*live));
    if (!live) {
        fprintf(stderr, "bench_gpu: out of host memory\n");
        exit(1);
    }
    double t0 = now_ns();
    for (long i = 0; i < steps; i++) {
        int k = mt64_pick(&rng, (uint64_t)slots);
        if (live[k]) {
            if (!draws_only)
                free_or_die(live[k]);
            live[k] = NULL;
        } else {
            size_t size = mt64_log_size(&rng, &sizes); /* >= 512: a slot never NULL */
            live[k] = draws_only ? (void *)(uintptr_t)size : alloc_or_die(size, s, -1);
        }
    }
    double dt = now_ns() - t0;
    for (int k = 0; k < slots; k++)
        if (live[k] && !draws_only)
            free_or_die(live[k]);
    free(live);
    return dt / (double)steps;
}

static pthread_barrier_t pass_barrier; /* workers + main, between the two passes */

typedef struct worker {
    pthread_t thread;
    cca_stream_t stream;
    int device;
    long steps;
    unsigned seed;
    double ns_per_op;
    double warm_ns_per_op;
} worker_t;

static void *worker_main(void *arg)
{
    worker_t *w = arg;
    cca_status_t st = cca_set_device(w->device);
    if (st != CCA_OK)
        die("cca_set_device", st);
    w->ns_per_op = random_workload(w->stream, 64, w->steps, 4u << 20, w->seed, false);
    pthread_barrier_wait(&pass_barrier); /* first pass over everywhere */
    pthread_barrier_wait(&pass_barrier); /* main has read the clock */
    w->warm_ns_per_op = random_workload(w->stream, 64, w->steps, 4u << 20, w->seed, false);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *backend = "cuda";
    const char *name = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) {
            backend = argv[++i];
        } else if (!strcmp(argv[i], "--name") && i + 1 < argc) {
            name = argv[++i];
        } else if (!strcmp(argv[i], "--quick")) {
            scale_div = 10;
        } else if (!strcmp(argv[i], "--devices") && i + 1 < argc) {
            device_count = atoi(argv[++i]);
            if (device_count < 1 || device_count > 16) {
                fprintf(stderr, "bench_gpu: --devices takes 1 to 16\n");
                return 2;
            }
        } else {
            fprintf(stderr, "usage: %s [--backend cuda|sim] [--quick] [--devices N] [--name LABEL]\n",
                    argv[0]);
            return 2;
        }
    }
    if (strcmp(backend, "cuda") != 0 && strcmp(backend, "sim") != 0) {
        fprintf(stderr, "bench_gpu: unknown backend '%s' (cuda or sim)\n", backend);
        return 2;
    }
    use_cuda = !strcmp(backend, "cuda");
#ifndef BENCH_HAVE_CUDA
    if (use_cuda) {
        fprintf(stderr, "bench_gpu: built without the CUDA headers; use --backend sim\n");
        return 2;
    }
#endif
    if (!use_cuda)
        allocator_name = "cca-sim";
    if (name)
        allocator_name = name;
    setenv("CCA_BACKEND", backend, 1);
    if (!use_cuda && device_count > 1) {
        char n[16];
        snprintf(n, sizeof(n), "%d", device_count);
        setenv("CCA_SIM_DEVICES", n, 1);
    }
    cca_status_t st = cca_init();
    if (st != CCA_OK)
        die("cca_init", st);
    int have = 0;
    if ((st = cca_device_count(&have)) != CCA_OK)
        die("cca_device_count", st);
    if (device_count > have) {
        fprintf(stderr, "bench_gpu: --devices %d but the backend has %d\n", device_count, have);
        return 2;
    }
    if ((st = cca_set_device(0)) != CCA_OK)
        die("cca_set_device", st);
    printf("# cca %d.%d.%d on backend %s\n", CCA_VERSION_MAJOR, CCA_VERSION_MINOR,
           CCA_VERSION_PATCH, cca_backend_name());

    cca_stream_t s = stream_create(0, 0);
    const size_t sizes[] = {512, 65536, 1u << 20, 8u << 20, 64u << 20};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        double ns = pair_latency(sizes[i], s, -1, 1000000 / scale_div);
        double glibc_ns = glibc_pair_latency(sizes[i], 1000000 / scale_div);
        printf("RESULT %s pair_latency size=%zu ns_per_pair=%.1f\n", allocator_name, sizes[i], ns);
        printf("RESULT glibc pair_latency size=%zu ns_per_pair=%.1f\n", sizes[i], glibc_ns);
        printf("# cpu pair ratio size=%zu cca/glibc=%.2f\n", sizes[i], ns / glibc_ns);
        fflush(stdout);
    }
    /* the ratio again, each side's best of PAIR_ROUNDS rounds taken in turn: one round of
     * either moves with the host (other processes, frequency), the best of several less */
    enum { PAIR_ROUNDS = 7 };
    double best = 0.0, glibc_best = 0.0;
    for (int r = 0; r < PAIR_ROUNDS; r++) {
        double ns = pair_latency(512, s, -1, 1000000 / scale_div);
        double glibc_ns = glibc_pair_latency(512, 1000000 / scale_div);
        best = r == 0 || ns < best ? ns : best;
        glibc_best = r == 0 || glibc_ns < glibc_best ? glibc_ns : glibc_best;
    }
    printf("RESULT %s pair_latency_best size=512 rounds=%d ns_per_pair=%.1f\n", allocator_name,
           PAIR_ROUNDS, best);
    printf("RESULT glibc pair_latency_best size=512 rounds=%d ns_per_pair=%.1f\n", PAIR_ROUNDS,
           glibc_best);
    printf("# cpu pair ratio, best of %d rounds each, size=512 cca/glibc=%.2f\n", PAIR_ROUNDS,
           best / glibc_best);
    printf("RESULT %s pair_latency_named_device size=512 ns_per_pair=%.1f\n", allocator_name,
           pair_latency(512, s, 0, 1000000 / scale_div));
#ifdef BENCH_HAVE_CUDA
    if (use_cuda)
        device_query_costs(1000000 / scale_div);
#endif
    fflush(stdout);
    double ns = random_workload(s, 512, 1000000 / scale_div, 8u << 20, 42, false);
    printf("RESULT %s random_1thread ns_per_op=%.1f\n", allocator_name, ns);
    printf("RESULT %s random_generator_only ns_per_op=%.1f\n", allocator_name,
           random_workload(s, 512, 1000000 / scale_div, 8u << 20, 42, true));
    fflush(stdout);
    stream_destroy(s);

    const int thread_counts[] = {1, 2, 4, 8, 16};
    for (size_t c = 0; c < sizeof(thread_counts) / sizeof(thread_counts[0]); c++) {
        int n = thread_counts[c];
        worker_t workers[16];
        long steps = 200000 / scale_div;
        if (pthread_barrier_init(&pass_barrier, NULL, (unsigned)n + 1) != 0) {
            fprintf(stderr, "bench_gpu: pthread_barrier_init failed\n");
            return 1;
        }
        for (int t = 0; t < n; t++) {
            workers[t].device = t % device_count;
            workers[t].stream = stream_create(t + 1, workers[t].device);
            workers[t].steps = steps;
            workers[t].seed = 1000u + (unsigned)t;
        }
        for (int t = 0; t < n; t++)
            if (pthread_create(&workers[t].thread, NULL, worker_main, &workers[t]) != 0) {
                fprintf(stderr, "bench_gpu: pthread_create failed\n");
                return 1;
            }
        /* As the anchor: the clock starts once every thread has been started. */
        double t0 = now_ns();
        pthread_barrier_wait(&pass_barrier);
        double wall = now_ns() - t0;
        /* read before the barrier that lets the workers go: one of them may be done before
         * this thread runs again */
        double t1 = now_ns();
        pthread_barrier_wait(&pass_barrier);
        for (int t = 0; t < n; t++)
            pthread_join(workers[t].thread, NULL);
        double warm_wall = now_ns() - t1;
        pthread_barrier_destroy(&pass_barrier);
        printf("RESULT %s threads=%d total_Mops_per_s=%.3f\n", allocator_name, n,
               (double)steps * n / wall * 1e3);
        printf("RESULT %s threads_warm=%d total_Mops_per_s=%.3f\n", allocator_name, n,
               (double)steps * n / warm_wall * 1e3);
        fflush(stdout);
        for (int t = 0; t < n; t++)
            stream_destroy(workers[t].stream);
    }
    cca_shutdown();
    return 0;
}
