/*
 * test_cuda_multigpu.c - several GPUs and processes on real hardware:
 *  - two processes (fork before any CUDA call) share blocks both ways
 *    through cca IPC handles: two blocks of one segment and a large block
 *    one way, a block of the other process (on the second GPU when there is
 *    one) back; data written on the device by one process is checked by the
 *    other; the producer's writes are queued behind a held stream when it
 *    makes the handles, so the consumer's reads are right only if its stream
 *    waits for the producer's IPC event; a free while the other process maps
 *    the block is deferred until it closes it, then collected;
 *  - peer access between GPU 0 and GPU 1 and copies between them
 *    (cca_memcpy_peer_async and a plain device-to-device cudaMemcpy);
 *  - peer access to expandable segments and compact_memory's moved
 *    granules: the driver's access flags for the peer on ranges mapped
 *    before and after peer access was enabled and on granules a move mapped
 *    again, and the peer's copy engine reading and writing them;
 *  - backend:cudaMallocAsync: round trips on streams, record_stream,
 *    statistics from the pool, empty_cache trimming, a memory fraction,
 *    threads on every GPU at once;
 *  - cca_malloc follows the current device changed by cudaSetDevice behind
 *    cca's back (the backend caches it per thread with the current context).
 * Peer tests need two GPUs and are skipped (reported) with one. Exits 77
 * (skipped) without a GPU.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda.h> /* (types only: the driver's functions come through the runtime) */
#include <cuda_runtime_api.h>

#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;
static int gpus;

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
}

/* Set size bytes at p to value on the current device and wait. */
static bool device_fill(void *p, int value, size_t size)
{
    return cudaMemset(p, value, size) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
}

/* Bytes of [p, p + size) that differ from value (first and last 64 KiB). */
static size_t device_mismatches(const void *p, int value, size_t size)
{
    static unsigned char buf[65536];
    size_t bad = 0;
    for (int end = 0; end < 2; end++) {
        size_t n = size < sizeof(buf) ? size : sizeof(buf);
        const char *src = end ? (const char *)p + size - n : p;
        if (cudaMemcpy(buf, src, n, cudaMemcpyDeviceToHost) != cudaSuccess)
            return size;
        for (size_t i = 0; i < n; i++)
            bad += buf[i] != (unsigned char)value;
    }
    return bad;
}

/* ---- two processes ------------------------------------------------------------ */

typedef struct msg {
    int tag;
    cca_ipc_mem_handle_t handle[3];
} msg_t;

static void send_msg(int fd, const msg_t *m)
{
    if (write(fd, m, sizeof(*m)) != (ssize_t)sizeof(*m))
        HARNESS_FAIL("pipe write failed");
}

static msg_t recv_msg(int fd)
{
    msg_t m;
    memset(&m, 0, sizeof(m));
    size_t got = 0;
    while (got < sizeof(m)) {
        ssize_t n = read(fd, (char *)&m + got, sizeof(m) - got);
        if (n <= 0) {
            HARNESS_FAIL("pipe read failed");
            m.tag = -1;
            return m;
        }
        got += (size_t)n;
    }
    return m;
}

enum { MSG_HANDLES = 1, MSG_CHILD_QUEUED, MSG_CHILD_WROTE, MSG_PARENT_FREED, MSG_CHILD_CLOSED,
       MSG_PARENT_DONE };

/* A host function that holds its stream until the gate opens. */
static void CUDART_CB hold_stream(void *arg)
{
    atomic_int *gate = arg;
    while (!atomic_load(gate)) {
    }
}

static void ipc_child(int rfd, int wfd)
{
    if (!setup(NULL))
        return;
    msg_t m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_HANDLES);
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    size_t size = 0;
    cudaStream_t cs = NULL;
    unsigned char *hb = NULL;
    expect_true(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking) == cudaSuccess);
    expect_true(cudaMallocHost((void **)&hb, 3 * 4096) == cudaSuccess);
    expect_ok(cca_ipc_open(&m.handle[0], (cca_stream_t)cs, &big, &size));
    expect_eq_u64(size, 40 * MiB);
    expect_ok(cca_ipc_open(&m.handle[1], (cca_stream_t)cs, &s1, &size));
    expect_ok(cca_ipc_open(&m.handle[2], (cca_stream_t)cs, &s2, &size));
    if (!big || !s1 || !s2 || !hb)
        return;
    /* Queued now, while the producer's writes still wait behind its held stream. */
    expect_true(cudaMemcpyAsync(hb, (char *)big + 40 * MiB - 4096, 4096, cudaMemcpyDeviceToHost, cs) ==
                cudaSuccess);
    expect_true(cudaMemcpyAsync(hb + 4096, s1, 4096, cudaMemcpyDeviceToHost, cs) == cudaSuccess);
    expect_true(cudaMemcpyAsync(hb + 8192, s2, 4096, cudaMemcpyDeviceToHost, cs) == cudaSuccess);
    msg_t queued = {MSG_CHILD_QUEUED, {{{0}}}};
    send_msg(wfd, &queued);
    expect_true(cudaStreamSynchronize(cs) == cudaSuccess);
    size_t early = 0;
    for (int i = 0; i < 4096; i++)
        early += (hb[i] != 0x11) + (hb[4096 + i] != 0x22) + (hb[8192 + i] != 0x33);
    expect_eq_u64(early, 0); /* the consumer's stream waited for the producer's event */
    cudaFreeHost(hb);
    cudaStreamDestroy(cs);
    expect_eq_u64((uintptr_t)s2 - (uintptr_t)s1, 256 * 1024); /* one mapping of their segment */
    expect_eq_u64(device_mismatches(big, 0x11, 40 * MiB), 0);
    expect_eq_u64(device_mismatches(s1, 0x22, 256 * 1024), 0);
    expect_eq_u64(device_mismatches(s2, 0x33, 256 * 1024), 0);
    expect_true(device_fill(big, 0x44, 40 * MiB)); /* written here, read there */
    int other = gpus > 1 ? 1 : 0;
    void *mine = NULL;
    expect_ok(cca_malloc_device(&mine, 8 * MiB, other, NULL));
    expect_true(cudaSetDevice(other) == cudaSuccess);
    expect_true(device_fill(mine, 0x55, 8 * MiB));
    expect_true(cudaSetDevice(0) == cudaSuccess);
    msg_t out = {MSG_CHILD_WROTE, {{{0}}}};
    expect_ok(cca_ipc_get_handle(mine, NULL, &out.handle[0]));
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_FREED);
    expect_eq_u64(device_mismatches(big, 0x44, 40 * MiB), 0); /* still mapped and intact */
    expect_ok(cca_ipc_close(s1));
    expect_ok(cca_ipc_close(s2));
    expect_ok(cca_ipc_close(big));
    expect_ok(cca_free(mine)); /* deferred: the parent maps it */
    out.tag = MSG_CHILD_CLOSED;
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_DONE);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    teardown();
}

TEST(two_processes_share_both_ways)
{
    int down[2], up[2];
    if (pipe(down) || pipe(up)) {
        HARNESS_FAIL("pipe failed");
        return;
    }
    fflush(stdout);
    pid_t pid = fork(); /* before this process touches CUDA: main() only probed in a child */
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        ipc_child(down[0], up[1]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    if (!setup(NULL))
        return;
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    cudaStream_t ps = NULL;
    expect_true(cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking) == cudaSuccess);
    expect_ok(cca_malloc(&big, 40 * MiB, (cca_stream_t)ps));
    expect_ok(cca_malloc(&s1, 256 * 1024, (cca_stream_t)ps));
    expect_ok(cca_malloc(&s2, 256 * 1024, (cca_stream_t)ps));
    /* the writes wait behind a held stream while the handles are made and opened */
    atomic_int gate = 0;
    expect_true(cudaLaunchHostFunc(ps, hold_stream, &gate) == cudaSuccess);
    expect_true(cudaMemsetAsync(big, 0x11, 40 * MiB, ps) == cudaSuccess);
    expect_true(cudaMemsetAsync(s1, 0x22, 256 * 1024, ps) == cudaSuccess);
    expect_true(cudaMemsetAsync(s2, 0x33, 256 * 1024, ps) == cudaSuccess);
    msg_t m = {MSG_HANDLES, {{{0}}}};
    expect_ok(cca_ipc_get_handle(big, (cca_stream_t)ps, &m.handle[0]));
    expect_ok(cca_ipc_get_handle(s1, (cca_stream_t)ps, &m.handle[1]));
    expect_ok(cca_ipc_get_handle(s2, (cca_stream_t)ps, &m.handle[2]));
    send_msg(down[1], &m);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_QUEUED);
    atomic_store(&gate, 1);
    expect_true(cudaStreamSynchronize(ps) == cudaSuccess);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_WROTE);
    expect_eq_u64(device_mismatches(big, 0x44, 40 * MiB), 0);
    void *theirs = NULL;
    size_t size = 0;
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &theirs, &size));
    expect_eq_u64(size, 8 * MiB);
    if (theirs) {
        int dev = gpus > 1 ? 1 : 0;
        expect_true(cudaSetDevice(dev) == cudaSuccess);
        expect_eq_u64(device_mismatches(theirs, 0x55, 8 * MiB), 0);
        expect_true(cudaSetDevice(0) == cudaSuccess);
    }
    cca_device_stats_t st0;
    expect_ok(cca_get_device_stats(0, &st0));
    expect_ok(cca_free(big));
    expect_ok(cca_free(s1));
    expect_ok(cca_free(s2));
    cca_device_stats_t st1;
    expect_ok(cca_get_device_stats(0, &st1));
    expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current, st0.allocated_bytes[CCA_STAT_ALL].current);
    msg_t freed = {MSG_PARENT_FREED, {{{0}}}};
    send_msg(down[1], &freed);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_CLOSED);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_ok(cca_get_device_stats(0, &st1));
    expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_ok(cca_empty_cache());
    if (theirs)
        expect_ok(cca_ipc_close(theirs));
    cudaStreamDestroy(ps);
    msg_t done = {MSG_PARENT_DONE, {{{0}}}};
    send_msg(down[1], &done);
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    teardown();
}

/* ---- peer access ---------------------------------------------------------------- */

static void peer_round(const char *settings)
{
    if (gpus < 2) {
        printf("  (one GPU: peer access not tested)\n");
        return;
    }
    if (!setup(settings))
        return;
    bool can01 = false, can10 = false;
    expect_ok(cca_can_access_peer(0, 1, &can01));
    expect_ok(cca_can_access_peer(1, 0, &can10));
    printf("  peer access 0->1 %s, 1->0 %s\n", can01 ? "yes" : "no", can10 ? "yes" : "no");
    if (can01)
        expect_ok(cca_enable_peer_access(0, 1));
    if (can10)
        expect_ok(cca_enable_peer_access(1, 0));
    int peers[4];
    size_t n = 0;
    expect_ok(cca_peer_access_list(1, peers, 4, &n));
    expect_eq_u64(n, can01 ? 1 : 0);
    const size_t size = 64 * MiB;
    void *a = NULL, *b = NULL, *c = NULL;
    expect_ok(cca_malloc_device(&a, size, 0, NULL));
    expect_ok(cca_malloc_device(&b, size, 1, NULL));
    expect_ok(cca_malloc_device(&c, size, 0, NULL));
    if (!a || !b || !c)
        goto out;
    expect_true(cudaSetDevice(0) == cudaSuccess);
    expect_true(device_fill(a, 0x5a, size));
    expect_ok(cca_memcpy_peer_async(b, 1, a, 0, size, NULL));
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_true(cudaSetDevice(1) == cudaSuccess);
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_eq_u64(device_mismatches(b, 0x5a, size), 0);
    expect_true(device_fill(b, 0x6b, size));
    /* with peer access a plain device-to-device copy reaches across; it is
     * asynchronous to the host, and device 0's stream does not order after it */
    expect_true(cudaMemcpy(c, b, size, cudaMemcpyDeviceToDevice) == cudaSuccess);
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_true(cudaSetDevice(0) == cudaSuccess);
    expect_eq_u64(device_mismatches(c, 0x6b, size), 0);
out:
    expect_ok(cca_free(a));
    expect_ok(cca_free(b));
    expect_ok(cca_free(c));
    teardown();
}

TEST(peer_copies_native)
{
    peer_round(NULL);
}

TEST(peer_copies_cuda_malloc_async)
{
    peer_round("backend:cudaMallocAsync");
}

/* ---- peer access to expandable segments ------------------------------------------- */

typedef CUresult (*mem_get_access_fn)(unsigned long long *flags, const CUmemLocation *location,
                                      CUdeviceptr ptr);

/* The driver's cuMemGetAccess, or NULL. */
static mem_get_access_fn mem_get_access(void)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuMemGetAccess", &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuMemGetAccess", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn)
        return NULL;
    mem_get_access_fn f = NULL;
    memcpy(&f, &fn, sizeof(fn));
    return f;
}

/* Whether device may read and write the virtual memory mapping at p (cuMemGetAccess). */
static bool device_has_access(mem_get_access_fn get, const void *p, int device)
{
    unsigned long long flags = 0;
    CUmemLocation where = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device};
    return get(&flags, &where, (CUdeviceptr)(uintptr_t)p) == CUDA_SUCCESS &&
           flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
}

/* Bytes of [p, p + size) that differ from value, read on the host through p's own device. */
static size_t mismatches_on(const void *p, int value, size_t size, int device)
{
    expect_true(cudaSetDevice(device) == cudaSuccess);
    return device_mismatches(p, value, size);
}

/*
 * GPU 1's copy engine reads p (on GPU 0) into its own buffer and writes
 * value into p: both go through the peer mapping. Returns whether both
 * copies completed with the right bytes.
 */
static bool peer_round_trip(void *p, int value, size_t size, void *scratch1, cudaStream_t s1)
{
    expect_true(cudaSetDevice(1) == cudaSuccess);
    bool ok = cudaMemcpyAsync(scratch1, p, size, cudaMemcpyDeviceToDevice, s1) == cudaSuccess &&
              cudaStreamSynchronize(s1) == cudaSuccess;
    ok = ok && cudaMemsetAsync(scratch1, value, size, s1) == cudaSuccess &&
         cudaMemcpyAsync(p, scratch1, size, cudaMemcpyDeviceToDevice, s1) == cudaSuccess &&
         cudaStreamSynchronize(s1) == cudaSuccess;
    return ok && mismatches_on(p, value, size, 0) == 0;
}

/* cca.compact_moves (cca_memory_stats_extra). */
static int64_t compact_moves(int device)
{
    cca_stat_entry_t extra[CCA_MEMORY_STATS_EXTRA_COUNT];
    expect_ok(cca_memory_stats_extra(device, extra, CCA_MEMORY_STATS_EXTRA_COUNT));
    for (size_t i = 0; i < CCA_MEMORY_STATS_EXTRA_COUNT; i++)
        if (!strcmp(extra[i].key, "cca.compact_moves"))
            return extra[i].value;
    HARNESS_FAIL("no cca.compact_moves key");
    return -1;
}

/*
 * GPU 0's expandable segments under peer access from GPU 1: a block mapped
 * before cca_enable_peer_access(1, 0) gets GPU 1's access then (PyTorch's
 * addPeer), one mapped after gets it at its map, and, with compact_memory,
 * granules a growth moved from a hole of another stream's segment get it at
 * their new address. The driver's access flags say so, and GPU 1's copy
 * engine reads and writes each block through the peer mapping.
 */
static void peer_expandable_round(const char *settings, bool compact)
{
    if (gpus < 2) {
        printf("  (one GPU: peer access not tested)\n");
        return;
    }
    mem_get_access_fn get = mem_get_access();
    if (!get) {
        HARNESS_FAIL("no cuMemGetAccess from the driver");
        return;
    }
    if (!setup(settings))
        return;
    bool can10 = false;
    expect_ok(cca_can_access_peer(1, 0, &can10));
    if (!can10) {
        printf("  (GPU 1 cannot access GPU 0: not tested)\n");
        teardown();
        return;
    }
    const size_t size = 10 * MiB;
    expect_true(cudaSetDevice(0) == cudaSuccess);
    cudaStream_t a0 = NULL, b0 = NULL, s1 = NULL;
    expect_true(cudaStreamCreateWithFlags(&a0, cudaStreamNonBlocking) == cudaSuccess);
    expect_true(cudaStreamCreateWithFlags(&b0, cudaStreamNonBlocking) == cudaSuccess);
    char *before = NULL, *hole = NULL, *after = NULL, *moved = NULL;
    void *scratch1 = NULL;
    expect_ok(cca_malloc_device((void **)&before, size, 0, (cca_stream_t)a0));
    expect_ok(cca_malloc_device((void **)&hole, size, 0, (cca_stream_t)a0));
    expect_true(before && hole);
    if (!before || !hole)
        goto out;
    expect_false(device_has_access(get, before, 1)); /* no peer yet */
    expect_ok(cca_enable_peer_access(1, 0));
    expect_true(device_has_access(get, before, 1));
    expect_true(device_has_access(get, hole, 1));
    expect_ok(cca_malloc_device((void **)&after, size, 0, (cca_stream_t)a0));
    expect_true(after && device_has_access(get, after, 1));
    expect_true(device_has_access(get, after, 0));
    /* compact_memory: the hole's granules move to another stream's growth */
    int64_t moves0 = compact_moves(0);
    expect_true(cudaStreamSynchronize(a0) == cudaSuccess);
    expect_ok(cca_free(hole));
    hole = NULL;
    expect_ok(cca_malloc_device((void **)&moved, 8 * MiB, 0, (cca_stream_t)b0));
    expect_true(moved != NULL);
    if (compact)
        expect_true(compact_moves(0) > moves0);
    else
        expect_eq_i64(compact_moves(0), moves0);
    expect_true(moved && device_has_access(get, moved, 1) && device_has_access(get, moved, 0));
    expect_true(cudaSetDevice(1) == cudaSuccess);
    expect_true(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
    expect_ok(cca_malloc_device(&scratch1, size, 1, (cca_stream_t)s1));
    if (!scratch1 || !after || !moved)
        goto out;
    expect_true(peer_round_trip(before, 0x31, size, scratch1, s1));
    expect_true(peer_round_trip(after, 0x32, size, scratch1, s1));
    expect_true(peer_round_trip(moved, 0x33, 8 * MiB, scratch1, s1));
    /* the blocks beside the moved granules kept their bytes */
    expect_eq_u64(mismatches_on(before, 0x31, size, 0), 0);
    expect_eq_u64(mismatches_on(after, 0x32, size, 0), 0);
out:
    expect_true(cudaSetDevice(0) == cudaSuccess);
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_ok(cca_free(before));
    expect_ok(cca_free(hole));
    expect_ok(cca_free(after));
    expect_ok(cca_free(moved));
    expect_ok(cca_free(scratch1));
    expect_ok(cca_empty_cache());
    cudaStreamDestroy(a0);
    cudaStreamDestroy(b0);
    if (s1) {
        expect_true(cudaSetDevice(1) == cudaSuccess);
        cudaStreamDestroy(s1);
        expect_true(cudaSetDevice(0) == cudaSuccess);
    }
    teardown();
}

TEST(peer_access_expandable_segments)
{
    peer_expandable_round("expandable_segments:True", false);
}

TEST(peer_access_compact_moves)
{
    peer_expandable_round("compact_memory:True", true);
}

/* ---- backend:cudaMallocAsync ------------------------------------------------------ */

TEST(cuda_malloc_async_backend)
{
    if (!setup("backend:cudaMallocAsync"))
        return;
    cudaStream_t s1 = NULL, s2 = NULL;
    expect_true(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking) == cudaSuccess);
    expect_true(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking) == cudaSuccess);
    const size_t sizes[] = {1, 4096, MiB + 1, 20 * MiB, 200 * MiB};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        void *p = NULL;
        expect_ok(cca_malloc(&p, sizes[i], (cca_stream_t)s1));
        if (!p)
            continue;
        expect_true(cudaMemsetAsync(p, 0x70 + (int)i, sizes[i], s1) == cudaSuccess);
        expect_true(cudaStreamSynchronize(s1) == cudaSuccess);
        expect_eq_u64(device_mismatches(p, 0x70 + (int)i, sizes[i]), 0);
        expect_ok(cca_free(p));
    }
    /* used on a second stream: freed through the unifying stream */
    void *p = NULL;
    expect_ok(cca_malloc(&p, 32 * MiB, (cca_stream_t)s1));
    expect_true(cudaMemsetAsync(p, 1, 32 * MiB, s2) == cudaSuccess);
    expect_ok(cca_record_stream(p, (cca_stream_t)s2));
    cca_device_stats_t st;
    expect_ok(cca_get_device_stats(0, &st));
    expect_true(st.allocated_bytes[CCA_STAT_ALL].current >= (int64_t)(32 * MiB));
    expect_true(st.reserved_bytes[CCA_STAT_ALL].current >= st.allocated_bytes[CCA_STAT_ALL].current);
    expect_ok(cca_free(p));
    expect_true(cudaDeviceSynchronize() == cudaSuccess);
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.allocated_bytes[CCA_STAT_ALL].current, 0);
    expect_true(st.reserved_bytes[CCA_STAT_ALL].current > 0); /* the release threshold keeps it */
    size_t free_before = 0, free_after = 0, total = 0;
    expect_ok(cca_mem_get_info(0, &free_before, &total));
    expect_ok(cca_empty_cache());
    expect_ok(cca_get_device_stats(0, &st));
    expect_eq_i64(st.reserved_bytes[CCA_STAT_ALL].current, 0);
    expect_ok(cca_mem_get_info(0, &free_after, &total));
    expect_true(free_after > free_before);
    /* a memory fraction is a hard limit */
    expect_ok(cca_set_memory_fraction(0.05, 0));
    void *big = NULL;
    expect_status(cca_malloc(&big, total / 10, (cca_stream_t)s1), CCA_ERR_OUT_OF_MEMORY);
    expect_contains(cca_last_error()->message, "would exceed allowed memory");
    expect_ok(cca_set_memory_fraction(1.0, 0));
    cudaStreamDestroy(s1);
    cudaStreamDestroy(s2);
    teardown();
}

static atomic_int thread_errors;

static void *async_worker(void *arg)
{
    int device = (int)(intptr_t)arg % gpus;
    if (cca_set_device(device) != CCA_OK || cudaSetDevice(device) != cudaSuccess) {
        atomic_fetch_add(&thread_errors, 1);
        return NULL;
    }
    cudaStream_t s = NULL;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        atomic_fetch_add(&thread_errors, 1);
        return NULL;
    }
    void *live[16] = {0};
    for (int i = 0; i < 2000; i++) {
        int k = i % 16;
        if (live[k] && cca_free(live[k]) != CCA_OK)
            atomic_fetch_add(&thread_errors, 1);
        live[k] = NULL;
        size_t size = (size_t)((i * 7919) % (4 * 1024 * 1024)) + 1;
        if (cca_malloc(&live[k], size, (cca_stream_t)s) != CCA_OK ||
            cudaMemsetAsync(live[k], k, size, s) != cudaSuccess)
            atomic_fetch_add(&thread_errors, 1);
    }
    for (int k = 0; k < 16; k++)
        if (live[k] && cca_free(live[k]) != CCA_OK)
            atomic_fetch_add(&thread_errors, 1);
    if (cudaStreamSynchronize(s) != cudaSuccess)
        atomic_fetch_add(&thread_errors, 1);
    cudaStreamDestroy(s);
    return NULL;
}

static void threads_on_every_gpu(const char *settings)
{
    if (!setup(settings))
        return;
    atomic_store(&thread_errors, 0);
    pthread_t t[8];
    for (int i = 0; i < 8; i++)
        pthread_create(&t[i], NULL, async_worker, (void *)(intptr_t)i);
    for (int i = 0; i < 8; i++)
        pthread_join(t[i], NULL);
    expect_eq_i64(atomic_load(&thread_errors), 0);
    for (int d = 0; d < gpus; d++) {
        cca_device_stats_t st;
        expect_ok(cca_get_device_stats(d, &st));
        expect_eq_i64(st.allocated_bytes[CCA_STAT_ALL].current, 0);
    }
    teardown();
}

TEST(threads_on_every_gpu_native)
{
    threads_on_every_gpu(NULL);
}

TEST(threads_on_every_gpu_cuda_malloc_async)
{
    threads_on_every_gpu("backend:cudaMallocAsync");
}

/* The device of the block cca_malloc returned, from the driver. */
static int device_of(void *p)
{
    struct cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess)
        return -1;
    return attr.device;
}

static void *fresh_thread_alloc(void *arg)
{
    int *device = arg;
    void *p = NULL;
    /* no cudaSetDevice on this thread: no current context, cudaGetDevice's device 0 */
    if (cca_malloc(&p, 4096, NULL) == CCA_OK) {
        *device = device_of(p);
        cca_free(p);
    }
    return NULL;
}

/*
 * cca_malloc allocates on the current device, which cca caches per thread
 * with the current context: a change made by cudaSetDevice behind cca's back,
 * in either order and back, is followed at the next call; a thread that never
 * chose a device gets device 0.
 */
TEST(current_device_follows_cuda_set_device)
{
    if (!setup(NULL))
        return;
    for (int round = 0; round < 3; round++)
        for (int g = 0; g < gpus; g++) {
            int d = round == 1 ? gpus - 1 - g : g;
            expect_true(cudaSetDevice(d) == cudaSuccess);
            void *p = NULL;
            expect_ok(cca_malloc(&p, 1 << 20, NULL));
            expect_eq_i64(device_of(p), d);
            int cur = -1;
            expect_ok(cca_get_device(&cur));
            expect_eq_i64(cur, d);
            expect_ok(cca_free(p));
        }
    expect_true(cudaSetDevice(gpus - 1) == cudaSuccess);
    int fresh = -1;
    pthread_t t;
    pthread_create(&t, NULL, fresh_thread_alloc, &fresh);
    pthread_join(t, NULL);
    expect_eq_i64(fresh, 0);
    expect_true(cudaSetDevice(0) == cudaSuccess);
    teardown();
}

int main(void)
{
    /* Probe in a child: CUDA must not be initialised here before fork(). */
    pid_t probe = fork();
    if (probe == 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1)
            _exit(0);
        _exit(n > 100 ? 100 : n);
    }
    int status = 0;
    waitpid(probe, &status, 0);
    gpus = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
    if (gpus < 1) {
        printf("SKIPPED: no GPU\n");
        return 77;
    }
    printf("%d GPU(s)\n", gpus);
    RUN(two_processes_share_both_ways);
    RUN(peer_copies_native);
    RUN(peer_copies_cuda_malloc_async);
    RUN(peer_access_expandable_segments);
    RUN(peer_access_compact_moves);
    RUN(cuda_malloc_async_backend);
    RUN(threads_on_every_gpu_native);
    RUN(threads_on_every_gpu_cuda_malloc_async);
    RUN(current_device_follows_cuda_set_device);
    return harness_done();
}
