/*
 * test_ipc.c - device memory shared between processes on the simulated
 * backend. Its `ipc_shared` mode puts every allocation in shared memory that
 * another process maps through an IPC handle (as cudaIpcOpenMemHandle maps
 * the producer's allocation), so two processes made with fork() really share
 * the bytes: data is written and checked in both directions, a segment is
 * mapped once for several blocks, a block freed by its owner while the other
 * process maps it is kept until that process closes it (and then collected
 * explicitly or by the out-of-memory path). Blocks of expandable segments
 * are shared as PyTorch 2.11 shares them (each granule's physical memory
 * exported as a file descriptor, taken with pidfd_getfd, imported and mapped
 * by the other process), in both directions with the same checks, plus
 * faults on every backend call of the consumer. A block over many more
 * granules than the fixed handle names (51 granules of 2 MiB) is shared both
 * ways through serialized handles (cca_ipc_get_handle_bytes /
 * cca_ipc_open_bytes), with truncated, padded and altered handles refused and
 * faults at granules past the head's. Also: misuse, faults, and the
 * cudaMallocAsync backend's refusal.
 */
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "device.h"
#include "harness.h"
#include "ipc.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static cca_backend_t *sim;

static void setup(bool shared, size_t cap, const char *settings)
{
    cca_sim_config_t cfg = {0};
    cfg.devices = 2;
    cfg.total_memory = 1ull << 30;
    cfg.memory_cap = cap;
    cfg.backed = shared;
    cfg.ipc_shared = shared;
    cca_shutdown();
    if (cca_sim_create(&cfg, &sim) != CCA_OK || cca_init_with_backend(sim, settings) != CCA_OK) {
        printf("cannot set up: %s\n", cca_last_error()->message);
        exit(1);
    }
}

static int64_t allocated(int device)
{
    cca_device_stats_t s;
    cca_get_device_stats(device, &s);
    return s.allocated_bytes[CCA_STAT_ALL].current;
}

static void fill(void *p, size_t n, unsigned seed)
{
    unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)(i * 31 + seed);
}

static size_t mismatches(const void *p, size_t n, unsigned seed)
{
    const unsigned char *b = p;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += b[i] != (unsigned char)(i * 31 + seed);
    return bad;
}

/* Messages between the two processes: a tag and, for handles, the handle. */
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

enum { MSG_HANDLES = 1, MSG_CHILD_WROTE, MSG_PARENT_FREED, MSG_CHILD_CLOSED, MSG_PARENT_DONE };

/* The child: opens the parent's blocks, writes into one, shares its own. */
static void child(int rfd, int wfd)
{
    setup(true, 0, "");
    msg_t m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_HANDLES);
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    size_t size = 0;
    uint64_t opens = cca_sim_call_count(sim, CCA_OP_IPC_OPEN);
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &big, &size));
    expect_eq_u64(size, 40 * MiB);
    expect_eq_u64(mismatches(big, 40 * MiB, 1), 0);
    expect_ok(cca_ipc_open(&m.handle[1], NULL, &s1, &size));
    expect_eq_u64(size, 256 * KiB);
    expect_ok(cca_ipc_open(&m.handle[2], NULL, &s2, &size));
    expect_eq_u64(mismatches(s1, 256 * KiB, 2), 0);
    expect_eq_u64(mismatches(s2, 256 * KiB, 3), 0);
    /* two blocks of one segment: the segment is mapped once */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_IPC_OPEN), opens + 2);
    expect_eq_u64((uintptr_t)s2 - (uintptr_t)s1, 256 * KiB);
    /* a handle stands for one reference: a second open is refused */
    void *again = NULL;
    expect_status(cca_ipc_open(&m.handle[1], NULL, &again, NULL), CCA_ERR_INVALID_ARGUMENT);
    /* the other way: write into the parent's block, share a block of ours */
    fill(big, 40 * MiB, 9);
    void *mine = NULL;
    expect_ok(cca_malloc(&mine, 3 * MiB, NULL));
    fill(mine, 3 * MiB, 5);
    msg_t out = {MSG_CHILD_WROTE, {{{0}}}};
    expect_ok(cca_ipc_get_handle(mine, NULL, &out.handle[0]));
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_FREED);
    /* the parent freed `big`: still mapped and intact here */
    expect_eq_u64(mismatches(big, 40 * MiB, 9), 0);
    expect_eq_u64(ipc_open_count(), 3);
    expect_ok(cca_ipc_close(s1));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_IPC_CLOSE), 0); /* s2 keeps the segment */
    expect_ok(cca_ipc_close(s2));
    expect_ok(cca_ipc_close(big));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_IPC_CLOSE), 2);
    expect_status(cca_ipc_close(big), CCA_ERR_INVALID_POINTER);
    expect_eq_u64(ipc_open_count(), 0);
    /* our own block, still mapped by the parent: the free waits */
    int64_t before = allocated(0);
    expect_ok(cca_free(mine));
    expect_eq_i64(allocated(0), before);
    out.tag = MSG_CHILD_CLOSED;
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_DONE);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), before - (int64_t)(3 * MiB));
    cca_shutdown();
}

TEST(two_processes_share_both_ways)
{
    int down[2], up[2];
    if (pipe(down) || pipe(up)) {
        HARNESS_FAIL("pipe failed");
        return;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        child(down[0], up[1]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    /* a device of 64 MiB: the OOM path has to collect the deferred free */
    setup(true, 64 * MiB, "");
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    expect_ok(cca_malloc(&big, 40 * MiB, NULL));
    expect_ok(cca_malloc(&s1, 256 * KiB, NULL));
    expect_ok(cca_malloc(&s2, 256 * KiB, NULL));
    fill(big, 40 * MiB, 1);
    fill(s1, 256 * KiB, 2);
    fill(s2, 256 * KiB, 3);
    msg_t m = {MSG_HANDLES, {{{0}}}};
    expect_ok(cca_ipc_get_handle(big, NULL, &m.handle[0]));
    expect_ok(cca_ipc_get_handle(s1, NULL, &m.handle[1]));
    expect_ok(cca_ipc_get_handle(s2, NULL, &m.handle[2]));
    send_msg(down[1], &m);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_WROTE);
    /* the child's writes are in our memory */
    expect_eq_u64(mismatches(big, 40 * MiB, 9), 0);
    void *theirs = NULL;
    size_t size = 0;
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &theirs, &size));
    expect_eq_u64(size, 3 * MiB);
    expect_eq_u64(mismatches(theirs, 3 * MiB, 5), 0);
    /* free while the child maps it: deferred, still allocated */
    int64_t before = allocated(0);
    expect_ok(cca_free(big));
    expect_ok(cca_free(s1));
    expect_ok(cca_free(s2));
    expect_eq_i64(allocated(0), before);
    expect_status(cca_free(big), CCA_ERR_INVALID_POINTER); /* a double free stays one */
    size_t pending = 0;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 3);
    msg_t freed = {MSG_PARENT_FREED, {{{0}}}};
    send_msg(down[1], &freed);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_CLOSED);
    /* 40 MiB more fit only once the deferred block is collected and released */
    void *next = NULL;
    cca_status_t st = cca_malloc(&next, 40 * MiB, NULL);
    if (st != CCA_OK)
        printf("  %s\n", cca_last_error()->message);
    expect_ok(st);
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), 40 * MiB);
    expect_ok(cca_free(next));
    expect_ok(cca_ipc_close(theirs));
    msg_t done = {MSG_PARENT_DONE, {{{0}}}};
    send_msg(down[1], &done);
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(down[1]);
    close(up[0]);
}

/* Live reservations and physical handles of the backend. */
static uint64_t vmm_live(void)
{
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    return u.live_reservations * 1000 + u.live_handles;
}

/* The consumer of expandable blocks: faults first, then the same checks as above. */
static void expandable_child(int rfd, int wfd)
{
    setup(true, 0, "expandable_segments:True");
    msg_t m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_HANDLES);
    void *big = NULL, *s1 = NULL, *s2 = NULL;
    size_t size = 0;
    /* every backend call of the opening fails once (per granule: the first or the second
     * of the two): nothing stays, and the handle stays usable */
    static const struct {
        cca_backend_op_t op;
        uint64_t calls;
    } ops[] = {{CCA_OP_VMM_RESERVE, 1}, {CCA_OP_VMM_IMPORT, 2}, {CCA_OP_VMM_MAP, 2},
               {CCA_OP_VMM_RELEASE, 2}, {CCA_OP_VMM_SET_ACCESS, 1}, {CCA_OP_IPC_EVENT_OPEN, 1}};
    uint64_t live = vmm_live();
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
        for (uint64_t nth = 1; nth <= ops[i].calls; nth++) {
            expect_ok(cca_sim_inject_fault(sim, ops[i].op, nth, false, CCA_ERR_BACKEND));
            expect_status(cca_ipc_open(&m.handle[0], NULL, &big, &size), CCA_ERR_BACKEND);
            cca_sim_clear_faults(sim);
            expect_eq_u64(vmm_live(), live);
            expect_eq_u64(ipc_open_count(), 0);
        }
    uint64_t imports = cca_sim_call_count(sim, CCA_OP_VMM_IMPORT);
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &big, &size));
    expect_eq_u64(size, 30 * MiB);
    expect_eq_u64(mismatches(big, 30 * MiB, 1), 0);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_IMPORT), imports + 2); /* two granules */
    expect_ok(cca_ipc_open(&m.handle[1], NULL, &s1, &size));
    expect_eq_u64(size, 256 * KiB);
    expect_ok(cca_ipc_open(&m.handle[2], NULL, &s2, &size));
    expect_eq_u64(mismatches(s1, 256 * KiB, 2), 0);
    expect_eq_u64(mismatches(s2, 256 * KiB, 3), 0);
    /* two blocks of one granule: it is imported and mapped once */
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_IMPORT), imports + 3);
    expect_eq_u64((uintptr_t)s2 - (uintptr_t)s1, 256 * KiB);
    void *again = NULL;
    expect_status(cca_ipc_open(&m.handle[1], NULL, &again, NULL), CCA_ERR_INVALID_ARGUMENT);
    /* the other way: write into the parent's block, share an expandable block of ours */
    fill(big, 30 * MiB, 9);
    void *mine = NULL;
    uint64_t opened = vmm_live();
    expect_ok(cca_malloc(&mine, 3 * MiB, NULL));
    live += vmm_live() - opened; /* our own segment */
    fill(mine, 3 * MiB, 5);
    msg_t out = {MSG_CHILD_WROTE, {{{0}}}};
    expect_ok(cca_ipc_get_handle(mine, NULL, &out.handle[0]));
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_FREED);
    /* the parent freed `big`: its granules stay mapped here, intact */
    expect_eq_u64(mismatches(big, 30 * MiB, 9), 0);
    expect_eq_u64(ipc_open_count(), 3);
    expect_ok(cca_ipc_close(s1));
    expect_ok(cca_ipc_close(s2));
    expect_ok(cca_ipc_close(big));
    expect_status(cca_ipc_close(big), CCA_ERR_INVALID_POINTER); /* closed twice */
    expect_eq_u64(ipc_open_count(), 0);
    expect_eq_u64(vmm_live(), live);
    /* a stale handle: its block was closed here and freed by the parent */
    expect_status(cca_ipc_open(&m.handle[0], NULL, &again, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(vmm_live(), live);
    int64_t before = allocated(0);
    expect_ok(cca_free(mine)); /* mapped by the parent: the free waits */
    expect_eq_i64(allocated(0), before);
    out.tag = MSG_CHILD_CLOSED;
    send_msg(wfd, &out);
    m = recv_msg(rfd);
    expect_eq_i64(m.tag, MSG_PARENT_DONE);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), before - (int64_t)(3 * MiB));
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
    pid_t pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        expandable_child(down[0], up[1]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    setup(true, 0, "expandable_segments:True");
    void *pad = NULL, *big = NULL, *s1 = NULL, *s2 = NULL;
    /* 30 MiB after 5 MiB: two 20 MiB granules hold it, from 5 MiB into the first */
    expect_ok(cca_malloc(&pad, 5 * MiB, NULL));
    expect_ok(cca_malloc(&big, 30 * MiB, NULL));
    expect_ok(cca_malloc(&s1, 256 * KiB, NULL));
    expect_ok(cca_malloc(&s2, 256 * KiB, NULL));
    fill(big, 30 * MiB, 1);
    fill(s1, 256 * KiB, 2);
    fill(s2, 256 * KiB, 3);
    msg_t m = {MSG_HANDLES, {{{0}}}};
    uint64_t exports = cca_sim_call_count(sim, CCA_OP_VMM_EXPORT);
    expect_ok(cca_ipc_get_handle(big, NULL, &m.handle[0]));
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_EXPORT), exports + 2);
    expect_ok(cca_ipc_get_handle(s1, NULL, &m.handle[1]));
    expect_ok(cca_ipc_get_handle(s2, NULL, &m.handle[2]));
    send_msg(down[1], &m);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_WROTE);
    expect_eq_u64(mismatches(big, 30 * MiB, 9), 0);
    void *theirs = NULL;
    size_t size = 0;
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &theirs, &size));
    expect_eq_u64(size, 3 * MiB);
    expect_eq_u64(mismatches(theirs, 3 * MiB, 5), 0);
    /* freed while the child maps them: deferred */
    int64_t before = allocated(0);
    expect_ok(cca_free(big));
    expect_ok(cca_free(s1));
    expect_ok(cca_free(s2));
    expect_eq_i64(allocated(0), before);
    msg_t freed = {MSG_PARENT_FREED, {{{0}}}};
    send_msg(down[1], &freed);
    m = recv_msg(up[0]);
    expect_eq_i64(m.tag, MSG_CHILD_CLOSED);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), 5 * MiB);
    expect_ok(cca_empty_cache()); /* the granules go back; the child's mapping is gone */
    expect_ok(cca_free(pad));
    expect_ok(cca_ipc_close(theirs));
    msg_t done = {MSG_PARENT_DONE, {{{0}}}};
    send_msg(down[1], &done);
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(down[1]);
    close(up[0]);
}

TEST(expandable_export_faults_and_limits)
{
    setup(true, 0, "expandable_segments:True");
    void *p = NULL;
    expect_ok(cca_malloc(&p, 30 * MiB, NULL));
    cca_ipc_mem_handle_t h;
    /* the first or second granule's export fails: no reference is taken */
    for (uint64_t nth = 1; nth <= 2; nth++) {
        expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_EXPORT, nth, false, CCA_ERR_BACKEND));
        expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_BACKEND);
    }
    cca_sim_clear_faults(sim);
    /* a backend that cannot share physical memory: PyTorch's error */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_EXPORT, 1, false, CCA_ERR_NOT_SUPPORTED));
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "expandable_segments:True cannot be shared");
    /* more granules than a handle names */
    void *huge = NULL;
    expect_ok(cca_malloc(&huge, 400 * MiB, NULL));
    expect_status(cca_ipc_get_handle(huge, NULL, &h), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "granules");
    int64_t before = allocated(0);
    expect_ok(cca_free(p)); /* no reference was taken */
    expect_ok(cca_free(huge));
    expect_eq_i64(allocated(0), before - (int64_t)(430 * MiB));
    /* a handle made by this process is refused here, and releasing it frees the block */
    expect_ok(cca_malloc(&p, 3 * MiB, NULL));
    expect_ok(cca_ipc_get_handle(p, NULL, &h));
    void *q = NULL;
    expect_status(cca_ipc_open(&h, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_ipc_release_handle(&h));
    before = allocated(0);
    expect_ok(cca_free(p));
    expect_eq_i64(allocated(0), before - (int64_t)(3 * MiB));
}

/* ---- serialized handles: blocks over more granules than the fixed handle names ---- */

/* compact_memory maps the large pool in 2 MiB granules too (large_segment_size_mb
   cannot go below 11) */
#define MANY_SETTINGS "compact_memory:True"

/* A message of serialized handles: tag, count, then each as (length, bytes). */
typedef struct bytes_msg {
    int tag;
    uint32_t count;
    size_t len[2];
    unsigned char *bytes[2]; /* malloc'd by recv_bytes */
} bytes_msg_t;

static void write_all(int fd, const void *p, size_t n)
{
    if (write(fd, p, n) != (ssize_t)n)
        HARNESS_FAIL("pipe write failed");
}

static bool read_all(int fd, void *p, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, (char *)p + got, n - got);
        if (r <= 0)
            return false;
        got += (size_t)r;
    }
    return true;
}

static void send_bytes(int fd, const bytes_msg_t *m)
{
    write_all(fd, &m->tag, sizeof(m->tag));
    write_all(fd, &m->count, sizeof(m->count));
    for (uint32_t i = 0; i < m->count; i++) {
        write_all(fd, &m->len[i], sizeof(m->len[i]));
        write_all(fd, m->bytes[i], m->len[i]);
    }
}

static bytes_msg_t recv_bytes(int fd)
{
    bytes_msg_t m;
    memset(&m, 0, sizeof(m));
    if (!read_all(fd, &m.tag, sizeof(m.tag)) || !read_all(fd, &m.count, sizeof(m.count)) ||
        m.count > 2) {
        HARNESS_FAIL("pipe read failed");
        m.tag = -1;
        m.count = 0;
        return m;
    }
    for (uint32_t i = 0; i < m.count; i++) {
        if (!read_all(fd, &m.len[i], sizeof(m.len[i])) || m.len[i] > (1u << 20) ||
            !(m.bytes[i] = malloc(m.len[i])) || !read_all(fd, m.bytes[i], m.len[i])) {
            HARNESS_FAIL("pipe read failed");
            m.tag = -1;
            return m;
        }
    }
    return m;
}

static void bytes_msg_free(bytes_msg_t *m)
{
    for (uint32_t i = 0; i < m->count; i++)
        free(m->bytes[i]);
    m->count = 0;
}

/* The serialized handle of p (malloc'd into m's slot i); its granules from the exports made. */
static void share_bytes(void *p, bytes_msg_t *m, uint32_t i, uint64_t *granules)
{
    size_t len = 0, got = 0;
    expect_ok(cca_ipc_handle_size(p, &len));
    m->bytes[i] = malloc(len);
    uint64_t exports = cca_sim_call_count(sim, CCA_OP_VMM_EXPORT);
    expect_ok(cca_ipc_get_handle_bytes(p, NULL, m->bytes[i], len, &got));
    expect_eq_u64(got, len);
    m->len[i] = len;
    if (granules)
        *granules = cca_sim_call_count(sim, CCA_OP_VMM_EXPORT) - exports;
}

enum { BIG_BYTES = 101 * MiB, MINE_BYTES = 61 * MiB };

/* The consumer: malformed handles, faults at granules past the head's, then both ways. */
static void many_child(int rfd, int wfd)
{
    setup(true, 0, MANY_SETTINGS);
    bytes_msg_t m = recv_bytes(rfd);
    expect_eq_i64(m.tag, MSG_HANDLES);
    if (m.tag != MSG_HANDLES)
        return;
    unsigned char *h = m.bytes[0];
    size_t len = m.len[0];
    uint64_t granules = (len - CCA_IPC_HANDLE_SIZE) / 4 + 16;
    expect_true(granules >= 50);
    void *big = NULL, *s1 = NULL;
    size_t size = 0;
    /* truncated, padded, altered (head and tail), too short, NULL: refused, nothing mapped */
    uint64_t live = vmm_live();
    unsigned char *bad = malloc(len + 1);
    memcpy(bad, h, len);
    bad[len] = 0;
    expect_status(cca_ipc_open_bytes(h, len - 4, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "truncated");
    expect_status(cca_ipc_open_bytes(bad, len + 1, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_open_bytes(h, CCA_IPC_HANDLE_SIZE, NULL, &big, &size),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_open_bytes(h, 100, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_open_bytes(NULL, len, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    bad[len - 3] ^= 0x10; /* a descriptor of the tail */
    expect_status(cca_ipc_open_bytes(bad, len, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "corrupt");
    memcpy(bad, h, len);
    bad[40] ^= 1; /* the head */
    expect_status(cca_ipc_open_bytes(bad, len, NULL, &big, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_release_handle_bytes(bad, len), CCA_ERR_INVALID_ARGUMENT);
    free(bad);
    expect_eq_u64(vmm_live(), live);
    /* a fault at the first granule, one past the head's, and the last: nothing stays */
    uint64_t nths[3] = {1, 17, granules};
    cca_backend_op_t ops[3] = {CCA_OP_VMM_IMPORT, CCA_OP_VMM_MAP, CCA_OP_VMM_RELEASE};
    for (int o = 0; o < 3; o++)
        for (int k = 0; k < 3; k++) {
            expect_ok(cca_sim_inject_fault(sim, ops[o], nths[k], false, CCA_ERR_BACKEND));
            expect_status(cca_ipc_open_bytes(h, len, NULL, &big, &size), CCA_ERR_BACKEND);
            cca_sim_clear_faults(sim);
            expect_eq_u64(vmm_live(), live);
            expect_eq_u64(ipc_open_count(), 0);
        }
    uint64_t imports = cca_sim_call_count(sim, CCA_OP_VMM_IMPORT);
    expect_ok(cca_ipc_open_bytes(h, len, NULL, &big, &size));
    expect_eq_u64(size, BIG_BYTES);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_IMPORT), imports + granules);
    expect_eq_u64(mismatches(big, BIG_BYTES, 1), 0);
    /* a fixed-size handle's bytes open through either entry point */
    expect_eq_u64(m.len[1], CCA_IPC_HANDLE_SIZE);
    cca_ipc_mem_handle_t fixed;
    memcpy(fixed.bytes, m.bytes[1], CCA_IPC_HANDLE_SIZE);
    expect_ok(cca_ipc_open(&fixed, NULL, &s1, &size));
    expect_eq_u64(size, 256 * KiB);
    expect_eq_u64(mismatches(s1, 256 * KiB, 2), 0);
    void *again = NULL;
    expect_status(cca_ipc_open_bytes(m.bytes[1], CCA_IPC_HANDLE_SIZE, NULL, &again, NULL),
                  CCA_ERR_INVALID_ARGUMENT); /* open already */
    /* the other way: write into the parent's block, share a block of ours as large */
    fill(big, BIG_BYTES, 9);
    void *mine = NULL;
    uint64_t before_mine = vmm_live();
    expect_ok(cca_malloc(&mine, MINE_BYTES, NULL));
    live += vmm_live() - before_mine;
    fill(mine, MINE_BYTES, 5);
    bytes_msg_t out = {MSG_CHILD_WROTE, 1, {0, 0}, {NULL, NULL}};
    uint64_t mine_granules = 0;
    share_bytes(mine, &out, 0, &mine_granules);
    expect_true(mine_granules > 16);
    expect_eq_u64(out.len[0], CCA_IPC_HANDLE_SIZE + (mine_granules - 16) * 4);
    send_bytes(wfd, &out);
    bytes_msg_free(&out);
    bytes_msg_t back = recv_bytes(rfd);
    expect_eq_i64(back.tag, MSG_PARENT_FREED);
    /* the parent wrote into ours and closed it; freed its own, which stays mapped here */
    expect_eq_u64(mismatches(mine, MINE_BYTES, 7), 0);
    expect_eq_u64(mismatches(big, BIG_BYTES, 9), 0);
    expect_ok(cca_ipc_close(s1));
    expect_ok(cca_ipc_close(big));
    expect_eq_u64(ipc_open_count(), 0);
    expect_eq_u64(vmm_live(), live);
    int64_t before = allocated(0);
    expect_ok(cca_free(mine)); /* the parent closed it: freed at once */
    expect_eq_i64(allocated(0), before - (int64_t)MINE_BYTES);
    bytes_msg_t closed = {MSG_CHILD_CLOSED, 0, {0, 0}, {NULL, NULL}};
    send_bytes(wfd, &closed);
    bytes_msg_free(&m);
    cca_shutdown();
}

TEST(many_granules_shared_both_ways)
{
    int down[2], up[2];
    if (pipe(down) || pipe(up)) {
        HARNESS_FAIL("pipe failed");
        return;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        many_child(down[0], up[1]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    setup(true, 0, MANY_SETTINGS);
    void *pad = NULL, *big = NULL, *s1 = NULL;
    /* 101 MiB after 3 MiB in 2 MiB granules: [3, 104) MiB, granules 1 to 51 */
    expect_ok(cca_malloc(&pad, 3 * MiB, NULL));
    expect_ok(cca_malloc(&big, BIG_BYTES, NULL));
    expect_ok(cca_malloc(&s1, 256 * KiB, NULL));
    fill(big, BIG_BYTES, 1);
    fill(s1, 256 * KiB, 2);
    /* the fixed handle cannot name the block: the error names the serialized form */
    cca_ipc_mem_handle_t fixed;
    uint64_t exports = cca_sim_call_count(sim, CCA_OP_VMM_EXPORT);
    expect_status(cca_ipc_get_handle(big, NULL, &fixed), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cca_ipc_get_handle_bytes");
    /* a buffer too small: the length needed, nothing exported or taken */
    size_t len = 0, got = 0;
    expect_ok(cca_ipc_handle_size(big, &len));
    unsigned char small[CCA_IPC_HANDLE_SIZE];
    expect_status(cca_ipc_get_handle_bytes(big, NULL, small, sizeof(small), &got),
                  CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(got, len);
    expect_status(cca_ipc_get_handle_bytes(big, NULL, NULL, 0, &got), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_VMM_EXPORT), exports);
    bytes_msg_t m = {MSG_HANDLES, 2, {0, 0}, {NULL, NULL}};
    uint64_t granules = 0;
    share_bytes(big, &m, 0, &granules);
    expect_eq_u64(granules, 51);
    expect_eq_u64(len, CCA_IPC_HANDLE_SIZE + (51 - 16) * 4);
    share_bytes(s1, &m, 1, NULL);
    send_bytes(down[1], &m);
    bytes_msg_free(&m);
    bytes_msg_t in = recv_bytes(up[0]);
    expect_eq_i64(in.tag, MSG_CHILD_WROTE);
    expect_eq_u64(mismatches(big, BIG_BYTES, 9), 0);
    void *theirs = NULL;
    size_t size = 0;
    if (in.count == 1)
        expect_ok(cca_ipc_open_bytes(in.bytes[0], in.len[0], NULL, &theirs, &size));
    expect_eq_u64(size, MINE_BYTES);
    if (theirs) {
        expect_eq_u64(mismatches(theirs, MINE_BYTES, 5), 0);
        fill(theirs, MINE_BYTES, 7);
        expect_ok(cca_ipc_close(theirs));
    }
    bytes_msg_free(&in);
    /* freed while the child maps them: deferred */
    int64_t before = allocated(0);
    expect_ok(cca_free(big));
    expect_ok(cca_free(s1));
    expect_eq_i64(allocated(0), before);
    bytes_msg_t freed = {MSG_PARENT_FREED, 0, {0, 0}, {NULL, NULL}};
    send_bytes(down[1], &freed);
    in = recv_bytes(up[0]);
    expect_eq_i64(in.tag, MSG_CHILD_CLOSED);
    size_t pending = 9;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), 3 * MiB);
    expect_ok(cca_free(pad));
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(down[1]);
    close(up[0]);
}

TEST(many_granules_faults_and_misuse)
{
    setup(true, 0, MANY_SETTINGS);
    void *p = NULL;
    expect_ok(cca_malloc(&p, BIG_BYTES, NULL));
    size_t len = 0, got = 0;
    expect_ok(cca_ipc_handle_size(p, &len));
    unsigned char *buf = malloc(len);
    /* an export fails at the first granule, one past the head's, the last: nothing taken */
    uint64_t granules = (len - CCA_IPC_HANDLE_SIZE) / 4 + 16;
    uint64_t nths[3] = {1, 17, granules};
    for (int k = 0; k < 3; k++) {
        expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_EXPORT, nths[k], false, CCA_ERR_BACKEND));
        expect_status(cca_ipc_get_handle_bytes(p, NULL, buf, len, &got), CCA_ERR_BACKEND);
        cca_sim_clear_faults(sim);
    }
    /* the event fails: nothing taken either */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_IPC_EVENT_CREATE, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_ipc_get_handle_bytes(p, NULL, buf, len, &got), CCA_ERR_BACKEND);
    cca_sim_clear_faults(sim);
    /* a handle of this process: refused here; released through its bytes */
    expect_ok(cca_ipc_get_handle_bytes(p, NULL, buf, len, &got));
    void *q = NULL;
    expect_status(cca_ipc_open_bytes(buf, len, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "this process");
    expect_status(cca_ipc_release_handle_bytes(buf, len - 1), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_ipc_release_handle_bytes(buf, len));
    int64_t before = allocated(0);
    expect_ok(cca_free(p)); /* no reference left: freed at once */
    expect_eq_i64(allocated(0), before - (int64_t)BIG_BYTES);
    /* argument errors */
    int x;
    expect_status(cca_ipc_handle_size(&x, &len), CCA_ERR_INVALID_POINTER);
    expect_status(cca_ipc_handle_size(NULL, &len), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_malloc(&p, MiB, NULL));
    expect_status(cca_ipc_handle_size(p, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_get_handle_bytes(p, NULL, buf, len, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_get_handle_bytes((char *)p + 512, NULL, buf, len, &got),
                  CCA_ERR_INVALID_POINTER);
    /* a small-pool block: the fixed length, one granule */
    expect_ok(cca_ipc_handle_size(p, &len));
    expect_eq_u64(len, CCA_IPC_HANDLE_SIZE);
    expect_ok(cca_free(p));
    free(buf);
}

TEST(misuse)
{
    setup(false, 0, "");
    char *p = NULL;
    cca_ipc_mem_handle_t h;
    int x;
    expect_status(cca_ipc_get_handle(&x, NULL, &h), CCA_ERR_INVALID_POINTER);
    expect_ok(cca_malloc((void **)&p, MiB, NULL));
    expect_status(cca_ipc_get_handle(p + 512, NULL, &h), CCA_ERR_INVALID_POINTER);
    expect_status(cca_ipc_get_handle(p, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_get_handle(NULL, NULL, &h), CCA_ERR_INVALID_ARGUMENT);
    expect_ok(cca_ipc_get_handle(p, NULL, &h));
    void *q = NULL;
    expect_status(cca_ipc_open(&h, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT); /* our own */
    expect_contains(cca_last_error()->message, "this process");
    cca_ipc_mem_handle_t bad = h;
    bad.bytes[40] ^= 1;
    expect_status(cca_ipc_open(&bad, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "corrupt");
    memset(&bad, 0, sizeof(bad));
    expect_status(cca_ipc_open(&bad, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_open(NULL, NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_open(&h, NULL, NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_ipc_close(&x), CCA_ERR_INVALID_POINTER);
    /* nobody released the handle: the free is deferred, a second one is a double free */
    int64_t before = allocated(0);
    expect_ok(cca_free(p));
    expect_eq_i64(allocated(0), before);
    expect_status(cca_free(p), CCA_ERR_INVALID_POINTER);
    size_t pending = 0;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 1);
    /* shutdown forgets it; a new state starts clean */
    setup(false, 0, "");
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
}

TEST(unshared_blocks_free_at_once)
{
    setup(false, 0, "");
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, NULL));
    /* the backend's handle fails: no reference is taken */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_IPC_GET, 1, false, CCA_ERR_BACKEND));
    cca_ipc_mem_handle_t h;
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_BACKEND);
    /* the event cannot be made or recorded: no reference either, no event left */
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_IPC_EVENT_CREATE, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_BACKEND);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_EVENT_RECORD, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_BACKEND);
    cca_sim_usage_t u;
    expect_ok(cca_sim_usage(sim, &u));
    expect_eq_u64(u.live_events, 0);
    int64_t before = allocated(0);
    expect_ok(cca_free(p));
    expect_eq_i64(allocated(0), before - (int64_t)MiB);
}

TEST(expandable_segments_refuse)
{
    setup(false, 0, "expandable_segments:True");
    void *p = NULL;
    expect_ok(cca_malloc(&p, 3 * MiB, NULL));
    cca_ipc_mem_handle_t h;
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "expandable_segments:True cannot be shared");
    int64_t before = allocated(0);
    expect_ok(cca_free(p)); /* no reference was taken */
    expect_eq_i64(allocated(0), before - (int64_t)(3 * MiB));
    /* switched off at run time: new segments can be shared */
    expect_ok(cca_set_settings("expandable_segments:False"));
    expect_ok(cca_malloc(&p, 3 * MiB, NULL));
    expect_ok(cca_ipc_get_handle(p, NULL, &h));
    expect_ok(cca_ipc_release_handle(&h));
    expect_ok(cca_free(p));
}

TEST(async_backend_refuses)
{
    setup(false, 0, "backend:cudaMallocAsync");
    void *p = NULL;
    expect_ok(cca_malloc(&p, MiB, NULL));
    cca_ipc_mem_handle_t h;
    memset(&h, 0, sizeof(h));
    expect_status(cca_ipc_get_handle(p, NULL, &h), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cudaMallocAsync does not yet support shareIpcHandle");
    void *q = NULL;
    expect_status(cca_ipc_open(&h, NULL, &q, NULL), CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cudaMallocAsync does not yet support getIpcDevPtr");
    size_t len = 0;
    expect_status(cca_ipc_handle_size(p, &len), CCA_ERR_NOT_SUPPORTED);
    expect_status(cca_ipc_get_handle_bytes(p, NULL, h.bytes, sizeof(h.bytes), &len),
                  CCA_ERR_NOT_SUPPORTED);
    expect_status(cca_ipc_open_bytes(h.bytes, sizeof(h.bytes), NULL, &q, NULL),
                  CCA_ERR_NOT_SUPPORTED);
    expect_contains(cca_last_error()->message, "cudaMallocAsync does not yet support getIpcDevPtr");
    expect_ok(cca_free(p));
}

/* ---- forged handles, a close that fails ---- */

/* The handle's head as src/ipc/ipc.c lays it out, to forge handles whose check holds. */
typedef struct forged_wire {
    char magic[8];
    uint32_t kind;
    int32_t device;
    int32_t ref_pid, ref_fd;
    uint32_t ref_slot, granules;
    uint64_t ref_serial, ticket, offset, size, segment_size;
    unsigned char backend[64], event[64];
    uint64_t check;
} forged_wire_t;

/* The check recomputed over the head's fields (a segment's handle has no tail). */
static void forged_reseal(cca_ipc_mem_handle_t *h)
{
    forged_wire_t w;
    memcpy(&w, h->bytes, sizeof(w));
    uint64_t x = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < offsetof(forged_wire_t, check); i++) {
        x ^= h->bytes[i];
        x *= 0x100000001b3ull;
    }
    w.check = x;
    memcpy(h->bytes, &w, sizeof(w));
}

static void forged_child(int rfd)
{
    setup(true, 0, "");
    msg_t m = recv_msg(rfd);
    void *q = NULL;
    size_t size = 0;
    uint64_t opens = cca_sim_call_count(sim, CCA_OP_IPC_OPEN);
    /* a segment's handle naming granules: its close would take the expandable path */
    cca_ipc_mem_handle_t f = m.handle[0];
    ((forged_wire_t *)f.bytes)->granules = 1;
    forged_reseal(&f);
    expect_status(cca_ipc_open(&f, NULL, &q, &size), CCA_ERR_INVALID_ARGUMENT);
    /* a block that does not fit its segment: the opener would be told to use bytes past it */
    f = m.handle[1];
    forged_wire_t *w = (forged_wire_t *)f.bytes;
    w->size = w->segment_size - w->offset + 1;
    forged_reseal(&f);
    expect_status(cca_ipc_open(&f, NULL, &q, &size), CCA_ERR_INVALID_ARGUMENT);
    /* the head's last byte, past its fields, altered */
    f = m.handle[2];
    f.bytes[CCA_IPC_HANDLE_SIZE - 1] ^= 0x5a;
    expect_status(cca_ipc_open(&f, NULL, &q, &size), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_IPC_OPEN), opens); /* nothing opened */
    expect_eq_u64(ipc_open_count(), 0);
    /* the true handles open, and close with the backend's close */
    for (int i = 0; i < 3; i++) {
        expect_ok(cca_ipc_open(&m.handle[i], NULL, &q, &size));
        expect_eq_u64(size, i == 1 ? MiB / 2 : MiB);
        expect_ok(cca_ipc_close(q));
    }
    expect_eq_u64(ipc_open_count(), 0);
    cca_shutdown();
}

/* Fork a child that runs child(rfd) on the read end of a pipe and exits with its verdict;
 * the parent gets the write end (-1: no pipe, reported). */
static pid_t fork_child(void (*child)(int rfd), int *wfd)
{
    int down[2];
    *wfd = -1;
    if (pipe(down)) {
        HARNESS_FAIL("pipe failed");
        return -1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(down[1]);
        child(down[0]);
        fflush(stdout);
        _exit(harness_current_failed ? 1 : 0);
    }
    close(down[0]);
    *wfd = down[1];
    return pid;
}

/* Wait for the child, which must have passed, and close the pipe. */
static void child_done(pid_t pid, int wfd)
{
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    close(wfd);
}

TEST(forged_handles_refused)
{
    int wfd;
    pid_t pid = fork_child(forged_child, &wfd);
    if (pid < 0)
        return;
    setup(true, 0, "");
    void *p[3];
    msg_t m = {MSG_HANDLES, {{{0}}}};
    for (int i = 0; i < 3; i++) {
        expect_ok(cca_malloc(&p[i], i == 1 ? MiB / 2 : MiB, NULL));
        expect_ok(cca_ipc_get_handle(p[i], NULL, &m.handle[i]));
    }
    send_msg(wfd, &m);
    child_done(pid, wfd);
    for (int i = 0; i < 3; i++)
        expect_ok(cca_free(p[i]));
    cca_ipc_collect(NULL);
}

/* A close whose unmap fails keeps the open (still mapped, its reference held): a second close
 * unmaps and releases it. Before, the open was dropped and the mapping lost. */
static void close_fault_child(int rfd)
{
    setup(true, 0, "expandable_segments:True");
    uint64_t live = vmm_live();
    msg_t m = recv_msg(rfd);
    void *q = NULL;
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &q, NULL));
    expect_true(vmm_live() > live);
    expect_ok(cca_sim_inject_fault(sim, CCA_OP_VMM_UNMAP, 1, false, CCA_ERR_BACKEND));
    expect_status(cca_ipc_close(q), CCA_ERR_BACKEND);
    cca_sim_clear_faults(sim);
    expect_eq_u64(ipc_open_count(), 1);
    expect_ok(cca_ipc_close(q));
    expect_eq_u64(ipc_open_count(), 0);
    expect_eq_u64(vmm_live(), live);
    expect_status(cca_ipc_close(q), CCA_ERR_INVALID_POINTER); /* closed now */
    cca_shutdown();
}

TEST(failed_close_is_retried)
{
    int wfd;
    pid_t pid = fork_child(close_fault_child, &wfd);
    if (pid < 0)
        return;
    setup(true, 0, "expandable_segments:True");
    void *p = NULL;
    msg_t m = {MSG_HANDLES, {{{0}}}};
    expect_ok(cca_malloc(&p, 3 * MiB, NULL));
    expect_ok(cca_ipc_get_handle(p, NULL, &m.handle[0]));
    send_msg(wfd, &m);
    child_done(pid, wfd);
    expect_ok(cca_free(p)); /* the consumer released its reference: freed at once */
    cca_device_stats_t s;
    expect_ok(cca_get_device_stats(0, &s));
    expect_eq_i64(s.allocated_bytes[CCA_STAT_ALL].current, 0);
}

/*
 * A handle whose counter file is some other file the producer holds open (a
 * regular file whose every 16 bytes read as a live counter of the handle's
 * serial) is refused by the opener, at open and at release, and that file is
 * left as it was. Before, the opener mapped whatever the descriptor named, and
 * the close (and the release) decremented a word in it.
 */
static void forged_counter_child(int rfd)
{
    setup(true, 0, "");
    msg_t m = recv_msg(rfd);
    void *q = NULL;
    uint64_t opens = cca_sim_call_count(sim, CCA_OP_IPC_OPEN);
    cca_status_t st = cca_ipc_open(&m.handle[1], NULL, &q, NULL);
    expect_status(st, CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "not a cca counter file");
    if (st == CCA_OK)
        (void)cca_ipc_close(q);
    expect_status(cca_ipc_release_handle(&m.handle[1]), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "not a cca counter file");
    expect_eq_u64(cca_sim_call_count(sim, CCA_OP_IPC_OPEN), opens); /* nothing mapped */
    expect_eq_u64(ipc_open_count(), 0);
    /* the true handle opens and closes */
    expect_ok(cca_ipc_open(&m.handle[0], NULL, &q, NULL));
    expect_ok(cca_ipc_close(q));
    cca_shutdown();
}

TEST(forged_counter_file_refused)
{
    int wfd;
    pid_t pid = fork_child(forged_counter_child, &wfd);
    if (pid < 0)
        return;
    setup(true, 0, "");
    void *p = NULL;
    msg_t m = {MSG_HANDLES, {{{0}}}};
    expect_ok(cca_malloc(&p, MiB, NULL));
    expect_ok(cca_ipc_get_handle(p, NULL, &m.handle[0]));
    forged_wire_t w;
    memcpy(&w, m.handle[0].bytes, sizeof(w));
    /* the other file: 128 KiB of (count 7, the handle's serial) pairs */
    char path[] = "/tmp/cca-test-ipc-XXXXXX";
    int file = mkstemp(path);
    expect_true(file >= 0);
    unlink(path);
    static uint64_t words[128 * KiB / sizeof(uint64_t)];
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i += 2) {
        words[i] = 7;
        words[i + 1] = w.ref_serial;
    }
    expect_eq_i64(pwrite(file, words, sizeof(words), 0), (int64_t)sizeof(words));
    w.ref_fd = file;
    memcpy(m.handle[1].bytes, &w, sizeof(w));
    forged_reseal(&m.handle[1]);
    send_msg(wfd, &m);
    child_done(pid, wfd);
    static uint64_t after[sizeof(words) / sizeof(words[0])];
    expect_eq_i64(pread(file, after, sizeof(after), 0), (int64_t)sizeof(after));
    expect_true(memcmp(after, words, sizeof(words)) == 0);
    close(file);
    expect_ok(cca_free(p)); /* the true handle's reference came back: freed at once */
    expect_eq_i64(allocated(0), 0);
}

/* Another process releases a handle once: a second release, an open after the release and
 * a release after the close are refused, writing nothing (before, each lowered the block's
 * count again, and the free of a block another handle still held completed at once). */
static void repeated_release_child(int rfd)
{
    setup(true, 0, "");
    msg_t m = recv_msg(rfd);
    void *q = NULL;
    expect_ok(cca_ipc_release_handle(&m.handle[0]));
    expect_status(cca_ipc_release_handle(&m.handle[0]), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "released already");
    expect_status(cca_ipc_open(&m.handle[0], NULL, &q, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_u64(ipc_open_count(), 0);
    expect_ok(cca_ipc_open(&m.handle[1], NULL, &q, NULL));
    expect_ok(cca_ipc_close(q));
    expect_status(cca_ipc_release_handle(&m.handle[1]), CCA_ERR_INVALID_ARGUMENT);
    cca_shutdown();
}

TEST(repeated_release_from_another_process)
{
    int wfd;
    pid_t pid = fork_child(repeated_release_child, &wfd);
    if (pid < 0)
        return;
    setup(true, 0, "");
    void *p = NULL;
    msg_t m = {MSG_HANDLES, {{{0}}}};
    expect_ok(cca_malloc(&p, MiB, NULL));
    for (int i = 0; i < 3; i++)
        expect_ok(cca_ipc_get_handle(p, NULL, &m.handle[i]));
    send_msg(wfd, &m);
    child_done(pid, wfd);
    /* the third handle was never sent back: the free waits for it */
    expect_ok(cca_free(p));
    size_t pending = 0;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 1);
    expect_ok(cca_ipc_release_handle(&m.handle[2]));
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), 0);
}

/*
 * A forked child that shuts cca down (a worker done with it) must leave the
 * parent's IPC references alone: it inherits the list of the parent's counter
 * files, and its shutdown gave their slots back, so the parent's free of a
 * block a consumer still held no longer waited.
 */
TEST(forked_child_leaves_parent_references)
{
    setup(true, 0, "");
    void *p = NULL;
    cca_ipc_mem_handle_t h;
    expect_ok(cca_malloc(&p, MiB, NULL));
    expect_ok(cca_ipc_get_handle(p, NULL, &h)); /* one reference, held for a consumer */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        void *q = NULL; /* the child shares a block of its own too: a file of its own */
        cca_ipc_mem_handle_t hq;
        bool ok = cca_malloc(&q, MiB, NULL) == CCA_OK && cca_ipc_get_handle(q, NULL, &hq) == CCA_OK &&
                  cca_ipc_release_handle(&hq) == CCA_OK && cca_free(q) == CCA_OK;
        cca_shutdown();
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    expect_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    int64_t before = allocated(0);
    expect_ok(cca_free(p)); /* the handle still holds the block: the free waits */
    expect_eq_i64(allocated(0), before);
    size_t pending = 0;
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 1);
    expect_ok(cca_ipc_release_handle(&h)); /* the consumer's reference let go */
    expect_ok(cca_ipc_collect(&pending));
    expect_eq_u64(pending, 0);
    expect_eq_i64(allocated(0), before - (int64_t)MiB);
}

int main(void)
{
    RUN(two_processes_share_both_ways);
    RUN(expandable_blocks_shared_both_ways);
    RUN(expandable_export_faults_and_limits);
    RUN(many_granules_shared_both_ways);
    RUN(many_granules_faults_and_misuse);
    RUN(misuse);
    RUN(unshared_blocks_free_at_once);
    RUN(expandable_segments_refuse);
    RUN(async_backend_refuses);
    RUN(forged_handles_refused);
    RUN(failed_close_is_retried);
    RUN(forged_counter_file_refused);
    RUN(repeated_release_from_another_process);
    RUN(forked_child_leaves_parent_references);
    cca_shutdown();
    return harness_done();
}
