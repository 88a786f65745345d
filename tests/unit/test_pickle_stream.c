/*
 * test_pickle_stream.c - the streaming pickle reader against the tree reader:
 * every real trace streamed with its events as records must give, record by
 * record and field by field, what the tree reader finds, and the same tree for
 * the other fields; the same at window sizes that cut every opcode; every
 * pickle of the fuzz corpus streamed as a tree equals the tree reader's result
 * (or both fail); misuse and malformed shapes fail cleanly.
 */
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "harness.h"
#include "pickle_input.h"
#include "pickle_stream.h"
#include "pickle_compare.h"

static const char *const traces[] = {
    "gpt2_generate_default", "gpt2_train_default", "gpt2_train_gc07", "gpt2_train_split64",
    "graph_mlp_default", "mempool_default", "resnet50_train_default", "resnet50_train_expandable",
    "two_stream_pipeline_default", "two_stream_pipeline_round8",
};

/* ---- comparing ------------------------------------------------------------------------ */

/* Nodes same_tree may still visit: trees sharing nodes through the memo (the corpus's
 * "billion laughs") would take 2^depth steps; the corpus test bounds its walks. */
static long same_tree_budget = LONG_MAX;

static bool same_tree(const pv_node_t *a, const pv_node_t *b, int depth)
{
    if (depth > 100 || --same_tree_budget < 0)
        return true;
    if (pv_kind(a) != pv_kind(b) || pv_len(a) != pv_len(b))
        return false;
    int64_t ia, ib;
    uint64_t ua, ub;
    double da, db;
    bool ba, bb;
    const uint8_t *pa, *pb;
    const char *sa, *sb;
    size_t la, lb;
    switch (pv_kind(a)) {
    case PV_NONE: return true;
    case PV_BOOL: return pv_get_bool(a, &ba) && pv_get_bool(b, &bb) && ba == bb;
    case PV_INT:
        if (pv_get_int(a, &ia))
            return pv_get_int(b, &ib) && ia == ib;
        return pv_get_u64(a, &ua) && pv_get_u64(b, &ub) && ua == ub;
    case PV_FLOAT:
        pv_get_double(a, &da);
        pv_get_double(b, &db);
        return memcmp(&da, &db, sizeof(da)) == 0;
    case PV_STR:
        return pv_get_str(a, &sa, &la) && pv_get_str(b, &sb, &lb) && la == lb && !memcmp(sa, sb, la);
    case PV_BYTES:
        return pv_get_bytes(a, &pa, &la) && pv_get_bytes(b, &pb, &lb) && !memcmp(pa, pb, la);
    case PV_BIGINT:
        return pv_get_bigint(a, &pa, &la) && pv_get_bigint(b, &pb, &lb) && !memcmp(pa, pb, la);
    case PV_LIST:
    case PV_TUPLE:
        for (size_t i = 0; i < pv_len(a); i++)
            if (!same_tree(pv_at(a, i), pv_at(b, i), depth + 1))
                return false;
        return true;
    case PV_DICT:
        for (size_t i = 0; i < pv_len(a); i++)
            if (!same_tree(pv_dict_key_at(a, i), pv_dict_key_at(b, i), depth + 1) ||
                !same_tree(pv_dict_value_at(a, i), pv_dict_value_at(b, i), depth + 1))
                return false;
        return true;
    }
    return false;
}

/* ---- a consumer checking each record against the tree reader's result ------------------------ */

static const char *const syms[] = {"action", "addr", "size", "stream", "alloc", "free_completed"};

typedef struct checker {
    const pv_node_t *traces;  /* the tree reader's device_traces */
    size_t records, bad, groups;
    size_t by_tag_checked;
    const char *records_field;
} checker_t;

static pk_mode_t mode_of(void *ctx, const char *key, size_t len)
{
    checker_t *c = ctx;
    if (c->records_field && strlen(c->records_field) == len && !memcmp(key, c->records_field, len))
        return PK_RECORDS;
    return PK_TREE;
}

static cca_status_t on_group(void *ctx, const char *field, size_t group)
{
    checker_t *c = ctx;
    (void)field;
    if (group != c->groups)
        c->bad++;
    c->groups++;
    return CCA_OK;
}

static cca_status_t on_record(void *ctx, const pk_record_t *rec)
{
    checker_t *c = ctx;
    const pv_node_t *list = pv_at(c->traces, rec->group);
    const pv_node_t *d = list ? pv_at(list, rec->index) : NULL;
    if (!d || pv_len(d) != rec->count || strcmp(rec->field, "device_traces")) {
        c->bad++;
        return CCA_OK;
    }
    for (size_t i = 0; i < rec->count; i++) {
        pk_field_t f;
        if (!pk_record_field(rec, i, &f) || !pickle_value_is(&f.key, pv_dict_key_at(d, i)) ||
            !pickle_value_is(&f.value, pv_dict_value_at(d, i)))
            c->bad++;
    }
    pk_field_t none;
    if (pk_record_field(rec, rec->count, &none))
        c->bad++;
    for (size_t t = 0; t < sizeof(syms) / sizeof(syms[0]); t++) {
        const pv_node_t *want = pv_dict_get(d, syms[t]);
        const pk_value_t *got = rec->by_tag[t];
        if ((want == NULL) != (got == NULL) || (want && !pickle_value_is(got, want)))
            c->bad++;
        c->by_tag_checked += got != NULL;
    }
    /* a str value equal to a symbol carries its tag */
    const pk_value_t *action = rec->by_tag[0];
    if (action && action->kind == PV_STR) {
        int32_t want_tag = !strcmp(action->data, "alloc") ? 4 : !strcmp(action->data, "free_completed") ? 5 : -1;
        if (action->tag != want_tag)
            c->bad++;
    }
    c->records++;
    return CCA_OK;
}

static char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    rewind(f);
    char *data = malloc(size > 0 ? (size_t)size : 1);
    *n = data ? fread(data, 1, (size_t)size, f) : 0;
    fclose(f);
    return data;
}

/* Stream one trace (from the file, or from memory at a window size) and check it. */
static void check_trace(const char *name, size_t chunk, bool from_file)
{
    char path[256];
    snprintf(path, sizeof(path), "tests/data/traces/%s.pickle.gz", name);
    pv_doc_t *tree = NULL;
    if (pickle_load_file(path, &tree) != CCA_OK) {
        HARNESS_FAIL("%s: tree load: %s", name, cca_last_error()->message);
        return;
    }
    const pv_node_t *root = pv_doc_root(tree);
    checker_t c = {.traces = pv_dict_get(root, "device_traces"), .records_field = "device_traces"};
    pk_handler_t h = {
        .ctx = &c, .symbols = syms, .symbol_count = sizeof(syms) / sizeof(syms[0]),
        .field_mode = mode_of, .record = on_record, .group = on_group,
    };
    pv_doc_t *fields = NULL;
    cca_status_t st;
    if (from_file) {
        st = pickle_stream_file(path, &h, &fields);
    } else {
        size_t n = 0;
        char *data = read_all(path, &n);
        st = pickle_stream_buffer(data, n, chunk, &h, &fields);
        free(data);
    }
    if (st != CCA_OK) {
        HARNESS_FAIL("%s (chunk %zu): %s", name, chunk, cca_last_error()->message);
        pv_doc_free(tree);
        return;
    }
    size_t want_records = 0;
    for (size_t g = 0; g < pv_len(c.traces); g++)
        want_records += pv_len(pv_at(c.traces, g));
    expect_eq_u64(c.records, want_records);
    expect_eq_u64(c.groups, pv_len(c.traces));
    expect_eq_u64(c.bad, 0);
    expect_true(c.by_tag_checked >= want_records);
    /* the tree fields: every top-level field but device_traces, in order */
    const pv_node_t *kept = pv_doc_root(fields);
    expect_eq_u64(pv_len(kept) + 1, pv_len(root));
    for (size_t i = 0, j = 0; i < pv_len(root); i++) {
        if (pv_str_eq(pv_dict_key_at(root, i), "device_traces"))
            continue;
        expect_true(same_tree(pv_dict_key_at(root, i), pv_dict_key_at(kept, j), 0));
        expect_true(same_tree(pv_dict_value_at(root, i), pv_dict_value_at(kept, j), 0));
        j++;
    }
    pv_doc_free(fields);
    pv_doc_free(tree);
}

TEST(real_traces_stream_as_the_tree_reader_reads_them)
{
    for (size_t i = 0; i < sizeof(traces) / sizeof(traces[0]); i++)
        check_trace(traces[i], 0, true);
}

TEST(window_sizes_cut_every_opcode)
{
    static const size_t chunks[] = {1, 2, 3, 7, 64, 4093};
    for (size_t i = 0; i < sizeof(chunks) / sizeof(chunks[0]); i++)
        check_trace("two_stream_pipeline_default", chunks[i], false);
    check_trace("gpt2_train_gc07", 5, false);
}

/* ---- everything as a tree: the fuzz corpus ------------------------------------------------------ */

static pk_mode_t all_tree(void *ctx, const char *key, size_t len)
{
    (void)ctx, (void)key, (void)len;
    return PK_TREE;
}

TEST(corpus_streamed_as_a_tree_equals_the_tree_reader)
{
    DIR *dir = opendir("tests/fuzz/corpus/pickle");
    if (!dir) {
        HARNESS_FAIL("no pickle corpus");
        return;
    }
    size_t files = 0, both_ok = 0, mismatches = 0;
    pk_handler_t h = {.field_mode = all_tree};
    struct dirent *de;
    while ((de = readdir(dir)) != NULL) {
        if (de->d_name[0] == '.')
            continue;
        char path[512];
        snprintf(path, sizeof(path), "tests/fuzz/corpus/pickle/%s", de->d_name);
        size_t n = 0;
        char *data = read_all(path, &n);
        if (!data)
            continue;
        files++;
        static const size_t chunks[] = {0, 1, 5};
        for (size_t k = 0; k < 3; k++) {
            pv_doc_t *a = NULL, *b = NULL;
            cca_status_t sa = pickle_load_buffer(data, n, &a);
            cca_status_t sb = pickle_stream_buffer(data, n, chunks[k], &h, &b);
            same_tree_budget = 1000000;
            bool same = sa == CCA_OK && same_tree(pv_doc_root(a), pv_doc_root(b), 0);
            same_tree_budget = LONG_MAX;
            if (sb == CCA_OK && !same) {
                mismatches++;
                printf("  mismatch: %s (chunk %zu)\n", de->d_name, chunks[k]);
            }
            if (sa == CCA_OK && sb != CCA_OK &&
                !strstr(cca_last_error()->message, "memo index")) {
                mismatches++;
                printf("  stream failed where the tree reader did not: %s (chunk %zu): %s\n",
                       de->d_name, chunks[k], cca_last_error()->message);
            }
            both_ok += sa == CCA_OK && sb == CCA_OK;
            pv_doc_free(a);
            pv_doc_free(b);
        }
        free(data);
    }
    closedir(dir);
    expect_true(files > 100);
    expect_true(both_ok > 100);
    expect_eq_u64(mismatches, 0);
}

/* ---- shapes and errors ------------------------------------------------------------------------------ */

static pk_mode_t records_x(void *ctx, const char *key, size_t len)
{
    (void)ctx;
    if (len == 1 && key[0] == 'x')
        return PK_RECORDS;
    if (len == 1 && key[0] == 's')
        return PK_SKIP;
    return PK_TREE;
}

typedef struct counter {
    size_t records;
    int64_t sum;
    size_t last_group;
} counter_t;

static cca_status_t count_record(void *ctx, const pk_record_t *rec)
{
    counter_t *c = ctx;
    c->records++;
    c->last_group = rec->group;
    if (rec->by_tag[0] && rec->by_tag[0]->kind == PV_INT)
        c->sum += rec->by_tag[0]->num.i;
    return CCA_OK;
}

static cca_status_t stop_record(void *ctx, const pk_record_t *rec)
{
    (void)ctx, (void)rec;
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "consumer stops");
}

static const char *const sym_a[] = {"a"};

static cca_status_t stream_lit(const char *bytes, size_t n, counter_t *c, pv_doc_t **doc,
                               cca_status_t (*rec)(void *, const pk_record_t *))
{
    pk_handler_t h = {.ctx = c, .symbols = sym_a, .symbol_count = 1, .field_mode = records_x,
                      .record = rec ? rec : count_record};
    return pickle_stream_buffer(bytes, n, 3, &h, doc);
}
#define STREAM(lit, c, doc) stream_lit(lit, sizeof(lit) - 1, c, doc, NULL)

TEST(flat_nested_and_protocol0_records)
{
    counter_t c = {0};
    pv_doc_t *doc = NULL;
    /* protocol 4, batched: {'x': [{'a': 1}, {'a': 2}], 'y': 3} */
    expect_eq_i64(STREAM("\x80\x04}\x94(\x8c\x01x\x94]\x94(}\x94\x8c\x01" "a\x94K\x01s}\x94h\x04K\x02s"
                         "e\x8c\x01y\x94K\x03u.", &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 2);
    expect_eq_i64(c.sum, 3);
    expect_eq_u64(pv_len(pv_doc_root(doc)), 1);
    expect_true(pv_dict_get(pv_doc_root(doc), "y") != NULL);
    pv_doc_free(doc);
    /* nested, APPEND style: {'x': [[{'a': 5}], [{'a': 6}, {'a': 7}]]} */
    memset(&c, 0, sizeof(c));
    expect_eq_i64(STREAM("\x80\x02}(X\x01\x00\x00\x00x](]}X\x01\x00\x00\x00" "aK\x05sa](}X\x01\x00\x00\x00"
                         "aK\x06s}X\x01\x00\x00\x00" "aK\x07seeu.", &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 3);
    expect_eq_i64(c.sum, 18);
    expect_eq_u64(c.last_group, 1);
    pv_doc_free(doc);
    /* protocol 0: built bottom-up with DICT / LIST, so the records come from a tree */
    memset(&c, 0, sizeof(c));
    expect_eq_i64(STREAM("(X\x01\x00\x00\x00x((X\x01\x00\x00\x00" "aI9\ndlX\x01\x00\x00\x00sI1\nd.", &c, &doc),
                  CCA_OK);
    expect_eq_u64(c.records, 1);
    expect_eq_i64(c.sum, 9);
    expect_eq_u64(pv_len(pv_doc_root(doc)), 0); /* 's' skipped */
    pv_doc_free(doc);
}

TEST(malformed_shapes_fail_cleanly)
{
    counter_t c = {0};
    pv_doc_t *doc = (pv_doc_t *)0x1;
    /* a records field that is a dict */
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01x}u.", &c, &doc), CCA_ERR_FORMAT);
    expect_true(doc == NULL);
    expect_contains(cca_last_error()->message, "not a list of records");
    /* a records field that is an int */
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01xK\x01u.", &c, &doc), CCA_ERR_FORMAT);
    /* a records list holding an int */
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01x](K\x01" "eu.", &c, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "not a list of records");
    /* a streamed record referenced again in a kept field: read again whole, the record
     * handed over once */
    memset(&c, 0, sizeof(c));
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01x](}\x94" "e\x8c\x01yh\x00u.", &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 1);
    expect_eq_i64(pv_kind(pv_dict_get(pv_doc_root(doc), "y")), PV_DICT);
    pv_doc_free(doc);
    doc = (pv_doc_t *)0x1;
    /* truncated, in the middle of a string, and without STOP */
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x05xy", &c, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "truncated");
    expect_eq_i64(STREAM("\x80\x04}", &c, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "without STOP");
    /* a bad opcode, and invalid UTF-8 */
    expect_eq_i64(STREAM("\x80\x04\xff", &c, &doc), CCA_ERR_FORMAT);
    expect_eq_i64(STREAM("\x80\x04\x8c\x01\xff.", &c, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "UTF-8");
    /* a consumer's status stops the reading */
    static const char stops[] = "\x80\x04}(\x8c\x01x](}e\x8c\x01yK\x01u.";
    expect_eq_i64(stream_lit(stops, sizeof(stops) - 1, &c, &doc, stop_record), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "consumer stops");
    expect_true(doc == NULL);
}

TEST(misuse_and_io_errors)
{
    pk_handler_t h = {0};
    pv_doc_t *doc = NULL;
    expect_eq_i64(pickle_stream_file(NULL, &h, &doc), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(pickle_stream_file("x", NULL, &doc), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(pickle_stream_file("x", &h, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(pickle_stream_buffer(NULL, 3, 0, &h, &doc), CCA_ERR_INVALID_ARGUMENT);
    pk_handler_t bad = {.symbol_count = 2};
    expect_eq_i64(pickle_stream_buffer("N.", 2, 0, &bad, &doc), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_i64(pickle_stream_file("/nonexistent-dir/x.pickle", &h, &doc), CCA_ERR_IO);
    expect_eq_i64(pickle_stream_file("/tmp", &h, &doc), CCA_ERR_IO);
    /* a corrupt and a truncated gzip stream */
    size_t n = 0;
    char *data = read_all("tests/data/traces/two_stream_pipeline_default.pickle.gz", &n);
    expect_true(data != NULL && n > 1000);
    expect_eq_i64(pickle_stream_buffer(data, n / 2, 0, &h, &doc), CCA_ERR_FORMAT);
    memset(data + 100, 0x55, 200);
    expect_eq_i64(pickle_stream_buffer(data, n, 0, &h, &doc), CCA_ERR_FORMAT);
    free(data);
    /* a top value that is not a dict comes back as the tree */
    expect_eq_i64(pickle_stream_buffer("\x80\x04K\x07.", 5, 0, &h, &doc), CCA_OK);
    int64_t v = 0;
    expect_true(pv_get_int(pv_doc_root(doc), &v) && v == 7);
    pv_doc_free(doc);
}

TEST(crc32_equals_zlibs)
{
    size_t big = (size_t)1 << 20;
    uint8_t *b = malloc(big + 64);
    expect_true(b != NULL);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < big + 64; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b[i] = (uint8_t)x;
    }
    size_t bad = 0;
    for (size_t len = 0; len < 600; len++)
        for (size_t off = 0; off < 17; off += 3) {
            uint32_t seed = (uint32_t)(len * 2654435761u);
            if (pk_crc32(seed, b + off, len) != (uint32_t)crc32(seed, b + off, (uInt)len))
                bad++;
        }
    expect_eq_u64(bad, 0);
    /* in pieces of every size, as the inflater feeds it */
    uint32_t whole = (uint32_t)crc32(0, b, (uInt)big), pieces = 0;
    for (size_t at = 0, step = 1; at < big; at += step, step = step * 7 % 70001 + 1)
        pieces = pk_crc32(pieces, b + at, at + step > big ? big - at : step);
    expect_eq_u64(pieces, whole);
    expect_eq_u64(pk_crc32(0, NULL, 0), 0);
    free(b);
}

/* The gzip trailer's CRC and length are checked, whole or read a few bytes at a time,
 * in the first member and in a second one (read after STOP). */
TEST(gzip_trailer_checked)
{
    pk_handler_t h = {0};
    pv_doc_t *doc = NULL;
    size_t n = 0;
    char *one = read_all("tests/data/traces/two_stream_pipeline_default.pickle.gz", &n);
    expect_true(one != NULL && n > 1000);
    char *two = malloc(2 * n);
    expect_true(two != NULL);
    static const size_t chunks[] = {0, 7, 4093};
    for (size_t k = 0; k < sizeof(chunks) / sizeof(chunks[0]); k++) {
        memcpy(two, one, n);
        memcpy(two + n, one, n);
        expect_eq_i64(pickle_stream_buffer(two, 2 * n, chunks[k], &h, &doc), CCA_OK);
        pv_doc_free(doc);
        static const struct { size_t from_end; const char *what; } flips[] = {
            {8, "incorrect data check"}, {5, "incorrect data check"},
            {4, "incorrect length check"}, {1, "incorrect length check"},
        };
        for (size_t f = 0; f < sizeof(flips) / sizeof(flips[0]); f++) {
            for (int member = 0; member < 2; member++) {
                size_t at = (member ? 2 * n : n) - flips[f].from_end;
                two[at] ^= 0x40;
                doc = NULL;
                expect_eq_i64(pickle_stream_buffer(two, 2 * n, chunks[k], &h, &doc), CCA_ERR_FORMAT);
                expect_contains(cca_last_error()->message, flips[f].what);
                expect_true(doc == NULL);
                two[at] ^= 0x40;
            }
        }
    }
    free(two);
    free(one);
}

/* gzip of n bytes (one member), malloc'd; NULL on failure. */
static uint8_t *gzip_of(const void *data, size_t n, size_t *out_n)
{
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    if (deflateInit2(&zs, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
        return NULL;
    size_t cap = deflateBound(&zs, (uLong)n) + 64;
    uint8_t *out = malloc(cap);
    zs.next_in = (Bytef *)(uintptr_t)data;
    zs.avail_in = (uInt)n;
    zs.next_out = out;
    zs.avail_out = (uInt)cap;
    int zr = out ? deflate(&zs, Z_FINISH) : Z_MEM_ERROR;
    *out_n = zs.total_out;
    deflateEnd(&zs);
    if (zr != Z_STREAM_END) {
        free(out);
        return NULL;
    }
    return out;
}

/* gzip (level 1) of the pickle BINUNICODE8 n 'a' bytes STOP, made a MiB at a time; malloc'd. */
static uint8_t *gzip_str_pickle(uint64_t n, size_t *out_n)
{
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    if (deflateInit2(&zs, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
        return NULL;
    size_t cap = (size_t)(n / 50) + 65536, piece = (size_t)1 << 20;
    uint8_t *out = malloc(cap), *in = malloc(piece);
    uint8_t head[11] = {0x80, 0x04, 0x8d};
    for (int i = 0; i < 8; i++)
        head[3 + i] = (uint8_t)(n >> (8 * i));
    int zr = out && in ? Z_OK : Z_MEM_ERROR;
    zs.next_out = out;
    zs.avail_out = (uInt)cap;
    if (in)
        memset(in, 'a', piece);
    for (uint64_t left = n; zr == Z_OK && left;) {
        size_t k = left < piece ? (size_t)left : piece;
        zs.next_in = in;
        zs.avail_in = (uInt)k;
        if (left == n) {
            zs.next_in = head;
            zs.avail_in = sizeof(head);
            zr = deflate(&zs, Z_NO_FLUSH);
            zs.next_in = in;
            zs.avail_in = (uInt)k;
        }
        zr = zr == Z_OK ? deflate(&zs, Z_NO_FLUSH) : zr;
        left -= k;
    }
    zs.next_in = (Bytef *)(uintptr_t)".";
    zs.avail_in = 1;
    zr = zr == Z_OK ? deflate(&zs, Z_FINISH) : zr;
    *out_n = zs.total_out;
    deflateEnd(&zs);
    free(in);
    if (zr != Z_STREAM_END) {
        free(out);
        return NULL;
    }
    return out;
}

/* Strings longer than the room kept before an inflated block (4 KiB) and than
 * a block (256 KiB), cut by block boundaries anywhere, read from gzip on the
 * inflating thread: the same tree as the tree reader's. */
TEST(long_strings_across_inflated_blocks)
{
    pv_doc_t *src = pv_doc_new();
    expect_true(src != NULL);
    pv_node_t *root = pv_new_dict(src), *list = pv_new_list(src);
    expect_ok(pv_dict_set(src, root, "strings", list));
    size_t max = (size_t)700 * 1024;
    char *text = malloc(max + 64);
    expect_true(text != NULL);
    uint64_t x = 88172645463325252ull;
    for (size_t i = 0; i < max + 64; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        text[i] = (char)('a' + x % 26);
    }
    static const size_t lengths[] = {1, 17, 4095, 4096, 4097, 9000, 70000, 262144, 300000, 700 * 1024};
    for (int round = 0; round < 12; round++)
        for (size_t k = 0; k < sizeof(lengths) / sizeof(lengths[0]); k++)
            expect_ok(pv_list_append(src, list, pv_new_strn(src, text + (k * 7 + (size_t)round) % 32,
                                                            lengths[k] + (k * 5 + (size_t)round) % 29)));
    free(text);
    cca_strbuf_t raw;
    sb_init(&raw);
    expect_ok(pickle_write_buffer(root, &raw));
    size_t gz_n = 0;
    uint8_t *gz = gzip_of(raw.data, raw.len, &gz_n);
    expect_true(gz != NULL);
    /* the tree written, read back: from gzip on the inflating thread, and from gzip and
     * the raw pickle 7 and 4093 bytes at a time (strings of 64 KiB and more are read
     * into their node a window at a time) */
    pk_handler_t h = {0};
    static const size_t chunks[] = {0, 7, 4093};
    for (size_t k = 0; k < 6; k++) {
        pv_doc_t *got = NULL;
        if (k < 3)
            expect_ok(pickle_stream_buffer(gz, gz_n, chunks[k], &h, &got));
        else
            expect_ok(pickle_stream_buffer(raw.data, raw.len, chunks[k - 3], &h, &got));
        expect_true(got && same_tree(root, pv_doc_root(got), 0));
        pv_doc_free(got);
    }
    free(gz);
    sb_free(&raw);
    pv_doc_free(src);
}

/* ---- the key template: keys that change, memo entries set again -------------------------------- */

static const char *const sym_ab[] = {"a", "b"};

typedef struct noted {
    char text[1024];
    size_t len;
} noted_t;

static void note(noted_t *n, const pk_value_t *v)
{
    size_t room = sizeof(n->text) - n->len;
    int w;
    if (!v)
        w = snprintf(n->text + n->len, room, "-");
    else if (v->kind == PV_INT)
        w = snprintf(n->text + n->len, room, "%lld", (long long)v->num.i);
    else if (v->kind == PV_STR)
        w = snprintf(n->text + n->len, room, "%s", v->data);
    else
        w = snprintf(n->text + n->len, room, "?");
    if (w > 0 && (size_t)w < room)
        n->len += (size_t)w;
}

/* Notes each record as "key=value ... |a b;": its fields, then by_tag of 'a' and 'b'. */
static cca_status_t note_record(void *ctx, const pk_record_t *rec)
{
    noted_t *n = ctx;
    for (size_t i = 0; i < rec->count; i++) {
        pk_field_t f;
        if (!pk_record_field(rec, i, &f))
            return cca_raise(CCA_ERR_FORMAT, "no field %zu", i);
        note(n, &f.key);
        n->text[n->len++] = '=';
        note(n, &f.value);
        n->text[n->len++] = ' ';
    }
    n->text[n->len++] = '|';
    note(n, rec->by_tag[0]);
    n->text[n->len++] = ' ';
    note(n, rec->by_tag[1]);
    n->text[n->len++] = ';';
    n->text[n->len] = 0;
    return CCA_OK;
}

/* Stream {'x': [records], 'y': <40 bytes>} whole and in windows of 1, 7 and 4093 bytes;
 * each time the records must be noted as `want`. */
static void expect_records(const char *records, size_t n, const char *want)
{
    static const char head[] = "\x80\x04}(\x8c\x01x](";
    static const char tail[] = "e\x8c\x01y\x8c\x28" "0123456789012345678901234567890123456789u.";
    char data[1024];
    memcpy(data, head, sizeof(head) - 1);
    memcpy(data + sizeof(head) - 1, records, n);
    memcpy(data + sizeof(head) - 1 + n, tail, sizeof(tail) - 1);
    size_t size = sizeof(head) - 1 + n + sizeof(tail) - 1;
    static const size_t chunks[] = {0, 1, 7, 4093};
    for (size_t k = 0; k < sizeof(chunks) / sizeof(chunks[0]); k++) {
        noted_t got = {.len = 0};
        pk_handler_t h = {.ctx = &got, .symbols = sym_ab, .symbol_count = 2, .field_mode = records_x,
                          .record = note_record};
        pv_doc_t *doc = NULL;
        expect_ok(pickle_stream_buffer(data, size, chunks[k], &h, &doc));
        expect_eq_str(got.text, want);
        pv_doc_free(doc);
    }
}
#define EXPECT_RECORDS(lit, want) expect_records(lit, sizeof(lit) - 1, want)

/* A memo entry set again (BINPUT in a record the general path reads) changes what
 * the same key bytes name: the records after it must not reuse the keys before. */
TEST(key_template_follows_a_memo_entry_set_again)
{
    EXPECT_RECORDS("}(\x8c\x01" "aq\x00K\x01u"          /* 'a' into memo 0 (general path) */
                   "}(h\x00K\x02u"                      /* read whole: the template learns h 0 */
                   "}(h\x00K\x03u"                      /* from the template */
                   "e("                                 /* delivered; a second batch */
                   "}(h\x00K\x04\x8c\x01" "bq\x00K\x09u" /* memo 0 set to 'b' */
                   "}(h\x00K\x05u"                      /* h 0 is 'b' now */
                   "}(h\x00K\x06u",                     /* the template's again, delivered by plan */
                   "a=1 |1 -;a=2 |2 -;a=3 |3 -;a=4 b=9 |4 9;b=5 |- 5;b=6 |- 6;");
    /* the same by LONG_BINPUT and LONG_BINGET */
    EXPECT_RECORDS("}(\x8c\x01" "ar\x07\x00\x00\x00K\x01u"
                   "}(j\x07\x00\x00\x00K\x02u"
                   "}(j\x07\x00\x00\x00K\x03u"
                   "}(j\x07\x00\x00\x00K\x04\x8c\x01" "br\x07\x00\x00\x00K\x05u"
                   "}(j\x07\x00\x00\x00K\x06u",
                   "a=1 |1 -;a=2 |2 -;a=3 |3 -;a=4 b=5 |4 5;b=6 |- 6;");
}

/* Records whose keys differ from the ones before: in another order, fewer, more, a key
 * given twice (by_tag holds its last value), then back to fewer. */
TEST(key_template_with_keys_that_change)
{
    EXPECT_RECORDS("}(\x8c\x01" "a\x94K\x01\x8c\x01" "b\x94K\x02u" /* memo 0 'a', 1 'b' */
                   "}(h\x00K\x03h\x01K\x04u"
                   "}(h\x01K\x05h\x00K\x06u"            /* swapped */
                   "}(h\x01K\x07u"                      /* fewer */
                   "}(h\x01K\x08h\x00K\x09h\x00K\x0au"  /* more, 'a' twice */
                   "}(h\x01K\x0bh\x00K\x0ch\x00K\x0du"  /* the same keys: by plan */
                   "e("
                   "}(h\x01K\x0eu"
                   "}(h\x00K\x0fu",
                   "a=1 b=2 |1 2;a=3 b=4 |3 4;b=5 a=6 |6 5;b=7 |- 7;b=8 a=9 a=10 |10 8;"
                   "b=11 a=12 a=13 |13 11;b=14 |- 14;a=15 |15 -;");
}

/* Records a pickler shared through the memo (the same dict twice in the list, in one
 * batch, in a later batch, from a kept field, from a skipped one): each handed over
 * at each place, in order, and no record twice. */
TEST(records_shared_through_the_memo)
{
    /* the same batch: before, "item 2 of a list of records is a dict, not a dict" */
    EXPECT_RECORDS("}\x94(\x8c\x01" "a\x94K\x01u"      /* record 0 into memo 0, 'a' into 1 */
                   "}(h\x01K\x02u"
                   "h\x00",                              /* record 0 again */
                   "a=1 |1 -;a=2 |2 -;a=1 |1 -;");
    /* a later batch, and twice */
    EXPECT_RECORDS("}\x94(\x8c\x01" "a\x94K\x07\x8c\x01" "b\x94K\x08u"
                   "e("
                   "}(h\x02K\x09u"
                   "h\x00h\x00",
                   "a=7 b=8 |7 8;b=9 |- 9;a=7 b=8 |7 8;a=7 b=8 |7 8;");
    /* nested lists (as device_traces): the first group's record again in the second */
    counter_t c = {0};
    pv_doc_t *doc = NULL;
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01x](](}\x94(\x8c\x01" "a\x94K\x03u}(h\x01K\x04ue"
                         "](}(h\x01K\x05uh\x00}(h\x01K\x06ueeu.", &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 5);
    expect_eq_i64(c.sum, 3 + 4 + 5 + 3 + 6);
    expect_eq_u64(c.last_group, 1);
    pv_doc_free(doc);
    /* a dict of a kept field ('y', before 'x') handed over as a record too */
    memset(&c, 0, sizeof(c));
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01y}\x94(\x8c\x01" "aK\x02u\x8c\x01x](h\x00}(\x8c\x01" "aK\x05ueu.",
                         &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 2);
    expect_eq_i64(c.sum, 7);
    expect_eq_i64(pv_len(pv_dict_get(pv_doc_root(doc), "y")), 1);
    pv_doc_free(doc);
    /* a dict of a skipped field ('s'): read again whole */
    memset(&c, 0, sizeof(c));
    expect_eq_i64(STREAM("\x80\x04}(\x8c\x01s}\x94(\x8c\x01" "aK\x02u\x8c\x01x](}(\x8c\x01" "aK\x05uh\x00" "eu.",
                         &c, &doc), CCA_OK);
    expect_eq_u64(c.records, 2);
    expect_eq_i64(c.sum, 7);
    expect_true(pv_dict_get(pv_doc_root(doc), "s") == NULL);
    pv_doc_free(doc);
    /* a consumer that stops during the second reading stops it */
    static const char shared[] = "\x80\x04}(\x8c\x01x](}\x94(\x8c\x01" "aK\x01uh\x00" "eu.";
    doc = (pv_doc_t *)0x1;
    expect_eq_i64(stream_lit(shared, sizeof(shared) - 1, &c, &doc, stop_record), CCA_ERR_INVALID_ARGUMENT);
    expect_true(doc == NULL);
}

/* A handler that wants a dict (dict_root) refuses any other top-level value when it
 * begins: a 1 GiB string in 1 MiB of gzip is refused before it is inflated. */
TEST(dict_root_refuses_other_values_at_once)
{
    pk_handler_t h = {.dict_root = true};
    pv_doc_t *doc = (pv_doc_t *)0x1;
    expect_eq_i64(pickle_stream_buffer("\x80\x04K\x07.", 5, 0, &h, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "top-level value (int) is not a dict");
    expect_eq_i64(pickle_stream_buffer("\x80\x04]\x94.", 5, 0, &h, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "(list) is not a dict");
    expect_eq_i64(pickle_stream_buffer("(lp0\n.", 6, 0, &h, &doc), CCA_ERR_FORMAT);
    expect_true(doc == NULL);
    /* protocol 0's dict, a tuple key inside its MARK, is one */
    expect_eq_i64(pickle_stream_buffer("()I1\nd.", 7, 0, &h, &doc), CCA_OK);
    expect_eq_i64(pv_kind(pv_doc_root(doc)), PV_DICT);
    pv_doc_free(doc);
    /* BINUNICODE8 of 1 GiB, gzipped (a few MiB): refused at its opcode, at offset 2 */
    size_t n = 0;
    uint8_t *gz = gzip_str_pickle((uint64_t)1 << 30, &n);
    expect_true(gz != NULL && n < ((size_t)32 << 20));
    doc = (pv_doc_t *)0x1;
    expect_eq_i64(pickle_stream_buffer(gz, n, 0, &h, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "top-level value (str) is not a dict at offset 2");
    expect_true(doc == NULL);
    free(gz);
}

int main(void)
{
    RUN(real_traces_stream_as_the_tree_reader_reads_them);
    RUN(window_sizes_cut_every_opcode);
    RUN(corpus_streamed_as_a_tree_equals_the_tree_reader);
    RUN(flat_nested_and_protocol0_records);
    RUN(malformed_shapes_fail_cleanly);
    RUN(misuse_and_io_errors);
    RUN(crc32_equals_zlibs);
    RUN(gzip_trailer_checked);
    RUN(long_strings_across_inflated_blocks);
    RUN(key_template_follows_a_memo_entry_set_again);
    RUN(key_template_with_keys_that_change);
    RUN(records_shared_through_the_memo);
    RUN(dict_root_refuses_other_values_at_once);
    return harness_done();
}
