/*
 * test_cuda_graphs.c - private pools on a real GPU: CUDA graph capture with
 * allocations and frees inside the capture (cudaStreamCaptureModeGlobal, so
 * the segments cca allocates during it need relaxed mode), the captured work
 * replayed and its results checked, a second graph sharing the first one's
 * pool and reading its output, the pool released and the memory given back;
 * two threads where only one captures (its route takes its capture only);
 * a MemPool-style thread route; graph_capture_record_stream_reuse on a
 * real capture graph. The graphs run memsets, copies and, when
 * NVRTC and the driver can be loaded (dlopen; headers at build time:
 * CCA_TEST_KERNELS), kernels compiled at run time. Exits 77 (skipped) when
 * no GPU is usable.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv under -std=c11 */
#endif
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>
#ifdef CCA_TEST_KERNELS
#include <cuda.h>
#include <nvrtc.h>
#endif

#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;
#define N (1 << 20) /* floats per buffer: 4 MiB, the large pool */

static bool setup_with(const char *settings)
{
    setenv("CCA_BACKEND", "cuda", 1);
    if (settings)
        setenv("CCA_ALLOC_CONF", settings, 1);
    else
        unsetenv("CCA_ALLOC_CONF");
    cca_status_t st = cca_init();
    if (st != CCA_OK) {
        HARNESS_FAIL("cca_init: %s: %s", cca_status_str(st), cca_last_error()->message);
        return false;
    }
    return true;
}

static bool setup(void)
{
    return setup_with(NULL);
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        HARNESS_FAIL("cudaStreamCreateWithFlags failed");
    return s;
}

static void *xmalloc(size_t size, cudaStream_t s)
{
    void *p = NULL;
    cca_status_t st = cca_malloc(&p, size, (cca_stream_t)s);
    if (st != CCA_OK)
        HARNESS_FAIL("cca_malloc(%zu) during the test: %s", size, cca_last_error()->message);
    return p;
}

/* The private pool the segment holding p belongs to, from a snapshot. */
static cca_mempool_id_t pool_of(const void *p)
{
    cca_mempool_id_t id = {~0ull, ~0ull};
    cca_snapshot_t *snap = NULL;
    if (cca_snapshot(&snap) != CCA_OK)
        return id;
    for (size_t i = 0; i < snap->segment_count; i++) {
        const cca_segment_info_t *seg = &snap->segments[i];
        if ((uintptr_t)p >= seg->address && (uintptr_t)p < seg->address + seg->total_size) {
            id.first = seg->owner_private_pool_id[0];
            id.second = seg->owner_private_pool_id[1];
        }
    }
    cca_snapshot_free(snap);
    return id;
}

static bool same_id(cca_mempool_id_t a, cca_mempool_id_t b)
{
    return a.first == b.first && a.second == b.second;
}

/* PyTorch's capture filter: a stream belongs to the capture if it has the same capture id. */
typedef struct capture_filter {
    unsigned long long id;
} capture_filter_t;

static bool capture_id_of(cudaStream_t s, unsigned long long *id)
{
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
#if CUDART_VERSION >= 13000
    cudaError_t err = cudaStreamGetCaptureInfo(s, &status, id, NULL, NULL, NULL, NULL);
#else
    cudaError_t err = cudaStreamGetCaptureInfo(s, &status, id);
#endif
    return err == cudaSuccess && status == cudaStreamCaptureStatusActive;
}

static bool in_capture(cca_stream_t stream, void *arg)
{
    const capture_filter_t *f = arg;
    unsigned long long id = 0;
    return capture_id_of((cudaStream_t)stream, &id) && id == f->id;
}

/* ---- kernels ------------------------------------------------------------------------ */

#ifdef CCA_TEST_KERNELS
static const char *kernel_source =
    "extern \"C\" __global__ void axpb(float *y, const float *x, float a, float b, int n)\n"
    "{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + b; }\n"
    "extern \"C\" __global__ void add(float *z, const float *x, const float *y, int n)\n"
    "{ int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) z[i] = x[i] + y[i]; }\n";

static CUmodule module;
static CUfunction fn_axpb, fn_add;

/* The NVRTC and driver entry points the test uses, loaded at run time. */
static struct {
    nvrtcResult (*create)(nvrtcProgram *, const char *, const char *, int, const char *const *,
                          const char *const *);
    nvrtcResult (*compile)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*ptx_size)(nvrtcProgram, size_t *);
    nvrtcResult (*ptx)(nvrtcProgram, char *);
    nvrtcResult (*destroy)(nvrtcProgram *);
    CUresult (*load)(CUmodule *, const void *);
    CUresult (*unload)(CUmodule);
    CUresult (*function)(CUfunction *, CUmodule, const char *);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, CUstream, void **, void **);
} api;

static void *open_first(const char *const *names)
{
    for (; *names; names++) {
        void *h = dlopen(*names, RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
    }
    return NULL;
}

static bool api_load(void)
{
    static const char *const nvrtc_names[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12",
                                              CCA_CUDA_LIBDIR "/libnvrtc.so", NULL};
    static const char *const cuda_names[] = {"libcuda.so.1", "libcuda.so", NULL};
    void *nv = open_first(nvrtc_names), *cu = open_first(cuda_names);
    if (!nv || !cu)
        return false;
    *(void **)&api.create = dlsym(nv, "nvrtcCreateProgram");
    *(void **)&api.compile = dlsym(nv, "nvrtcCompileProgram");
    *(void **)&api.ptx_size = dlsym(nv, "nvrtcGetPTXSize");
    *(void **)&api.ptx = dlsym(nv, "nvrtcGetPTX");
    *(void **)&api.destroy = dlsym(nv, "nvrtcDestroyProgram");
    *(void **)&api.load = dlsym(cu, "cuModuleLoadData");
    *(void **)&api.unload = dlsym(cu, "cuModuleUnload");
    *(void **)&api.function = dlsym(cu, "cuModuleGetFunction");
    *(void **)&api.launch = dlsym(cu, "cuLaunchKernel");
    return api.create && api.compile && api.ptx_size && api.ptx && api.destroy && api.load &&
           api.unload && api.function && api.launch;
}

/* Compile the kernels for this GPU with NVRTC and load them. False: not available here. */
static bool kernels_load(void)
{
    if (!api_load()) {
        printf("  (NVRTC or the driver library cannot be loaded: memsets and copies only)\n");
        return false;
    }
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    char arch[64];
    snprintf(arch, sizeof(arch), "--gpu-architecture=compute_%d%d", major, minor);
    const char *opts[] = {arch};
    nvrtcProgram prog;
    if (api.create(&prog, kernel_source, "graph_kernels.cu", 0, NULL, NULL) != NVRTC_SUCCESS)
        return false;
    bool ok = api.compile(prog, 1, opts) == NVRTC_SUCCESS;
    size_t ptx_size = 0;
    char *ptx = NULL;
    if (ok && api.ptx_size(prog, &ptx_size) == NVRTC_SUCCESS && (ptx = malloc(ptx_size)))
        ok = api.ptx(prog, ptx) == NVRTC_SUCCESS;
    else
        ok = false;
    api.destroy(&prog);
    ok = ok && api.load(&module, ptx) == CUDA_SUCCESS &&
         api.function(&fn_axpb, module, "axpb") == CUDA_SUCCESS &&
         api.function(&fn_add, module, "add") == CUDA_SUCCESS;
    free(ptx);
    if (!ok)
        printf("  (the kernels did not compile or load: memsets and copies only)\n");
    return ok;
}

/* y = a * x + b */
static bool axpb(float *y, const float *x, float a, float b, cudaStream_t s)
{
    int n = N;
    void *args[] = {&y, &x, &a, &b, &n};
    return api.launch(fn_axpb, (N + 255) / 256, 1, 1, 256, 1, 1, 0, (CUstream)s, args, NULL) ==
           CUDA_SUCCESS;
}

/* z = x + y */
static bool add(float *z, const float *x, const float *y, cudaStream_t s)
{
    int n = N;
    void *args[] = {&z, &x, &y, &n};
    return api.launch(fn_add, (N + 255) / 256, 1, 1, 256, 1, 1, 0, (CUstream)s, args, NULL) ==
           CUDA_SUCCESS;
}
#endif

/* Copy n floats of p to the host and count those that are not value. */
static size_t count_not(const float *p, float value)
{
    float *host = malloc(N * sizeof(float));
    if (!host || cudaMemcpy(host, p, N * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(host);
        return N;
    }
    size_t bad = 0;
    for (size_t i = 0; i < N; i++)
        bad += host[i] != value;
    free(host);
    return bad;
}

/* Bytes of p (size bytes) that are not value. */
static size_t count_bytes_not(const void *p, size_t size, unsigned char value)
{
    unsigned char *host = malloc(size);
    if (!host || cudaMemcpy(host, p, size, cudaMemcpyDeviceToHost) != cudaSuccess) {
        free(host);
        return size;
    }
    size_t bad = 0;
    for (size_t i = 0; i < size; i++)
        bad += host[i] != value;
    free(host);
    return bad;
}

static bool instantiate(cudaGraph_t graph, cudaGraphExec_t *exec)
{
    return cudaGraphInstantiate(exec, graph, 0) == cudaSuccess;
}

/* ---- tests ---------------------------------------------------------------------------- */

TEST(capture_replay_share_release)
{
    if (!setup())
        return;
    size_t free_before = 0, total = 0;
    cudaMemGetInfo(&free_before, &total);
    cudaStream_t s = new_stream();
    cca_mempool_id_t pool = cca_mempool_id_new(false);
    const size_t bytes = N * sizeof(float);
#ifdef CCA_TEST_KERNELS
    bool kernels = kernels_load(); /* before the capture: loading a module is not capturable */
#endif

    /* graph 1: allocations and frees inside a global-mode capture */
    cudaGraph_t g1 = NULL, g2 = NULL;
    cudaGraphExec_t e1 = NULL, e2 = NULL;
    expect_true(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    capture_filter_t f1 = {0};
    expect_true(capture_id_of(s, &f1.id));
    expect_ok(cca_begin_allocate_to_pool(0, pool, in_capture, &f1));
    char *a = xmalloc(bytes, s);   /* new segments: cudaMalloc in relaxed mode */
    char *b = xmalloc(bytes, s);
    expect_true(cudaMemsetAsync(a, 0x11, bytes, s) == cudaSuccess);
    expect_true(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    expect_ok(cca_free(a));        /* freed inside the capture ... */
    char *c = xmalloc(bytes, s);   /* ... and its memory reused by the next allocation */
    expect_eq_ptr(c, a);
    expect_true(cudaMemsetAsync(c, 0x22, bytes / 2, s) == cudaSuccess);
    expect_true(cudaMemcpyAsync(c + bytes / 2, b, bytes / 2, cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    float *out = NULL;
    (void)out; /* used only with kernels */
#ifdef CCA_TEST_KERNELS
    if (kernels) {
        float *x = xmalloc(bytes, s), *y = xmalloc(bytes, s);
        expect_true(cudaMemsetAsync(x, 0, bytes, s) == cudaSuccess); /* no NaN from old bytes */
        expect_true(axpb(x, x, 0.0f, 1.0f, s));   /* x = 1 */
        expect_true(axpb(y, x, 2.0f, 3.0f, s));   /* y = 5 */
        expect_ok(cca_free(x));
        float *z = xmalloc(bytes, s);             /* x's memory again */
        expect_eq_ptr(z, x);
        expect_true(add(z, y, y, s));             /* z = 10 */
        out = xmalloc(bytes, s);
        expect_true(axpb(out, z, 0.5f, 1.0f, s)); /* out = 6 */
        expect_ok(cca_free(y));
        expect_ok(cca_free(z));
    }
#endif
    expect_ok(cca_free(b));
    expect_true(cudaStreamEndCapture(s, &g1) == cudaSuccess);
    expect_ok(cca_end_allocate_to_pool(0, pool));
    expect_true(same_id(pool_of(c), pool));
    expect_true(instantiate(g1, &e1));

    /* outside the capture the pool's free memory is not handed out */
    void *eager = xmalloc(bytes, s);
    expect_true(!same_id(pool_of(eager), pool));
    expect_true(eager != (void *)b);

    /* replay: scribble on the kept buffer, replay, check what the graph wrote */
    expect_true(cudaMemsetAsync(c, 0, bytes, s) == cudaSuccess);
    for (int i = 0; i < 3; i++)
        expect_true(cudaGraphLaunch(e1, s) == cudaSuccess);
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    expect_eq_u64(count_bytes_not(c, bytes / 2, 0x22), 0);
    expect_eq_u64(count_bytes_not(c + bytes / 2, bytes / 2, 0x11), 0);

#ifdef CCA_TEST_KERNELS
    /* graph 2 shares the pool and reads graph 1's output */
    float *out2 = NULL;
    if (kernels) {
        expect_eq_u64(count_not(out, 6.0f), 0);
        expect_true(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
        capture_filter_t f2 = {0};
        expect_true(capture_id_of(s, &f2.id));
        expect_ok(cca_begin_allocate_to_pool(0, pool, in_capture, &f2));
        int uc = 0;
        expect_ok(cca_pool_use_count(0, pool, &uc));
        expect_eq_i64(uc, 2);
        float *t = xmalloc(bytes, s);
        expect_true(add(t, out, out, s));         /* t = 12 */
        out2 = xmalloc(bytes, s);
        expect_true(axpb(out2, t, 1.0f, 1.0f, s)); /* out2 = 13 */
        expect_ok(cca_free(t));
        expect_true(cudaStreamEndCapture(s, &g2) == cudaSuccess);
        expect_ok(cca_end_allocate_to_pool(0, pool));
        expect_true(same_id(pool_of(out2), pool));
        expect_true(instantiate(g2, &e2));
        expect_true(cudaMemsetAsync(out, 0, bytes, s) == cudaSuccess);
        expect_true(cudaMemsetAsync(out2, 0, bytes, s) == cudaSuccess);
        expect_true(cudaGraphLaunch(e1, s) == cudaSuccess);
        expect_true(cudaGraphLaunch(e2, s) == cudaSuccess);
        expect_true(cudaStreamSynchronize(s) == cudaSuccess);
        expect_eq_u64(count_not(out, 6.0f), 0);
        expect_eq_u64(count_not(out2, 13.0f), 0);
    }
#else
    (void)count_not;
#endif

    /* the graphs go: release the pool (once per graph), free the kept outputs */
    if (e2) {
        cudaGraphExecDestroy(e2);
        cudaGraphDestroy(g2);
        expect_ok(cca_release_pool(0, pool));
    }
    cudaGraphExecDestroy(e1);
    cudaGraphDestroy(g1);
    expect_ok(cca_release_pool(0, pool));
    expect_ok(cca_free(c));
#ifdef CCA_TEST_KERNELS
    expect_ok(cca_free(out));
    expect_ok(cca_free(out2));
#endif
    expect_ok(cca_free(eager));
    expect_ok(cca_empty_cache());
    int uc = 0;
    expect_status(cca_pool_use_count(0, pool, &uc), CCA_ERR_INVALID_ARGUMENT); /* gone */
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    size_t free_after = 0;
    cudaMemGetInfo(&free_after, &total);
    expect_true(free_after + 64 * MiB >= free_before); /* the memory came back */
    cudaStreamDestroy(s);
#ifdef CCA_TEST_KERNELS
    if (kernels)
        api.unload(module);
#endif
    cca_shutdown();
}

/* Two threads: A captures on its stream, B allocates on its own meanwhile. */
typedef struct two_threads {
    pthread_barrier_t started, finished;
    cudaStream_t sb, sc;
    void *b_ptrs[16];
    size_t b_bad;
    cca_status_t b_status;
} two_threads_t;

static void *thread_b(void *arg)
{
    two_threads_t *t = arg;
    pthread_barrier_wait(&t->started); /* A's capture and route are active */
    t->b_status = CCA_OK;
    for (int i = 0; i < 16 && t->b_status == CCA_OK; i++) {
        size_t size = (i % 2 ? 3 : 24) * MiB;
        t->b_status = cca_malloc(&t->b_ptrs[i], size, (cca_stream_t)t->sb);
        if (t->b_status != CCA_OK)
            break;
        cudaMemsetAsync(t->b_ptrs[i], 0x5a, size, t->sb);
        if (i % 4 == 3) { /* used on another stream, freed during A's capture: set aside */
            cca_record_stream(t->b_ptrs[i], (cca_stream_t)t->sc);
            t->b_status = cca_free(t->b_ptrs[i]);
            t->b_ptrs[i] = NULL;
        }
    }
    cudaStreamSynchronize(t->sb);
    for (int i = 0; i < 16; i++)
        if (t->b_ptrs[i])
            t->b_bad += count_bytes_not(t->b_ptrs[i], MiB, 0x5a);
    pthread_barrier_wait(&t->finished);
    return NULL;
}

TEST(two_threads_one_captures)
{
    if (!setup())
        return;
    two_threads_t t;
    memset(&t, 0, sizeof(t));
    pthread_barrier_init(&t.started, NULL, 2);
    pthread_barrier_init(&t.finished, NULL, 2);
    cudaStream_t sa = new_stream();
    t.sb = new_stream();
    t.sc = new_stream();
    pthread_t b;
    pthread_create(&b, NULL, thread_b, &t);
    cca_mempool_id_t pool = cca_mempool_id_new(false);
    const size_t bytes = 8 * MiB;
    cudaGraph_t g = NULL;
    cudaGraphExec_t e = NULL;
    expect_true(cudaStreamBeginCapture(sa, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    capture_filter_t f = {0};
    expect_true(capture_id_of(sa, &f.id));
    expect_ok(cca_begin_allocate_to_pool(0, pool, in_capture, &f));
    pthread_barrier_wait(&t.started);
    char *p = xmalloc(bytes, sa);
    char *q = xmalloc(bytes, sa);
    expect_true(cudaMemsetAsync(p, 0x33, bytes, sa) == cudaSuccess);
    expect_true(cudaMemcpyAsync(q, p, bytes, cudaMemcpyDeviceToDevice, sa) == cudaSuccess);
    expect_ok(cca_free(p));
    pthread_barrier_wait(&t.finished); /* B did all its work during the capture */
    expect_true(cudaStreamEndCapture(sa, &g) == cudaSuccess);
    expect_ok(cca_end_allocate_to_pool(0, pool));
    pthread_join(b, NULL);
    expect_eq_i64(t.b_status, CCA_OK);
    expect_eq_u64(t.b_bad, 0);
    expect_true(same_id(pool_of(q), pool));
    for (int i = 0; i < 16; i++)
        if (t.b_ptrs[i])
            expect_true(!same_id(pool_of(t.b_ptrs[i]), pool)); /* B never used A's pool */
    expect_true(instantiate(g, &e));
    expect_true(cudaMemsetAsync(q, 0, bytes, sa) == cudaSuccess);
    expect_true(cudaGraphLaunch(e, sa) == cudaSuccess);
    expect_true(cudaStreamSynchronize(sa) == cudaSuccess);
    expect_eq_u64(count_bytes_not(q, bytes, 0x33), 0);
    cudaGraphExecDestroy(e);
    cudaGraphDestroy(g);
    expect_ok(cca_release_pool(0, pool));
    expect_ok(cca_free(q));
    for (int i = 0; i < 16; i++)
        expect_ok(cca_free(t.b_ptrs[i]));
    cudaDeviceSynchronize();
    expect_ok(cca_empty_cache());
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    pthread_barrier_destroy(&t.started);
    pthread_barrier_destroy(&t.finished);
    cudaStreamDestroy(sa);
    cudaStreamDestroy(t.sb);
    cudaStreamDestroy(t.sc);
    cca_shutdown();
}

TEST(mempool_thread_route)
{
    if (!setup())
        return;
    cudaStream_t s = new_stream();
    cca_mempool_id_t pool = cca_mempool_id_new(true);
    expect_ok(cca_pool_create(0, pool));              /* MemPool() */
    expect_ok(cca_begin_allocate_thread_to_pool(0, pool)); /* with use_mem_pool(pool): */
    void *p = xmalloc(6 * MiB, s);
    expect_true(cudaMemsetAsync(p, 0x44, 6 * MiB, s) == cudaSuccess);
    expect_ok(cca_end_allocate_to_pool(0, pool));
    expect_ok(cca_release_pool(0, pool));
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    expect_eq_u64(count_bytes_not(p, 6 * MiB, 0x44), 0);
    expect_true(same_id(pool_of(p), pool));
    expect_ok(cca_free(p));
    expect_ok(cca_release_pool(0, pool));              /* ~MemPool */
    expect_ok(cca_empty_cache_pool(pool));
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    cudaStreamDestroy(s);
    cca_shutdown();
}

/*
 * graph_capture_record_stream_reuse: a block used on a forked stream of the
 * capture is reused inside the capture once that stream joined back, read
 * from the real capture graph (cudaStreamGetCaptureInfo and the nodes'
 * dependencies); the replay still computes the right values.
 */
TEST(record_stream_reuse_in_capture)
{
    if (!setup_with("graph_capture_record_stream_reuse:True"))
        return;
    cudaStream_t s1 = new_stream(), s2 = new_stream();
    cudaEvent_t fork = NULL, join = NULL;
    expect_true(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) == cudaSuccess);
    expect_true(cudaEventCreateWithFlags(&join, cudaEventDisableTiming) == cudaSuccess);
    cca_mempool_id_t pool = cca_mempool_id_new(false);
    const size_t bytes = 8 * MiB;
    cudaGraph_t g = NULL;
    cudaGraphExec_t e = NULL;
    expect_true(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal) == cudaSuccess);
    capture_filter_t f = {0};
    expect_true(capture_id_of(s1, &f.id));
    expect_ok(cca_begin_allocate_to_pool(0, pool, in_capture, &f));
    char *p = xmalloc(bytes, s1);
    char *out = xmalloc(bytes, s1);
    char *keep = xmalloc(bytes, s1); /* p's neighbour stays allocated */
    expect_true(cudaMemsetAsync(p, 0x61, bytes, s1) == cudaSuccess);
    expect_true(cudaEventRecord(fork, s1) == cudaSuccess);
    expect_true(cudaStreamWaitEvent(s2, fork, 0) == cudaSuccess); /* s2 joins the capture */
    expect_true(cudaMemcpyAsync(out, p, bytes, cudaMemcpyDeviceToDevice, s2) == cudaSuccess);
    expect_ok(cca_record_stream(p, (cca_stream_t)s2));
    expect_ok(cca_free(p));
    char *early = xmalloc(bytes, s1); /* s2's copy may still read p: not p */
    expect_true(early != p);
    expect_true(cudaEventRecord(join, s2) == cudaSuccess);
    expect_true(cudaStreamWaitEvent(s1, join, 0) == cudaSuccess); /* s1 waits for s2 */
    char *again = xmalloc(bytes, s1); /* now p's memory is safe to reuse in the capture */
    expect_eq_ptr(again, p);
    expect_true(cudaMemsetAsync(again, 0x62, bytes, s1) == cudaSuccess);
    expect_true(cudaStreamEndCapture(s1, &g) == cudaSuccess);
    expect_ok(cca_end_allocate_to_pool(0, pool));
    expect_true(instantiate(g, &e));
    expect_true(cudaMemsetAsync(out, 0, bytes, s1) == cudaSuccess);
    expect_true(cudaGraphLaunch(e, s1) == cudaSuccess);
    expect_true(cudaStreamSynchronize(s1) == cudaSuccess);
    expect_eq_u64(count_bytes_not(out, bytes, 0x61), 0); /* the copy read p before its reuse */
    expect_eq_u64(count_bytes_not(again, bytes, 0x62), 0);
    cudaGraphExecDestroy(e);
    cudaGraphDestroy(g);
    expect_ok(cca_release_pool(0, pool));
    expect_ok(cca_free(out));
    expect_ok(cca_free(keep));
    expect_ok(cca_free(early));
    expect_ok(cca_free(again));
    expect_ok(cca_empty_cache());
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    cca_shutdown();
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    RUN(capture_replay_share_release);
    RUN(two_threads_one_captures);
    RUN(mempool_thread_route);
    RUN(record_stream_reuse_in_capture);
    return harness_done();
}
