/*
 * test_cuda_expandable.c - expandable segments on a real GPU (CUDA virtual
 * memory through the driver API): blocks that grow across granule boundaries
 * are written and read across them (memset kernels and device-to-device
 * copies), a hole unmapped by empty_cache is mapped again and used, unmapping
 * gives the memory back to the driver (cudaMemGetInfo), and the memory
 * fraction caps growth with PyTorch's out-of-memory error; a graph pool's
 * checkpoints restored unmap and map its growth; compact_memory
 * moves a hole to another stream, waiting for the owning stream's event when
 * it is still busy. Each test starts
 * from a fresh cca_init and ends with cca_shutdown. Exits 77 (skipped) when
 * no GPU is usable.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv under -std=c11 */
#endif
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;

static bool setup(const char *settings)
{
    setenv("CCA_BACKEND", "cuda", 1);
    setenv("CCA_ALLOC_CONF", settings, 1);
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
}

static cudaStream_t new_stream(void)
{
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
        HARNESS_FAIL("cudaStreamCreateWithFlags failed");
    return s;
}

/* Bytes of [ptr + at - 4 KiB, ptr + at + 4 KiB) that differ from value (a window on a boundary). */
static size_t check_window(const void *ptr, size_t at, int value, cudaStream_t s)
{
    unsigned char buf[8192];
    if (cudaMemcpyAsync(buf, (const char *)ptr + at - 4096, sizeof(buf), cudaMemcpyDeviceToHost, s) !=
            cudaSuccess ||
        cudaStreamSynchronize(s) != cudaSuccess)
        return sizeof(buf);
    size_t bad = 0;
    for (size_t i = 0; i < sizeof(buf); i++)
        bad += buf[i] != (unsigned char)value;
    return bad;
}

/* A block grown over three granules is usable across both boundaries. */
TEST(growth_across_granules)
{
    if (!setup("expandable_segments:True"))
        return;
    cudaStream_t s = new_stream();
    char *a = NULL, *b = NULL, *c = NULL;
    expect_ok(cca_malloc((void **)&a, 15 * MiB, (cca_stream_t)s)); /* maps granule 0 */
    expect_ok(cca_malloc((void **)&b, 40 * MiB, (cca_stream_t)s)); /* grows: granules 1, 2 */
    expect_eq_u64((uintptr_t)b, (uintptr_t)a + 15 * MiB);
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 60 * MiB);
    expect_eq_i64(st.segment[CCA_STAT_ALL].current, 0);
    expect_eq_i64(st.num_device_alloc, 2);
    if (a && b) {
        expect_true(cudaMemsetAsync(a, 0x11, 15 * MiB, s) == cudaSuccess);
        expect_true(cudaMemsetAsync(b, 0x5a, 40 * MiB, s) == cudaSuccess);
        /* granule boundaries at a + 20 MiB and a + 40 MiB lie inside b */
        expect_eq_u64(check_window(a, 20 * MiB, 0x5a, s), 0);
        expect_eq_u64(check_window(a, 40 * MiB, 0x5a, s), 0);
        expect_eq_u64(check_window(b, 40 * MiB - 4096, 0x5a, s), 0);
        /* a device-to-device copy across both boundaries, into a third block */
        expect_ok(cca_malloc((void **)&c, 40 * MiB, (cca_stream_t)s));
        if (c) {
            expect_true(cudaMemsetAsync(c, 0, 40 * MiB, s) == cudaSuccess);
            expect_true(cudaMemcpyAsync(c, b, 40 * MiB, cudaMemcpyDeviceToDevice, s) == cudaSuccess);
            expect_eq_u64(check_window(c, 5 * MiB, 0x5a, s), 0);
            expect_eq_u64(check_window(c, 25 * MiB, 0x5a, s), 0);
            expect_eq_u64(check_window(c, 40 * MiB - 4096, 0x5a, s), 0);
        }
        expect_eq_u64(check_window(a, 15 * MiB - 4096, 0x11, s), 0);
    }
    expect_true(cudaStreamSynchronize(s) == cudaSuccess);
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    cudaStreamDestroy(s);
    teardown();
}

/* empty_cache unmaps whole free granules: the driver gets them back. */
TEST(empty_cache_unmaps_and_returns_memory)
{
    if (!setup("expandable_segments:True"))
        return;
    cudaStream_t s = new_stream();
    const size_t size = 1000 * MiB;
    size_t free_before, free_cached, free_after, total;
    expect_ok(cca_mem_get_info(0, &free_before, &total));
    void *p = NULL;
    expect_ok(cca_malloc(&p, size, (cca_stream_t)s));
    if (p)
        expect_true(cudaMemsetAsync(p, 0x33, size, s) == cudaSuccess);
    expect_ok(cca_free(p));
    expect_ok(cca_mem_get_info(0, &free_cached, &total));
    expect_true(free_cached + size <= free_before + 64 * MiB);
    expect_ok(cca_empty_cache());
    expect_ok(cca_mem_get_info(0, &free_after, &total));
    expect_true(free_after >= free_cached + size);
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_eq_i64(st.num_device_free, 1);
    cudaStreamDestroy(s);
    teardown();
}

/* A hole unmapped in the middle is mapped again and used. */
TEST(hole_mapped_again)
{
    if (!setup("expandable_segments:True"))
        return;
    cudaStream_t s = new_stream();
    char *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    expect_ok(cca_malloc((void **)&a, 30 * MiB, (cca_stream_t)s));
    expect_ok(cca_malloc((void **)&b, 30 * MiB, (cca_stream_t)s));
    expect_ok(cca_malloc((void **)&c, 15 * MiB, (cca_stream_t)s));
    expect_ok(cca_free(b));
    expect_ok(cca_empty_cache()); /* unmaps the granule [a + 40, a + 60) MiB */
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 60 * MiB);
    expect_ok(cca_malloc((void **)&d, 25 * MiB, (cca_stream_t)s));
    expect_eq_u64((uintptr_t)d, (uintptr_t)a + 30 * MiB);
    if (d && c) {
        expect_true(cudaMemsetAsync(d, 0x7e, 25 * MiB, s) == cudaSuccess);
        expect_true(cudaMemsetAsync(c, 0x01, 15 * MiB, s) == cudaSuccess);
        expect_eq_u64(check_window(d, 10 * MiB, 0x7e, s), 0); /* the remapped granule's start */
        expect_eq_u64(check_window(d, 25 * MiB - 4096, 0x7e, s), 0);
        expect_eq_u64(check_window(c, 4096, 0x01, s), 0);
    }
    expect_ok(cca_free(a));
    expect_ok(cca_free(c));
    expect_ok(cca_free(d));
    expect_ok(cca_empty_cache());
    cudaStreamDestroy(s);
    teardown();
}

/*
 * Checkpoints of a graph pool holding an expandable segment (cudagraph trees under
 * expandable_segments:True): restoring the smaller one unmaps the growth (the driver
 * gets it back), the larger one maps it again; the live block's bytes survive both
 * and the growth is usable across its granule boundary again.
 */
TEST(checkpoint_restore_maps_and_unmaps)
{
    if (!setup("expandable_segments:True"))
        return;
    cudaStream_t s = new_stream();
    const cca_mempool_id_t g = {11, 0};
    char *a = NULL, *d = NULL;
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, (cca_stream_t)s));
    expect_ok(cca_malloc((void **)&a, 15 * MiB, (cca_stream_t)s)); /* one granule */
    expect_ok(cca_end_allocate_to_pool(0, g));
    if (a)
        expect_true(cudaMemsetAsync(a, 0x5a, 15 * MiB, s) == cudaSuccess);
    cca_pool_state_t *small = NULL, *big = NULL;
    expect_ok(cca_pool_get_checkpoint(0, g, &small));
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    int64_t reserved_small = st.reserved_bytes[CCA_STAT_ALL].current;
    expect_ok(cca_begin_allocate_stream_to_pool(0, g, (cca_stream_t)s));
    expect_ok(cca_malloc((void **)&d, 40 * MiB, (cca_stream_t)s)); /* grows two granules */
    expect_ok(cca_end_allocate_to_pool(0, g));
    expect_ok(cca_pool_get_checkpoint(0, g, &big));
    expect_ok(cca_get_device_stats(0, &st));
    int64_t reserved_big = st.reserved_bytes[CCA_STAT_ALL].current;
    expect_true(reserved_big > reserved_small);
    cca_checkpoint_delta_t delta;
    size_t free_big = 0, free_small = 0, total = 0;
    expect_ok(cca_mem_get_info(0, &free_big, &total));
    expect_ok(cca_pool_set_checkpoint(0, small, &delta)); /* d dies, its granules go */
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, reserved_small);
    expect_ok(cca_mem_get_info(0, &free_small, &total));
    expect_true(free_small >= free_big + (size_t)(reserved_big - reserved_small));
    if (a)
        expect_eq_u64(check_window(a, 8 * MiB, 0x5a, s), 0);
    expect_ok(cca_pool_set_checkpoint(0, big, &delta)); /* mapped again: a and d live */
    expect_eq_u64(delta.allocated_count, 2);
    cca_checkpoint_delta_free(&delta);
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, reserved_big);
    if (a && d) {
        expect_eq_u64(check_window(a, 8 * MiB, 0x5a, s), 0);
        expect_true(cudaMemsetAsync(d, 0x33, 40 * MiB, s) == cudaSuccess);
        expect_eq_u64(check_window(d, 5 * MiB, 0x33, s), 0);  /* the first new granule's start */
        expect_eq_u64(check_window(d, 25 * MiB, 0x33, s), 0); /* the second's */
    }
    cca_pool_state_free(small);
    cca_pool_state_free(big);
    expect_ok(cca_free(a));
    expect_ok(cca_free(d));
    expect_ok(cca_release_pool(0, g)); /* both captures' graphs are gone */
    expect_ok(cca_release_pool(0, g));
    expect_ok(cca_empty_cache());
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    cudaStreamDestroy(s);
    teardown();
}

/* The memory fraction stops growth with PyTorch's error; the allocator stays usable. */
TEST(out_of_memory_with_fraction)
{
    if (!setup("expandable_segments:True"))
        return;
    size_t free_bytes = 0, total = 0;
    expect_ok(cca_mem_get_info(0, &free_bytes, &total));
    expect_ok(cca_set_memory_fraction(0.05, 0));
    cudaStream_t s = new_stream();
    const size_t chunk = 100 * MiB;
    void *blocks[1024];
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
    expect_contains(cca_last_error()->message, "allowed");
    expect_true(count >= 1);
    expect_true(count * chunk <= total / 20);
    for (size_t i = 1; i < count; i++)
        expect_eq_u64((uintptr_t)blocks[i], (uintptr_t)blocks[i - 1] + chunk); /* one growing range */
    cca_device_stats_t ds;
    expect_ok(cca_get_device_stats(0, &ds));
    expect_true((size_t)ds.reserved_bytes[CCA_STAT_ALL].current <= total / 20);
    expect_true(cudaPeekAtLastError() == cudaSuccess);
    for (size_t i = 0; i < count; i++)
        expect_ok(cca_free(blocks[i]));
    void *p = NULL;
    expect_ok(cca_malloc(&p, chunk, (cca_stream_t)s));
    if (p)
        expect_true(cudaMemsetAsync(p, 0x44, chunk, s) == cudaSuccess);
    if (p)
        expect_eq_u64(check_window(p, chunk - 4096, 0x44, s), 0);
    expect_ok(cca_free(p));
    cudaStreamDestroy(s);
    teardown();
}

/* Several streams and both pools: one reservation each, all usable. */
TEST(streams_and_pools)
{
    if (!setup("expandable_segments:True"))
        return;
    cudaStream_t s[3] = {new_stream(), new_stream(), new_stream()};
    void *small[3] = {0}, *large[3] = {0};
    for (int i = 0; i < 3; i++) {
        expect_ok(cca_malloc(&small[i], 3000, (cca_stream_t)s[i]));
        expect_ok(cca_malloc(&large[i], 25 * MiB, (cca_stream_t)s[i]));
        if (small[i] && large[i]) {
            expect_true(cudaMemsetAsync(small[i], 0x20 + i, 3000, s[i]) == cudaSuccess);
            expect_true(cudaMemsetAsync(large[i], 0x30 + i, 25 * MiB, s[i]) == cudaSuccess);
        }
    }
    for (int i = 0; i < 3; i++)
        if (large[i])
            expect_eq_u64(check_window(large[i], 20 * MiB, 0x30 + i, s[i]), 0);
    cca_snapshot_t *snap = NULL;
    expect_ok(cca_snapshot(&snap));
    if (snap) {
        expect_eq_u64(snap->segment_count, 6);
        for (size_t i = 0; i < snap->segment_count; i++)
            expect_true(snap->segments[i].is_expandable);
        cca_snapshot_free(snap);
    }
    for (int i = 0; i < 3; i++) {
        expect_ok(cca_free(small[i]));
        expect_ok(cca_free(large[i]));
    }
    expect_ok(cca_empty_cache());
    for (int i = 0; i < 3; i++)
        cudaStreamDestroy(s[i]);
    teardown();
}

/*
 * compact_memory: a hole in one stream's segment moves to another stream's
 * growth (no new memory: cudaMemGetInfo unchanged within a granule); the
 * moved granules hold the new block's data and the blocks around the hole
 * keep theirs.
 */
TEST(compact_moves_a_hole_to_another_stream)
{
    if (!setup("compact_memory:True"))
        return;
    cudaStream_t s1 = new_stream(), s2 = new_stream();
    char *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    expect_ok(cca_malloc((void **)&a, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&b, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&c, 10 * MiB, (cca_stream_t)s1));
    if (a && b && c) {
        expect_true(cudaMemsetAsync(a, 0x21, 10 * MiB, s1) == cudaSuccess);
        expect_true(cudaMemsetAsync(b, 0x22, 10 * MiB, s1) == cudaSuccess);
        expect_true(cudaMemsetAsync(c, 0x23, 10 * MiB, s1) == cudaSuccess);
    }
    expect_ok(cca_free(b)); /* queued work on s1 still uses it: the move waits for s1 */
    cca_device_stats_t before, after;
    expect_ok(cca_get_device_stats(0, &before));
    size_t free_before, free_after, total;
    expect_ok(cca_mem_get_info(0, &free_before, &total));
    expect_ok(cca_malloc((void **)&d, 8 * MiB, (cca_stream_t)s2));
    expect_ok(cca_get_device_stats(0, &after));
    expect_ok(cca_mem_get_info(0, &free_after, &total));
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, before.reserved_bytes[CCA_STAT_ALL].current);
    expect_true(free_after + 2 * MiB >= free_before);
    if (d && a && c) {
        expect_true(cudaMemsetAsync(d, 0x44, 8 * MiB, s2) == cudaSuccess);
        expect_eq_u64(check_window(d, 4096, 0x44, s2), 0);
        expect_eq_u64(check_window(d, 8 * MiB - 4096, 0x44, s2), 0);
        expect_eq_u64(check_window(a, 10 * MiB - 4096, 0x21, s1), 0);
        expect_eq_u64(check_window(c, 4096, 0x23, s1), 0);
    }
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_ok(cca_free(a));
    expect_ok(cca_free(c));
    expect_ok(cca_free(d));
    expect_ok(cca_empty_cache());
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    teardown();
}

/*
 * A gate on a stream: a host function queued on it that returns only once the
 * test opens the gate, so the stream's work stays pending (its events
 * incomplete) for as long as a test needs, whatever the GPU's speed.
 */
static atomic_int gate_open;

static void CUDART_CB gate_wait(void *arg)
{
    (void)arg;
    while (!atomic_load(&gate_open)) {
    }
}

static void gate_close(cudaStream_t s)
{
    atomic_store(&gate_open, 0);
    expect_true(cudaLaunchHostFunc(s, gate_wait, NULL) == cudaSuccess);
}

static void gate_release(void)
{
    atomic_store(&gate_open, 1);
}

/* cca's own counters of compact_memory's moves (cca_memory_stats_extra). */
static void compact_counts(int64_t *moves, int64_t *pending)
{
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(0, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    expect_true(!strcmp(extra[4].key, "cca.compact_pending_growths"));
    expect_true(!strcmp(extra[8].key, "cca.compact_syncs"));
    *moves = extra[3].value;
    *pending = extra[4].value;
    expect_eq_i64(extra[8].value, 0); /* no event call failed: never a synchronisation */
}

/*
 * compact_memory with the owning stream busy: s1 still writes the freed
 * block b (a queue of memsets held behind a gate the test opens later) when
 * s2's growth wants b's granules. The
 * growth does not wait: it maps new memory (reserved grows, no move) and
 * leaves b's granules in place, s1's queued memsets end without an error
 * (none hit unmapped memory), the blocks around the hole keep s1's data.
 * Then, with s1 idle, the next growth sees s1's event complete and moves
 * the granules (reserved unchanged), which hold s2's data.
 */
TEST(compact_moves_after_the_owning_streams_event)
{
    if (!setup("compact_memory:True"))
        return;
    cudaStream_t s1 = new_stream(), s2 = new_stream();
    char *a = NULL, *b = NULL, *c = NULL, *d = NULL, *e = NULL, *f = NULL;
    expect_ok(cca_malloc((void **)&a, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&b, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&c, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&e, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&f, 10 * MiB, (cca_stream_t)s1));
    if (!(a && b && c && e && f)) {
        teardown();
        return;
    }
    expect_true(cudaMemsetAsync(a, 0x21, 10 * MiB, s1) == cudaSuccess);
    expect_true(cudaMemsetAsync(c, 0x23, 10 * MiB, s1) == cudaSuccess);
    expect_true(cudaMemsetAsync(f, 0x25, 10 * MiB, s1) == cudaSuccess);
    for (int i = 0; i < 128; i++) /* about 1.3 GB of writes */
        expect_true(cudaMemsetAsync(b, i & 0xff, 10 * MiB, s1) == cudaSuccess);
    gate_close(s1); /* s1 stays busy until the gate opens */
    expect_ok(cca_free(b));
    int64_t moves0, pending0, moves1, pending1, moves2, pending2;
    compact_counts(&moves0, &pending0);
    cca_device_stats_t before, after;
    expect_ok(cca_get_device_stats(0, &before));
    expect_ok(cca_malloc((void **)&d, 8 * MiB, (cca_stream_t)s2));
    expect_ok(cca_get_device_stats(0, &after));
    compact_counts(&moves1, &pending1);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current,
                  before.reserved_bytes[CCA_STAT_ALL].current + (int64_t)(8 * MiB));
    expect_true(moves1 == moves0);
    expect_true(pending1 == pending0 + 1);
    printf("  busy stream: %lld move, %lld growth past pending granules (new memory, no wait)\n",
           (long long)(moves1 - moves0), (long long)(pending1 - pending0));
    if (d) {
        expect_true(cudaMemsetAsync(d, 0x44, 8 * MiB, s2) == cudaSuccess);
        expect_eq_u64(check_window(d, 4096, 0x44, s2), 0);
        expect_eq_u64(check_window(d, 8 * MiB - 4096, 0x44, s2), 0);
    }
    gate_release();
    expect_true(cudaStreamSynchronize(s1) == cudaSuccess); /* s1's memsets hit no unmapped page */
    expect_eq_u64(check_window(a, 10 * MiB - 4096, 0x21, s1), 0);
    expect_eq_u64(check_window(c, 4096, 0x23, s1), 0);
    /* s1 idle: its event (and a new record covering e) complete: b's granules move */
    expect_ok(cca_free(e));
    char *g = NULL;
    expect_ok(cca_get_device_stats(0, &before));
    expect_ok(cca_malloc((void **)&g, 8 * MiB, (cca_stream_t)s2));
    expect_ok(cca_get_device_stats(0, &after));
    compact_counts(&moves2, &pending2);
    expect_true(moves2 == moves1 + 1);
    expect_true(pending2 == pending1);
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, before.reserved_bytes[CCA_STAT_ALL].current);
    printf("  idle stream: %lld move, %lld growth past pending granules\n", (long long)(moves2 - moves1),
           (long long)(pending2 - pending1));
    if (g) {
        expect_true(cudaMemsetAsync(g, 0x46, 8 * MiB, s2) == cudaSuccess);
        expect_eq_u64(check_window(g, 8 * MiB - 4096, 0x46, s2), 0);
    }
    expect_eq_u64(check_window(f, 4096, 0x25, s1), 0);
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    void *ptrs[] = {a, c, d, f, g};
    for (size_t i = 0; i < 5; i++)
        expect_ok(cca_free(ptrs[i]));
    expect_ok(cca_empty_cache());
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    teardown();
}

/*
 * The owning stream's own growth takes its freed granules while the stream is still
 * writing them: they are mapped at the growth's address too (no new device memory for
 * them, no wait), and the stream's order keeps the old and the new work apart.
 */
TEST(compact_aliases_the_streams_own_pending_granules)
{
    if (!setup("compact_memory:True"))
        return;
    cudaStream_t s1 = new_stream();
    char *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    expect_ok(cca_malloc((void **)&a, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&b, 10 * MiB, (cca_stream_t)s1));
    expect_ok(cca_malloc((void **)&c, 10 * MiB, (cca_stream_t)s1));
    if (!(a && b && c)) {
        teardown();
        return;
    }
    expect_true(cudaMemsetAsync(a, 0x21, 10 * MiB, s1) == cudaSuccess);
    expect_true(cudaMemsetAsync(c, 0x23, 10 * MiB, s1) == cudaSuccess);
    for (int i = 0; i < 128; i++) /* about 1.3 GB of writes into b */
        expect_true(cudaMemsetAsync(b, i & 0xff, 10 * MiB, s1) == cudaSuccess);
    gate_close(s1); /* s1 stays busy until the gate opens: b's granules stay pending */
    expect_ok(cca_free(b));
    int64_t moves0, pending0, moves1, pending1;
    compact_counts(&moves0, &pending0);
    cca_device_stats_t before, after;
    expect_ok(cca_get_device_stats(0, &before));
    expect_ok(cca_malloc((void **)&d, 16 * MiB, (cca_stream_t)s1)); /* b's hole is too small */
    expect_ok(cca_get_device_stats(0, &after));
    compact_counts(&moves1, &pending1);
    /* b's 10 MiB serve the growth, only the other 6 MiB are new */
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current,
                  before.reserved_bytes[CCA_STAT_ALL].current + (int64_t)(6 * MiB));
    expect_true(moves1 == moves0 + 1);
    expect_true(pending1 == pending0);
    gate_release();
    if (d) {
        expect_true(cudaMemsetAsync(d, 0x44, 16 * MiB, s1) == cudaSuccess); /* after b's writes */
        expect_eq_u64(check_window(d, 4096, 0x44, s1), 0);
        expect_eq_u64(check_window(d, 16 * MiB - 4096, 0x44, s1), 0);
    }
    expect_eq_u64(check_window(a, 10 * MiB - 4096, 0x21, s1), 0);
    expect_eq_u64(check_window(c, 4096, 0x23, s1), 0);
    expect_true(cudaDeviceSynchronize() == cudaSuccess); /* no write reached an unmapped page */
    void *ptrs[] = {a, c, d};
    for (size_t i = 0; i < 3; i++)
        expect_ok(cca_free(ptrs[i]));
    expect_ok(cca_empty_cache()); /* the old addresses' mappings go too */
    expect_ok(cca_get_device_stats(0, &after));
    expect_eq_i64(after.reserved_bytes[CCA_STAT_ALL].current, 0);
    cudaStreamDestroy(s1);
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
    RUN(growth_across_granules);
    RUN(empty_cache_unmaps_and_returns_memory);
    RUN(hole_mapped_again);
    RUN(checkpoint_restore_maps_and_unmaps);
    RUN(out_of_memory_with_fraction);
    RUN(streams_and_pools);
    RUN(compact_moves_a_hole_to_another_stream);
    RUN(compact_moves_after_the_owning_streams_event);
    RUN(compact_aliases_the_streams_own_pending_granules);
    return harness_done();
}
