/*
 * test_cuda_async_graphs.c - CUDA graph capture with backend:cudaMallocAsync
 * on a real GPU, as PyTorch's CudaMallocAsync allocator captures: the route
 * begins before cudaStreamBeginCapture (cudaStreamCaptureModeGlobal);
 * allocations during the capture are cudaMallocAsync nodes of the graph and
 * frees of them cudaFreeAsync nodes; the free of an allocation made before
 * the capture is deferred (a cudaFreeAsync of it inside the capture would
 * invalidate it) and done by the first allocation after it; a forked stream
 * that frees after it joined back leaves a dangling free, which the end of
 * the route joins into the capture stream, so cudaStreamEndCapture succeeds.
 * The graph (instantiated with auto-free on launch, as PyTorch does) is
 * replayed and its output checked; one capture at a time; the pool calls
 * PyTorch refuses for this backend. Exits 77 (skipped) without a GPU.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv under -std=c11 */
#endif
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "async.h"
#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;

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
        HARNESS_FAIL("cca_malloc(%zu): %s", size, cca_last_error()->message);
    return p;
}

/* Bytes of [p, p + size) that differ from value. */
static size_t mismatches(const void *p, int value, size_t size)
{
    unsigned char *host = malloc(size);
    size_t bad = size;
    if (host && cudaMemcpy(host, p, size, cudaMemcpyDeviceToHost) == cudaSuccess) {
        bad = 0;
        for (size_t i = 0; i < size; i++)
            bad += host[i] != (unsigned char)value;
    }
    free(host);
    return bad;
}

static int64_t allocated(void)
{
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    return s.allocated_bytes[CCA_STAT_ALL].current;
}

static void join(cudaStream_t dst, cudaStream_t src)
{
    cudaEvent_t e = NULL;
    expect_true(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
    expect_true(cudaEventRecord(e, src) == cudaSuccess);
    expect_true(cudaStreamWaitEvent(dst, e, 0) == cudaSuccess);
    expect_true(cudaEventDestroy(e) == cudaSuccess);
}

TEST(capture_with_cuda_malloc_async)
{
    setenv("CCA_BACKEND", "cuda", 1);
    setenv("CCA_ALLOC_CONF", "backend:cudaMallocAsync", 1);
    if (cca_init() != CCA_OK) {
        HARNESS_FAIL("cca_init: %s", cca_last_error()->message);
        return;
    }
    cudaStream_t s = new_stream(), side = new_stream();
    /* made before the capture: its free during the capture is deferred */
    void *old = xmalloc(4 * MiB, s);
    expect_true(cudaMemsetAsync(old, 0x11, 4 * MiB, s) == cudaSuccess);
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    int64_t before = allocated();

    cca_mempool_id_t id = cca_mempool_id_new(false);
    expect_ok(cca_begin_allocate_stream_to_pool(0, id, (cca_stream_t)s));
    expect_status(cca_begin_allocate_stream_to_pool(0, cca_mempool_id_new(false), (cca_stream_t)side),
                  CCA_ERR_BUSY); /* one capture at a time */
    expect_true(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    void *tmp = xmalloc(8 * MiB, s); /* a cudaMallocAsync node */
    void *out = xmalloc(8 * MiB, s); /* the graph's output: never freed inside it */
    expect_true(cudaMemsetAsync(tmp, 0x22, 8 * MiB, s) == cudaSuccess);
    expect_true(cudaMemcpyAsync(out, tmp, 8 * MiB, cudaMemcpyDeviceToDevice, s) == cudaSuccess);
    expect_ok(cca_free(tmp)); /* a cudaFreeAsync node */
    expect_ok(cca_free(old)); /* uncaptured: deferred, nothing reaches the driver */
    expect_eq_u64(async_deferred_count(), 1);
    /* a forked stream, joined back; then a free on it after the join: left dangling */
    join(side, s);
    void *scratch = xmalloc(MiB, side);
    void *late = xmalloc(MiB, side);
    expect_true(cudaMemsetAsync(scratch, 0x33, MiB, side) == cudaSuccess);
    expect_ok(cca_free(scratch));
    join(s, side);
    expect_ok(cca_free(late)); /* after the join: cca's end joins `side` back into s */
    expect_ok(cca_end_allocate_to_pool(0, id));
    cudaGraph_t graph = NULL;
    cudaError_t err = cudaStreamEndCapture(s, &graph);
    expect_true(err == cudaSuccess);
    if (err != cudaSuccess)
        printf("cudaStreamEndCapture: %s\n", cudaGetErrorString(err));
    expect_status(cca_end_allocate_to_pool(0, id), CCA_ERR_BUSY);

    /* replay twice (auto-free on launch, as PyTorch instantiates) and check the output */
    cudaGraphExec_t exec = NULL;
    if (graph) {
        expect_true(cudaGraphInstantiateWithFlags(&exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch) ==
                    cudaSuccess);
        for (int i = 0; exec && i < 2; i++)
            expect_true(cudaGraphLaunch(exec, s) == cudaSuccess);
        expect_true(cudaStreamSynchronize(s) == cudaSuccess);
        expect_eq_u64(mismatches(out, 0x22, 8 * MiB), 0);
    }
    /* the deferred free waits for the next allocation */
    expect_eq_u64(async_deferred_count(), 1);
    void *after = xmalloc(MiB, s);
    expect_eq_u64(async_deferred_count(), 0);
    expect_ok(cca_free(after));
    expect_ok(cca_free(out)); /* the graph's allocation, freed outside it (a warning) */
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    expect_true(allocated() <= before - (int64_t)(4 * MiB) + (int64_t)MiB);
    expect_ok(cca_release_pool(0, id)); /* nothing to do for this backend */

    /* MemPool and checkpoints: PyTorch's errors */
    expect_status(cca_pool_create(0, cca_mempool_id_new(true)), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cudaMallocAsync does not yet support createOrIncrefPool");
    cca_pool_state_t *state = NULL;
    expect_status(cca_pool_get_checkpoint(0, id, &state), CCA_ERR_NOT_SUPPORTED);

    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    expect_true(cudaStreamSynchronize(side) == cudaSuccess);
    cudaStreamDestroy(s);
    cudaStreamDestroy(side);
    cca_shutdown();
}

int main(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("no usable GPU: skipped\n");
        return 77;
    }
    RUN(capture_with_cuda_malloc_async);
    return harness_done();
}
