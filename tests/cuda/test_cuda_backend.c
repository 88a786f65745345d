/*
 * test_cuda_backend.c - the CUDA backend's operations on a real GPU, without
 * the allocator core: devices, memory info, malloc/free (OOM mapping,
 * relaxed capture mode), events (NOT_READY on a stream held by a host
 * function), virtual memory, host memory, IPC and concurrent use.
 * Exits 77 (skipped) when no GPU is usable.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, clock_gettime, aligned_alloc under -std=c11 */
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "internal.h"

static cca_backend_t *be;
static void *cx;

/* A host function that holds its stream until the test opens the gate. */
static void CUDART_CB hold_stream(void *arg)
{
    atomic_int *gate = arg;
    while (!atomic_load(gate)) {
    }
}

static bool cuda_clean(void)
{
    return cudaGetLastError() == cudaSuccess;
}

TEST(device_count_and_props)
{
    int count = -1, runtime_count = -2;
    expect_ok(be->device_count(cx, &count));
    expect_true(cudaGetDeviceCount(&runtime_count) == cudaSuccess);
    expect_eq_i64(count, runtime_count);
    cca_device_props_t props;
    expect_ok(be->device_props(cx, 0, &props));
    expect_true(props.name[0] != '\0');
    size_t free_bytes = 0, total = 0;
    expect_ok(be->mem_get_info(cx, 0, &free_bytes, &total));
    expect_eq_u64(total, props.total_memory);
    expect_true(free_bytes > 0 && free_bytes <= total);
}

TEST(get_set_device)
{
    int count = 0, device = -1;
    expect_ok(be->device_count(cx, &count));
    expect_ok(be->set_device(cx, count - 1));
    expect_ok(be->get_device(cx, &device));
    expect_eq_i64(device, count - 1);
    int runtime_device = -1;
    expect_true(cudaGetDevice(&runtime_device) == cudaSuccess);
    expect_eq_i64(runtime_device, count - 1);
    /* A per-device call on another device leaves the current device alone. */
    size_t free_bytes, total;
    expect_ok(be->mem_get_info(cx, 0, &free_bytes, &total));
    expect_ok(be->get_device(cx, &device));
    expect_eq_i64(device, count - 1);
    expect_ok(be->set_device(cx, 0));
    /* An out-of-range device is CUDA's error, reported with its code. */
    expect_status(be->set_device(cx, count + 5), CCA_ERR_BACKEND);
    expect_true(cca_last_error()->backend_code == cudaErrorInvalidDevice);
    expect_contains(cca_last_error()->message, "cudaSetDevice");
    expect_true(cuda_clean());
    expect_ok(be->get_device(cx, &device));
    expect_eq_i64(device, 0);
}

TEST(malloc_round_trip)
{
    const size_t size = 3 * CCA_MiB + 512;
    void *dev = NULL;
    expect_ok(be->malloc(cx, 0, size, &dev));
    expect_true(dev != NULL);
    unsigned char *host = malloc(size);
    expect_true(cudaMemset(dev, 0x5A, size) == cudaSuccess);
    expect_true(cudaMemcpy(host, dev, size, cudaMemcpyDeviceToHost) == cudaSuccess);
    size_t bad = 0;
    for (size_t i = 0; i < size; i++)
        bad += host[i] != 0x5A;
    expect_eq_u64(bad, 0);
    free(host);
    /* cudaMalloc'd memory counts against the device. */
    size_t free_before, free_after, total;
    expect_ok(be->mem_get_info(cx, 0, &free_before, &total));
    expect_ok(be->free(cx, 0, dev));
    expect_ok(be->mem_get_info(cx, 0, &free_after, &total));
    expect_true(free_after >= free_before);
}

TEST(malloc_out_of_memory_is_cleared)
{
    size_t free_bytes, total;
    expect_ok(be->mem_get_info(cx, 0, &free_bytes, &total));
    void *dev = (void *)0x1;
    expect_status(be->malloc(cx, 0, total * 4, &dev), CCA_ERR_OUT_OF_MEMORY);
    expect_eq_ptr(dev, (void *)0x1);
    expect_eq_i64(cca_last_error()->backend_code, cudaErrorMemoryAllocation);
    expect_contains(cca_last_error()->message, "out of memory");
    /* The error was cleared: the next call sees a clean state and succeeds. */
    expect_true(cudaPeekAtLastError() == cudaSuccess);
    expect_ok(be->malloc(cx, 0, 4096, &dev));
    expect_ok(be->free(cx, 0, dev));
}

TEST(free_bad_pointer_is_backend_error)
{
    int local = 0;
    expect_status(be->free(cx, 0, &local), CCA_ERR_BACKEND);
    expect_true(cca_last_error()->backend_code != 0);
    expect_contains(cca_last_error()->message, "cudaFree failed");
    expect_true(cuda_clean());
}

TEST(malloc_inside_capture)
{
    cudaStream_t s;
    expect_true(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    int status = -1;
    expect_ok(be->stream_capture_status(cx, 0, (cca_stream_t)s, &status));
    expect_eq_i64(status, CCA_CAPTURE_NONE);
    expect_true(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
    expect_ok(be->stream_capture_status(cx, 0, (cca_stream_t)s, &status));
    expect_eq_i64(status, CCA_CAPTURE_ACTIVE);
    /* Global mode forbids cudaMalloc on this thread; the backend's relaxed mode allows it. */
    void *dev = NULL;
    expect_ok(be->malloc(cx, 0, CCA_MiB, &dev));
    expect_true(cudaMemsetAsync(dev, 1, CCA_MiB, s) == cudaSuccess);
    expect_ok(be->stream_capture_status(cx, 0, (cca_stream_t)s, &status));
    expect_eq_i64(status, CCA_CAPTURE_ACTIVE);
    cudaGraph_t graph = NULL;
    expect_true(cudaStreamEndCapture(s, &graph) == cudaSuccess);
    /* The thread's capture mode is global again. */
    enum cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    expect_true(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
    expect_eq_i64(mode, cudaStreamCaptureModeGlobal);
    expect_true(cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess);
    if (graph)
        expect_true(cudaGraphDestroy(graph) == cudaSuccess);
    expect_ok(be->stream_capture_status(cx, 0, (cca_stream_t)s, &status));
    expect_eq_i64(status, CCA_CAPTURE_NONE);
    expect_ok(be->free(cx, 0, dev));
    expect_true(cudaStreamDestroy(s) == cudaSuccess);
}

TEST(event_not_ready_until_stream_released)
{
    cudaStream_t s;
    expect_true(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    atomic_int gate = 0;
    cca_event_t ev = NULL;
    expect_ok(be->event_create(cx, 0, &ev));
    expect_true(cudaLaunchHostFunc(s, hold_stream, &gate) == cudaSuccess);
    expect_ok(be->event_record(cx, 0, ev, (cca_stream_t)s));
    expect_status(be->event_query(cx, 0, ev), CCA_ERR_NOT_READY);
    expect_true(cuda_clean());
    expect_status(be->event_query(cx, 0, ev), CCA_ERR_NOT_READY);
    atomic_store(&gate, 1);
    expect_ok(be->event_synchronize(cx, 0, ev));
    expect_ok(be->event_query(cx, 0, ev));
    expect_ok(be->stream_synchronize(cx, 0, (cca_stream_t)s));
    expect_ok(be->device_synchronize(cx, 0));
    expect_ok(be->event_destroy(cx, 0, ev));
    /* Timing is disabled on backend events. */
    cca_event_t a = NULL, b = NULL;
    expect_ok(be->event_create(cx, 0, &a));
    expect_ok(be->event_create(cx, 0, &b));
    expect_ok(be->event_record(cx, 0, a, (cca_stream_t)s));
    expect_ok(be->event_record(cx, 0, b, (cca_stream_t)s));
    expect_ok(be->event_synchronize(cx, 0, b));
    float ms = 0;
    expect_true(cudaEventElapsedTime(&ms, (cudaEvent_t)a, (cudaEvent_t)b) != cudaSuccess);
    (void)cudaGetLastError();
    expect_ok(be->event_destroy(cx, 0, a));
    expect_ok(be->event_destroy(cx, 0, b));
    expect_true(cudaStreamDestroy(s) == cudaSuccess);
}

TEST(vmm_map_use_unmap)
{
    size_t g = 0;
    expect_ok(be->vmm_granularity(cx, 0, &g));
    expect_true(g > 0 && (g & (g - 1)) == 0);
    void *base = NULL;
    expect_ok(be->vmm_reserve(cx, 0, 4 * g, &base));
    expect_true(base != NULL);
    cca_phys_handle_t h1 = 0, h2 = 0;
    expect_ok(be->vmm_create(cx, 0, g, &h1));
    expect_ok(be->vmm_create(cx, 0, 2 * g, &h2));
    char *second = (char *)base + g;
    expect_ok(be->vmm_map(cx, 0, base, g, h1));
    expect_ok(be->vmm_map(cx, 0, second, 2 * g, h2));
    expect_ok(be->vmm_set_access(cx, 0, base, 3 * g));
    /* The two mappings form one contiguous range the device can write. */
    expect_true(cudaMemset(base, 0xC3, 3 * g) == cudaSuccess);
    unsigned char *host = malloc(3 * g);
    expect_true(cudaMemcpy(host, base, 3 * g, cudaMemcpyDeviceToHost) == cudaSuccess);
    size_t bad = 0;
    for (size_t i = 0; i < 3 * g; i++)
        bad += host[i] != 0xC3;
    expect_eq_u64(bad, 0);
    free(host);
    expect_ok(be->device_synchronize(cx, 0));
    expect_ok(be->vmm_unmap(cx, 0, second, 2 * g));
    expect_ok(be->vmm_release(cx, 0, h2));
    expect_ok(be->vmm_unmap(cx, 0, base, g));
    expect_ok(be->vmm_release(cx, 0, h1));
    expect_ok(be->vmm_free(cx, 0, base, 4 * g));
    /* Mapping with a released handle is the driver's error, reported as such. */
    expect_status(be->vmm_map(cx, 0, base, g, h1), CCA_ERR_BACKEND);
    expect_contains(cca_last_error()->message, "cuMemMap failed");
    expect_true(cca_last_error()->backend_code != 0);
}

TEST(vmm_create_out_of_memory)
{
    size_t g = 0, free_bytes, total;
    expect_ok(be->vmm_granularity(cx, 0, &g));
    expect_ok(be->mem_get_info(cx, 0, &free_bytes, &total));
    size_t size = (total * 2 + g - 1) / g * g;
    cca_phys_handle_t h = 7;
    cca_status_t st = be->vmm_create(cx, 0, size, &h);
    expect_eq_i64(st, CCA_ERR_OUT_OF_MEMORY);
    expect_eq_u64(h, 7);
    if (st != CCA_ERR_OUT_OF_MEMORY)
        printf("  vmm_create(%zu): %s\n", size, cca_last_error()->message);
    expect_true(cuda_clean());
}

TEST(host_alloc_and_register)
{
    const size_t size = 2 * CCA_MiB;
    unsigned char *pinned = NULL;
    expect_ok(be->host_alloc(cx, size, (void **)&pinned));
    expect_true(pinned != NULL);
    memset(pinned, 0x11, size);
    void *dev = NULL;
    expect_ok(be->malloc(cx, 0, size, &dev));
    expect_true(cudaMemcpy(dev, pinned, size, cudaMemcpyHostToDevice) == cudaSuccess);
    memset(pinned, 0, size);
    expect_true(cudaMemcpy(pinned, dev, size, cudaMemcpyDeviceToHost) == cudaSuccess);
    expect_true(pinned[0] == 0x11 && pinned[size - 1] == 0x11);
    expect_ok(be->host_free(cx, pinned));

    unsigned char *plain = aligned_alloc(4096, size);
    memset(plain, 0x22, size);
    void *mapped = NULL;
    expect_ok(be->host_register(cx, plain, size, &mapped));
    expect_true(mapped != NULL);
    /* The device address reads the same host bytes. */
    expect_true(cudaMemcpy(dev, mapped, size, cudaMemcpyDefault) == cudaSuccess);
    unsigned char back[16];
    expect_true(cudaMemcpy(back, (char *)dev + size - 16, 16, cudaMemcpyDeviceToHost) ==
                cudaSuccess);
    expect_true(back[0] == 0x22 && back[15] == 0x22);
    expect_ok(be->host_unregister(cx, plain));
    expect_status(be->host_unregister(cx, plain), CCA_ERR_BACKEND);
    expect_contains(cca_last_error()->message, "cudaHostUnregister");
    expect_true(cuda_clean());
    free(plain);
    expect_ok(be->free(cx, 0, dev));
}

TEST(ipc_handle)
{
    void *dev = NULL;
    expect_ok(be->malloc(cx, 0, 2 * CCA_MiB, &dev));
    cca_ipc_handle_t h;
    memset(&h, 0, sizeof(h));
    expect_ok(be->ipc_get_handle(cx, 0, dev, &h));
    size_t nonzero = 0;
    for (size_t i = 0; i < sizeof(h.bytes); i++)
        nonzero += h.bytes[i] != 0;
    expect_true(nonzero > 0);
    /* A process cannot open its own handle: CUDA's error comes back intact. */
    void *opened = (void *)0x1;
    expect_status(be->ipc_open(cx, 0, &h, &opened), CCA_ERR_BACKEND);
    expect_eq_ptr(opened, (void *)0x1);
    expect_contains(cca_last_error()->message, "cudaIpcOpenMemHandle");
    expect_true(cuda_clean());
    expect_ok(be->free(cx, 0, dev));
}

/* Each thread allocates, fills on its own stream, checks, frees. */
static void *worker(void *arg)
{
    int id = (int)(intptr_t)arg;
    cudaStream_t s;
    int failures = 0;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        return (void *)(intptr_t)1;
    unsigned char host[4096];
    for (int round = 0; round < 50; round++) {
        void *dev = NULL;
        size_t size = (size_t)(id + 1) * 65536 + (size_t)round * 512;
        cca_event_t ev = NULL;
        if (be->malloc(cx, 0, size, &dev) != CCA_OK || be->event_create(cx, 0, &ev) != CCA_OK) {
            failures++;
            break;
        }
        int value = (id * 31 + round) & 0xFF;
        cudaMemsetAsync(dev, value, size, s);
        cudaMemcpyAsync(host, (char *)dev + size - sizeof(host), sizeof(host),
                        cudaMemcpyDeviceToHost, s);
        if (be->event_record(cx, 0, ev, (cca_stream_t)s) != CCA_OK ||
            be->event_synchronize(cx, 0, ev) != CCA_OK)
            failures++;
        for (size_t i = 0; i < sizeof(host); i++)
            failures += host[i] != value;
        if (be->event_destroy(cx, 0, ev) != CCA_OK || be->free(cx, 0, dev) != CCA_OK)
            failures++;
    }
    cudaStreamDestroy(s);
    return (void *)(intptr_t)failures;
}

TEST(threads_concurrently)
{
    pthread_t threads[8];
    for (int i = 0; i < 8; i++)
        pthread_create(&threads[i], NULL, worker, (void *)(intptr_t)i);
    intptr_t failures = 0;
    for (int i = 0; i < 8; i++) {
        void *r = NULL;
        pthread_join(threads[i], &r);
        failures += (intptr_t)r;
    }
    expect_eq_i64(failures, 0);
}

int main(void)
{
    if (cca_cuda_create(NULL) != CCA_ERR_INVALID_ARGUMENT) {
        printf("FAIL cca_cuda_create(NULL) must be CCA_ERR_INVALID_ARGUMENT\n");
        return 1;
    }
    cca_status_t st = cca_cuda_create(&be);
    if (st == CCA_ERR_NO_DEVICE) {
        printf("SKIPPED: no GPU (%s)\n", cca_last_error()->message);
        /* The message must say what happened and how to run without a GPU. */
        if (!strstr(cca_last_error()->message, "no usable CUDA device") ||
            !strstr(cca_last_error()->message, "CCA_BACKEND=sim")) {
            printf("FAIL no-device message\n");
            return 1;
        }
        return 77;
    }
    if (st != CCA_OK) {
        printf("FAIL cca_cuda_create: %s: %s\n", cca_status_str(st), cca_last_error()->message);
        return 1;
    }
    expect_eq_str(be->name, "cuda");
    cx = be->ctx;
    RUN(device_count_and_props);
    RUN(get_set_device);
    RUN(malloc_round_trip);
    RUN(malloc_out_of_memory_is_cleared);
    RUN(free_bad_pointer_is_backend_error);
    RUN(malloc_inside_capture);
    RUN(event_not_ready_until_stream_released);
    RUN(vmm_map_use_unmap);
    RUN(vmm_create_out_of_memory);
    RUN(host_alloc_and_register);
    RUN(ipc_handle);
    RUN(threads_concurrently);
    be->destroy(be->ctx);
    return harness_done();
}
