/*
 * test_cuda_host.c - the pinned host caching allocator on a real GPU: pinned
 * blocks used by cudaMemcpyAsync on two streams, record_event keeping a block
 * out of reuse while a stream still needs it, in both slow-path modes
 * (cudaHostAlloc, and malloc + pre-fault + cudaHostRegister), blocks a CUDA
 * graph capture used kept out of reuse. Exits 77
 * (skipped) without a GPU.
 */
#include <cuda_runtime.h>
#include <stdatomic.h>
#include <stdint.h>

#include "harness.h"
#include "host.h"
#include "settings.h"

/* The core defines cca_init; this stand-in lets the test link without it. */
__attribute__((weak)) cca_status_t cca_init(void)
{
    return CCA_OK;
}

#define MiB ((size_t)1024 * 1024)
#define COPY_BYTES (8 * MiB)

static cca_backend_t *backend;

/* A host function that holds its stream until the test opens the gate. */
static atomic_bool gate_open;

static void CUDART_CB wait_for_gate(void *arg)
{
    (void)arg;
    while (!atomic_load(&gate_open)) {
    }
}

static bool cuda_ok(cudaError_t err, const char *what)
{
    if (err != cudaSuccess) {
        HARNESS_FAIL("%s: %s", what, cudaGetErrorString(err));
        return false;
    }
    return true;
}

/* A test's end: its device buffer and two streams gone (each may be NULL), the allocator
 * checked and destroyed. */
static void finish(host_alloc_t *h, void *dev, cudaStream_t s1, cudaStream_t s2)
{
    if (dev)
        cudaFree(dev);
    if (s1)
        cudaStreamDestroy(s1);
    if (s2)
        cudaStreamDestroy(s2);
    expect_true(host_is_valid(h));
    host_destroy(h);
}

/* Copy host -> device on s1 and device -> host on s2, with reuse checks. */
static void copies_on_two_streams(bool use_register)
{
    cca_settings_t s;
    settings_default(&s);
    s.pinned_use_cuda_host_register = use_register;
    s.pinned_num_register_threads = use_register ? 8 : 1;
    host_alloc_t *h;
    if (host_create(backend, &s, &h) != CCA_OK) {
        HARNESS_FAIL("host_create: %s", cca_last_error()->message);
        return;
    }
    cudaStream_t s1 = NULL, s2 = NULL;
    void *dev = NULL;
    unsigned char *src = NULL, *dst = NULL, *other = NULL;
    if (!cuda_ok(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "stream 1") ||
        !cuda_ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "stream 2") ||
        !cuda_ok(cudaMalloc(&dev, COPY_BYTES), "cudaMalloc"))
        goto out;
    expect_ok(host_malloc(h, (void **)&src, COPY_BYTES));
    expect_ok(host_malloc(h, (void **)&dst, COPY_BYTES));
    if (!src || !dst)
        goto out;
    for (size_t i = 0; i < COPY_BYTES; i++)
        src[i] = (unsigned char)(i * 31 + 7);
    memset(dst, 0, COPY_BYTES);

    /* s1 is held by the gate: the copy out of src cannot have run at free. */
    atomic_store(&gate_open, false);
    if (!cuda_ok(cudaLaunchHostFunc(s1, wait_for_gate, NULL), "cudaLaunchHostFunc") ||
        !cuda_ok(cudaMemcpyAsync(dev, src, COPY_BYTES, cudaMemcpyHostToDevice, s1), "H2D"))
        goto out;
    expect_ok(host_record_event(h, src + 4096, s1)); /* an interior pointer names the block */
    expect_ok(host_release_ptr(h, src));
    expect_ok(host_malloc(h, (void **)&other, COPY_BYTES));
    expect_true(other != src); /* still in use by s1 */
    expect_ok(host_release_ptr(h, other));
    other = NULL;

    atomic_store(&gate_open, true);
    if (!cuda_ok(cudaStreamSynchronize(s1), "sync s1"))
        goto out;
    /* s2 waits for the data on the device, then copies it back. */
    cudaEvent_t ready;
    if (!cuda_ok(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event"))
        goto out;
    cudaEventRecord(ready, s1);
    cudaStreamWaitEvent(s2, ready, 0);
    if (!cuda_ok(cudaMemcpyAsync(dst, dev, COPY_BYTES, cudaMemcpyDeviceToHost, s2), "D2H"))
        goto out;
    expect_ok(host_record_event(h, dst, s2));
    cuda_ok(cudaStreamSynchronize(s2), "sync s2");
    cudaEventDestroy(ready);
    size_t bad = 0;
    for (size_t i = 0; i < COPY_BYTES; i++)
        bad += dst[i] != (unsigned char)(i * 31 + 7);
    expect_eq_u64(bad, 0);

    /* Both streams are done: src comes back (LIFO over other), then dst. */
    expect_ok(host_release_ptr(h, dst));
    dst = NULL;
    void *again = NULL;
    expect_ok(host_malloc(h, &again, COPY_BYTES));
    expect_true(again != NULL);
    expect_ok(host_release_ptr(h, again));

    cca_host_stats_t st;
    expect_ok(host_get_stats(h, &st));
    expect_eq_i64(st.active_requests.current, 0);
    expect_eq_i64(st.num_host_alloc, 3);
    expect_ok(host_empty_cache(h));
    expect_ok(host_get_stats(h, &st));
    expect_eq_i64(st.allocations.current, 0);
    expect_eq_i64(st.num_host_free, 3);
    printf("  %s: host_alloc_time total %lld us over %lld calls, max %lld us\n",
           use_register ? "register" : "cudaHostAlloc", (long long)st.host_alloc_time.total,
           (long long)st.host_alloc_time.count, (long long)st.host_alloc_time.max);

out:
    atomic_store(&gate_open, true); /* never leave s1 held */
    if (dst)
        host_release_ptr(h, dst);
    finish(h, dev, s1, s2);
}

TEST(cuda_host_alloc_mode)
{
    copies_on_two_streams(false);
}

TEST(cuda_host_register_mode)
{
    copies_on_two_streams(true);
}

/*
 * Pinned blocks and CUDA graph capture: a block whose copy was captured
 * (recorded while its stream was capturing, global mode) and a block freed
 * while a stream it was used on is capturing are both kept, never reused;
 * the graph's replays read the first block's data intact after its free.
 */
TEST(captured_blocks_are_kept)
{
    cca_settings_t s;
    settings_default(&s);
    host_alloc_t *h;
    if (host_create(backend, &s, &h) != CCA_OK) {
        HARNESS_FAIL("host_create: %s", cca_last_error()->message);
        return;
    }
    const size_t n = 1 * MiB;
    cudaStream_t s1 = NULL, s2 = NULL;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    void *dev = NULL, *dev2 = NULL;
    unsigned char *src = NULL, *late = NULL, *back = NULL;
    if (!cuda_ok(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking), "stream 1") ||
        !cuda_ok(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking), "stream 2") ||
        !cuda_ok(cudaMalloc(&dev, n), "cudaMalloc") || !cuda_ok(cudaMalloc(&dev2, n), "cudaMalloc 2"))
        goto out;
    expect_ok(host_malloc(h, (void **)&src, n));
    expect_ok(host_malloc(h, (void **)&late, n));
    back = malloc(n);
    if (!src || !late || !back)
        goto out;
    for (size_t i = 0; i < n; i++)
        src[i] = (unsigned char)(i * 13 + 5);

    /* late: used on s2 before any capture, freed while s2 captures */
    if (!cuda_ok(cudaMemcpyAsync(dev2, late, n, cudaMemcpyHostToDevice, s2), "H2D late"))
        goto out;
    expect_ok(host_record_event(h, late, s2));
    if (!cuda_ok(cudaStreamBeginCapture(s2, cudaStreamCaptureModeGlobal), "capture s2"))
        goto out;
    cudaMemsetAsync(dev2, 0, n, s2);
    expect_ok(host_release_ptr(h, late));
    cudaGraph_t g2 = NULL;
    if (cuda_ok(cudaStreamEndCapture(s2, &g2), "end capture s2"))
        cudaGraphDestroy(g2);

    /* src: its copy is captured, its use recorded during the capture */
    if (!cuda_ok(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal), "capture s1") ||
        !cuda_ok(cudaMemcpyAsync(dev, src, n, cudaMemcpyHostToDevice, s1), "captured H2D"))
        goto out;
    expect_ok(host_record_event(h, src, s1));
    if (!cuda_ok(cudaStreamEndCapture(s1, &graph), "end capture s1") ||
        !cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate"))
        goto out;
    expect_ok(host_release_ptr(h, src));

    /* neither comes back; new blocks are written over and over */
    for (int i = 0; i < 4; i++) {
        unsigned char *p = NULL;
        expect_ok(host_malloc(h, (void **)&p, n));
        expect_true(p != src && p != late);
        if (p) {
            memset(p, 0xEE, n);
            expect_ok(host_release_ptr(h, p));
        }
    }
    for (int r = 0; r < 3; r++) {
        if (!cuda_ok(cudaMemsetAsync(dev, 0, n, s1), "memset") || !cuda_ok(cudaGraphLaunch(exec, s1), "launch") ||
            !cuda_ok(cudaMemcpyAsync(back, dev, n, cudaMemcpyDeviceToHost, s1), "D2H") ||
            !cuda_ok(cudaStreamSynchronize(s1), "sync"))
            goto out;
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            bad += back[i] != (unsigned char)(i * 13 + 5);
        expect_eq_u64(bad, 0);
    }
    cca_host_stats_t st;
    expect_ok(host_get_stats(h, &st));
    expect_eq_i64(st.active_requests.current, 2); /* the two kept blocks */
    expect_ok(host_empty_cache(h));
    expect_ok(host_get_stats(h, &st));
    expect_eq_i64(st.allocations.current, 2);
    expect_eq_i64(host_release_ptr(h, src), CCA_ERR_INVALID_POINTER);

out:
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    free(back);
    if (dev2)
        cudaFree(dev2);
    finish(h, dev, s1, s2);
}

/* The first allocation of 1 GiB in each mode (informational timing, and it must work). */
TEST(first_gib)
{
    const struct {
        bool reg;
        size_t threads;
    } modes[] = {{false, 1}, {true, 1}, {true, 8}};
    for (size_t m = 0; m < 3; m++) {
        cca_settings_t s;
        settings_default(&s);
        s.pinned_use_cuda_host_register = modes[m].reg;
        s.pinned_num_register_threads = modes[m].threads;
        host_alloc_t *h;
        if (host_create(backend, &s, &h) != CCA_OK)
            continue;
        void *p = NULL;
        uint64_t t0 = cca_now_ns();
        cca_status_t st = host_malloc(h, &p, 1024 * MiB);
        uint64_t t1 = cca_now_ns();
        expect_ok(st);
        if (st == CCA_OK) {
            printf("  first 1 GiB, %s, %zu thread(s): %.1f ms\n",
                   modes[m].reg ? "register" : "cudaHostAlloc", modes[m].threads,
                   (double)(t1 - t0) / 1e6);
            ((volatile char *)p)[1024 * MiB - 1] = 1;
            expect_ok(host_release_ptr(h, p));
        }
        expect_ok(host_empty_cache(h));
        host_destroy(h);
    }
}

int main(void)
{
    cca_status_t st = cca_cuda_create(&backend);
    if (st == CCA_ERR_NO_DEVICE || st == CCA_ERR_NOT_SUPPORTED) {
        printf("skipped: %s\n", cca_last_error()->message);
        return 77;
    }
    if (st != CCA_OK) {
        printf("cca_cuda_create: %s\n", cca_last_error()->message);
        return 1;
    }
    RUN(cuda_host_alloc_mode);
    RUN(cuda_host_register_mode);
    RUN(captured_blocks_are_kept);
    RUN(first_gib);
    backend->destroy(backend->ctx);
    return harness_done();
}
