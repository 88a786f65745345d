/*
 * settings.h - the allocator settings (PyTorch's CUDAAllocatorConfig keys) as
 * parsed values, and the parser of the "key:value,key:value" string.
 */
#ifndef CCA_SETTINGS_H
#define CCA_SETTINGS_H

#include "internal.h"

/* Number of roundup_power2_divisions intervals: [1 MiB, 2 MiB) ... [32 GiB, inf). */
#define CCA_ROUNDUP_INTERVALS 16

typedef enum cca_backend_kind {
    CCA_BACKEND_NATIVE = 0,   /* the caching allocator */
    CCA_BACKEND_ASYNC = 1,    /* cudaMallocAsync */
} cca_backend_kind_t;

/* The option table's order; one entry per key. */
typedef enum cca_setting_key {
    CCA_SET_BACKEND = 0,
    CCA_SET_MAX_SPLIT_SIZE_MB,
    CCA_SET_MAX_NON_SPLIT_ROUNDING_MB,
    CCA_SET_LARGE_SEGMENT_SIZE_MB,
    CCA_SET_ROUNDUP_POWER2_DIVISIONS,
    CCA_SET_GARBAGE_COLLECTION_THRESHOLD,
    CCA_SET_EXPANDABLE_SEGMENTS,
    CCA_SET_PER_PROCESS_MEMORY_FRACTION,
    CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC,
    CCA_SET_GRAPH_CAPTURE_RECORD_STREAM_REUSE,
    CCA_SET_PINNED_USE_CUDA_HOST_REGISTER,
    CCA_SET_PINNED_NUM_REGISTER_THREADS,
    CCA_SET_PINNED_USE_BACKGROUND_THREADS,
    CCA_SET_PINNED_RESERVE_SEGMENT_SIZE_MB,
    CCA_SET_PINNED_MAX_ROUND_THRESHOLD_MB,
    CCA_SET_PINNED_MAX_CACHED_SIZE_MB,
    CCA_SET_EXACT_PEAK_STATS,
    CCA_SET_COMPACT_MEMORY,
    CCA_SET_COUNT
} cca_setting_key_t;

/* Where the value of a key came from. */
typedef enum cca_setting_source {
    CCA_SRC_DEFAULT = 0,
    CCA_SRC_ENVIRONMENT = 1, /* CCA_ALLOC_CONF */
    CCA_SRC_ARGUMENT = 2,    /* a string given to the API at init or run time */
} cca_setting_source_t;

typedef struct cca_settings {
    cca_backend_kind_t backend;
    size_t max_split_size;          /* bytes; SIZE_MAX = unlimited (the default) */
    size_t max_non_split_rounding;  /* bytes; default 20 MiB */
    size_t large_segment_size;      /* bytes; segment size for 1-10 MiB requests, default 20 MiB */
    size_t roundup_power2_divisions[CCA_ROUNDUP_INTERVALS]; /* 0 or 1 = none */
    double garbage_collection_threshold; /* 0 = off, else in (0, 1) */
    bool expandable_segments;
    double per_process_memory_fraction;  /* 0 = none (1.0 effective), else in (0, 1] */
    bool release_lock_on_cudamalloc;
    bool graph_capture_record_stream_reuse;
    bool pinned_use_cuda_host_register;
    size_t pinned_num_register_threads;  /* power of two, <= 128; default 1 */
    bool pinned_use_background_threads;
    size_t pinned_reserve_segment_size;  /* bytes; 0 = none */
    size_t pinned_max_round_threshold;   /* bytes; SIZE_MAX = always round (PyTorch) */
    size_t pinned_max_cached_size;       /* bytes; SIZE_MAX = cache all (PyTorch) */
    bool exact_peak_stats;               /* exact device-wide peaks (one stats lock per op) */
    bool compact_memory;                 /* expandable segments in device granules, free granules
                                            re-mapped where growth needs them (compact.c) */
    cca_setting_source_t source[CCA_SET_COUNT];
} cca_settings_t;

/* The defaults (PyTorch 2.11's). */
void settings_default(cca_settings_t *s);

/*
 * Parse a settings string over *s, marking keys it names with source. On any
 * error *s is unchanged and CCA_ERR_BAD_SETTINGS is raised with a message
 * naming the offending key:value and what is allowed. NULL or "" is valid.
 */
cca_status_t settings_parse(cca_settings_t *s, const char *text, cca_setting_source_t source);

/*
 * Return the keys PyTorch's parseArgs resets before reading each string to their
 * defaults: max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold
 * (a run-time string that does not name them turns them off, PyTorch's
 * test_allocator_settings). Every other key keeps its value.
 */
void settings_reset_for_new_string(cca_settings_t *s);

/* Name of a key as written in the string. */
const char *settings_key_name(cca_setting_key_t key);

/* Name of a source as printed: "default", "environment", "argument". */
const char *settings_source_name(cca_setting_source_t source);

/* The key named name[0, len); false if no key has that name (case-sensitive). */
bool settings_lookup_key(const char *name, size_t len, cca_setting_key_t *key);

/* Append the effective value of every key ("key value (source)" per line). */
void settings_describe(const cca_settings_t *s, cca_strbuf_t *out);

/* The divisions to use for a request of size bytes (PyTorch's lookup). */
static inline size_t settings_roundup_divisions(const cca_settings_t *s, size_t size)
{
    size_t index = 0;
    if (size >= ((size_t)1 << 20)) {
        index = (size_t)(63 - __builtin_clzll((unsigned long long)size)) - 20;
        if (index >= CCA_ROUNDUP_INTERVALS)
            index = CCA_ROUNDUP_INTERVALS - 1;
    }
    return s->roundup_power2_divisions[index];
}

/*
 * The pure tokenizer: splits text into tokens (identifiers/numbers, and the
 * single characters ':' ',' '[' ']' '>'), whitespace ignored. Fills up to
 * max tokens as (offset, length) pairs; *count gets the number found (which
 * may exceed max). Never allocates. Returns false on a character that is not
 * allowed, with *bad_offset set and *count the tokens before it. NULL text is
 * empty; tokens may be NULL when max is 0; count and bad_offset may be NULL.
 * A word is a run of letters, digits and "_.+-"; whitespace between two word
 * characters is part of the word (dropped when it is read, as PyTorch drops
 * it: "12 8" is one word that reads 128).
 */
typedef struct cca_token {
    size_t offset;
    size_t length;
} cca_token_t;
bool settings_tokenize(const char *text, cca_token_t *tokens, size_t max, size_t *count,
                       size_t *bad_offset);

#endif /* CCA_SETTINGS_H */
