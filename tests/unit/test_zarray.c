/*
 * test_zarray.c - the zero-filled array that grows without copying
 * (cca_zarray_grow, core/util.c): it starts zeroed, keeps its content across
 * every growth (in place or moved), zeroes what each growth adds, refuses a
 * size that cannot exist, and frees cleanly at every size.
 */
#include <stdint.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

TEST(grows_zeroed_and_keeps_its_content)
{
    uint8_t *a = NULL;
    size_t bytes = 0;
    expect_true(cca_zarray_grow((void **)&a, &bytes, 1));
    expect_true(a != NULL);
    expect_true(bytes >= 1);
    size_t written = 0;
    for (size_t need = 1; need <= ((size_t)48 << 20); need = need * 3 + 7) {
        expect_true(cca_zarray_grow((void **)&a, &bytes, need));
        expect_true(bytes >= need);
        /* what was written is still there; everything after it is zero */
        bool kept = true, zero = true;
        for (size_t i = 0; i < written; i += 997)
            kept = kept && a[i] == (uint8_t)(i * 31 + 1);
        for (size_t i = written; i < bytes; i += 4093)
            zero = zero && a[i] == 0;
        expect_true(kept);
        expect_true(zero);
        expect_eq_u64(a[bytes - 1], 0);
        for (size_t i = written; i < need; i++)
            a[i] = (uint8_t)(i * 31 + 1);
        written = need;
    }
    /* growing to a size it already has changes nothing */
    uint8_t *before = a;
    size_t had = bytes;
    expect_true(cca_zarray_grow((void **)&a, &bytes, had));
    expect_true(a == before);
    expect_eq_u64(bytes, had);
    cca_zarray_free(a, bytes);
}

TEST(refuses_an_impossible_size)
{
    uint8_t *a = NULL;
    size_t bytes = 0;
    expect_true(cca_zarray_grow((void **)&a, &bytes, 4096));
    a[0] = 7;
    expect_false(cca_zarray_grow((void **)&a, &bytes, SIZE_MAX - 5));
    expect_true(bytes >= 4096);
    expect_eq_u64(a[0], 7); /* left as it was */
    cca_zarray_free(a, bytes);
    cca_zarray_free(NULL, 0);
}

int main(void)
{
    RUN(grows_zeroed_and_keeps_its_content);
    RUN(refuses_an_impossible_size);
    return harness_done();
}
