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

typedef struct cca_spinlock {
    atomic_int locked;
} cca_spinlock_t;

#define CCA_SPINLOCK_INIT {0}

void cca_spin_lock_slow(cca_spinlock_t *l);

/* One step of waiting for another thread: spin briefly, then yield the CPU (spinlock.c). */
void cca_spin_backoff(unsigned spins);

static inline void cca_spin_init(cca_spinlock_t *l)
{
    atomic_init(&l->locked, 0);
}

static inline void cca_spin_lock(cca_spinlock_t *l)
{
    if (!atomic_exchange_explicit(&l->locked, 1, memory_order_acquire))
        return;
    cca_spin_lock_slow(l);
}

static inline bool cca_spin_trylock(cca_spinlock_t *l)
{
    return !atomic_load_explicit(&l->locked, memory_order_relaxed) &&
           !atomic_exchange_explicit(&l->locked, 1, memory_order_acquire);
}

static inline void cca_spin_unlock(cca_spinlock_t *l)
{
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

/* Monotonic time in nanoseconds; wall-clock time in microseconds. */
uint64_t cca_now_ns(void);
int64_t cca_wall_us(void);

#endif /* CCA_INTERNAL_H */
