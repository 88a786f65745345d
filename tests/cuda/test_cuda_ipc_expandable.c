/*
 * test_cuda_ipc_expandable.c - blocks of expandable segments shared between
 * two processes on one GPU (fork before any CUDA call), as PyTorch 2.11
 * shares them: each granule's physical memory exported as a POSIX file
 * descriptor, taken by the other process with pidfd_getfd, imported and
 * mapped. A block spanning two granules and two blocks of one granule go one
 * way, a block of the other process back; data written on the device by one
 * process is checked by the other; a free while the other process maps the
 * block is deferred until it closes it; closing twice and a stale handle are
 * refused. Then blocks over more granules than the fixed handle names (21
 * granules of 20 MiB) go both ways through serialized handles
 * (cca_ipc_get_handle_bytes / cca_ipc_open_bytes), checked in every granule.
 * Where the driver cannot make shareable memory the producer gets PyTorch's
 * error and the test is reported skipped. Exits 77 without a GPU.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "harness.h"
#include "internal.h"

static const size_t MiB = 1024 * 1024;
/* Blocks over more granules than cca_ipc_mem_handle_t names: [5, 415) MiB is 21 granules. */
static const size_t MANY = 410 * 1024 * 1024;

static bool setup(void)
{
    setenv("CCA_BACKEND", "cuda", 1);
    setenv("CCA_ALLOC_CONF", "expandable_segments:True", 1);
    cca_status_t st = cca_init();
    if (st != CCA_OK) {
        HARNESS_FAIL("cca_init: %s: %s", cca_status_str(st), cca_last_error()->message);
        return false;
    }
    return true;
}

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

/* Bytes of [p, p + size) that differ from value: 4 KiB in every 20 MiB granule, and the last. */
static size_t granule_mismatches(const void *p, int value, size_t size)
{
    static unsigned char buf[4096];
    size_t bad = 0;
    for (size_t off = 0; off < size; off += 20 * MiB) {
        size_t n = size - off < sizeof(buf) ? size - off : sizeof(buf);
        if (cudaMemcpy(buf, (const char *)p + off, n, cudaMemcpyDeviceToHost) != cudaSuccess)
            return size;
        for (size_t i = 0; i < n; i++)
            bad += buf[i] != (unsigned char)value;
    }
    return bad + device_mismatches(p, value, size);
}

typedef struct msg {
    int tag;
    cca_ipc_mem_handle_t handle[3];
} msg_t;

enum { MSG_HANDLES = 1, MSG_CHILD_WROTE, MSG_PARENT_FREED, MSG_CHILD_CLOSED, MSG_PARENT_DONE,
       MSG_UNSUPPORTED };

static void send_msg(int fd, const msg_t *m)
{
    if (write(fd, m, sizeof(*m)) != (ssize_t)sizeof(*m))
        HARNESS_FAIL("pipe write failed");
}

/* A serialized handle: its length, then its bytes. */
static void send_blob(int fd, const void *bytes, size_t len)
{
    if (write(fd, &len, sizeof(len)) != (ssize_t)sizeof(len) ||
        write(fd, bytes, len) != (ssize_t)len)
        HARNESS_FAIL("pipe write failed");
}

static bool read_all(int fd, void *p, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return true;
}

/* The next serialized handle (malloc'd), its length in *len; NULL on failure. */
static unsigned char *recv_blob(int fd, size_t *len)
{
    unsigned char *b = NULL;
    if (!read_all(fd, len, sizeof(*len)) || *len > 65536 || !(b = malloc(*len)) ||
        !read_all(fd, b, *len)) {
        HARNESS_FAIL("pipe read failed");
        free(b);
        return NULL;
    }
    return b;
}

/* The serialized handle of p (malloc'd), after checking the fixed form refuses it. */
static unsigned char *share_many(void *p, size_t *len)
{
    cca_ipc_mem_handle_t fixed;
    expect_status(cca_ipc_get_handle(p, NULL, &fixed), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cca_ipc_get_handle_bytes");
    expect_ok(cca_ipc_handle_size(p, len));
    expect_true(*len > CCA_IPC_HANDLE_SIZE);
    unsigned char *b = malloc(*len);
    size_t got = 0;
    expect_ok(cca_ipc_get_handle_bytes(p, NULL, b, *len, &got));
    expect_eq_u64(got, *len);
    return b;
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

static void child(int rfd, int wfd)
{
    if (!setup())
        return;
    msg_t m = recv_msg(rfd);
    if (m.tag == MSG_UNSUPPORTED) {
        cca_shutdown();
        return;
    }
    expect_eq_i64(m.tag, MSG_HANDLES);
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    size_t size = 0;
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &big, &size));
    expect_eq_u64(size, 30 * MiB);
    expect_ok(cca_ipc_open(&m.handle[1], NULL, &s1, &size));
    expect_ok(cca_ipc_open(&m.handle[2], NULL, &s2, &size));
    if (!big || !s1 || !s2)
        return;
    expect_eq_u64((uintptr_t)s2 - (uintptr_t)s1, 256 * 1024); /* one mapping of their granule */
    expect_eq_u64(device_mismatches(big, 0x11, 30 * MiB), 0);
    expect_eq_u64(device_mismatches(s1, 0x22, 256 * 1024), 0);
    expect_eq_u64(device_mismatches(s2, 0x33, 256 * 1024), 0);
    expect_true(device_fill(big, 0x44, 30 * MiB)); /* written here, read there */
    void *mine = NULL;
    expect_ok(cca_malloc(&mine, 8 * MiB, NULL));
    expect_true(device_fill(mine, 0x55, 8 * MiB));
    msg_t out = {MSG_CHILD_WROTE, {{{0}}}};
    expect_ok(cca_ipc_get_handle(mine, NULL, &out.handle[0]));
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_FREED);
    expect_eq_u64(device_mismatches(big, 0x44, 30 * MiB), 0); /* still mapped and intact */
    expect_ok(cca_ipc_close(s1));
    expect_ok(cca_ipc_close(s2));
    expect_ok(cca_ipc_close(big));
    expect_status(cca_ipc_close(big), CCA_ERR_INVALID_POINTER);
    void *again = NULL;
    expect_status(cca_ipc_open(&m.handle[0], NULL, &again, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_free(mine)); /* deferred: the parent maps it */
    out.tag = MSG_CHILD_CLOSED;
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_DONE);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    /* serialized handles: the parent's block over 21 granules, then one of ours */
    size_t len = 0;
    unsigned char *h = recv_blob(rfd, &len);
    void *many = NULL;
    if (h)
        expect_ok(cca_ipc_open_bytes(h, len, NULL, &many, &size));
    free(h);
    if (!many)
        return;
    expect_eq_u64(size, MANY);
    expect_eq_u64(granule_mismatches(many, 0x66, MANY), 0);
    expect_true(device_fill(many, 0x77, MANY));
    void *mine_many = NULL;
    expect_ok(cca_malloc(&mine_many, MANY, NULL));
    expect_true(device_fill(mine_many, 0x88, MANY));
    h = share_many(mine_many, &len);
    send_blob(wfd, h, len);
    free(h);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_FREED);
    expect_eq_u64(granule_mismatches(mine_many, 0x99, MANY), 0); /* written there */
    expect_eq_u64(granule_mismatches(many, 0x77, MANY), 0);      /* freed there: still mapped */
    expect_ok(cca_ipc_close(many));
    expect_ok(cca_free(mine_many)); /* the parent closed it: not deferred */
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    out.tag = MSG_CHILD_CLOSED;
    send_msg(wfd, &out);
    cca_shutdown();
}

TEST(expandable_blocks_shared_both_ways)
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
        child(down[0], up[1]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    if (!setup())
        return;
    void *pad = NULL, *big = NULL, *s1 = NULL, *s2 = NULL;
    /* 30 MiB after 5 MiB: two granules of the large pool hold it */
    expect_ok(cca_malloc(&pad, 5 * MiB, NULL));
    expect_ok(cca_malloc(&big, 30 * MiB, NULL));
    expect_ok(cca_malloc(&s1, 256 * 1024, NULL));
    expect_ok(cca_malloc(&s2, 256 * 1024, NULL));
    expect_true(device_fill(big, 0x11, 30 * MiB));
    expect_true(device_fill(s1, 0x22, 256 * 1024));
    expect_true(device_fill(s2, 0x33, 256 * 1024));
    msg_t m = {MSG_HANDLES, {{{0}}}};
    cca_status_t st = cca_ipc_get_handle(big, NULL, &m.handle[0]);
    if (st == CCA_ERR_NOT_SUPPORTED) {
        printf("SKIPPED: %s\n", cca_last_error()->message);
        m.tag = MSG_UNSUPPORTED;
        send_msg(down[1], &m);
    } else {
        expect_ok(st);
        expect_ok(cca_ipc_get_handle(s1, NULL, &m.handle[1]));
        expect_ok(cca_ipc_get_handle(s2, NULL, &m.handle[2]));
        send_msg(down[1], &m);
        m = recv_msg(up[0]);
        expect_eq_i64(m.tag, MSG_CHILD_WROTE);
        expect_eq_u64(device_mismatches(big, 0x44, 30 * MiB), 0);
        void *theirs = NULL;
        size_t size = 0;
        expect_ok(cca_ipc_open(&m.handle[0], NULL, &theirs, &size));
        expect_eq_u64(size, 8 * MiB);
        if (theirs)
            expect_eq_u64(device_mismatches(theirs, 0x55, 8 * MiB), 0);
        cca_device_stats_t st0, st1;
        expect_ok(cca_get_device_stats(0, &st0));
        expect_ok(cca_free(big));
        expect_ok(cca_free(s1));
        expect_ok(cca_free(s2));
        expect_ok(cca_get_device_stats(0, &st1));
        expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current,
                      st0.allocated_bytes[CCA_STAT_ALL].current);
        msg_t freed = {MSG_PARENT_FREED, {{{0}}}};
        send_msg(down[1], &freed);
        m = recv_msg(up[0]);
        expect_eq_i64(m.tag, MSG_CHILD_CLOSED);
        size_t pending = 9;
        expect_ok(cca_ipc_collect(&pending));
        expect_eq_u64(pending, 0);
        expect_ok(cca_get_device_stats(0, &st1));
        expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current, (int64_t)(5 * MiB));
        if (theirs)
            expect_ok(cca_ipc_close(theirs));
        msg_t done = {MSG_PARENT_DONE, {{{0}}}};
        send_msg(down[1], &done);
        /* serialized handles of blocks over 21 granules, both ways */
        void *many = NULL;
        expect_ok(cca_malloc(&many, MANY, NULL));
        expect_true(device_fill(many, 0x66, MANY));
        size_t len = 0;
        unsigned char *h = share_many(many, &len);
        send_blob(down[1], h, len);
        free(h);
        h = recv_blob(up[0], &len);
        void *theirs_many = NULL;
        if (h)
            expect_ok(cca_ipc_open_bytes(h, len, NULL, &theirs_many, &size));
        free(h);
        expect_eq_u64(granule_mismatches(many, 0x77, MANY), 0);
        if (theirs_many) {
            expect_eq_u64(size, MANY);
            expect_eq_u64(granule_mismatches(theirs_many, 0x88, MANY), 0);
            expect_true(device_fill(theirs_many, 0x99, MANY));
            expect_ok(cca_ipc_close(theirs_many));
        }
        expect_ok(cca_get_device_stats(0, &st0));
        expect_ok(cca_free(many)); /* the child maps it: deferred */
        expect_ok(cca_get_device_stats(0, &st1));
        expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current,
                      st0.allocated_bytes[CCA_STAT_ALL].current);
        send_msg(down[1], &freed);
        m = recv_msg(up[0]);
        expect_eq_i64(m.tag, MSG_CHILD_CLOSED);
        expect_ok(cca_ipc_collect(&pending));
        expect_eq_u64(pending, 0);
        expect_ok(cca_get_device_stats(0, &st1));
        expect_eq_i64(st1.allocated_bytes[CCA_STAT_ALL].current, (int64_t)(5 * MiB));
    }
    expect_ok(cca_free(pad));
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    cca_shutdown();
}

int main(void)
{
    /* Probe in a child: CUDA must not be initialised here before fork(). */
    pid_t probe = fork();
    if (probe == 0) {
        int n = 0;
        _exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 1 : 0);
    }
    int status = 0;
    waitpid(probe, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1) {
        printf("SKIPPED: no GPU\n");
        return 77;
    }
    RUN(expandable_blocks_shared_both_ways);
    return harness_done();
}
