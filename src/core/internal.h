/*
 * internal.h - declarations shared between cca's source files, grouped by the
 * file that defines them. Nothing here is part of the public interface.
 */
#ifndef CCA_INTERNAL_H
#define CCA_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cca.h"
#include "cca_backend.h"

/* ---- sizes ---------------------------------------------------------------- */

#define CCA_KiB ((size_t)1024)
#define CCA_MiB ((size_t)1024 * 1024)
#define CCA_GiB ((size_t)1024 * 1024 * 1024)
/* Requests of 1 EB or more fail as in PyTorch. */
#define CCA_MAX_REQUEST ((size_t)1 << 60)

#define CCA_MAX_DEVICES 64

/* ---- error.c ---------------------------------------------------------------- */

/*
 * Record an error in the calling thread's last-error record and return status.
 * The one place errors are raised: put a breakpoint on cca_raise_at.
 */
cca_status_t cca_raise_at(const char *file, int line, cca_status_t status, long backend_code,
                          const char *fmt, ...) __attribute__((format(printf, 5, 6)));
cca_status_t cca_raise_vat(const char *file, int line, cca_status_t status, long backend_code,
                           const char *fmt, va_list ap);
#define cca_raise(status, ...) cca_raise_at(__FILE__, __LINE__, (status), 0, __VA_ARGS__)
#define cca_raise_backend(status, code, ...) \
    cca_raise_at(__FILE__, __LINE__, (status), (code), __VA_ARGS__)

/* Put the calling thread's last-error record back as saved (a copy of *cca_last_error()):
 * for a path that meets a failure it recovers from, so that the caller's call, which
 * succeeds, leaves the record as it found it. */
void cca_error_restore(const cca_error_t *saved);

/* Write text to the registered output sink. */
void cca_output(const char *text);
void cca_outputf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- assertions (mimalloc-style levels, CCA_DEBUG = 0..3) -------------------- */

#ifndef CCA_DEBUG
#define CCA_DEBUG 0
#endif

void cca_assert_fail(const char *expr, const char *file, int line, const char *func);

#if CCA_DEBUG >= 1
#define cca_assert(x) ((x) ? (void)0 : cca_assert_fail(#x, __FILE__, __LINE__, __func__))
#else
#define cca_assert(x) ((void)0)
#endif
#if CCA_DEBUG >= 2
#define cca_assert_internal(x) cca_assert(x)
#else
#define cca_assert_internal(x) ((void)0)
#endif
#if CCA_DEBUG >= 3
#define cca_assert_expensive(x) cca_assert(x)
#else
#define cca_assert_expensive(x) ((void)0)
#endif

/* ---- spinlock.c: a small lock for short critical sections on hot paths ---- */

#include <stdatomic.h>

/*
 * A lock may be biased to one thread (cca_spin_bias): that thread then takes
 * and releases it with plain stores, no atomic read-modify-write and no
 * fence. Its busy flag is read by any other thread, which takes the lock
 * word, revokes the bias for good (revoked, then membarrier(2): every
 * thread of the process passes a full barrier, which orders the owner's
 * store of busy before its load of revoked, the other half of Dekker's
 * handshake) and waits for busy to drop. From then on every thread, the
 * owner too, takes the lock word. Without membarrier no lock is biased.
 */
typedef struct cca_spinlock {
    atomic_int locked;           /* the lock word: every thread but a bias owner's */
    atomic_int busy;             /* the bias owner is inside (only it writes it) */
    atomic_int revoked;          /* the bias is gone for good */
    _Atomic(const void *) owner; /* the thread biased to (cca_thread_token), or NULL */
} cca_spinlock_t;

#define CCA_SPINLOCK_INIT {0, 0, 0, NULL}

/*
 * Thread-local variables read on every allocation. The build asks for TLS
 * descriptors where the compiler has them (-mtls-dialect=gnu2): in a shared
 * library, the address then comes from a call that keeps every register
 * (no spills around it) and returns at once for a library loaded at start-up;
 * in a program linked with libcca.a, from one %fs-relative load.
 */
#define CCA_THREAD_HOT _Thread_local

/*
 * Internal variables read on the hot paths: hidden, so that the compiler
 * addresses them directly (one load, no GOT entry) in the shared library too.
 * The version script keeps them out of libcca.so's exports either way.
 */
#define CCA_HIDDEN __attribute__((visibility("hidden")))

/* An address of the calling thread's own, for nothing but telling threads apart. */
extern CCA_HIDDEN CCA_THREAD_HOT char cca_thread_token;

void cca_spin_lock_slow(cca_spinlock_t *l);
/* A thread not the owner holds the lock word of a biased lock not yet revoked: revoke the
 * bias, wait for the owner to leave. */
void cca_spin_bias_take(cca_spinlock_t *l);
/* Bias l to the calling thread, if the system allows (the lock is not yet shared). */
void cca_spin_bias(cca_spinlock_t *l);
/* Whether locks are biased at all (membarrier(2) registered); false for good once disabled. */
bool cca_spin_bias_available(void);
/* No new bias (the tests' switch, and what a failed registration leaves). */
void cca_spin_bias_disable(void);
/* Tests: every membarrier(2) call fails while on, as after a seccomp filter that refuses it
 * was installed; revocations fall back to a barrier through the scheduler. */
void cca_spin_test_fail_membarrier(bool on);

/* One step of waiting for another thread: spin briefly, then yield the CPU (spinlock.c). */
void cca_spin_backoff(unsigned spins);

static inline void cca_spin_init(cca_spinlock_t *l)
{
    atomic_init(&l->locked, 0);
    atomic_init(&l->busy, 0);
    atomic_init(&l->revoked, 0);
    atomic_init(&l->owner, NULL);
}

/* The owner of a biased lock enters without the lock word, unless the bias is revoked. */
static inline __attribute__((always_inline)) bool cca_spin_bias_enter(cca_spinlock_t *l)
{
    if (atomic_load_explicit(&l->revoked, memory_order_relaxed))
        return false;
    atomic_store_explicit(&l->busy, 1, memory_order_relaxed);
    /* no fence here: a revoker's membarrier stands for it (see above) */
    atomic_signal_fence(memory_order_seq_cst);
    if (!atomic_load_explicit(&l->revoked, memory_order_acquire))
        return true;
    atomic_store_explicit(&l->busy, 0, memory_order_release);
    return false;
}

/* Enter l at once and without a call, for paths that fall back to another when it fails:
 * as the owner of its bias (CCA_SPIN_BIASED), or through the lock word of a lock biased to
 * nobody, or whose bias is revoked, that nobody holds (CCA_SPIN_WORD). 0: nothing taken (a
 * lock biased to another thread is left to cca_spin_lock, which revokes the bias). Leave
 * with cca_spin_leave and the way it was entered. */
enum { CCA_SPIN_BIASED = 1, CCA_SPIN_WORD = 2 };
static inline __attribute__((always_inline)) int cca_spin_tryenter(cca_spinlock_t *l)
{
    const void *owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (owner && owner == &cca_thread_token && cca_spin_bias_enter(l))
        return CCA_SPIN_BIASED;
    if (owner && !atomic_load_explicit(&l->revoked, memory_order_acquire))
        return 0;
    return !atomic_load_explicit(&l->locked, memory_order_relaxed) &&
                   !atomic_exchange_explicit(&l->locked, 1, memory_order_acquire)
               ? CCA_SPIN_WORD
               : 0;
}

static inline __attribute__((always_inline)) void cca_spin_leave(cca_spinlock_t *l, int entered)
{
    atomic_store_explicit(entered == CCA_SPIN_BIASED ? &l->busy : &l->locked, 0, memory_order_release);
}

/* cca_spin_lock that says how it entered (CCA_SPIN_BIASED or CCA_SPIN_WORD): a caller that
 * keeps the answer leaves with cca_spin_leave, without cca_spin_unlock's questions (the
 * owner, the thread's token, busy). */
static inline __attribute__((always_inline)) int cca_spin_enter(cca_spinlock_t *l)
{
    const void *owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (owner && owner == &cca_thread_token && cca_spin_bias_enter(l))
        return CCA_SPIN_BIASED;
    if (atomic_exchange_explicit(&l->locked, 1, memory_order_acquire))
        cca_spin_lock_slow(l);
    /* once revoked, the revoker waited for the owner under this lock word: nobody is inside */
    if (owner && !atomic_load_explicit(&l->revoked, memory_order_relaxed))
        cca_spin_bias_take(l);
    return CCA_SPIN_WORD;
}

static inline __attribute__((always_inline)) void cca_spin_lock(cca_spinlock_t *l)
{
    (void)cca_spin_enter(l);
}

static inline __attribute__((always_inline)) bool cca_spin_trylock(cca_spinlock_t *l)
{
    const void *owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (owner && owner == &cca_thread_token && cca_spin_bias_enter(l))
        return true;
    if (atomic_load_explicit(&l->locked, memory_order_relaxed) ||
        atomic_exchange_explicit(&l->locked, 1, memory_order_acquire))
        return false;
    /* once revoked, the revoker waited for the owner under this lock word: nobody is inside */
    if (owner && !atomic_load_explicit(&l->revoked, memory_order_relaxed))
        cca_spin_bias_take(l);
    return true;
}

static inline __attribute__((always_inline)) void cca_spin_unlock(cca_spinlock_t *l)
{
    const void *owner = atomic_load_explicit(&l->owner, memory_order_relaxed);
    if (owner && owner == &cca_thread_token && atomic_load_explicit(&l->busy, memory_order_relaxed))
        atomic_store_explicit(&l->busy, 0, memory_order_release);
    else
        atomic_store_explicit(&l->locked, 0, memory_order_release);
}

/* ---- util.c ------------------------------------------------------------------- */

/* A growable string buffer that never allocates through cca. */
typedef struct cca_strbuf {
    char *data;   /* NUL-terminated once anything was appended */
    size_t len;   /* bytes used, without the NUL */
    size_t cap;   /* bytes allocated */
    bool failed;  /* an append ran out of memory; the text is truncated */
} cca_strbuf_t;

void sb_init(cca_strbuf_t *sb);
void sb_free(cca_strbuf_t *sb);
void sb_append(cca_strbuf_t *sb, const char *text);
void sb_appendn(cca_strbuf_t *sb, const char *text, size_t n);
void sb_printf(cca_strbuf_t *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Append text as a JSON string literal, quotes included. */
void sb_json_string(cca_strbuf_t *sb, const char *text);

/* Parse a byte size such as "80G", "512M", "4096" (K/M/G/T, binary). */
bool cca_parse_bytes(const char *text, size_t *bytes);

/*
 * A zero-filled array of bytes that grows without copying: on Linux its own
 * mapping, grown in place or moved by remapping (pages never touched are
 * never faulted in, and the old content is not copied); elsewhere realloc and
 * memset. *data NULL and *bytes 0 start an empty one. cca_zarray_grow makes
 * room for at least need bytes (false when out of memory: the array is left
 * as it was); cca_zarray_free releases it (bytes: its current size).
 */
bool cca_zarray_grow(void **data, size_t *bytes, size_t need);
void cca_zarray_free(void *data, size_t bytes);

/*
 * A test countdown: set to n, the n-th call of cca_countdown_hit from then on
 * returns true (once), as the n-th host allocation failing would; 0: never.
 * Used by the failure hooks of the tests.
 */
static inline bool cca_countdown_hit(_Atomic long *countdown)
{
    long n = atomic_load_explicit(countdown, memory_order_relaxed);
    while (n > 0 && !atomic_compare_exchange_weak_explicit(countdown, &n, n - 1, memory_order_relaxed,
                                                           memory_order_relaxed))
        ;
    return n == 1;
}

/* Monotonic time in nanoseconds; wall-clock time in microseconds. */
uint64_t cca_now_ns(void);
int64_t cca_wall_us(void);

#endif /* CCA_INTERNAL_H */
