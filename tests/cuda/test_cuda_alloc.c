/*
 * test_cuda_alloc.c - cca's public API on a real GPU: allocations the device
 * can use (memset + memcpy round trips on streams), stream-ordered reuse,
 * record_stream holding a block while a consumer stream is held by a host
 * function, out-of-memory under a memory fraction, empty_cache giving memory
 * back to the device, 8 threads on 8 streams, uncached mode,
 * segments, the backend's virtual memory, IPC and host memory operations.
 * Each test starts from a fresh cca_init and ends with cca_shutdown.
 * Exits 77 (skipped) when no GPU is usable.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, aligned_alloc under -std=c11 */
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;

/* Initialise cca on the CUDA backend with the given settings (NULL: none). */
static bool setup(const char *settings)
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

static void teardown(void)
{
    cca_shutdown();
    unsetenv("CCA_ALLOC_CONF");
    unsetenv("CCA_NO_CACHING");
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        HARNESS_FAIL("cudaStreamCreateWithFlags failed");
    return s;
}

/*
 * Fill [ptr, ptr + size) with value on stream s, read back the first and last
 * 4 KiB, and return how many bytes differ (0 when the device memory works).
 */
static size_t fill_and_check(void *ptr, size_t size, int value, cudaStream_t s)
{
    unsigned char head[4096], tail[4096];
    size_t n = size < sizeof(head) ? size : sizeof(head);
    if (cudaMemsetAsync(ptr, value, size, s) != cudaSuccess ||
        cudaMemcpyAsync(head, ptr, n, cudaMemcpyDeviceToHost, s) != cudaSuccess ||
        cudaMemcpyAsync(tail, (char *)ptr + size - n, n, cudaMemcpyDeviceToHost, s) !=
            cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
        return size ? size : 1;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += (head[i] != (unsigned char)value) + (tail[i] != (unsigned char)value);
    return bad;
}

/* A host function that holds its stream until the test opens the gate. */
static void CUDART_CB hold_stream(void *arg)
{
    atomic_int *gate = arg;
    while (!atomic_load(gate)) {
    }
}

static bool ranges_overlap(const void *a, size_t a_size, const void *b, size_t b_size)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return x < y + b_size && y < x + a_size;
}

TEST(round_trip_sizes)
{
    if (!setup(NULL))
        return;
    cudaStream_t s = new_stream();
    const size_t sizes[] = {1, 512, 4096, MiB + 1, 3 * MiB, 20 * MiB, 100 * MiB};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        void *p = NULL;
        expect_ok(cca_malloc(&p, sizes[i], (cca_stream_t)s));
        expect_true(p != NULL);
        if (!p)
            continue;
        expect_eq_u64(fill_and_check(p, sizes[i], (int)(0x30 + i), s), 0);
        expect_ok(cca_free(p));
    }
    void *zero = (void *)0x1;
    expect_ok(cca_malloc(&zero, 0, (cca_stream_t)s));
    expect_eq_ptr(zero, NULL);
    cudaStreamDestroy(s);
    teardown();
}

TEST(same_stream_reuse)
{
    if (!setup(NULL))
        return;
    cudaStream_t s = new_stream();
    const size_t sizes[] = {4096, MiB, 20 * MiB};
    for (size_t i = 0; i < 3; i++) {
        void *a = NULL, *b = NULL;
        expect_ok(cca_malloc(&a, sizes[i], (cca_stream_t)s));
        expect_eq_u64(fill_and_check(a, sizes[i], 0x41, s), 0);
        expect_ok(cca_free(a));
        /* Freed on its own stream, the block is reusable at once. */
        expect_ok(cca_malloc(&b, sizes[i], (cca_stream_t)s));
        expect_eq_ptr(b, a);
        expect_ok(cca_free(b));
    }
    cudaStreamDestroy(s);
    teardown();
}

TEST(record_stream_holds_block)
{
    if (!setup(NULL))
        return;
    const size_t size = 2 * MiB;
    cudaStream_t producer = new_stream(), consumer = new_stream();
    void *p = NULL;
    expect_ok(cca_malloc(&p, size, (cca_stream_t)producer));
    expect_eq_u64(fill_and_check(p, size, 0x10, producer), 0);
    /* The consumer stream is held; its write into p is queued behind the gate. */
    atomic_int gate = 0;
    expect_true(cudaLaunchHostFunc(consumer, hold_stream, &gate) == cudaSuccess);
    expect_true(cudaMemsetAsync(p, 0x77, size, consumer) == cudaSuccess);
    expect_ok(cca_record_stream(p, (cca_stream_t)consumer));
    expect_ok(cca_free(p));
    /* While the consumer's work is pending, p must not be handed out again. */
    void *q = NULL, *r = NULL;
    expect_ok(cca_malloc(&q, size, (cca_stream_t)producer));
    expect_ok(cca_malloc(&r, size, (cca_stream_t)producer));
    expect_false(ranges_overlap(q, size, p, size));
    expect_false(ranges_overlap(r, size, p, size));
    expect_eq_u64(fill_and_check(q, size, 0x11, producer), 0);
    expect_ok(cca_free(r));
    expect_ok(cca_free(q));
    void *still = NULL;
    expect_ok(cca_malloc(&still, size, (cca_stream_t)producer));
    expect_false(ranges_overlap(still, size, p, size));
    expect_ok(cca_free(still));
    /* Release the consumer: its write lands in p, untouched by anyone else. */
    atomic_store(&gate, 1);
    expect_true(cudaStreamSynchronize(consumer) == cudaSuccess);
    unsigned char byte = 0;
    expect_true(cudaMemcpy(&byte, (char *)p + size - 1, 1, cudaMemcpyDeviceToHost) == cudaSuccess);
    expect_eq_u64(byte, 0x77);
    /* Once the event completed, p (the first block of its segment) is reused. */
    void *again = NULL;
    expect_ok(cca_malloc(&again, size, (cca_stream_t)producer));
    expect_eq_ptr(again, p);
    expect_ok(cca_free(again));
    cudaStreamDestroy(consumer);
    cudaStreamDestroy(producer);
    teardown();
}

TEST(out_of_memory_with_fraction)
{
    if (!setup(NULL))
        return;
    size_t free_bytes = 0, total = 0;
    expect_ok(cca_mem_get_info(0, &free_bytes, &total));
    expect_ok(cca_set_memory_fraction(0.1, 0));
    cudaStream_t s = new_stream();
    const size_t chunk = 256 * MiB;
    void *blocks[4096];
    size_t count = 0;
    cca_status_t st = CCA_OK;
    while (count < sizeof(blocks) / sizeof(blocks[0])) {
        void *p = NULL;
        st = cca_malloc(&p, chunk, (cca_stream_t)s);
        if (st != CCA_OK)
            break;
        blocks[count++] = p;
    }
    expect_eq_i64(st, CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "Tried to allocate");
    expect_contains(cca_last_error()->message, "256.00 MiB");
    /* The fraction, not the device, was the limit. */
    expect_true(count * chunk <= total / 10);
    expect_true(count >= 1);
    expect_true(cudaPeekAtLastError() == cudaSuccess);
    for (size_t i = 0; i < count; i++)
        expect_ok(cca_free(blocks[i]));
    void *p = NULL;
    expect_ok(cca_malloc(&p, chunk, (cca_stream_t)s));
    if (p)
        expect_eq_u64(fill_and_check(p, chunk, 0x5C, s), 0);
    expect_ok(cca_free(p));
    cudaStreamDestroy(s);
    teardown();
}

TEST(empty_cache_returns_memory)
{
    if (!setup(NULL))
        return;
    cudaStream_t s = new_stream();
    const size_t size = 512 * MiB;
    size_t free_before, free_cached, free_after, total;
    expect_ok(cca_mem_get_info(0, &free_before, &total));
    void *p = NULL;
    expect_ok(cca_malloc(&p, size, (cca_stream_t)s));
    expect_eq_u64(fill_and_check(p, size, 0x22, s), 0);
    expect_ok(cca_free(p));
    size_t cached = 0, largest = 0;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_true(cached >= size);
    expect_ok(cca_mem_get_info(0, &free_cached, &total));
    expect_true(free_cached + size <= free_before + 64 * MiB);
    expect_ok(cca_empty_cache());
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_eq_u64(cached, 0);
    /* PyTorch's cacheInfo (cuDNN's workspace guess): 0 in starts from the device's free memory */
    size_t guess = 0, free_1 = 0, free_2 = 0;
    expect_true(cudaMemGetInfo(&free_1, &total) == cudaSuccess);
    expect_ok(cca_cache_info_largest(0, &guess));
    expect_true(cudaMemGetInfo(&free_2, &total) == cudaSuccess);
    expect_true(guess >= (free_1 < free_2 ? free_1 : free_2) && guess <= (free_1 > free_2 ? free_1 : free_2));
    expect_ok(cca_mem_get_info(0, &free_after, &total));
    expect_true(free_after >= free_cached + size);
    cudaStreamDestroy(s);
    teardown();
}

typedef struct thread_arg {
    int id;
    size_t failures;
} thread_arg_t;

/* One thread: allocate, fill, check and free on its own stream, fixed-seed sizes. */
static void *thread_main(void *argp)
{
    thread_arg_t *arg = argp;
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
        cca_set_device(0) != CCA_OK) {
        arg->failures++;
        return NULL;
    }
    uint64_t state = 0x9E3779B97F4A7C15ULL * (uint64_t)(arg->id + 1);
    void *live[8] = {0};
    size_t live_size[8] = {0};
    for (int round = 0; round < 300; round++) {
        state = state * 6364136223846793005ULL + 1442695040888963407ULL;
        int slot = (int)((state >> 33) % 8);
        if (live[slot]) {
            /* The block still holds the value written when it was allocated. */
            unsigned char byte = 0;
            int value = (int)(((uintptr_t)live[slot] >> 9) + (uintptr_t)arg->id) & 0xFF;
            if (cudaMemcpyAsync(&byte, (char *)live[slot] + live_size[slot] - 1, 1,
                                cudaMemcpyDeviceToHost, s) != cudaSuccess ||
                cudaStreamSynchronize(s) != cudaSuccess || byte != (unsigned char)value)
                arg->failures++;
            if (cca_free(live[slot]) != CCA_OK)
                arg->failures++;
            live[slot] = NULL;
        } else {
            size_t size = 512 + (size_t)((state >> 17) % (6 * MiB));
            void *p = NULL;
            if (cca_malloc(&p, size, (cca_stream_t)s) != CCA_OK) {
                arg->failures++;
                continue;
            }
            int value = (int)(((uintptr_t)p >> 9) + (uintptr_t)arg->id) & 0xFF;
            arg->failures += fill_and_check(p, size, value, s);
            live[slot] = p;
            live_size[slot] = size;
        }
    }
    for (int i = 0; i < 8; i++)
        if (live[i] && cca_free(live[i]) != CCA_OK)
            arg->failures++;
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
    return NULL;
}

TEST(eight_threads_eight_streams)
{
    if (!setup(NULL))
        return;
    pthread_t threads[8];
    thread_arg_t args[8];
    for (int i = 0; i < 8; i++) {
        args[i].id = i;
        args[i].failures = 0;
        pthread_create(&threads[i], NULL, thread_main, &args[i]);
    }
    size_t failures = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(threads[i], NULL);
        failures += args[i].failures;
    }
    expect_eq_u64(failures, 0);
    cca_device_stats_t stats;
    expect_ok(cca_get_device_stats(0, &stats));
    expect_eq_i64(stats.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(stats.allocation[CCA_STAT_ALL].current, 0);
    teardown();
}

TEST(uncached_mode)
{
    setenv("CCA_NO_CACHING", "1", 1);
    if (!setup(NULL))
        return;
    cudaStream_t s = new_stream();
    void *p = NULL;
    expect_ok(cca_malloc(&p, 3 * MiB, (cca_stream_t)s));
    expect_eq_u64(fill_and_check(p, 3 * MiB, 0x66, s), 0);
    expect_ok(cca_free(p));
    /* Nothing stays cached: the memory went straight back to the device. */
    size_t cached = 1, largest = 1;
    expect_ok(cca_cache_info(0, &cached, &largest));
    expect_eq_u64(cached, 0);
    cca_device_stats_t stats;
    expect_ok(cca_get_device_stats(0, &stats));
    expect_eq_i64(stats.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_true(stats.num_device_free >= 1);
    cudaStreamDestroy(s);
    teardown();
}

TEST(backend_virtual_memory)
{
    if (!setup(NULL))
        return;
    cca_backend_t *be = cca_current_backend();
    expect_true(be != NULL);
    if (!be)
        goto out;
    expect_eq_str(be->name, "cuda");
    size_t g = 0;
    expect_ok(be->vmm_granularity(be->ctx, 0, &g));
    void *base = NULL;
    cca_phys_handle_t h = 0;
    expect_ok(be->vmm_reserve(be->ctx, 0, 2 * g, &base));
    expect_ok(be->vmm_create(be->ctx, 0, 2 * g, &h));
    expect_ok(be->vmm_map(be->ctx, 0, base, 2 * g, h));
    expect_ok(be->vmm_set_access(be->ctx, 0, base, 2 * g));
    cudaStream_t s = new_stream();
    expect_eq_u64(fill_and_check(base, 2 * g, 0x3D, s), 0);
    cudaStreamDestroy(s);
    expect_ok(be->vmm_unmap(be->ctx, 0, base, 2 * g));
    expect_ok(be->vmm_release(be->ctx, 0, h));
    expect_ok(be->vmm_free(be->ctx, 0, base, 2 * g));
out:
    teardown();
}

TEST(ipc_handle_of_allocation)
{
    if (!setup(NULL))
        return;
    cca_backend_t *be = cca_current_backend();
    void *p = NULL;
    expect_ok(cca_malloc(&p, 4 * MiB, NULL));
    void *base = NULL;
    size_t seg_size = 0;
    expect_ok(cca_get_base_allocation(p, &base, &seg_size));
    expect_true(seg_size >= 4 * MiB);
    cca_ipc_handle_t h;
    memset(&h, 0, sizeof(h));
    if (be)
        expect_ok(be->ipc_get_handle(be->ctx, 0, base, &h));
    size_t nonzero = 0;
    for (size_t i = 0; i < sizeof(h.bytes); i++)
        nonzero += h.bytes[i] != 0;
    expect_true(nonzero > 0);
    expect_ok(cca_free(p));
    teardown();
}

TEST(host_memory)
{
    if (!setup(NULL))
        return;
    cudaStream_t s = new_stream();
    const size_t size = 4 * MiB;
    unsigned char *pinned = NULL;
    void *dev = NULL;
    expect_ok(cca_host_malloc((void **)&pinned, size));
    expect_ok(cca_malloc(&dev, size, (cca_stream_t)s));
    if (!pinned || !dev)
        goto out;
    memset(pinned, 0xA5, size);
    /* The copy out of pinned waits behind a gate, so its event cannot complete. */
    atomic_int gate = 0;
    expect_true(cudaLaunchHostFunc(s, hold_stream, &gate) == cudaSuccess);
    expect_true(cudaMemcpyAsync(dev, pinned, size, cudaMemcpyHostToDevice, s) == cudaSuccess);
    expect_ok(cca_host_record_event(pinned, (cca_stream_t)s));
    expect_ok(cca_host_free(pinned));
    /* A new pinned block while the copy is pending is not the recorded one. */
    unsigned char *other = NULL;
    expect_ok(cca_host_malloc((void **)&other, size));
    expect_true(other != pinned);
    atomic_store(&gate, 1);
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    if (other) {
        expect_true(cudaMemcpy(other, dev, size, cudaMemcpyDeviceToHost) == cudaSuccess);
        expect_true(other[0] == 0xA5 && other[size - 1] == 0xA5);
        expect_ok(cca_host_free(other));
    }
    cca_backend_t *be = cca_current_backend();
    unsigned char *plain = aligned_alloc(4096, size);
    void *mapped = NULL;
    if (be && plain) {
        memset(plain, 0x5A, size);
        expect_ok(be->host_register(be->ctx, plain, size, &mapped));
        expect_true(cudaMemcpy(dev, mapped, size, cudaMemcpyDefault) == cudaSuccess);
        unsigned char byte = 0;
        expect_true(cudaMemcpy(&byte, (char *)dev + size - 1, 1, cudaMemcpyDeviceToHost) ==
                    cudaSuccess);
        expect_eq_u64(byte, 0x5A);
        expect_ok(be->host_unregister(be->ctx, plain));
    }
    free(plain);
    expect_ok(cca_host_empty_cache());
out:
    expect_ok(cca_free(dev));
    cudaStreamDestroy(s);
    teardown();
}

int main(void)
{
    setenv("CCA_BACKEND", "cuda", 1);
    cca_status_t st = cca_init();
    if (st == CCA_ERR_NO_DEVICE) {
        printf("SKIPPED: no GPU (%s)\n", cca_last_error()->message);
        return 77;
    }
    if (st != CCA_OK) {
        printf("FAIL cca_init: %s: %s\n", cca_status_str(st), cca_last_error()->message);
        return 1;
    }
    cca_shutdown();
    RUN(round_trip_sizes);
    RUN(same_stream_reuse);
    RUN(record_stream_holds_block);
    RUN(out_of_memory_with_fraction);
    RUN(empty_cache_returns_memory);
    RUN(eight_threads_eight_streams);
    RUN(uncached_mode);
    RUN(backend_virtual_memory);
    RUN(ipc_handle_of_allocation);
    RUN(host_memory);
    return harness_done();
}
