/*
 * fuzz_check.h - CHECK(cond, fmt, ...) for the fuzz targets: where cond is
 * false, the target's file, the condition, its line and the message on
 * stderr, then abort() (what libFuzzer, and the corpus replay under ASan,
 * report as a crash).
 */
#ifndef CCA_FUZZ_CHECK_H
#define CCA_FUZZ_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define CHECK(x, ...)                                                                   \
    do {                                                                                \
        if (!(x)) {                                                                     \
            fprintf(stderr, "%s: check failed: %s (line %d): ", __FILE__, #x, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                               \
            fprintf(stderr, "\n");                                                      \
            abort();                                                                    \
        }                                                                               \
    } while (0)

#endif
