/*
 * fuzz_settings.c - libFuzzer target for the settings string. The input,
 * NUL-terminated, goes through the tokenizer (whose tokens must tile the
 * text in order) and the parser, over the defaults and over a non-default
 * state. A failed parse must leave the settings byte-for-byte unchanged and
 * raise CCA_ERR_BAD_SETTINGS; a successful one must give values inside every
 * key's range, and the printed roundup value must parse back to the same
 * divisions. Any violation aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "settings.h"

#define CHECK(x)                                                               \
    do {                                                                       \
        if (!(x)) {                                                            \
            fprintf(stderr, "fuzz_settings: check failed: %s (line %d)\n", #x, \
                    __LINE__);                                                 \
            abort();                                                           \
        }                                                                      \
    } while (0)

static bool is_pow2_or_zero(size_t v)
{
    return (v & (v - 1)) == 0;
}

/* Tokens are in order, inside the text, non-empty, never overlapping. */
static void check_tokens(const char *text)
{
    cca_token_t tokens[64];
    size_t count = 0, bad = 0, len = strlen(text);
    bool ok = settings_tokenize(text, tokens, 64, &count, &bad);
    size_t shown = count < 64 ? count : 64;
    size_t previous_end = 0;
    for (size_t i = 0; i < shown; i++) {
        CHECK(tokens[i].length > 0);
        CHECK(tokens[i].offset >= previous_end);
        CHECK(tokens[i].offset + tokens[i].length <= len);
        previous_end = tokens[i].offset + tokens[i].length;
    }
    if (!ok)
        CHECK(bad < len);
    size_t again = 0;
    CHECK(settings_tokenize(text, NULL, 0, &again, &bad) == ok);
    CHECK(again == count);
}

/* Every value a successful parse can leave. */
static void check_ranges(const cca_settings_t *s)
{
    CHECK(s->backend == CCA_BACKEND_NATIVE || s->backend == CCA_BACKEND_ASYNC);
    CHECK(s->large_segment_size > 10 * CCA_MiB);
    CHECK(s->max_split_size == SIZE_MAX || s->max_split_size >= s->large_segment_size);
    CHECK(s->max_non_split_rounding >= s->large_segment_size);
    for (int i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
        CHECK(is_pow2_or_zero(s->roundup_power2_divisions[i]));
    CHECK(s->garbage_collection_threshold >= 0.0 && s->garbage_collection_threshold < 1.0);
    CHECK(s->per_process_memory_fraction >= 0.0 && s->per_process_memory_fraction <= 1.0);
    CHECK(s->pinned_num_register_threads >= 1 && s->pinned_num_register_threads <= 128);
    CHECK(is_pow2_or_zero(s->pinned_num_register_threads));
    for (int k = 0; k < CCA_SET_COUNT; k++)
        CHECK(s->source[k] <= CCA_SRC_ARGUMENT);
}

/* The printed roundup value parses back to the same divisions. */
static void check_roundup_round_trip(const cca_settings_t *s)
{
    static const char prefix[] = "roundup_power2_divisions ";
    cca_strbuf_t sb;
    sb_init(&sb);
    settings_describe(s, &sb);
    CHECK(!sb.failed && sb.data);
    const char *line = strstr(sb.data, prefix);
    CHECK(line);
    const char *value = line + strlen(prefix);
    const char *end = strstr(value, " (");
    CHECK(end);
    char text[512];
    CHECK(snprintf(text, sizeof(text), "roundup_power2_divisions:%.*s", (int)(end - value),
                   value) < (int)sizeof(text));
    cca_settings_t back;
    settings_default(&back);
    CHECK(settings_parse(&back, text, CCA_SRC_ARGUMENT) == CCA_OK);
    CHECK(memcmp(back.roundup_power2_divisions, s->roundup_power2_divisions,
                 sizeof(back.roundup_power2_divisions)) == 0);
    sb_free(&sb);
}

static void parse_over(const cca_settings_t *start, const char *text)
{
    cca_settings_t s = *start;
    cca_clear_error();
    cca_status_t status = settings_parse(&s, text, CCA_SRC_ARGUMENT);
    if (status != CCA_OK) {
        CHECK(status == CCA_ERR_BAD_SETTINGS);
        CHECK(cca_last_error()->status == CCA_ERR_BAD_SETTINGS);
        CHECK(cca_last_error()->message[0] != '\0');
        CHECK(memcmp(&s, start, sizeof(s)) == 0);
        return;
    }
    check_ranges(&s);
    check_roundup_round_trip(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';

    check_tokens(text);

    cca_settings_t start;
    settings_default(&start);
    parse_over(&start, text);
    CHECK(settings_parse(&start,
                         "max_split_size_mb:512,expandable_segments:True,"
                         "roundup_power2_divisions:[64:2,>:4],pinned_num_register_threads:8",
                         CCA_SRC_ENVIRONMENT) == CCA_OK);
    parse_over(&start, text);

    free(text);
    return 0;
}
