/*
 * settings.c - the allocator settings string ("key:value,key:value", the
 * syntax of PYTORCH_CUDA_ALLOC_CONF): a pure tokenizer, one option table
 * indexed by cca_setting_key_t with typed handlers, precise error messages,
 * and the effective-settings printer.
 *
 * Invariant: settings_parse() is atomic. It parses into a copy and writes the
 * copy back only when the whole string (and the cross-key rules on the
 * combined result) is valid, so on any error the caller's settings are
 * byte-for-byte unchanged.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "settings.h"

/* Longest value text shown in an error message. */
#define SHOW_MAX 120
/* Most register threads (PyTorch's limit). */
#define MAX_REGISTER_THREADS 128
/* large_segment_size_mb must be larger than this (PyTorch's kMinLargeAlloc in MiB): the
   segment then holds any request it serves, all below 10 MiB. */
#define MIN_LARGE_ALLOC_MIB 10

/* ---- tokenizer ---------------------------------------------------------------- */

typedef enum tok_kind {
    TOK_END = 0, /* end of the text */
    TOK_WORD,    /* identifier or number: [A-Za-z0-9_.+-]+, whitespace inside dropped */
    TOK_COLON,
    TOK_COMMA,
    TOK_LBRACKET,
    TOK_RBRACKET,
    TOK_GREATER,
    TOK_BAD,     /* a character that is not allowed (offset = where) */
} tok_kind_t;

/* A cursor over text[pos, end). */
typedef struct scanner {
    const char *text;
    size_t pos;
    size_t end;
} scanner_t;

typedef struct token {
    tok_kind_t kind;
    size_t offset; /* into scanner.text */
    size_t length;
} token_t;

static bool is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static bool is_word_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-' || c == '+';
}

/* Whether the word text[0, len) is word, the whitespace inside it dropped. */
static bool word_is(const char *text, size_t len, const char *word)
{
    size_t w = 0;
    for (size_t i = 0; i < len; i++) {
        if (is_space(text[i]))
            continue;
        if (word[w] == '\0' || word[w] != text[i])
            return false;
        w++;
    }
    return word[w] == '\0';
}

/* The next token of sc, advancing past it. Never allocates. */
static token_t scan_next(scanner_t *sc)
{
    token_t tok = {TOK_END, sc->end, 0};

    while (sc->pos < sc->end && is_space(sc->text[sc->pos]))
        sc->pos++;
    if (sc->pos >= sc->end)
        return tok;
    tok.offset = sc->pos;
    tok.length = 1;
    switch (sc->text[sc->pos]) {
    case ':': tok.kind = TOK_COLON; break;
    case ',': tok.kind = TOK_COMMA; break;
    case '[': tok.kind = TOK_LBRACKET; break;
    case ']': tok.kind = TOK_RBRACKET; break;
    case '>': tok.kind = TOK_GREATER; break;
    default:
        if (!is_word_char(sc->text[sc->pos])) {
            tok.kind = TOK_BAD;
            return tok; /* the cursor stays on the bad character */
        }
        /* whitespace between word characters joins them into one word, as
           PyTorch drops whitespace wherever it is ("12 8" reads 128); the
           token spans up to its last word character */
        tok.kind = TOK_WORD;
        for (size_t p = sc->pos + 1; p < sc->end; p++) {
            if (is_word_char(sc->text[p]))
                tok.length = p + 1 - sc->pos;
            else if (!is_space(sc->text[p]))
                break;
        }
        break;
    }
    sc->pos += tok.length;
    return tok;
}

bool settings_tokenize(const char *text, cca_token_t *tokens, size_t max, size_t *count,
                       size_t *bad_offset)
{
    scanner_t sc = {text, 0, text ? strlen(text) : 0};
    size_t found = 0;

    for (;;) {
        token_t tok = scan_next(&sc);
        if (tok.kind == TOK_END)
            break;
        if (tok.kind == TOK_BAD) {
            if (count)
                *count = found;
            if (bad_offset)
                *bad_offset = tok.offset;
            return false;
        }
        if (tokens && found < max) {
            tokens[found].offset = tok.offset;
            tokens[found].length = tok.length;
        }
        found++;
    }
    if (count)
        *count = found;
    return true;
}

/* ---- the option table ---------------------------------------------------------- */

typedef enum opt_type {
    OPT_BACKEND,   /* native | cudaMallocAsync */
    OPT_MIB,       /* an integer number of MiB, stored as bytes (size_t) */
    OPT_FRACTION,  /* a double within [lo, hi], ends open or closed */
    OPT_BOOL,      /* True/False (cca's own keys: also true/false, 1/0) */
    OPT_POW2,      /* a power of two <= max (size_t) */
    OPT_ROUNDUP,   /* one division for all intervals, or a [interval:division,...] list */
} opt_type_t;

typedef struct option option_t;
typedef cca_status_t (*opt_parse_fn)(const option_t *opt, cca_settings_t *s, const char *text,
                                     size_t off, size_t len);
typedef void (*opt_print_fn)(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out);

struct option {
    const char *name;    /* the key as written */
    opt_type_t type;
    size_t offset;       /* of the field in cca_settings_t */
    const char *allowed; /* the accepted values, for error messages */
    const char *doc;     /* what the key does */
    /* the default: bytes (OPT_MIB), 0/1 (OPT_BOOL), the enum (OPT_BACKEND), the
       count (OPT_POW2), the divisions of every interval (OPT_ROUNDUP) */
    uint64_t default_value;
    double default_fraction; /* OPT_FRACTION */
    /* OPT_MIB: smallest value; OPT_POW2: largest value */
    uint64_t min;
    uint64_t max;
    const char *range_error; /* OPT_MIB / OPT_POW2: text when the range check fails */
    /* OPT_FRACTION: bounds; an open end excludes the bound */
    double lo, hi;
    bool lo_open, hi_open;
    const char *too_small, *too_big;
    bool cca_only; /* a key PyTorch does not have */
};

static cca_status_t parse_backend(const option_t *, cca_settings_t *, const char *, size_t, size_t);
static cca_status_t parse_mib(const option_t *, cca_settings_t *, const char *, size_t, size_t);
static cca_status_t parse_fraction(const option_t *, cca_settings_t *, const char *, size_t,
                                   size_t);
static cca_status_t parse_bool(const option_t *, cca_settings_t *, const char *, size_t, size_t);
static cca_status_t parse_pow2(const option_t *, cca_settings_t *, const char *, size_t, size_t);
static cca_status_t parse_roundup(const option_t *, cca_settings_t *, const char *, size_t, size_t);
static void print_backend(const option_t *, const cca_settings_t *, cca_strbuf_t *);
static void print_mib(const option_t *, const cca_settings_t *, cca_strbuf_t *);
static void print_fraction(const option_t *, const cca_settings_t *, cca_strbuf_t *);
static void print_bool(const option_t *, const cca_settings_t *, cca_strbuf_t *);
static void print_pow2(const option_t *, const cca_settings_t *, cca_strbuf_t *);
static void print_roundup(const option_t *, const cca_settings_t *, cca_strbuf_t *);

/* The typed handlers, indexed by opt_type_t. */
static const struct {
    opt_parse_fn parse;
    opt_print_fn print;
} handlers[] = {
    [OPT_BACKEND] = {parse_backend, print_backend},
    [OPT_MIB] = {parse_mib, print_mib},
    [OPT_FRACTION] = {parse_fraction, print_fraction},
    [OPT_BOOL] = {parse_bool, print_bool},
    [OPT_POW2] = {parse_pow2, print_pow2},
    [OPT_ROUNDUP] = {parse_roundup, print_roundup},
};

#define FIELD(f) offsetof(cca_settings_t, f)
/* PyTorch takes exactly True or False; cca's own keys also take true/false, 1/0 */
#define BOOL_ALLOWED "True or False"
#define CCA_BOOL_ALLOWED "True or False (also true/false, 1/0)"

/* One entry per key, in cca_setting_key_t order: the single source of names,
   defaults, accepted values and range checks. */
static const option_t options[CCA_SET_COUNT] = {
    [CCA_SET_BACKEND] = {
        .default_value = CCA_BACKEND_NATIVE,
        .name = "backend", .type = OPT_BACKEND, .offset = FIELD(backend),
        .allowed = "native or cudaMallocAsync",
        .doc = "the allocator: cca's caching allocator, or the driver's cudaMallocAsync pools"},
    [CCA_SET_MAX_SPLIT_SIZE_MB] = {
        .default_value = SIZE_MAX,
        .name = "max_split_size_mb", .type = OPT_MIB, .offset = FIELD(max_split_size),
        .allowed = "an integer number of MiB >= large_segment_size_mb (20 by default)",
        .doc = "cached blocks this large or larger are never split"},
    [CCA_SET_MAX_NON_SPLIT_ROUNDING_MB] = {
        .default_value = 20 * CCA_MiB,
        .name = "max_non_split_rounding_mb", .type = OPT_MIB,
        .offset = FIELD(max_non_split_rounding),
        .allowed = "an integer number of MiB >= large_segment_size_mb (20 by default)",
        .doc = "an oversize request may use a cached block at most this much larger"},
    [CCA_SET_LARGE_SEGMENT_SIZE_MB] = {
        .default_value = 20 * CCA_MiB,
        .name = "large_segment_size_mb", .type = OPT_MIB, .offset = FIELD(large_segment_size),
        .allowed = "an integer number of MiB > 10", .min = MIN_LARGE_ALLOC_MIB + 1,
        .range_error = "large_segment_size_mb must be > 10 MB",
        .doc = "size of the segments allocated for requests of 1 to 10 MiB"},
    [CCA_SET_ROUNDUP_POWER2_DIVISIONS] = {
        .default_value = 0,
        .name = "roundup_power2_divisions", .type = OPT_ROUNDUP,
        .offset = FIELD(roundup_power2_divisions),
        .allowed = "a power of two, or a list such as [256:1,512:2,1024:4,>:8] "
                   "(interval in MiB, a power of two : divisions, 0 or a power of two)",
        .doc = "round request sizes up to one of N divisions of their power-of-two interval"},
    [CCA_SET_GARBAGE_COLLECTION_THRESHOLD] = {
        .default_fraction = 0.0,
        .name = "garbage_collection_threshold", .type = OPT_FRACTION,
        .offset = FIELD(garbage_collection_threshold),
        .allowed = "a number strictly between 0 and 1", .lo = 0.0, .hi = 1.0,
        .lo_open = true, .hi_open = true,
        .too_small = "garbage_collection_threshold too small, set it 0.0~1.0",
        .too_big = "garbage_collection_threshold too big, set it 0.0~1.0",
        .doc = "free cached blocks (oldest first) once usage passes this fraction of the limit"},
    [CCA_SET_EXPANDABLE_SEGMENTS] = {
        .default_value = false,
        .name = "expandable_segments", .type = OPT_BOOL, .offset = FIELD(expandable_segments),
        .allowed = BOOL_ALLOWED,
        .doc = "grow one segment per stream in virtual memory instead of many fixed segments"},
    [CCA_SET_PER_PROCESS_MEMORY_FRACTION] = {
        .default_fraction = 0.0,
        .name = "per_process_memory_fraction", .type = OPT_FRACTION,
        .offset = FIELD(per_process_memory_fraction),
        .allowed = "a number between 0 and 1", .lo = 0.0, .hi = 1.0,
        .too_small = "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
        .too_big = "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
        .doc = "limit each device to this fraction of its memory (0: no limit)"},
    [CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC] = {
        .default_value = false,
        .name = "release_lock_on_cudamalloc", .type = OPT_BOOL,
        .offset = FIELD(release_lock_on_cudamalloc), .allowed = BOOL_ALLOWED,
        .doc = "drop the allocator lock around the backend's malloc"},
    [CCA_SET_GRAPH_CAPTURE_RECORD_STREAM_REUSE] = {
        .default_value = false,
        .name = "graph_capture_record_stream_reuse", .type = OPT_BOOL,
        .offset = FIELD(graph_capture_record_stream_reuse), .allowed = BOOL_ALLOWED,
        .doc = "reuse blocks freed during graph capture once their recorded streams allow it"},
    [CCA_SET_PINNED_USE_CUDA_HOST_REGISTER] = {
        .default_value = false,
        .name = "pinned_use_cuda_host_register", .type = OPT_BOOL,
        .offset = FIELD(pinned_use_cuda_host_register), .allowed = BOOL_ALLOWED,
        .doc = "pinned memory from malloc + cudaHostRegister instead of cudaHostAlloc"},
    [CCA_SET_PINNED_NUM_REGISTER_THREADS] = {
        .default_value = 1,
        .name = "pinned_num_register_threads", .type = OPT_POW2,
        .offset = FIELD(pinned_num_register_threads),
        .allowed = "a power of two <= 128", .max = MAX_REGISTER_THREADS,
        .range_error = "Number of register threads has to be a power of 2 and <= 128",
        .doc = "threads that pre-fault pages before cudaHostRegister"},
    [CCA_SET_PINNED_USE_BACKGROUND_THREADS] = {
        .default_value = false,
        .name = "pinned_use_background_threads", .type = OPT_BOOL,
        .offset = FIELD(pinned_use_background_threads), .allowed = BOOL_ALLOWED,
        .doc = "a background thread processes the events of freed pinned blocks"},
    [CCA_SET_PINNED_RESERVE_SEGMENT_SIZE_MB] = {
        .default_value = 0,
        .name = "pinned_reserve_segment_size_mb", .type = OPT_MIB,
        .offset = FIELD(pinned_reserve_segment_size),
        .allowed = "a positive integer number of MiB", .min = 1,
        .range_error = "pinned_reserve_segment_size_mb must be > 0",
        .doc = "reserve one pinned segment of this size up front and carve small requests from it"},
    [CCA_SET_PINNED_MAX_ROUND_THRESHOLD_MB] = {
        .default_value = SIZE_MAX,
        .name = "pinned_max_round_threshold_mb", .type = OPT_MIB, .cca_only = true,
        .offset = FIELD(pinned_max_round_threshold),
        .allowed = "an integer number of MiB",
        .doc = "pinned requests larger than this are not rounded up to a power of two"},
    [CCA_SET_PINNED_MAX_CACHED_SIZE_MB] = {
        .default_value = SIZE_MAX,
        .name = "pinned_max_cached_size_mb", .type = OPT_MIB, .cca_only = true,
        .offset = FIELD(pinned_max_cached_size),
        .allowed = "an integer number of MiB",
        .doc = "freed pinned blocks larger than this are released instead of cached"},
    [CCA_SET_EXACT_PEAK_STATS] = {
        .default_value = true,
        .name = "exact_peak_stats", .type = OPT_BOOL, .offset = FIELD(exact_peak_stats),
        .allowed = CCA_BOOL_ALLOWED, .cca_only = true,
        .doc = "False: per-stream statistics, peaks sampled on slow paths (scales across streams)"},
    [CCA_SET_COMPACT_MEMORY] = {
        .default_value = false,
        .name = "compact_memory", .type = OPT_BOOL, .offset = FIELD(compact_memory),
        .allowed = CCA_BOOL_ALLOWED, .cca_only = true,
        .doc = "implies expandable_segments; free granules are re-mapped where growth needs them "
               "instead of reserving more (not PyTorch's behaviour)"},
};

#define SETTING(s, opt, type) ((type *)(void *)((char *)(s) + (opt)->offset))
#define SETTING_C(s, opt, type) ((const type *)(const void *)((const char *)(s) + (opt)->offset))

/* Store opt's default into s. */
static void store_default(const option_t *opt, cca_settings_t *s)
{
    switch (opt->type) {
    case OPT_BACKEND:
        *SETTING(s, opt, cca_backend_kind_t) = (cca_backend_kind_t)opt->default_value;
        break;
    case OPT_MIB:
    case OPT_POW2: *SETTING(s, opt, size_t) = (size_t)opt->default_value; break;
    case OPT_FRACTION: *SETTING(s, opt, double) = opt->default_fraction; break;
    case OPT_BOOL: *SETTING(s, opt, bool) = opt->default_value != 0; break;
    case OPT_ROUNDUP:
        for (size_t i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
            SETTING(s, opt, size_t)[i] = (size_t)opt->default_value;
        break;
    }
}

void settings_default(cca_settings_t *s)
{
    memset(s, 0, sizeof(*s));
    for (int k = 0; k < CCA_SET_COUNT; k++) {
        store_default(&options[k], s);
        s->source[k] = CCA_SRC_DEFAULT;
    }
}

void settings_reset_for_new_string(cca_settings_t *s)
{
    static const cca_setting_key_t reset[] = {CCA_SET_MAX_SPLIT_SIZE_MB, CCA_SET_ROUNDUP_POWER2_DIVISIONS,
                                              CCA_SET_GARBAGE_COLLECTION_THRESHOLD};
    for (size_t i = 0; i < sizeof(reset) / sizeof(reset[0]); i++) {
        store_default(&options[reset[i]], s);
        s->source[reset[i]] = CCA_SRC_DEFAULT;
    }
}

const char *settings_key_name(cca_setting_key_t key)
{
    if ((unsigned)key >= CCA_SET_COUNT)
        return "(invalid key)";
    return options[key].name;
}

const char *settings_source_name(cca_setting_source_t source)
{
    switch (source) {
    case CCA_SRC_DEFAULT: return "default";
    case CCA_SRC_ENVIRONMENT: return "environment";
    case CCA_SRC_ARGUMENT: return "argument";
    }
    return "unknown";
}

/* Other names PyTorch accepts for a key: its ROCm spellings, taken by every
   build of PyTorch. */
static const struct {
    const char *name;
    cca_setting_key_t key;
} key_aliases[] = {
    {"release_lock_on_hipmalloc", CCA_SET_RELEASE_LOCK_ON_CUDAMALLOC},
    {"pinned_use_hip_host_register", CCA_SET_PINNED_USE_CUDA_HOST_REGISTER},
};

bool settings_lookup_key(const char *name, size_t len, cca_setting_key_t *key)
{
    for (int k = 0; k < CCA_SET_COUNT; k++) {
        if (word_is(name, len, options[k].name)) {
            *key = (cca_setting_key_t)k;
            return true;
        }
    }
    for (size_t a = 0; a < sizeof(key_aliases) / sizeof(key_aliases[0]); a++) {
        if (word_is(name, len, key_aliases[a].name)) {
            *key = key_aliases[a].key;
            return true;
        }
    }
    return false;
}

/* ---- errors ---------------------------------------------------------------------- */

/* Length of a span as shown in messages, and whether it was cut. */
static int shown_len(size_t len)
{
    return (int)(len > SHOW_MAX ? SHOW_MAX : len);
}

static const char *cut_mark(size_t len)
{
    return len > SHOW_MAX ? "..." : "";
}

/*
 * Raise CCA_ERR_BAD_SETTINGS for the value text[off, off+len) of opt:
 * "Invalid allocator setting 'key:value': <what>".
 */
static cca_status_t __attribute__((format(printf, 5, 6)))
bad_value(const option_t *opt, const char *text, size_t off, size_t len, const char *fmt, ...)
{
    char what[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    return cca_raise(CCA_ERR_BAD_SETTINGS, "Invalid allocator setting '%s:%.*s%s': %s", opt->name,
                     shown_len(len), text + off, cut_mark(len), what);
}

/* Text of a token for messages ("end of settings" for TOK_END). */
static void token_text(const char *text, token_t tok, char *buf, size_t size)
{
    if (tok.kind == TOK_END)
        snprintf(buf, size, "end of settings");
    else
        snprintf(buf, size, "'%.*s%s'", shown_len(tok.length), text + tok.offset,
                 cut_mark(tok.length));
}

/* The error for a character the tokenizer rejects. */
static cca_status_t bad_character(const char *text, size_t offset)
{
    unsigned char c = (unsigned char)text[offset];
    size_t len = strlen(text);
    if (c >= 0x20 && c < 0x7f)
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Invalid character '%c' at offset %zu in allocator settings '%.*s%s': "
                         "keys and values use letters, digits and _ . + -, separated by : , [ ] >",
                         c, offset, shown_len(len), text, cut_mark(len));
    return cca_raise(CCA_ERR_BAD_SETTINGS,
                     "Invalid character 0x%02x at offset %zu in allocator settings: keys and "
                     "values use letters, digits and _ . + -, separated by : , [ ] >",
                     c, offset);
}

static cca_status_t unknown_key(const char *text, token_t tok)
{
    char valid[1024];
    size_t used = 0;
    valid[0] = '\0';
    for (int k = 0; k < CCA_SET_COUNT && used < sizeof(valid); k++)
        used += (size_t)snprintf(valid + used, sizeof(valid) - used, "%s%s", k ? ", " : "",
                                 options[k].name);
    return cca_raise(CCA_ERR_BAD_SETTINGS,
                     "Unrecognized key '%.*s%s' in allocator settings; valid keys are: %s",
                     shown_len(tok.length), text + tok.offset, cut_mark(tok.length), valid);
}

/* ---- value parsers --------------------------------------------------------------- */

/*
 * A decimal integer without sign or junk: digits only, at most UINT64_MAX.
 * Returns false on anything else (the caller names the allowed values).
 */
static bool parse_u64(const char *p, size_t len, uint64_t *value)
{
    uint64_t v = 0;
    bool digits = false;
    for (size_t i = 0; i < len; i++) {
        if (is_space(p[i]))
            continue; /* inside a word: dropped */
        digits = true;
        if (p[i] < '0' || p[i] > '9')
            return false;
        unsigned digit = (unsigned)(p[i] - '0');
        if (v > (UINT64_MAX - digit) / 10)
            return false;
        v = v * 10 + digit;
    }
    if (!digits)
        return false;
    *value = v;
    return true;
}

/*
 * A finite decimal number ("0.5", "1e-3", "-2"); false on junk, inf or nan,
 * and on a number out of a double's range (under- or overflow), which
 * PyTorch's std::stod refuses too.
 */
static bool parse_double(const char *p, size_t len, double *value)
{
    char buf[64];
    size_t used = 0;
    for (size_t i = 0; i < len; i++) {
        char c = p[i];
        if (is_space(c))
            continue; /* inside a word: dropped */
        if (!((c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'))
            return false;
        if (used + 1 >= sizeof(buf))
            return false;
        buf[used++] = c;
    }
    if (used == 0)
        return false;
    buf[used] = '\0';
    char *end = NULL;
    errno = 0;
    double v = strtod(buf, &end);
    if (end != buf + used || !isfinite(v) || errno == ERANGE)
        return false;
    *value = v;
    return true;
}

static bool is_pow2(uint64_t v)
{
    return v != 0 && (v & (v - 1)) == 0;
}

static unsigned log2_floor(uint64_t v)
{
    return 63u - (unsigned)__builtin_clzll(v);
}

/* MiB to bytes, clamped to SIZE_MAX (which means unlimited). */
static size_t mib_to_bytes(uint64_t mib)
{
    if (mib > SIZE_MAX / CCA_MiB)
        return SIZE_MAX;
    return (size_t)mib * CCA_MiB;
}

/* A list where a single value is expected. */
static bool is_list(const char *text, size_t off)
{
    return text[off] == '[';
}

static cca_status_t parse_backend(const option_t *opt, cca_settings_t *s, const char *text,
                                  size_t off, size_t len)
{
    cca_backend_kind_t *field = SETTING(s, opt, cca_backend_kind_t);
    if (word_is(text + off, len, "native"))
        *field = CCA_BACKEND_NATIVE;
    else if (word_is(text + off, len, "cudaMallocAsync"))
        *field = CCA_BACKEND_ASYNC;
    else
        return bad_value(opt, text, off, len,
                         "Unknown allocator backend, options are native and cudaMallocAsync");
    return CCA_OK;
}

static cca_status_t parse_mib(const option_t *opt, cca_settings_t *s, const char *text,
                              size_t off, size_t len)
{
    uint64_t mib;
    if (is_list(text, off) || !parse_u64(text + off, len, &mib))
        return bad_value(opt, text, off, len, "expected %s", opt->allowed);
    if (mib < opt->min)
        return bad_value(opt, text, off, len, "%s", opt->range_error);
    *SETTING(s, opt, size_t) = mib_to_bytes(mib);
    return CCA_OK;
}

static cca_status_t parse_fraction(const option_t *opt, cca_settings_t *s, const char *text,
                                   size_t off, size_t len)
{
    double v;
    if (is_list(text, off) || !parse_double(text + off, len, &v))
        return bad_value(opt, text, off, len, "expected %s", opt->allowed);
    if (v < opt->lo || (opt->lo_open && v == opt->lo))
        return bad_value(opt, text, off, len, "%s", opt->too_small);
    if (v > opt->hi || (opt->hi_open && v == opt->hi))
        return bad_value(opt, text, off, len, "%s", opt->too_big);
    *SETTING(s, opt, double) = v;
    return CCA_OK;
}

static cca_status_t parse_bool(const option_t *opt, cca_settings_t *s, const char *text,
                               size_t off, size_t len)
{
    static const struct {
        const char *word;
        bool value;
    } words[] = {{"True", true}, {"False", false}, {"true", true},
                 {"false", false}, {"1", true},   {"0", false}};
    /* PyTorch's keys take only the first two spellings */
    size_t spellings = opt->cca_only ? sizeof(words) / sizeof(words[0]) : 2;
    for (size_t i = 0; i < spellings; i++) {
        if (word_is(text + off, len, words[i].word)) {
            *SETTING(s, opt, bool) = words[i].value;
            return CCA_OK;
        }
    }
    return bad_value(opt, text, off, len, "Expected a value of %s for %s", opt->allowed,
                     opt->name);
}

static cca_status_t parse_pow2(const option_t *opt, cca_settings_t *s, const char *text,
                               size_t off, size_t len)
{
    uint64_t v;
    if (is_list(text, off) || !parse_u64(text + off, len, &v))
        return bad_value(opt, text, off, len, "expected %s", opt->allowed);
    if (!is_pow2(v) || v > opt->max)
        return bad_value(opt, text, off, len, "%s", opt->range_error);
    *SETTING(s, opt, size_t) = (size_t)v;
    return CCA_OK;
}

/* A roundup division in a list: 0 (no rounding) or a power of two. */
static bool valid_division(uint64_t d)
{
    return d == 0 || is_pow2(d);
}

#define DIVISIONS_ERROR "For roundups, the divisions have to be power of 2 or 0"

/*
 * The list form [B:D,B:D,...,>:D] over text[off, off+len), which starts with
 * '[' and ends with ']' (the caller checked the brackets), read as PyTorch
 * 2.11 reads it. B is an interval start in MiB, a power of two, at index
 * log2(B) clamped to 15; entries apply in order, so a later entry overwrites
 * an earlier one whatever their order. The first B entry also fills the
 * indices below it; '>' fills the indices after the last B entry's (after
 * index 0 when no B entry came before it). Indices no entry covers get 0, so
 * the empty list [] turns rounding off. One ',' may follow the last entry.
 */
static cca_status_t parse_roundup_list(const option_t *opt, size_t out[CCA_ROUNDUP_INTERVALS],
                                       const char *text, size_t off, size_t len)
{
    scanner_t sc = {text, off + 1, off + len - 1};
    size_t last_index = 0;
    size_t entries = 0;
    bool first_interval = true;

    for (size_t i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
        out[i] = 0;
    for (;;) {
        token_t first = scan_next(&sc);
        if (first.kind == TOK_END)
            return CCA_OK;
        if (entries > 0) {
            if (first.kind != TOK_COMMA)
                return bad_value(opt, text, off, len,
                                 "entries of the list must be separated by ','; expected %s",
                                 opt->allowed);
            first = scan_next(&sc);
            if (first.kind == TOK_END)
                return CCA_OK; /* a trailing ',' (PyTorch skips it) */
        }
        token_t colon = scan_next(&sc);
        token_t division = scan_next(&sc);
        if ((first.kind != TOK_WORD && first.kind != TOK_GREATER) || colon.kind != TOK_COLON ||
            division.kind != TOK_WORD)
            return bad_value(opt, text, off, len,
                             "each entry must be interval:divisions or >:divisions; expected %s",
                             opt->allowed);

        uint64_t d;
        if (!parse_u64(text + division.offset, division.length, &d) || !valid_division(d))
            return bad_value(opt, text, off, len, "%s", DIVISIONS_ERROR);

        if (first.kind == TOK_GREATER) {
            for (size_t i = last_index + 1; i < CCA_ROUNDUP_INTERVALS; i++)
                out[i] = (size_t)d;
        } else {
            uint64_t interval;
            if (!parse_u64(text + first.offset, first.length, &interval) || !is_pow2(interval))
                return bad_value(opt, text, off, len,
                                 "For roundups, the intervals have to be power of 2");
            size_t index = log2_floor(interval);
            if (index >= CCA_ROUNDUP_INTERVALS)
                index = CCA_ROUNDUP_INTERVALS - 1;
            if (first_interval) {
                for (size_t i = 0; i < index; i++)
                    out[i] = (size_t)d;
                first_interval = false;
            }
            out[index] = (size_t)d;
            last_index = index;
        }
        entries++;
    }
}

static cca_status_t parse_roundup(const option_t *opt, cca_settings_t *s, const char *text,
                                  size_t off, size_t len)
{
    size_t *field = SETTING(s, opt, size_t);
    size_t divisions[CCA_ROUNDUP_INTERVALS];

    if (is_list(text, off)) {
        cca_status_t status = parse_roundup_list(opt, divisions, text, off, len);
        if (status != CCA_OK)
            return status;
    } else {
        /* the single value has no 0: PyTorch asks for a power of two here */
        uint64_t d;
        if (!parse_u64(text + off, len, &d))
            return bad_value(opt, text, off, len, "expected %s", opt->allowed);
        if (!is_pow2(d))
            return bad_value(opt, text, off, len,
                             "For roundups, the divisions has to be power of 2 (1 or the "
                             "empty list [] means no rounding)");
        for (size_t i = 0; i < CCA_ROUNDUP_INTERVALS; i++)
            divisions[i] = (size_t)d;
    }
    memcpy(field, divisions, sizeof(divisions));
    return CCA_OK;
}

/* ---- the parser ------------------------------------------------------------------ */

/*
 * Rules between keys, checked on the combined result of a parse: as PyTorch,
 * max_split_size_mb and max_non_split_rounding_mb are at least
 * large_segment_size_mb (the value after this parse, as PyTorch reads that key
 * first).
 */
static cca_status_t check_cross_keys(const cca_settings_t *s)
{
    size_t large_mib = s->large_segment_size / CCA_MiB;
    if (s->max_split_size != SIZE_MAX && s->max_split_size < s->large_segment_size)
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Invalid allocator settings 'max_split_size_mb:%zu' with "
                         "'large_segment_size_mb:%zu': max_split_size_mb too small, must be >= "
                         "%zu (large_segment_size_mb)",
                         s->max_split_size / CCA_MiB, large_mib, large_mib);
    if (s->max_non_split_rounding < s->large_segment_size)
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Invalid allocator settings 'max_non_split_rounding_mb:%zu' with "
                         "'large_segment_size_mb:%zu': max_non_split_rounding_mb too small, must "
                         "be >= %zu (large_segment_size_mb)",
                         s->max_non_split_rounding / CCA_MiB, large_mib, large_mib);
    return CCA_OK;
}

/*
 * Parse one "key:value" element starting at the key token; on success the
 * cursor is after the value. The text holds no bad character (settings_parse
 * checked), so TOK_BAD cannot come. Returns CCA_OK or CCA_ERR_BAD_SETTINGS.
 */
static cca_status_t parse_element(scanner_t *sc, token_t key_tok, cca_settings_t *work,
                                  cca_setting_source_t source, cca_setting_key_t *named)
{
    const char *text = sc->text;
    char found[SHOW_MAX + 8];
    cca_setting_key_t key;

    if (key_tok.kind != TOK_WORD) {
        token_text(text, key_tok, found, sizeof(found));
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Empty key at offset %zu in allocator settings (found %s); expected "
                         "key:value pairs separated by ','",
                         key_tok.offset, found);
    }
    if (!settings_lookup_key(text + key_tok.offset, key_tok.length, &key))
        return unknown_key(text, key_tok);
    const option_t *opt = &options[key];

    token_t colon = scan_next(sc);
    if (colon.kind != TOK_COLON) {
        token_text(text, colon, found, sizeof(found));
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Missing ':' after key '%s' in allocator settings (found %s); expected "
                         "'%s:<value>' with a value of %s",
                         opt->name, found, opt->name, opt->allowed);
    }

    token_t value = scan_next(sc);
    size_t value_off = value.offset, value_len = value.length;
    if (value.kind == TOK_LBRACKET) {
        for (;;) {
            token_t t = scan_next(sc);
            if (t.kind == TOK_END || t.kind == TOK_LBRACKET) {
                size_t shown = (t.kind == TOK_END ? sc->end : t.offset) - value_off;
                return bad_value(opt, text, value_off, shown,
                                 "unbalanced brackets: '[' without its ']'; expected %s",
                                 opt->allowed);
            }
            if (t.kind == TOK_RBRACKET) {
                value_len = t.offset + 1 - value_off;
                break;
            }
        }
    } else if (value.kind != TOK_WORD) {
        token_text(text, value, found, sizeof(found));
        return cca_raise(CCA_ERR_BAD_SETTINGS,
                         "Missing value for key '%s' in allocator settings (found %s); expected "
                         "'%s:<value>' with a value of %s",
                         opt->name, found, opt->name, opt->allowed);
    }

    cca_status_t status = handlers[opt->type].parse(opt, work, text, value_off, value_len);
    if (status != CCA_OK)
        return status;
    work->source[key] = source;
    *named = key;
    return CCA_OK;
}

cca_status_t settings_parse(cca_settings_t *s, const char *text, cca_setting_source_t source)
{
    if (!s)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "settings_parse: settings is NULL");
    if (!text)
        return CCA_OK;

    cca_settings_t work = *s;
    scanner_t sc = {text, 0, strlen(text)};
    char found[SHOW_MAX + 8];
    size_t bad_offset = 0;

    /* characters first, so that a bad one is reported as such wherever it is */
    if (!settings_tokenize(text, NULL, 0, NULL, &bad_offset))
        return bad_character(text, bad_offset);
    bool named_expandable = false, named_large_segment = false, named_non_split = false;

    for (;;) {
        token_t key_tok = scan_next(&sc);
        if (key_tok.kind == TOK_END)
            break; /* empty string, or one trailing ',' (accepted, as PyTorch does) */
        size_t element_off = key_tok.offset;
        cca_setting_key_t named = CCA_SET_COUNT;
        cca_status_t status = parse_element(&sc, key_tok, &work, source, &named);
        named_expandable |= named == CCA_SET_EXPANDABLE_SEGMENTS;
        named_large_segment |= named == CCA_SET_LARGE_SEGMENT_SIZE_MB;
        named_non_split |= named == CCA_SET_MAX_NON_SPLIT_ROUNDING_MB;
        size_t element_len = sc.pos - element_off;
        if (status != CCA_OK)
            return status;

        token_t sep = scan_next(&sc);
        if (sep.kind == TOK_END)
            break;
        if (sep.kind != TOK_COMMA) {
            token_text(text, sep, found, sizeof(found));
            return cca_raise(CCA_ERR_BAD_SETTINGS,
                             "Unexpected %s after '%.*s%s' in allocator settings; settings are "
                             "key:value pairs separated by ','",
                             found, shown_len(element_len), text + element_off,
                             cut_mark(element_len));
        }
    }

    /* max_non_split_rounding_mb defaults to the segment size: PyTorch sets it to
       large_segment_size_mb before reading the other keys */
    if (named_large_segment && !named_non_split) {
        work.max_non_split_rounding = work.large_segment_size;
        work.source[CCA_SET_MAX_NON_SPLIT_ROUNDING_MB] = source;
    }

    /* compact_memory implies expandable_segments, unless this text turns those off */
    if (work.compact_memory) {
        if (!work.expandable_segments && named_expandable)
            return cca_raise(CCA_ERR_BAD_SETTINGS,
                             "Invalid allocator settings 'compact_memory:True' with "
                             "'expandable_segments:False': compact_memory needs expandable segments");
        work.expandable_segments = true;
    }
    cca_status_t status = check_cross_keys(&work);
    if (status != CCA_OK)
        return status;
    *s = work;
    return CCA_OK;
}

/* ---- the printer ----------------------------------------------------------------- */

static void print_backend(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    cca_backend_kind_t kind = *SETTING_C(s, opt, cca_backend_kind_t);
    sb_append(out, kind == CCA_BACKEND_ASYNC ? "cudaMallocAsync" : "native");
}

static void print_mib(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    size_t bytes = *SETTING_C(s, opt, size_t);
    if (bytes == SIZE_MAX)
        sb_append(out, "unlimited");
    else if (bytes % CCA_MiB == 0)
        sb_printf(out, "%zu", bytes / CCA_MiB);
    else
        sb_printf(out, "%g", (double)bytes / (double)CCA_MiB);
}

static void print_fraction(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    sb_printf(out, "%g", *SETTING_C(s, opt, double));
}

static void print_bool(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    sb_append(out, *SETTING_C(s, opt, bool) ? "True" : "False");
}

static void print_pow2(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    sb_printf(out, "%zu", *SETTING_C(s, opt, size_t));
}

/*
 * The divisions in a compact form that parses back to the same array: one
 * value when all are equal ("[]" when all are 0), else a list where the first run is one entry at
 * its last index, middle runs one entry per index, and the last run is '>'.
 */
static void print_roundup(const option_t *opt, const cca_settings_t *s, cca_strbuf_t *out)
{
    const size_t *d = SETTING_C(s, opt, size_t);
    size_t first_end = 0; /* last index of the first run */
    size_t last_start = CCA_ROUNDUP_INTERVALS - 1; /* first index of the last run */

    while (first_end + 1 < CCA_ROUNDUP_INTERVALS && d[first_end + 1] == d[0])
        first_end++;
    if (first_end == CCA_ROUNDUP_INTERVALS - 1) {
        /* no rounding anywhere is the empty list: a single value cannot be 0 */
        if (d[0] == 0)
            sb_append(out, "[]");
        else
            sb_printf(out, "%zu", d[0]);
        return;
    }
    while (last_start > first_end + 1 && d[last_start - 1] == d[CCA_ROUNDUP_INTERVALS - 1])
        last_start--;
    sb_printf(out, "[%zu:%zu", (size_t)1 << first_end, d[0]);
    for (size_t i = first_end + 1; i < last_start; i++)
        sb_printf(out, ",%zu:%zu", (size_t)1 << i, d[i]);
    sb_printf(out, ",>:%zu]", d[CCA_ROUNDUP_INTERVALS - 1]);
}

void settings_describe(const cca_settings_t *s, cca_strbuf_t *out)
{
    for (int k = 0; k < CCA_SET_COUNT; k++) {
        const option_t *opt = &options[k];
        sb_append(out, opt->name);
        sb_append(out, " ");
        handlers[opt->type].print(opt, s, out);
        sb_printf(out, " (%s)\n", settings_source_name(s->source[k]));
    }
}

/* ---- public ---------------------------------------------------------------------- */

cca_status_t cca_settings_describe(const char *settings, char **text)
{
    cca_settings_t s;
    cca_strbuf_t sb;
    cca_status_t status;

    if (!text)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "cca_settings_describe: text is NULL");
    settings_default(&s);
    status = settings_parse(&s, getenv("CCA_ALLOC_CONF"), CCA_SRC_ENVIRONMENT);
    if (status != CCA_OK) {
        char message[sizeof(cca_last_error()->message)];
        snprintf(message, sizeof(message), "%s", cca_last_error()->message);
        return cca_raise(status, "CCA_ALLOC_CONF: %s", message);
    }
    status = settings_parse(&s, settings, CCA_SRC_ARGUMENT);
    if (status != CCA_OK)
        return status;

    sb_init(&sb);
    settings_describe(&s, &sb);
    if (sb.failed || !sb.data) {
        sb_free(&sb);
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "cca_settings_describe: out of host memory");
    }
    *text = sb.data;
    return CCA_OK;
}
