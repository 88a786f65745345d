/*
 * harness.h - a tiny test harness: named tests, typed expectations, and a
 * closing line "N passed, N failed". Include once per test program.
 *
 *   TEST(name) { expect_eq_u64(1 + 1, 2); }
 *   int main(void) { RUN(name); return harness_done(); }
 */
#ifndef CCA_HARNESS_H
#define CCA_HARNESS_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int harness_passed, harness_failed, harness_current_failed;
static const char *harness_current;

#define TEST(name) static void test_##name(void)

/*
 * Whether RUN runs the test called name: HARNESS_ONLY (a comma-separated list
 * of test names) runs those alone, HARNESS_SKIP all but those, e.g.
 * HARNESS_ONLY=real_traces ./build-asan/unit_test_pickle in the edit loop.
 */
static inline int harness_listed(const char *list, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = list; p && *p;) {
        size_t len = strcspn(p, ",");
        if (len == n && !strncmp(p, name, n))
            return 1;
        p += len + (p[len] == ',');
    }
    return 0;
}
static inline int harness_selected(const char *name)
{
    const char *only = getenv("HARNESS_ONLY"), *skip = getenv("HARNESS_SKIP");
    return (!only || harness_listed(only, name)) && !harness_listed(skip, name);
}

/* The process's CPU time in seconds (every thread), printed after each test where
 * HARNESS_TIMES is set (scripts/test-times.py finds where a program's time goes). */
static inline double harness_cpu_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

#define RUN(name)                                                        \
    do {                                                                 \
        if (!harness_selected(#name))                                    \
            break;                                                       \
        harness_current = #name;                                         \
        harness_current_failed = 0;                                      \
        double cpu_ = harness_cpu_seconds();                             \
        test_##name();                                                   \
        if (harness_current_failed) {                                    \
            harness_failed++;                                            \
            printf("FAIL %s", #name);                                    \
        } else {                                                         \
            harness_passed++;                                            \
            printf("ok   %s", #name);                                    \
        }                                                                \
        if (getenv("HARNESS_TIMES"))                                     \
            printf(" (%.2f s CPU)", harness_cpu_seconds() - cpu_);      \
        printf("\n");                                                    \
        fflush(stdout);                                                  \
    } while (0)

static inline int harness_done(void)
{
    printf("%d passed, %d failed\n", harness_passed, harness_failed);
    return harness_failed ? 1 : 0;
}

#define HARNESS_FAIL(...)                                                \
    do {                                                                 \
        harness_current_failed = 1;                                      \
        printf("  %s:%d: %s: ", __FILE__, __LINE__, harness_current);    \
        printf(__VA_ARGS__);                                             \
        printf("\n");                                                    \
    } while (0)

#define expect_true(x)                                                   \
    do {                                                                 \
        if (!(x)) HARNESS_FAIL("expected true: %s", #x);                 \
    } while (0)
#define expect_false(x) expect_true(!(x))

#define expect_eq_i64(a, b)                                              \
    do {                                                                 \
        int64_t a_ = (int64_t)(a), b_ = (int64_t)(b);                    \
        if (a_ != b_)                                                    \
            HARNESS_FAIL("%s == %s: %" PRId64 " != %" PRId64, #a, #b, a_, b_); \
    } while (0)
#define expect_eq_u64(a, b)                                              \
    do {                                                                 \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                 \
        if (a_ != b_)                                                    \
            HARNESS_FAIL("%s == %s: %" PRIu64 " != %" PRIu64, #a, #b, a_, b_); \
    } while (0)
#define expect_ne_u64(a, b)                                              \
    do {                                                                 \
        uint64_t a_ = (uint64_t)(a), b_ = (uint64_t)(b);                 \
        if (a_ == b_)                                                    \
            HARNESS_FAIL("%s != %s: both %" PRIu64, #a, #b, a_);         \
    } while (0)
#define expect_eq_ptr(a, b)                                              \
    do {                                                                 \
        const void *a_ = (const void *)(a), *b_ = (const void *)(b);     \
        if (a_ != b_) HARNESS_FAIL("%s == %s: %p != %p", #a, #b, a_, b_); \
    } while (0)
#define expect_eq_dbl(a, b)                                              \
    do {                                                                 \
        double a_ = (a), b_ = (b);                                       \
        if (a_ != b_) HARNESS_FAIL("%s == %s: %.17g != %.17g", #a, #b, a_, b_); \
    } while (0)
#define expect_eq_str(a, b)                                              \
    do {                                                                 \
        const char *a_ = (a), *b_ = (b);                                 \
        if (!a_ || !b_ || strcmp(a_, b_) != 0)                           \
            HARNESS_FAIL("%s == %s:\n  \"%s\"\n  \"%s\"", #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)"); \
    } while (0)
#define expect_contains(hay, needle)                                     \
    do {                                                                 \
        const char *h_ = (hay), *n_ = (needle);                          \
        if (!h_ || !strstr(h_, n_))                                      \
            HARNESS_FAIL("%s contains \"%s\": \"%s\"", #hay, n_, h_ ? h_ : "(null)"); \
    } while (0)
/* A cca call expected to return a status. */
#define expect_status(call, st)                                          \
    do {                                                                 \
        int s_ = (int)(call);                                            \
        if (s_ != (int)(st))                                             \
            HARNESS_FAIL("%s: status %d, expected %d (%s)", #call, s_, (int)(st), #st); \
    } while (0)
#define expect_ok(call) expect_status(call, 0)

#endif /* CCA_HARNESS_H */
