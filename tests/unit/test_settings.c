/*
 * test_settings.c - the settings string: tokenizer, every key's values and
 * errors, the roundup list semantics, syntax errors, atomicity, sources and
 * the effective-settings printer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "settings.h"

/* ---- helpers ------------------------------------------------------------------- */

/* Parse text over defaults as an argument; expects success. */
static cca_settings_t parsed(const char *text)
{
    cca_settings_t s;
    settings_default(&s);
    cca_status_t status = settings_parse(&s, text, CCA_SRC_ARGUMENT);
    if (status != CCA_OK)
        HARNESS_FAIL("parse of \"%s\" failed: %s", text, cca_last_error()->message);
    return s;
}

/*
 * Expect text to be rejected over start, with a message holding needle1 and
 * needle2 (may be NULL), and start left byte-for-byte unchanged.
 */
static void expect_bad_over(const cca_settings_t *start, const char *text, const char *needle1,
                            const char *needle2)
{
    cca_settings_t s = *start;
    cca_clear_error();
    cca_status_t status = settings_parse(&s, text, CCA_SRC_ARGUMENT);
    if (status != CCA_ERR_BAD_SETTINGS) {
        HARNESS_FAIL("\"%s\": status %d, expected CCA_ERR_BAD_SETTINGS", text, (int)status);
        return;
    }
    const char *message = cca_last_error()->message;
    if (cca_last_error()->status != CCA_ERR_BAD_SETTINGS)
        HARNESS_FAIL("\"%s\": last error status %d", text, (int)cca_last_error()->status);
    if (needle1 && !strstr(message, needle1))
        HARNESS_FAIL("\"%s\": message lacks \"%s\": %s", text, needle1, message);
    if (needle2 && !strstr(message, needle2))
        HARNESS_FAIL("\"%s\": message lacks \"%s\": %s", text, needle2, message);
    if (memcmp(&s, start, sizeof(s)) != 0)
        HARNESS_FAIL("\"%s\": settings changed by a failed parse", text);
}

static void expect_bad(const char *text, const char *needle1, const char *needle2)
{
    cca_settings_t s;
    settings_default(&s);
    expect_bad_over(&s, text, needle1, needle2);
}

/* The describe line of key ("key value (source)") without its newline. */
static void describe_line(const cca_settings_t *s, cca_setting_key_t key, char *line, size_t size)
{
    cca_strbuf_t sb;
    sb_init(&sb);
    settings_describe(s, &sb);
    line[0] = '\0';
    const char *name = settings_key_name(key);
    size_t name_len = strlen(name);
    for (const char *p = sb.data; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        if (len > name_len && !memcmp(p, name, name_len) && p[name_len] == ' ') {
            snprintf(line, size, "%.*s", (int)len, p);
            break;
        }
        p += len + (nl ? 1 : 0);
    }
    sb_free(&sb);
}

static void expect_divisions(const cca_settings_t *s, const size_t expected[CCA_ROUNDUP_INTERVALS])
{
    for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
        if (s->roundup_power2_divisions[i] != expected[i])
            HARNESS_FAIL("division[%d] = %zu, expected %zu", i, s->roundup_power2_divisions[i],
                         expected[i]);
}

/* ---- defaults, empty input, names ---------------------------------------------- */

TEST(defaults)
{
    cca_settings_t s;
    settings_default(&s);
    expect_eq_u64(s.backend, CCA_BACKEND_NATIVE);
    expect_eq_u64(s.max_split_size, SIZE_MAX);
    expect_eq_u64(s.max_non_split_rounding, 20 * CCA_MiB);
    expect_eq_u64(s.large_segment_size, 20 * CCA_MiB);
    for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
        expect_eq_u64(s.roundup_power2_divisions[i], 0);
    expect_eq_dbl(s.garbage_collection_threshold, 0.0);
    expect_false(s.expandable_segments);
    expect_eq_dbl(s.per_process_memory_fraction, 0.0);
    expect_false(s.release_lock_on_cudamalloc);
    expect_false(s.graph_capture_record_stream_reuse);
    expect_false(s.pinned_use_cuda_host_register);
    expect_eq_u64(s.pinned_num_register_threads, 1);
    expect_false(s.pinned_use_background_threads);
    expect_eq_u64(s.pinned_reserve_segment_size, 0);
    expect_eq_u64(s.pinned_max_round_threshold, SIZE_MAX);
    expect_eq_u64(s.pinned_max_cached_size, SIZE_MAX);
    for (int k = 0; k < CCA_SET_COUNT; k++)
        expect_eq_u64(s.source[k], CCA_SRC_DEFAULT);
}

TEST(empty_and_null_change_nothing)
{
    cca_settings_t start, s;
    settings_default(&start);
    start.expandable_segments = true;
    s = start;
    expect_ok(settings_parse(&s, NULL, CCA_SRC_ARGUMENT));
    expect_true(memcmp(&s, &start, sizeof(s)) == 0);
    expect_ok(settings_parse(&s, "", CCA_SRC_ARGUMENT));
    expect_true(memcmp(&s, &start, sizeof(s)) == 0);
    expect_ok(settings_parse(&s, "  \t\n ", CCA_SRC_ARGUMENT));
    expect_true(memcmp(&s, &start, sizeof(s)) == 0);
    expect_status(settings_parse(NULL, "backend:native", CCA_SRC_ARGUMENT),
                  CCA_ERR_INVALID_ARGUMENT);
}

TEST(key_names_round_trip)
{
    for (int k = 0; k < CCA_SET_COUNT; k++) {
        const char *name = settings_key_name((cca_setting_key_t)k);
        cca_setting_key_t found = CCA_SET_COUNT;
        expect_true(settings_lookup_key(name, strlen(name), &found));
        expect_eq_u64(found, k);
    }
    cca_setting_key_t key;
    expect_false(settings_lookup_key("Backend", 7, &key));
    expect_false(settings_lookup_key("backen", 6, &key));
    expect_true(settings_key_name(CCA_SET_COUNT) != NULL);
    expect_eq_str(settings_source_name(CCA_SRC_DEFAULT), "default");
    expect_eq_str(settings_source_name(CCA_SRC_ENVIRONMENT), "environment");
    expect_eq_str(settings_source_name(CCA_SRC_ARGUMENT), "argument");
}

/* ---- the tokenizer ------------------------------------------------------------- */

TEST(tokenizer_splits)
{
    const char *text = " max_split_size_mb :128,r:[ 256:1 ,>:8]";
    cca_token_t t[32];
    size_t count = 0, bad = 99;
    expect_true(settings_tokenize(text, t, 32, &count, &bad));
    expect_eq_u64(count, 15);
    expect_eq_u64(bad, 99);
    const char *want[] = {"max_split_size_mb", ":", "128", ",", "r", ":", "[", "256",
                          ":", "1", ",", ">", ":", "8", "]"};
    for (size_t i = 0; i < 15 && i < count; i++) {
        char buf[64];
        snprintf(buf, sizeof(buf), "%.*s", (int)t[i].length, text + t[i].offset);
        expect_eq_str(buf, want[i]);
    }
    expect_eq_u64(t[0].offset, 1);
    expect_eq_u64(t[1].offset, 19); /* the ':' after the space */
}

/* PyTorch drops whitespace wherever it is, so whitespace between word
   characters joins them into one word; around punctuation it separates */
TEST(tokenizer_whitespace_joins_words)
{
    cca_token_t t[4];
    size_t count = 0;
    expect_true(settings_tokenize(" 12 34\t5 ", t, 4, &count, NULL));
    expect_eq_u64(count, 1);
    expect_eq_u64(t[0].offset, 1);
    expect_eq_u64(t[0].length, 7);
    expect_true(settings_tokenize("a b : c\nd ,", t, 4, &count, NULL));
    expect_eq_u64(count, 4);
    expect_eq_u64(t[0].length, 3);
    expect_eq_u64(t[2].offset, 6);
    expect_eq_u64(t[2].length, 3);
}

/* A word is read with its inner whitespace dropped, keys and values alike, as
   PyTorch reads it */
TEST(whitespace_inside_words_dropped)
{
    cca_settings_t s = parsed("max_split_size_mb:12 8");
    expect_eq_u64(s.max_split_size, 128 * CCA_MiB);
    s = parsed("max_split_ size_mb:1 024,expandable_segments:Tr ue");
    expect_eq_u64(s.max_split_size, 1024 * CCA_MiB);
    expect_true(s.expandable_segments);
    s = parsed("garbage_collection_threshold:0. 5,backend:nat ive");
    expect_eq_dbl(s.garbage_collection_threshold, 0.5);
    expect_eq_u64(s.backend, CCA_BACKEND_NATIVE);
    const size_t want[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 0};
    s = parsed("roundup_power2_divisions:[2 56:1,5 12:2]");
    expect_divisions(&s, want);
    /* words joined can make a bad value, refused as such */
    expect_bad("roundup_power2_divisions:[256:1 512:2]",
               "'roundup_power2_divisions:[256:1 512:2]'", "divisions have to be power of 2");
    expect_bad("expandable_segments:True False", "'expandable_segments:True False'",
               "True or False");
}

TEST(tokenizer_counts_beyond_max)
{
    cca_token_t t[2];
    memset(t, 0xAB, sizeof(t));
    size_t count = 0;
    expect_true(settings_tokenize("a:b,c:d", t, 1, &count, NULL));
    expect_eq_u64(count, 7);
    expect_eq_u64(t[0].offset, 0);
    expect_eq_u64(t[0].length, 1);
    /* the second slot was not written */
    expect_eq_u64(t[1].offset, ((size_t)-1 / 0xFF) * 0xAB);
    expect_true(settings_tokenize("a:b,c:d", NULL, 0, &count, NULL));
    expect_eq_u64(count, 7);
}

TEST(tokenizer_empty_and_null)
{
    size_t count = 5;
    expect_true(settings_tokenize(NULL, NULL, 0, &count, NULL));
    expect_eq_u64(count, 0);
    count = 5;
    expect_true(settings_tokenize("   ", NULL, 0, &count, NULL));
    expect_eq_u64(count, 0);
}

TEST(tokenizer_bad_character)
{
    cca_token_t t[8];
    size_t count = 0, bad = 0;
    expect_false(settings_tokenize("ab:c@d", t, 8, &count, &bad));
    expect_eq_u64(bad, 4);
    expect_eq_u64(count, 3); /* ab, :, c before the bad character */
    expect_false(settings_tokenize("\"x\"", t, 8, &count, &bad));
    expect_eq_u64(bad, 0);
    expect_false(settings_tokenize("a:\xc3\xa9", t, 8, &count, &bad));
    expect_eq_u64(bad, 2);
}

/* ---- keys -------------------------------------------------------------------- */

TEST(backend_key)
{
    expect_eq_u64(parsed("backend:cudaMallocAsync").backend, CCA_BACKEND_ASYNC);
    expect_eq_u64(parsed("backend:native").backend, CCA_BACKEND_NATIVE);
    expect_eq_u64(parsed("backend:native").source[CCA_SET_BACKEND], CCA_SRC_ARGUMENT);
    expect_bad("backend:foo", "'backend:foo'", "options are native and cudaMallocAsync");
    expect_bad("backend:Native", "'backend:Native'", NULL);
}

TEST(max_split_size_mb_key)
{
    expect_eq_u64(parsed("max_split_size_mb:20").max_split_size, 20 * CCA_MiB);
    expect_eq_u64(parsed("max_split_size_mb:128").max_split_size, 128 * CCA_MiB);
    expect_eq_u64(parsed("max_split_size_mb:00128").max_split_size, 128 * CCA_MiB);
    expect_bad("max_split_size_mb:19", "'max_split_size_mb:19'",
               "max_split_size_mb too small, must be >= 20");
    expect_bad("max_split_size_mb:0", "'max_split_size_mb:0'", "too small");
    expect_bad("max_split_size_mb:12abc", "'max_split_size_mb:12abc'",
               "an integer number of MiB >= large_segment_size_mb");
    expect_bad("max_split_size_mb:-128", "'max_split_size_mb:-128'", "integer");
    expect_bad("max_split_size_mb:+128", "'max_split_size_mb:+128'", "integer");
    expect_bad("max_split_size_mb:1.5", "'max_split_size_mb:1.5'", "integer");
    expect_bad("max_split_size_mb:[20]", "'max_split_size_mb:[20]'", "integer");
    /* more than UINT64_MAX */
    expect_bad("max_split_size_mb:18446744073709551616", "'max_split_size_mb:18446744073709551616'",
               "integer");
    /* the largest exact value, and the first that would overflow bytes: clamped */
    size_t largest = SIZE_MAX / CCA_MiB;
    char text[64];
    snprintf(text, sizeof(text), "max_split_size_mb:%zu", largest);
    expect_eq_u64(parsed(text).max_split_size, largest * CCA_MiB);
    snprintf(text, sizeof(text), "max_split_size_mb:%zu", largest + 1);
    expect_eq_u64(parsed(text).max_split_size, SIZE_MAX);
    expect_eq_u64(parsed("max_split_size_mb:18446744073709551615").max_split_size, SIZE_MAX);
}

TEST(max_non_split_rounding_mb_key)
{
    expect_eq_u64(parsed("max_non_split_rounding_mb:20").max_non_split_rounding, 20 * CCA_MiB);
    expect_eq_u64(parsed("max_non_split_rounding_mb:1024").max_non_split_rounding, CCA_GiB);
    expect_bad("max_non_split_rounding_mb:19", "'max_non_split_rounding_mb:19'",
               "max_non_split_rounding_mb too small, must be >= 20");
    expect_bad("max_non_split_rounding_mb:x", "'max_non_split_rounding_mb:x'", "MiB");
}

/* PyTorch takes any large_segment_size_mb above 10 (kMinLargeAlloc, so that a
   segment holds any request it serves), odd or even */
TEST(large_segment_size_mb_key)
{
    expect_eq_u64(parsed("large_segment_size_mb:11").large_segment_size, 11 * CCA_MiB);
    expect_eq_u64(parsed("large_segment_size_mb:21").large_segment_size, 21 * CCA_MiB);
    expect_eq_u64(parsed("large_segment_size_mb:64").large_segment_size, 64 * CCA_MiB);
    expect_bad("large_segment_size_mb:0", "'large_segment_size_mb:0'", "must be > 10");
    expect_bad("large_segment_size_mb:2", "'large_segment_size_mb:2'", "must be > 10");
    expect_bad("large_segment_size_mb:10", "'large_segment_size_mb:10'", "must be > 10");
    expect_bad("large_segment_size_mb:two", "'large_segment_size_mb:two'", "integer");
}

/* As PyTorch: the smallest max_split_size_mb and max_non_split_rounding_mb is
   large_segment_size_mb (not a fixed 20), and max_non_split_rounding_mb takes
   the value of a large_segment_size_mb given without it */
TEST(split_minimums_follow_large_segment)
{
    cca_settings_t s = parsed("large_segment_size_mb:12,max_split_size_mb:12");
    expect_eq_u64(s.max_split_size, 12 * CCA_MiB);
    s = parsed("max_non_split_rounding_mb:16,large_segment_size_mb:16");
    expect_eq_u64(s.max_non_split_rounding, 16 * CCA_MiB);
    expect_bad("large_segment_size_mb:12,max_split_size_mb:11", "max_split_size_mb:11",
               "must be >= 12");
    expect_bad("large_segment_size_mb:40,max_non_split_rounding_mb:30",
               "max_non_split_rounding_mb:30", "must be >= 40");
    s = parsed("large_segment_size_mb:40");
    expect_eq_u64(s.max_non_split_rounding, 40 * CCA_MiB);
    expect_eq_u64(s.source[CCA_SET_MAX_NON_SPLIT_ROUNDING_MB], CCA_SRC_ARGUMENT);
    s = parsed("large_segment_size_mb:40,max_non_split_rounding_mb:64");
    expect_eq_u64(s.max_non_split_rounding, 64 * CCA_MiB);
    /* a segment size set earlier stays the minimum */
    cca_settings_t env;
    settings_default(&env);
    expect_ok(settings_parse(&env, "large_segment_size_mb:40", CCA_SRC_ENVIRONMENT));
    expect_bad_over(&env, "max_non_split_rounding_mb:30", "must be >= 40", NULL);
    expect_bad_over(&env, "max_split_size_mb:30", "must be >= 40", NULL);
}

TEST(max_split_at_least_large_segment)
{
    /* max_split_size unset (unlimited): any segment size */
    expect_eq_u64(parsed("large_segment_size_mb:128").large_segment_size, 128 * CCA_MiB);
    cca_settings_t s = parsed("max_split_size_mb:64,large_segment_size_mb:64");
    expect_eq_u64(s.max_split_size, 64 * CCA_MiB);
    expect_bad("max_split_size_mb:64,large_segment_size_mb:128", "max_split_size_mb:64",
               "large_segment_size_mb:128");
    /* checked on the whole string, whatever the order */
    expect_bad("large_segment_size_mb:128,max_split_size_mb:64", "max_split_size_mb",
               "large_segment_size_mb");
    /* the default segment size (20) against a small max split: 20 is allowed */
    expect_eq_u64(parsed("max_split_size_mb:20").max_split_size, 20 * CCA_MiB);
    /* checked against the combined result of earlier parses */
    cca_settings_t env;
    settings_default(&env);
    expect_ok(settings_parse(&env, "max_split_size_mb:64", CCA_SRC_ENVIRONMENT));
    expect_bad_over(&env, "large_segment_size_mb:128", "max_split_size_mb",
                    "large_segment_size_mb");
    /* a later value may repair an earlier one in the same string */
    s = parsed("max_split_size_mb:64,large_segment_size_mb:128,max_split_size_mb:256");
    expect_eq_u64(s.max_split_size, 256 * CCA_MiB);
}

TEST(roundup_single_value)
{
    for (size_t d = 1; d <= 64; d *= 2) {
        char text[64];
        snprintf(text, sizeof(text), "roundup_power2_divisions:%zu", d);
        cca_settings_t s = parsed(text);
        for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
            expect_eq_u64(s.roundup_power2_divisions[i], d);
    }
    /* no upper bound: PyTorch takes any power of two that fits in 64 bits */
    expect_eq_u64(parsed("roundup_power2_divisions:1073741824").roundup_power2_divisions[5],
                  (size_t)1 << 30);
    expect_eq_u64(parsed("roundup_power2_divisions:9223372036854775808").roundup_power2_divisions[0],
                  (size_t)1 << 63);
    expect_bad("roundup_power2_divisions:3", "'roundup_power2_divisions:3'",
               "For roundups, the divisions has to be power of 2");
    /* PyTorch refuses 0 as the single value (it is not a power of two); only a
       list entry may be 0 */
    expect_bad("roundup_power2_divisions:0", "'roundup_power2_divisions:0'",
               "For roundups, the divisions has to be power of 2");
    expect_bad("roundup_power2_divisions:four", "'roundup_power2_divisions:four'",
               "a power of two");
    expect_bad("roundup_power2_divisions:-4", "'roundup_power2_divisions:-4'", NULL);
}

TEST(roundup_list_example)
{
    /* indices 0..8 = 1 (256 MiB is index 8, the first entry fills below it),
       9 = 2, 10 = 4, 11..15 = 8 ('>' fills after the last entry) */
    const size_t want[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
    cca_settings_t s = parsed("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    expect_divisions(&s, want);
    expect_eq_u64(s.source[CCA_SET_ROUNDUP_POWER2_DIVISIONS], CCA_SRC_ARGUMENT);
}

TEST(roundup_list_fills)
{
    /* the first entry fills every index below it; the rest stay 0 */
    const size_t first_only[CCA_ROUNDUP_INTERVALS] = {2, 2, 2, 0};
    cca_settings_t s = parsed("roundup_power2_divisions:[4:2]");
    expect_divisions(&s, first_only);

    /* '>' with no interval before it fills after index 0, as PyTorch (which
       starts after its last index, 0 until an interval entry comes) */
    const size_t all4[CCA_ROUNDUP_INTERVALS] = {0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
    s = parsed("roundup_power2_divisions:[>:4]");
    expect_divisions(&s, all4);

    /* a gap between entries is 0 (no rounding) */
    const size_t gap[CCA_ROUNDUP_INTERVALS] = {1, 0, 4, 0};
    s = parsed("roundup_power2_divisions:[1:1,4:4]");
    expect_divisions(&s, gap);

    /* interval 1 MiB is index 0 */
    const size_t one[CCA_ROUNDUP_INTERVALS] = {8, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
    s = parsed("roundup_power2_divisions:[1:8,>:2]");
    expect_divisions(&s, one);

    /* intervals past 32 GiB clamp to index 15; the first entry still fills below */
    const size_t clamp[CCA_ROUNDUP_INTERVALS] = {2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2};
    s = parsed("roundup_power2_divisions:[1048576:2]");
    expect_divisions(&s, clamp);
    const size_t clamp2[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 4};
    s = parsed("roundup_power2_divisions:[16384:1,32768:2,65536:4,131072:4]");
    expect_divisions(&s, clamp2);

    /* '>' after an entry at index 15 fills nothing */
    const size_t last[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    s = parsed("roundup_power2_divisions:[32768:1,>:8]");
    expect_divisions(&s, last);

    /* divisions of 0 inside a list */
    const size_t zeros[CCA_ROUNDUP_INTERVALS] = {0, 0, 0, 0, 0, 0, 0, 0,
                                                 0, 16, 16, 16, 16, 16, 16, 16};
    s = parsed("roundup_power2_divisions:[256:0,>:16]");
    expect_divisions(&s, zeros);
}

/* PyTorch accepts the empty list: every interval keeps the 0 it was reset
   to, so rounding is off */
TEST(roundup_empty_list)
{
    const size_t none[CCA_ROUNDUP_INTERVALS] = {0};
    cca_settings_t s;
    settings_default(&s);
    expect_ok(settings_parse(&s, "roundup_power2_divisions:8", CCA_SRC_ENVIRONMENT));
    expect_ok(settings_parse(&s, "roundup_power2_divisions:[]", CCA_SRC_ARGUMENT));
    expect_divisions(&s, none);
    expect_eq_u64(s.source[CCA_SET_ROUNDUP_POWER2_DIVISIONS], CCA_SRC_ARGUMENT);
    s = parsed("roundup_power2_divisions:[],expandable_segments:True");
    expect_divisions(&s, none);
    expect_true(s.expandable_segments);
}

/* PyTorch skips one ',' before the closing bracket */
TEST(roundup_list_trailing_comma)
{
    const size_t want[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 0};
    cca_settings_t s = parsed("roundup_power2_divisions:[256:1,512:2,]");
    expect_divisions(&s, want);
    s = parsed("roundup_power2_divisions:[256:1,512:2,],max_split_size_mb:64");
    expect_divisions(&s, want);
    expect_eq_u64(s.max_split_size, 64 * CCA_MiB);
    const size_t greater[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                   8, 8, 8, 8, 8, 8, 8};
    s = parsed("roundup_power2_divisions:[256:1,>:8,]");
    expect_divisions(&s, greater);
}

/* PyTorch applies the entries in the order given, with no rule on their
   order: a later entry overwrites an earlier one, '>' may come anywhere and
   more than once, and the first interval entry fills below itself even after
   a '>' */
TEST(roundup_list_any_order)
{
    const size_t down[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 1, 0};
    cca_settings_t s = parsed("roundup_power2_divisions:[512:1,256:2]");
    expect_divisions(&s, down);

    const size_t twice[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 0};
    s = parsed("roundup_power2_divisions:[256:1,256:2]");
    expect_divisions(&s, twice);

    const size_t greater_first[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                         8, 8, 8, 8, 8, 8, 8};
    s = parsed("roundup_power2_divisions:[>:8,256:1]");
    expect_divisions(&s, greater_first);

    const size_t greater_twice[CCA_ROUNDUP_INTERVALS] = {0, 4, 4, 4, 4, 4, 4, 4,
                                                         4, 4, 4, 4, 4, 4, 4, 4};
    s = parsed("roundup_power2_divisions:[>:8,>:4]");
    expect_divisions(&s, greater_twice);

    const size_t greater_between[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1,
                                                           4, 2, 4, 4, 4, 4, 4};
    s = parsed("roundup_power2_divisions:[256:1,>:4,1024:2]");
    expect_divisions(&s, greater_between);
}

TEST(roundup_list_replaces_whole_array)
{
    cca_settings_t s;
    settings_default(&s);
    expect_ok(settings_parse(&s, "roundup_power2_divisions:8", CCA_SRC_ENVIRONMENT));
    expect_ok(settings_parse(&s, "roundup_power2_divisions:[2:4]", CCA_SRC_ARGUMENT));
    const size_t want[CCA_ROUNDUP_INTERVALS] = {4, 4, 0};
    expect_divisions(&s, want);
    expect_eq_u64(s.source[CCA_SET_ROUNDUP_POWER2_DIVISIONS], CCA_SRC_ARGUMENT);
}

TEST(roundup_list_errors)
{
    expect_bad("roundup_power2_divisions:[3:1]", "'roundup_power2_divisions:[3:1]'",
               "For roundups, the intervals have to be power of 2");
    expect_bad("roundup_power2_divisions:[0:1]", "'roundup_power2_divisions:[0:1]'",
               "intervals have to be power of 2");
    expect_bad("roundup_power2_divisions:[256:3]", "'roundup_power2_divisions:[256:3]'",
               "For roundups, the divisions have to be power of 2 or 0");
    expect_bad("roundup_power2_divisions:[256:1,,512:2]",
               "'roundup_power2_divisions:[256:1,,512:2]'", "interval:divisions");
    expect_bad("roundup_power2_divisions:[,]", "'roundup_power2_divisions:[,]'",
               "interval:divisions");
    expect_bad("roundup_power2_divisions:[256]", "'roundup_power2_divisions:[256]'",
               "interval:divisions");
    expect_bad("roundup_power2_divisions:[256:]", "'roundup_power2_divisions:[256:]'",
               "interval:divisions");
    expect_bad("roundup_power2_divisions:[:4]", "'roundup_power2_divisions:[:4]'",
               "interval:divisions");
    expect_bad("roundup_power2_divisions:[256:1:2]", "'roundup_power2_divisions:[256:1:2]'",
               "separated by ','");
    expect_bad("roundup_power2_divisions:[256x:1]", "'roundup_power2_divisions:[256x:1]'",
               "intervals have to be power of 2");
    expect_bad("roundup_power2_divisions:[256:1", "'roundup_power2_divisions:[256:1'",
               "unbalanced");
    expect_bad("roundup_power2_divisions:[256:1,[512:2]]", "'roundup_power2_divisions:[256:1,",
               "unbalanced");
    expect_bad("roundup_power2_divisions:[256:1]]", "Unexpected ']'", NULL);
    expect_bad("roundup_power2_divisions:]", "Missing value", "roundup_power2_divisions");
    expect_bad("roundup_power2_divisions:>", "Missing value", NULL);
}

TEST(garbage_collection_threshold_key)
{
    expect_eq_dbl(parsed("garbage_collection_threshold:0.5").garbage_collection_threshold, 0.5);
    expect_eq_dbl(parsed("garbage_collection_threshold:1e-3").garbage_collection_threshold, 1e-3);
    expect_eq_dbl(parsed("garbage_collection_threshold:.75").garbage_collection_threshold, 0.75);
    expect_bad("garbage_collection_threshold:0", "'garbage_collection_threshold:0'",
               "garbage_collection_threshold too small, set it 0.0~1.0");
    expect_bad("garbage_collection_threshold:-0.5", "'garbage_collection_threshold:-0.5'",
               "too small");
    expect_bad("garbage_collection_threshold:1", "'garbage_collection_threshold:1'",
               "garbage_collection_threshold too big, set it 0.0~1.0");
    expect_bad("garbage_collection_threshold:1.5", "'garbage_collection_threshold:1.5'",
               "too big");
    expect_bad("garbage_collection_threshold:abc", "'garbage_collection_threshold:abc'",
               "strictly between 0 and 1");
    expect_bad("garbage_collection_threshold:nan", "'garbage_collection_threshold:nan'", NULL);
    expect_bad("garbage_collection_threshold:0.5x", "'garbage_collection_threshold:0.5x'", NULL);
    expect_bad("garbage_collection_threshold:1e999", "'garbage_collection_threshold:1e999'",
               NULL);
}

TEST(per_process_memory_fraction_key)
{
    expect_eq_dbl(parsed("per_process_memory_fraction:0").per_process_memory_fraction, 0.0);
    expect_eq_dbl(parsed("per_process_memory_fraction:1").per_process_memory_fraction, 1.0);
    expect_eq_dbl(parsed("per_process_memory_fraction:0.25").per_process_memory_fraction, 0.25);
    expect_bad("per_process_memory_fraction:1.01", "'per_process_memory_fraction:1.01'",
               "[0.0, 1.0]");
    expect_bad("per_process_memory_fraction:-0.5", "'per_process_memory_fraction:-0.5'",
               "[0.0, 1.0]");
    expect_bad("per_process_memory_fraction:half", "'per_process_memory_fraction:half'",
               "between 0 and 1");
    /* PyTorch's std::stod refuses a number that underflows a double (it does
       not read it as 0) */
    expect_bad("per_process_memory_fraction:1e-400", "'per_process_memory_fraction:1e-400'",
               "between 0 and 1");
    expect_bad("garbage_collection_threshold:1e-310", "'garbage_collection_threshold:1e-310'",
               "strictly between 0 and 1");
}

TEST(boolean_keys)
{
    static const cca_setting_key_t keys[] = {
        CCA_SET_EXPANDABLE_SEGMENTS, CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC,
        CCA_SET_GRAPH_CAPTURE_RECORD_STREAM_REUSE, CCA_SET_PINNED_USE_CUDA_HOST_REGISTER,
        CCA_SET_PINNED_USE_BACKGROUND_THREADS};
    static const struct {
        const char *word;
        bool value;
    } words[] = {{"True", true}, {"False", false}};
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        const char *name = settings_key_name(keys[k]);
        for (size_t w = 0; w < sizeof(words) / sizeof(words[0]); w++) {
            char text[128];
            snprintf(text, sizeof(text), "%s:%s", name, words[w].word);
            cca_settings_t s = parsed(text);
            bool value = false;
            switch (keys[k]) {
            case CCA_SET_EXPANDABLE_SEGMENTS: value = s.expandable_segments; break;
            case CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC: value = s.release_lock_on_cudamalloc; break;
            case CCA_SET_GRAPH_CAPTURE_RECORD_STREAM_REUSE:
                value = s.graph_capture_record_stream_reuse;
                break;
            case CCA_SET_PINNED_USE_CUDA_HOST_REGISTER:
                value = s.pinned_use_cuda_host_register;
                break;
            default: value = s.pinned_use_background_threads; break;
            }
            if (value != words[w].value)
                HARNESS_FAIL("%s gave %d", text, (int)value);
            expect_eq_u64(s.source[keys[k]], CCA_SRC_ARGUMENT);
        }
        /* PyTorch takes exactly True or False for its keys: true/false and 1/0
           are refused */
        static const char *bad_words[] = {"yes", "TRUE", "2", "Tru", "10",
                                          "true", "false", "1", "0"};
        for (size_t w = 0; w < sizeof(bad_words) / sizeof(bad_words[0]); w++) {
            char text[128], needle[160];
            snprintf(text, sizeof(text), "%s:%s", name, bad_words[w]);
            snprintf(needle, sizeof(needle), "'%s'", text);
            expect_bad(text, needle, "True or False");
        }
    }
}

/* PyTorch takes the ROCm names of two keys in every build */
TEST(hip_key_names)
{
    cca_settings_t s = parsed("release_lock_on_hipmalloc:True,pinned_use_hip_host_register:True");
    expect_true(s.release_lock_on_cudamalloc);
    expect_true(s.pinned_use_cuda_host_register);
    expect_eq_u64(s.source[CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC], CCA_SRC_ARGUMENT);
    expect_eq_u64(s.source[CCA_SET_PINNED_USE_CUDA_HOST_REGISTER], CCA_SRC_ARGUMENT);
    expect_bad("release_lock_on_hipmalloc:true", "'release_lock_on_cudamalloc:true'",
               "True or False");
    /* the other hip spellings are not keys */
    expect_bad("pinned_num_register_threads_hip:2", "Unrecognized key", NULL);
}

/* cca's own boolean keys keep their wider spellings */
TEST(cca_boolean_keys)
{
    expect_false(parsed("exact_peak_stats:false").exact_peak_stats);
    expect_false(parsed("exact_peak_stats:0").exact_peak_stats);
    expect_true(parsed("compact_memory:true").compact_memory);
    expect_true(parsed("compact_memory:1").compact_memory);
    expect_false(parsed("compact_memory:False").compact_memory);
    expect_bad("compact_memory:yes", "'compact_memory:yes'", "also true/false, 1/0");
}

TEST(pinned_num_register_threads_key)
{
    for (size_t n = 1; n <= 128; n *= 2) {
        char text[64];
        snprintf(text, sizeof(text), "pinned_num_register_threads:%zu", n);
        expect_eq_u64(parsed(text).pinned_num_register_threads, n);
    }
    expect_bad("pinned_num_register_threads:0", "'pinned_num_register_threads:0'",
               "power of 2");
    expect_bad("pinned_num_register_threads:3", "'pinned_num_register_threads:3'",
               "power of 2");
    expect_bad("pinned_num_register_threads:256", "'pinned_num_register_threads:256'",
               "<= 128");
    expect_bad("pinned_num_register_threads:8t", "'pinned_num_register_threads:8t'",
               "a power of two <= 128");
}

TEST(pinned_size_keys)
{
    expect_eq_u64(parsed("pinned_reserve_segment_size_mb:64").pinned_reserve_segment_size,
                  64 * CCA_MiB);
    expect_bad("pinned_reserve_segment_size_mb:0", "'pinned_reserve_segment_size_mb:0'",
               "must be > 0");
    expect_bad("pinned_reserve_segment_size_mb:-1", "'pinned_reserve_segment_size_mb:-1'",
               "positive integer");
    expect_eq_u64(parsed("pinned_max_round_threshold_mb:0").pinned_max_round_threshold, 0);
    expect_eq_u64(parsed("pinned_max_round_threshold_mb:256").pinned_max_round_threshold,
                  256 * CCA_MiB);
    expect_eq_u64(parsed("pinned_max_cached_size_mb:0").pinned_max_cached_size, 0);
    expect_eq_u64(parsed("pinned_max_cached_size_mb:1024").pinned_max_cached_size, CCA_GiB);
    expect_bad("pinned_max_round_threshold_mb:1.5", "'pinned_max_round_threshold_mb:1.5'",
               "integer number of MiB");
    expect_bad("pinned_max_cached_size_mb:big", "'pinned_max_cached_size_mb:big'",
               "integer number of MiB");
}

/* ---- syntax ---------------------------------------------------------------------- */

TEST(unknown_key)
{
    expect_bad("foo:1", "Unrecognized key 'foo' in allocator settings", "max_split_size_mb");
    expect_bad("backend:native,Expandable_segments:True", "Unrecognized key 'Expandable_segments'",
               "expandable_segments");
    /* the list of valid keys names every key */
    cca_settings_t s;
    settings_default(&s);
    expect_status(settings_parse(&s, "foo:1", CCA_SRC_ARGUMENT), CCA_ERR_BAD_SETTINGS);
    for (int k = 0; k < CCA_SET_COUNT; k++)
        expect_contains(cca_last_error()->message, settings_key_name((cca_setting_key_t)k));
}

TEST(malformed_syntax)
{
    expect_bad("max_split_size_mb", "Missing ':' after key 'max_split_size_mb'", "integer");
    expect_bad("max_split_size_mb,backend:native", "Missing ':'", "found ','");
    /* PyTorch drops the space: the key reads max_split_size_mb128 */
    expect_bad("max_split_size_mb 128", "Unrecognized key 'max_split_size_mb 128'", NULL);
    expect_bad("max_split_size_mb:", "Missing value for key 'max_split_size_mb'",
               "end of settings");
    expect_bad("max_split_size_mb:,backend:native", "Missing value", "found ','");
    expect_bad("max_split_size_mb::128", "Missing value", "found ':'");
    expect_bad(":128", "Empty key", "found ':'");
    expect_bad(",backend:native", "Empty key", NULL);
    expect_bad("backend:native,,expandable_segments:True", "Empty key", NULL);
    expect_bad("backend:native,[", "Empty key", NULL);
    expect_bad("backend:native garbage", "'backend:native garbage'",
               "Unknown allocator backend");
    expect_bad("backend:native:x", "Unexpected ':' after 'backend:native'", NULL);
    expect_bad("max_split_size_mb@:20", "Invalid character '@' at offset 17", NULL);
    expect_bad("backend:native;expandable_segments:True", "Invalid character ';'", NULL);
    expect_bad("backend:\"native\"", "Invalid character '\"' at offset 8", NULL);
    expect_bad("backend:nat\x01ive", "Invalid character 0x01 at offset 11", NULL);
    expect_bad("expandable_segments:True]", "Unexpected ']'", NULL);
}

TEST(trailing_comma_accepted)
{
    cca_settings_t s = parsed("expandable_segments:True,");
    expect_true(s.expandable_segments);
    s = parsed(" expandable_segments : True , ");
    expect_true(s.expandable_segments);
}

TEST(whitespace_ignored)
{
    cca_settings_t s = parsed(
        " max_split_size_mb : 128 ,\texpandable_segments :\nTrue ,roundup_power2_divisions: "
        "[ 256 : 1 , 512:2 ,1024 : 4, > : 8 ] , garbage_collection_threshold : 0.6 ");
    expect_eq_u64(s.max_split_size, 128 * CCA_MiB);
    expect_true(s.expandable_segments);
    expect_eq_dbl(s.garbage_collection_threshold, 0.6);
    const size_t want[CCA_ROUNDUP_INTERVALS] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8};
    expect_divisions(&s, want);
}

TEST(repeated_key_last_wins)
{
    cca_settings_t s = parsed("max_split_size_mb:64,expandable_segments:True,"
                              "max_split_size_mb:256,expandable_segments:False");
    expect_eq_u64(s.max_split_size, 256 * CCA_MiB);
    expect_false(s.expandable_segments);
    expect_eq_u64(s.source[CCA_SET_EXPANDABLE_SEGMENTS], CCA_SRC_ARGUMENT);
    /* a bad repeat fails the whole string */
    expect_bad("max_split_size_mb:64,max_split_size_mb:10", "'max_split_size_mb:10'", NULL);
}

TEST(atomic_on_error)
{
    cca_settings_t start;
    settings_default(&start);
    expect_ok(settings_parse(&start,
                             "max_split_size_mb:512,roundup_power2_divisions:[64:2,>:4],"
                             "garbage_collection_threshold:0.7,pinned_num_register_threads:8",
                             CCA_SRC_ENVIRONMENT));
    /* every key valid but the last: nothing of it may stick */
    expect_bad_over(&start,
                    "backend:cudaMallocAsync,max_split_size_mb:1024,large_segment_size_mb:64,"
                    "roundup_power2_divisions:16,garbage_collection_threshold:0.2,"
                    "expandable_segments:True,per_process_memory_fraction:0.5,"
                    "pinned_num_register_threads:16,pinned_max_cached_size_mb:64,bogus:1",
                    "Unrecognized key 'bogus'", NULL);
    expect_bad_over(&start, "expandable_segments:True,max_split_size_mb:10", "too small", NULL);
    expect_bad_over(&start, "expandable_segments:True,roundup_power2_divisions:[2:2,1:3]",
                    "divisions have to be power of 2 or 0", NULL);
}

TEST(atomic_success_marks_sources)
{
    cca_settings_t s;
    settings_default(&s);
    expect_ok(settings_parse(&s, "max_split_size_mb:512,expandable_segments:True",
                             CCA_SRC_ENVIRONMENT));
    expect_ok(settings_parse(&s, "expandable_segments:False,pinned_num_register_threads:4",
                             CCA_SRC_ARGUMENT));
    expect_eq_u64(s.source[CCA_SET_MAX_SPLIT_SIZE_MB], CCA_SRC_ENVIRONMENT);
    expect_eq_u64(s.source[CCA_SET_EXPANDABLE_SEGMENTS], CCA_SRC_ARGUMENT);
    expect_eq_u64(s.source[CCA_SET_PINNED_NUM_REGISTER_THREADS], CCA_SRC_ARGUMENT);
    expect_eq_u64(s.source[CCA_SET_BACKEND], CCA_SRC_DEFAULT);
    expect_eq_u64(s.max_split_size, 512 * CCA_MiB);
    expect_false(s.expandable_segments);
    expect_eq_u64(s.pinned_num_register_threads, 4);
}

TEST(long_value_in_message_is_cut)
{
    char text[1200];
    int n = snprintf(text, sizeof(text), "max_split_size_mb:");
    memset(text + n, '7', 1000);
    text[n + 1000] = '\0';
    expect_bad(text, "'max_split_size_mb:777", "...");
    expect_true(strlen(cca_last_error()->message) < 600);
}

/* ---- the roundup lookup ---------------------------------------------------------- */

TEST(roundup_lookup_boundaries)
{
    cca_settings_t s;
    settings_default(&s);
    for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
        s.roundup_power2_divisions[i] = 100 + (size_t)i; /* index i visible as 100 + i */
    expect_eq_u64(settings_roundup_divisions(&s, 0), 100);
    expect_eq_u64(settings_roundup_divisions(&s, 512), 100);
    expect_eq_u64(settings_roundup_divisions(&s, CCA_MiB - 1), 100);
    expect_eq_u64(settings_roundup_divisions(&s, CCA_MiB), 100);
    expect_eq_u64(settings_roundup_divisions(&s, 2 * CCA_MiB - 1), 100);
    expect_eq_u64(settings_roundup_divisions(&s, 2 * CCA_MiB), 101);
    expect_eq_u64(settings_roundup_divisions(&s, 256 * CCA_MiB), 108);
    expect_eq_u64(settings_roundup_divisions(&s, 512 * CCA_MiB - 1), 108);
    expect_eq_u64(settings_roundup_divisions(&s, 32 * CCA_GiB - 1), 114);
    expect_eq_u64(settings_roundup_divisions(&s, 32 * CCA_GiB), 115);
    expect_eq_u64(settings_roundup_divisions(&s, 64 * CCA_GiB - 1), 115);
    expect_eq_u64(settings_roundup_divisions(&s, 64 * CCA_GiB), 115);
    expect_eq_u64(settings_roundup_divisions(&s, 1024 * CCA_GiB), 115);
    expect_eq_u64(settings_roundup_divisions(&s, SIZE_MAX), 115);
}

TEST(roundup_lookup_after_parse)
{
    cca_settings_t s = parsed("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    expect_eq_u64(settings_roundup_divisions(&s, 100), 1);
    expect_eq_u64(settings_roundup_divisions(&s, 300 * CCA_MiB), 1);
    expect_eq_u64(settings_roundup_divisions(&s, 600 * CCA_MiB), 2);
    expect_eq_u64(settings_roundup_divisions(&s, 1500 * CCA_MiB), 4);
    expect_eq_u64(settings_roundup_divisions(&s, 2048 * CCA_MiB), 8);
    expect_eq_u64(settings_roundup_divisions(&s, 100 * CCA_GiB), 8);
}

/* ---- describe -------------------------------------------------------------------- */

TEST(describe_defaults)
{
    cca_settings_t s;
    settings_default(&s);
    cca_strbuf_t sb;
    sb_init(&sb);
    settings_describe(&s, &sb);
    expect_false(sb.failed);
    /* one line per key, in table order, each "key value (default)" */
    const char *p = sb.data;
    for (int k = 0; k < CCA_SET_COUNT && p; k++) {
        const char *name = settings_key_name((cca_setting_key_t)k);
        if (strncmp(p, name, strlen(name)) != 0 || p[strlen(name)] != ' ')
            HARNESS_FAIL("line %d does not start with %s: %.40s", k, name, p);
        const char *nl = strchr(p, '\n');
        if (!nl || nl - p < 10 || memcmp(nl - 10, " (default)", 10) != 0)
            HARNESS_FAIL("line %d does not end with (default)", k);
        p = nl ? nl + 1 : NULL;
    }
    expect_true(p && *p == '\0');
    expect_contains(sb.data, "backend native (default)\n");
    expect_contains(sb.data, "max_split_size_mb unlimited (default)\n");
    expect_contains(sb.data, "max_non_split_rounding_mb 20 (default)\n");
    expect_contains(sb.data, "large_segment_size_mb 20 (default)\n");
    /* no rounding is printed as the empty list: 0 is no single value */
    expect_contains(sb.data, "roundup_power2_divisions [] (default)\n");
    expect_contains(sb.data, "garbage_collection_threshold 0 (default)\n");
    expect_contains(sb.data, "expandable_segments False (default)\n");
    expect_contains(sb.data, "pinned_num_register_threads 1 (default)\n");
    expect_contains(sb.data, "pinned_reserve_segment_size_mb 0 (default)\n");
    expect_contains(sb.data, "pinned_max_round_threshold_mb unlimited (default)\n");
    expect_contains(sb.data, "pinned_max_cached_size_mb unlimited (default)\n");
    sb_free(&sb);
}

TEST(describe_values)
{
    cca_settings_t s = parsed("backend:cudaMallocAsync,max_split_size_mb:256,"
                              "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],"
                              "garbage_collection_threshold:0.8,expandable_segments:True,"
                              "per_process_memory_fraction:0.25,pinned_num_register_threads:8,"
                              "pinned_reserve_segment_size_mb:64,pinned_max_cached_size_mb:0");
    char line[256];
    describe_line(&s, CCA_SET_BACKEND, line, sizeof(line));
    expect_eq_str(line, "backend cudaMallocAsync (argument)");
    describe_line(&s, CCA_SET_MAX_SPLIT_SIZE_MB, line, sizeof(line));
    expect_eq_str(line, "max_split_size_mb 256 (argument)");
    describe_line(&s, CCA_SET_ROUNDUP_POWER2_DIVISIONS, line, sizeof(line));
    expect_eq_str(line, "roundup_power2_divisions [256:1,512:2,1024:4,>:8] (argument)");
    describe_line(&s, CCA_SET_GARBAGE_COLLECTION_THRESHOLD, line, sizeof(line));
    expect_eq_str(line, "garbage_collection_threshold 0.8 (argument)");
    describe_line(&s, CCA_SET_EXPANDABLE_SEGMENTS, line, sizeof(line));
    expect_eq_str(line, "expandable_segments True (argument)");
    describe_line(&s, CCA_SET_PER_PROCESS_MEMORY_FRACTION, line, sizeof(line));
    expect_eq_str(line, "per_process_memory_fraction 0.25 (argument)");
    describe_line(&s, CCA_SET_PINNED_NUM_REGISTER_THREADS, line, sizeof(line));
    expect_eq_str(line, "pinned_num_register_threads 8 (argument)");
    describe_line(&s, CCA_SET_PINNED_RESERVE_SEGMENT_SIZE_MB, line, sizeof(line));
    expect_eq_str(line, "pinned_reserve_segment_size_mb 64 (argument)");
    describe_line(&s, CCA_SET_PINNED_MAX_CACHED_SIZE_MB, line, sizeof(line));
    expect_eq_str(line, "pinned_max_cached_size_mb 0 (argument)");
    describe_line(&s, CCA_SET_LARGE_SEGMENT_SIZE_MB, line, sizeof(line));
    expect_eq_str(line, "large_segment_size_mb 20 (default)");
    /* a size the core set that is not whole MiB */
    s.max_non_split_rounding = 20 * CCA_MiB + CCA_MiB / 2;
    describe_line(&s, CCA_SET_MAX_NON_SPLIT_ROUNDING_MB, line, sizeof(line));
    expect_eq_str(line, "max_non_split_rounding_mb 20.5 (default)");
}

/* Describe the divisions, parse the printed value back, and compare. */
static void expect_roundup_round_trip(const size_t divisions[CCA_ROUNDUP_INTERVALS])
{
    cca_settings_t s;
    settings_default(&s);
    memcpy(s.roundup_power2_divisions, divisions, sizeof(s.roundup_power2_divisions));
    char line[512], text[512];
    describe_line(&s, CCA_SET_ROUNDUP_POWER2_DIVISIONS, line, sizeof(line));
    const char *value = line + strlen("roundup_power2_divisions ");
    const char *end = strstr(value, " (");
    if (!end) {
        HARNESS_FAIL("bad line %s", line);
        return;
    }
    snprintf(text, sizeof(text), "roundup_power2_divisions:%.*s", (int)(end - value), value);
    cca_settings_t back = parsed(text);
    if (memcmp(back.roundup_power2_divisions, divisions, sizeof(back.roundup_power2_divisions)))
        HARNESS_FAIL("%s does not parse back to the array it came from", text);
}

TEST(describe_roundup_round_trips)
{
    const size_t gap[CCA_ROUNDUP_INTERVALS] = {1, 0, 4, 0};
    expect_roundup_round_trip(gap);
    const size_t first[CCA_ROUNDUP_INTERVALS] = {2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
    expect_roundup_round_trip(first);
    const size_t last[CCA_ROUNDUP_INTERVALS] = {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2};
    expect_roundup_round_trip(last);
    /* random arrays of 0, 1, 2, 4, 8 from a fixed-seed generator */
    uint64_t state = 0x9E3779B97F4A7C15ull;
    for (int round = 0; round < 500; round++) {
        size_t d[CCA_ROUNDUP_INTERVALS];
        for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            unsigned pick = (unsigned)(state >> 61) % 5;  /* 0..4 */
            d[i] = pick == 0 ? 0 : (size_t)1 << (pick - 1);
            if (round % 3 == 0 && i > 0 && (state >> 40) % 2)
                d[i] = d[i - 1]; /* longer runs */
        }
        expect_roundup_round_trip(d);
    }
}

/* ---- cca_settings_describe and sources ------------------------------------------ */

TEST(public_describe_sources)
{
    setenv("CCA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:256", 1);
    char *text = NULL;
    expect_ok(cca_settings_describe("max_split_size_mb:512,pinned_num_register_threads:4", &text));
    expect_contains(text, "backend native (default)\n");
    expect_contains(text, "expandable_segments True (environment)\n");
    expect_contains(text, "max_split_size_mb 512 (argument)\n");
    expect_contains(text, "pinned_num_register_threads 4 (argument)\n");
    free(text);

    text = NULL;
    expect_ok(cca_settings_describe(NULL, &text));
    expect_contains(text, "max_split_size_mb 256 (environment)\n");
    free(text);

    /* a bad argument: error, nothing written */
    text = NULL;
    expect_status(cca_settings_describe("max_split_size_mb:1", &text), CCA_ERR_BAD_SETTINGS);
    expect_true(text == NULL);
    expect_contains(cca_last_error()->message, "'max_split_size_mb:1'");

    /* the cross-key rule spans environment and argument */
    expect_status(cca_settings_describe("large_segment_size_mb:512", &text),
                  CCA_ERR_BAD_SETTINGS);
    expect_true(text == NULL);

    /* a bad environment variable is named */
    setenv("CCA_ALLOC_CONF", "expandable_segments:maybe", 1);
    expect_status(cca_settings_describe(NULL, &text), CCA_ERR_BAD_SETTINGS);
    expect_true(text == NULL);
    expect_contains(cca_last_error()->message, "CCA_ALLOC_CONF");
    expect_contains(cca_last_error()->message, "'expandable_segments:maybe'");

    unsetenv("CCA_ALLOC_CONF");
    expect_ok(cca_settings_describe("", &text));
    expect_contains(text, "expandable_segments False (default)\n");
    free(text);

    expect_status(cca_settings_describe(NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
}

int main(void)
{
    unsetenv("CCA_ALLOC_CONF");
    RUN(defaults);
    RUN(empty_and_null_change_nothing);
    RUN(key_names_round_trip);
    RUN(tokenizer_splits);
    RUN(tokenizer_whitespace_joins_words);
    RUN(tokenizer_counts_beyond_max);
    RUN(tokenizer_empty_and_null);
    RUN(tokenizer_bad_character);
    RUN(backend_key);
    RUN(max_split_size_mb_key);
    RUN(max_non_split_rounding_mb_key);
    RUN(large_segment_size_mb_key);
    RUN(split_minimums_follow_large_segment);
    RUN(max_split_at_least_large_segment);
    RUN(roundup_single_value);
    RUN(roundup_list_example);
    RUN(roundup_list_fills);
    RUN(roundup_empty_list);
    RUN(roundup_list_trailing_comma);
    RUN(roundup_list_any_order);
    RUN(roundup_list_replaces_whole_array);
    RUN(roundup_list_errors);
    RUN(garbage_collection_threshold_key);
    RUN(per_process_memory_fraction_key);
    RUN(boolean_keys);
    RUN(cca_boolean_keys);
    RUN(hip_key_names);
    RUN(pinned_num_register_threads_key);
    RUN(pinned_size_keys);
    RUN(unknown_key);
    RUN(malformed_syntax);
    RUN(trailing_comma_accepted);
    RUN(whitespace_ignored);
    RUN(whitespace_inside_words_dropped);
    RUN(repeated_key_last_wins);
    RUN(atomic_on_error);
    RUN(atomic_success_marks_sources);
    RUN(long_value_in_message_is_cut);
    RUN(roundup_lookup_boundaries);
    RUN(roundup_lookup_after_parse);
    RUN(describe_defaults);
    RUN(describe_values);
    RUN(describe_roundup_round_trips);
    RUN(public_describe_sources);
    return harness_done();
}
