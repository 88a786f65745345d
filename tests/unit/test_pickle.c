/*
 * test_pickle.c - the pickle reader, writer and JSON renderer: real PyTorch
 * snapshots checked against facts Python derived from them
 * (tests/data/traces/NAME.counts.txt, from make_counts.py), every opcode,
 * truncation and corruption, nesting, write/read round trips, Python reading
 * cca's output, and exact JSON.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "harness.h"
#include "pickle.h"

/* Files go to a directory of this process's own: tests of other build trees may run at once. */
static char tmp_dir[] = "/tmp/cca_test_pickle_XXXXXX";

static const char *tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", tmp_dir, name);
    return buf;
}

static const char *const traces[] = {
    "gpt2_generate_default", "gpt2_train_default", "gpt2_train_expandable", "gpt2_train_gc07",
    "gpt2_train_split64", "graph_mlp_default", "graph_mlp_expandable", "mempool_default",
    "mempool_expandable", "resnet50_train_default", "resnet50_train_expandable",
    "two_stream_pipeline_default", "two_stream_pipeline_round8", "gpt2_train20_default",
    "gpt2_train20_expandable", "resnet50_train16_default", "resnet50_train16_expandable",
    "bert_train_varlen24_default", "bert_train_varlen24_expandable", "vit_train_varbatch24_default",
    "vit_train_varbatch24_expandable", "gpt2_train_generate6_default", "gpt2_train_generate6_expandable",
    "resnet50_train_infer8_default", "resnet50_train_infer8_expandable", "resnet50_train_eval12_default",
    "resnet50_train_eval12_expandable", "gpt2_train_eval12_default", "gpt2_train_eval12_expandable",
    "gpt2_train_ckpt_bf16_12_default", "gpt2_train_ckpt_bf16_12_expandable",
    "llama_train_accum8_default", "llama_train_accum8_expandable", "t5_train_varlen24_default",
    "t5_train_varlen24_expandable", "llama_generate8_default", "llama_generate8_expandable",
    "deeplab_train_amp_varsize24_default", "deeplab_train_amp_varsize24_expandable",
};

/* Load bytes; expect success and return the doc. */
static pv_doc_t *load(const char *bytes, size_t n)
{
    pv_doc_t *doc = NULL;
    cca_status_t st = pickle_load_buffer(bytes, n, &doc);
    if (st != CCA_OK)
        HARNESS_FAIL("load failed: %s", cca_last_error()->message);
    return doc;
}
#define LOAD(lit) load(lit, sizeof(lit) - 1)

/* Expect a load to fail with CCA_ERR_FORMAT and a message containing needle. */
static void expect_format_error(const char *bytes, size_t n, const char *needle)
{
    pv_doc_t *doc = (pv_doc_t *)0x1;
    cca_status_t st = pickle_load_buffer(bytes, n, &doc);
    expect_eq_i64(st, CCA_ERR_FORMAT);
    expect_true(doc == NULL);
    if (st == CCA_ERR_FORMAT && needle)
        expect_contains(cca_last_error()->message, needle);
    if (st == CCA_OK)
        pv_doc_free(doc);
}
#define BAD(lit, needle) expect_format_error(lit, sizeof(lit) - 1, needle)

static int64_t int_of(const pv_node_t *n)
{
    int64_t v = -999;
    if (!pv_get_int(n, &v))
        HARNESS_FAIL("not an int (%s)", pv_kind_name(pv_kind(n)));
    return v;
}

/* ---- real traces ------------------------------------------------------------------ */

/* The value of `name` in a counts file; -1 when absent. */
static long long count_of(const char *counts, const char *name, char *text, size_t text_size)
{
    size_t n = strlen(name);
    for (const char *line = counts; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        if (strncmp(line, name, n) == 0 && line[n] == ' ') {
            if (text) {
                size_t len = strcspn(line + n + 1, "\n");
                snprintf(text, text_size, "%.*s", (int)len, line + n + 1);
            }
            return atoll(line + n + 1);
        }
    }
    return -1;
}

static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = calloc(1, 1 << 16);
    size_t n = buf ? fread(buf, 1, (1 << 16) - 1, f) : 0;
    (void)n;
    fclose(f);
    return buf;
}

static void check_trace(const char *name)
{
    char path[512], counts_path[512];
    snprintf(path, sizeof(path), "tests/data/traces/%s.pickle.gz", name);
    snprintf(counts_path, sizeof(counts_path), "tests/data/traces/%s.counts.txt", name);
    char *counts = read_text(counts_path);
    expect_true(counts != NULL);
    if (!counts)
        return;
    pv_doc_t *doc = NULL;
    uint64_t t0 = cca_now_ns();
    cca_status_t st = pickle_load_file(path, &doc);
    uint64_t t1 = cca_now_ns();
    expect_eq_i64(st, CCA_OK);
    if (st) {
        printf("  %s\n", cca_last_error()->message);
        free(counts);
        return;
    }
    const pv_node_t *root = pv_doc_root(doc);
    expect_eq_i64(pv_kind(root), PV_DICT);

    /* Top-level keys, in order. */
    char keys[256] = "", expected_keys[256] = "";
    for (size_t i = 0; i < pv_len(root); i++) {
        const char *k = "?";
        pv_get_str(pv_dict_key_at(root, i), &k, NULL);
        size_t used = strlen(keys);
        snprintf(keys + used, sizeof(keys) - used, "%s%s", i ? "," : "", k);
    }
    count_of(counts, "top_keys", expected_keys, sizeof(expected_keys));
    expect_eq_str(keys, expected_keys);

    const pv_node_t *events = pv_at(pv_dict_get(root, "device_traces"), 0);
    expect_eq_u64(pv_len(events), count_of(counts, "events", NULL, 0));
    const char *actions[] = {"alloc", "free_requested", "free_completed", "segment_alloc",
                             "segment_free", "segment_map", "segment_unmap", "oom", "snapshot"};
    size_t by_action[9] = {0};
    uint64_t alloc_sum = 0, max_addr = 0;
    size_t unknown = 0;
    for (size_t i = 0; i < pv_len(events); i++) {
        const pv_node_t *e = pv_at(events, i);
        size_t a = 0;
        while (a < 9 && !pv_str_eq(pv_dict_get(e, "action"), actions[a]))
            a++;
        if (a == 9) {
            unknown++;
            continue;
        }
        by_action[a]++;
        uint64_t size = 0, addr = 0;
        if (a == 0 && pv_get_u64(pv_dict_get(e, "size"), &size))
            alloc_sum += size;
        if (pv_get_u64(pv_dict_get(e, "addr"), &addr) && addr > max_addr)
            max_addr = addr;
    }
    expect_eq_u64(unknown, 0);
    for (size_t a = 0; a < 9; a++) {
        char key[64];
        snprintf(key, sizeof(key), "action.%s", actions[a]);
        long long want = count_of(counts, key, NULL, 0);
        expect_eq_u64(by_action[a], want < 0 ? 0 : (uint64_t)want);
    }
    expect_eq_u64(alloc_sum, count_of(counts, "alloc_size_sum", NULL, 0));
    expect_eq_u64(max_addr, count_of(counts, "max_addr", NULL, 0));

    const pv_node_t *segments = pv_dict_get(root, "segments");
    expect_eq_u64(pv_len(segments), count_of(counts, "segments", NULL, 0));
    size_t blocks = 0;
    for (size_t i = 0; i < pv_len(segments); i++)
        blocks += pv_len(pv_dict_get(pv_at(segments, i), "blocks"));
    expect_eq_u64(blocks, count_of(counts, "blocks", NULL, 0));

    const pv_node_t *meta = pv_dict_get(root, "cca_meta");
    const pv_node_t *stats = pv_dict_get(meta, "final_memory_stats");
    expect_eq_u64(pv_len(stats), count_of(counts, "stats_keys", NULL, 0));
    int64_t peak = -1;
    expect_true(pv_get_int(pv_dict_get(stats, "reserved_bytes.all.peak"), &peak));
    expect_eq_i64(peak, count_of(counts, "peak_reserved", NULL, 0));
    const char *summary = NULL;
    size_t summary_len = 0;
    expect_true(pv_get_str(pv_dict_get(meta, "final_memory_summary"), &summary, &summary_len));
    expect_eq_u64(summary_len, count_of(counts, "summary_len", NULL, 0));
    expect_eq_u64(strlen(summary), summary_len);
    double fraction = -1;
    expect_true(pv_get_double(pv_dict_get(meta, "fraction"), &fraction));

    /* Writing the whole snapshot and reading it back gives the same events. */
    cca_strbuf_t out;
    sb_init(&out);
    expect_ok(pickle_write_buffer(root, &out));
    pv_doc_t *again = NULL;
    expect_ok(pickle_load_buffer(out.data, out.len, &again));
    const pv_node_t *events2 = pv_at(pv_dict_get(pv_doc_root(again), "device_traces"), 0);
    expect_eq_u64(pv_len(events2), pv_len(events));
    size_t mismatches = 0;
    for (size_t i = 0; i < pv_len(events); i++) {
        const pv_node_t *a = pv_at(events, i), *b = pv_at(events2, i);
        uint64_t x = 0, y = 1;
        pv_get_u64(pv_dict_get(a, "time_us"), &x);
        pv_get_u64(pv_dict_get(b, "time_us"), &y);
        if (x != y || pv_len(a) != pv_len(b))
            mismatches++;
    }
    expect_eq_u64(mismatches, 0);
    pv_doc_free(again);
    sb_free(&out);

    if (strcmp(name, "gpt2_generate_default") == 0)
        printf("  load of %s: %.1f ms (%zu events, arena %.1f MiB)\n", name, (t1 - t0) / 1e6,
               pv_len(events), pv_doc_arena_bytes(doc) / 1048576.0);
    pv_doc_free(doc);
    free(counts);
}

TEST(real_traces)
{
    for (size_t i = 0; i < sizeof(traces) / sizeof(traces[0]); i++)
        check_trace(traces[i]);
}

/* ---- opcodes ------------------------------------------------------------------------ */

TEST(scalars)
{
    pv_doc_t *d;
    d = LOAD("\x80\x04N."); expect_true(pv_is_none(pv_doc_root(d))); pv_doc_free(d);
    bool b = false;
    d = LOAD("\x80\x04\x88."); expect_true(pv_get_bool(pv_doc_root(d), &b) && b); pv_doc_free(d);
    d = LOAD("\x80\x04\x89."); expect_true(pv_get_bool(pv_doc_root(d), &b) && !b); pv_doc_free(d);
    d = LOAD("\x80\x04K\xff."); expect_eq_i64(int_of(pv_doc_root(d)), 255); pv_doc_free(d);
    d = LOAD("\x80\x04M\x01\x02."); expect_eq_i64(int_of(pv_doc_root(d)), 0x0201); pv_doc_free(d);
    d = LOAD("\x80\x04J\xfe\xff\xff\xff."); expect_eq_i64(int_of(pv_doc_root(d)), -2); pv_doc_free(d);
    /* LONG1: 2^63 (9 bytes) is a u64; -2^63 fits int64; 2^64 is a big int. */
    uint64_t u = 0;
    d = LOAD("\x80\x04\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.");
    expect_true(pv_get_u64(pv_doc_root(d), &u) && u == (1ull << 63));
    expect_true(pv_is_u64(pv_doc_root(d)));
    int64_t i = 0;
    expect_false(pv_get_int(pv_doc_root(d), &i));
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.");
    expect_eq_i64(int_of(pv_doc_root(d)), INT64_MIN);
    expect_false(pv_get_u64(pv_doc_root(d), &u));
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8a\x00."); expect_eq_i64(int_of(pv_doc_root(d)), 0); pv_doc_free(d);
    d = LOAD("\x80\x04\x8a\x02\xff\x00."); expect_eq_i64(int_of(pv_doc_root(d)), 255); pv_doc_free(d);
    d = LOAD("\x80\x04\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.");
    const uint8_t *big;
    size_t big_len = 0;
    expect_true(pv_get_bigint(pv_doc_root(d), &big, &big_len));
    expect_eq_u64(big_len, 9);
    expect_eq_u64(big[8], 1);
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8b\x03\x00\x00\x00\x01\x00\xff.");
    expect_eq_i64(int_of(pv_doc_root(d)), -65535);
    pv_doc_free(d);
    /* Text INT / LONG (protocol 0). */
    d = LOAD("I-42\n."); expect_eq_i64(int_of(pv_doc_root(d)), -42); pv_doc_free(d);
    d = LOAD("I01\n."); expect_true(pv_get_bool(pv_doc_root(d), &b) && b); pv_doc_free(d);
    d = LOAD("I00\n."); expect_true(pv_get_bool(pv_doc_root(d), &b) && !b); pv_doc_free(d);
    d = LOAD("L18446744073709551615L\n.");
    expect_true(pv_get_u64(pv_doc_root(d), &u) && u == UINT64_MAX);
    pv_doc_free(d);
    BAD("L18446744073709551616\n.", "beyond 64 bits");
    BAD("Iabc\n.", "bad digit");
    BAD("I12", "no newline");
    /* BINFLOAT is big-endian; getters accept ints as doubles. */
    double f = 0;
    d = LOAD("\x80\x04G\x3f\xf8\x00\x00\x00\x00\x00\x00.");
    expect_true(pv_get_double(pv_doc_root(d), &f));
    expect_eq_dbl(f, 1.5);
    expect_false(pv_get_int(pv_doc_root(d), &i));
    pv_doc_free(d);
    d = LOAD("\x80\x04K\x07."); expect_true(pv_get_double(pv_doc_root(d), &f)); expect_eq_dbl(f, 7.0);
    expect_false(pv_get_str(pv_doc_root(d), &(const char *){0}, NULL));
    pv_doc_free(d);
}

TEST(strings_and_bytes)
{
    const char *s;
    size_t n;
    const uint8_t *p;
    pv_doc_t *d;
    d = LOAD("\x80\x04\x8c\x03" "abc.");
    expect_true(pv_get_str(pv_doc_root(d), &s, &n) && n == 3 && strcmp(s, "abc") == 0);
    pv_doc_free(d);
    d = LOAD("\x80\x04X\x02\x00\x00\x00\xc3\xa9.");
    expect_true(pv_get_str(pv_doc_root(d), &s, &n) && n == 2 && strcmp(s, "\xc3\xa9") == 0);
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8d\x01\x00\x00\x00\x00\x00\x00\x00z.");
    expect_true(pv_str_eq(pv_doc_root(d), "z"));
    pv_doc_free(d);
    /* A lone surrogate passes, as with Python's surrogatepass. */
    d = LOAD("\x80\x04\x8c\x03\xed\xa0\x80.");
    expect_eq_u64(pv_len(pv_doc_root(d)), 3);
    pv_doc_free(d);
    d = LOAD("\x80\x04" "C\x02\x00\x01.");
    expect_true(pv_get_bytes(pv_doc_root(d), &p, &n) && n == 2 && p[0] == 0 && p[1] == 1);
    expect_false(pv_get_str(pv_doc_root(d), &s, &n));
    pv_doc_free(d);
    d = LOAD("\x80\x04" "B\x01\x00\x00\x00q.");
    expect_true(pv_get_bytes(pv_doc_root(d), &p, &n) && n == 1 && p[0] == 'q');
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8e\x01\x00\x00\x00\x00\x00\x00\x00r.");
    expect_true(pv_get_bytes(pv_doc_root(d), &p, &n) && n == 1 && p[0] == 'r');
    pv_doc_free(d);
    d = LOAD("\x80\x05\x96\x02\x00\x00\x00\x00\x00\x00\x00st.");
    expect_true(pv_get_bytes(pv_doc_root(d), &p, &n) && n == 2 && p[1] == 't');
    pv_doc_free(d);
    BAD("\x80\x04\x8c\x02\xff\xfe.", "not valid UTF-8");
    BAD("\x80\x04\x8c\x02\xc0\x80.", "not valid UTF-8"); /* overlong */
}

TEST(containers)
{
    pv_doc_t *d;
    /* EMPTY_LIST, MEMOIZE, MARK, APPENDS, APPEND. */
    d = LOAD("\x80\x04]\x94(K\x01K\x02" "eK\x03" "a.");
    const pv_node_t *r = pv_doc_root(d);
    expect_eq_i64(pv_kind(r), PV_LIST);
    expect_eq_u64(pv_len(r), 3);
    expect_eq_i64(int_of(pv_at(r, 2)), 3);
    expect_true(pv_at(r, 3) == NULL);
    pv_doc_free(d);
    /* LIST, TUPLE, TUPLE1-3, EMPTY_TUPLE. */
    d = LOAD("(K\x01K\x02l.");
    expect_eq_u64(pv_len(pv_doc_root(d)), 2);
    pv_doc_free(d);
    d = LOAD("\x80\x04(K\x01K\x02K\x03K\x04t.");
    expect_eq_i64(pv_kind(pv_doc_root(d)), PV_TUPLE);
    expect_eq_u64(pv_len(pv_doc_root(d)), 4);
    pv_doc_free(d);
    d = LOAD("\x80\x04K\x01\x85K\x01K\x02\x86K\x01K\x02K\x03\x87)\x87.");
    r = pv_doc_root(d);
    expect_eq_u64(pv_len(r), 3);
    expect_eq_u64(pv_len(pv_at(r, 0)), 2); /* TUPLE3 took the three topmost */
    expect_eq_u64(pv_len(pv_at(r, 1)), 3);
    expect_eq_u64(pv_len(pv_at(r, 2)), 0);
    expect_eq_i64(pv_kind(pv_at(r, 2)), PV_TUPLE);
    pv_doc_free(d);
    /* EMPTY_DICT, SETITEM, SETITEMS, DICT; repeated keys replace in place. */
    d = LOAD("\x80\x04}(\x8c\x01" "aK\x01\x8c\x01" "bK\x02u\x8c\x01" "aK\x09s.");
    r = pv_doc_root(d);
    expect_eq_u64(pv_len(r), 2);
    expect_eq_i64(int_of(pv_dict_get(r, "a")), 9);
    expect_true(pv_str_eq(pv_dict_key_at(r, 0), "a"));
    expect_eq_i64(int_of(pv_dict_value_at(r, 1)), 2);
    expect_true(pv_dict_get(r, "c") == NULL);
    pv_doc_free(d);
    d = LOAD("(\x8c\x01xK\x05" "d.");
    expect_eq_i64(int_of(pv_dict_get(pv_doc_root(d), "x")), 5);
    pv_doc_free(d);
    /* 1, True and 1.0 are one key, as in Python. */
    d = LOAD("\x80\x04}(K\x01K\x01\x88K\x02G\x3f\xf0\x00\x00\x00\x00\x00\x00K\x03u.");
    expect_eq_u64(pv_len(pv_doc_root(d)), 1);
    expect_eq_i64(int_of(pv_dict_value_at(pv_doc_root(d), 0)), 3);
    pv_doc_free(d);
    /* Tuple keys compare by value. */
    d = LOAD("\x80\x04}(K\x01\x85K\x01K\x01\x85K\x02u.");
    expect_eq_u64(pv_len(pv_doc_root(d)), 1);
    pv_doc_free(d);
    BAD("\x80\x04}]K\x01s.", "unhashable dict key (list)");
    BAD("\x80\x04}(K\x01u.", "odd number of items");
    BAD("\x80\x04K\x01K\x02" "a.", "not a list");
    BAD("\x80\x04]K\x01K\x02s.", "not a dict");
}

TEST(stack_and_memo)
{
    pv_doc_t *d;
    /* DUP and shared nodes. */
    d = LOAD("\x80\x04]2\x86.");
    const pv_node_t *r = pv_doc_root(d);
    expect_true(pv_at(r, 0) == pv_at(r, 1));
    pv_doc_free(d);
    /* POP, POP_MARK, POP of an empty mark. */
    d = LOAD("\x80\x04K\x01K\x02" "0."); expect_eq_i64(int_of(pv_doc_root(d)), 1); pv_doc_free(d);
    d = LOAD("\x80\x04K\x01(K\x02K\x03" "1."); expect_eq_i64(int_of(pv_doc_root(d)), 1); pv_doc_free(d);
    d = LOAD("\x80\x04K\x01(0."); expect_eq_i64(int_of(pv_doc_root(d)), 1); pv_doc_free(d);
    /* BINPUT/BINGET, LONG_BINPUT/LONG_BINGET: a list containing itself. */
    d = LOAD("\x80\x04]q\x00h\x00" "a.");
    r = pv_doc_root(d);
    expect_true(pv_at(r, 0) == r);
    pv_doc_free(d);
    d = LOAD("\x80\x04\x8c\x01kr\x07\x00\x00\x00j\x07\x00\x00\x00\x86.");
    r = pv_doc_root(d);
    expect_true(pv_at(r, 0) == pv_at(r, 1));
    pv_doc_free(d);
    /* MEMOIZE numbers as Python's len(memo): after BINPUT 5 it stores at 1. */
    d = LOAD("\x80\x04K\x07q\x05K\x08\x94h\x01h\x05\x86.");
    r = pv_doc_root(d);
    expect_eq_i64(int_of(pv_at(r, 0)), 8);
    expect_eq_i64(int_of(pv_at(r, 1)), 7);
    pv_doc_free(d);
    /* FRAME and PROTO are accepted; trailing bytes after STOP are ignored. */
    d = LOAD("\x80\x05\x95\x03\x00\x00\x00\x00\x00\x00\x00K\x01.garbage");
    expect_eq_i64(int_of(pv_doc_root(d)), 1);
    pv_doc_free(d);
    BAD("\x80\x04h\x03.", "memo key 3 is not defined");
    BAD("\x80\x04K\x01r\xf0\xff\xff\xff.", "memo index");
    BAD("\x80\x04q\x00.", "empty stack");
    BAD("\x80\x04" "0.", "stack underflow in POP");
    BAD("\x80\x04(K\x01\x86.", "stack underflow in TUPLE2");
    BAD("\x80\x04u.", "SETITEMS without a MARK");
    BAD("\x80\x04(K\x01K\x02u.", "no container below the MARK");
    BAD("\x80\x04(.", "stack underflow in STOP");
    BAD("\x80\x04" "1.", "POP_MARK without a MARK");
    BAD("\x80\x04" "2.", "stack underflow in DUP");
}

TEST(unsupported_and_malformed)
{
    BAD("\x80\x04" "c__builtin__\nset\n.", "unsupported pickle opcode 0x63 ('c') at offset 2");
    BAD("\x80\x04N\x93.", "unsupported pickle opcode 0x93 at offset 3");
    BAD("\x80\x04NR.", "opcode 0x52");
    BAD("\x80\x04Nb.", "opcode 0x62");
    BAD("\x80\x04P.", "opcode 0x50");
    BAD("\x80\x06N.", "unsupported pickle protocol 6");
    BAD("", "pickle ends without STOP at offset 0");
    BAD("\x80\x04N", "pickle ends without STOP at offset 3");
    /* Length fields beyond the input fail before allocating. */
    BAD("\x80\x04X\xff\xff\xff\xff" "a.", "length 4294967295 exceeds the 2 bytes left");
    BAD("\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\xff.", "exceeds");
    BAD("\x80\x04\x8e\x00\x00\x00\x00\x00\x00\x01\x00.", "exceeds");
    BAD("\x80\x04\x96\x00\x00\x00\x00\x00\x00\x00\x10.", "exceeds");
    BAD("\x80\x04\x8a\xff\x01.", "exceeds");
    BAD("\x80\x04\x8b\x00\x00\x00\x80.", "negative byte count");
    BAD("\x80\x04\x95\x00\x00\x00\x00\x00\x01\x00\x00N.", "frame of");
    BAD("\x80\x04J\x01\x02", "truncated BININT: needs 4 argument bytes, 2 left");
    BAD("\x1f\x8b\x08\x00garbage", "gzip");
}

/* Every prefix of a valid pickle fails cleanly (no crash, no leak). */
TEST(truncation_at_every_offset)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = pv_new_dict(doc);
    pv_node_t *items[3] = {pv_new_int(doc, -5), pv_new_str(doc, "h\xc3\xa9"), pv_new_none(doc)};
    pv_node_t *list = pv_new_list(doc);
    expect_ok(pv_list_append(doc, list, pv_new_tuple(doc, 3, items)));
    expect_ok(pv_list_append(doc, list, pv_new_float(doc, 2.5)));
    expect_ok(pv_list_append(doc, list, pv_new_u64(doc, UINT64_MAX)));
    expect_ok(pv_list_append(doc, list, pv_new_bytes(doc, "\x00\x01", 2)));
    expect_ok(pv_dict_set(doc, root, "list", list));
    expect_ok(pv_dict_set(doc, root, "big", pv_new_int(doc, 1ll << 40)));
    expect_ok(pv_dict_set(doc, root, "t", pv_new_bool(doc, true)));
    cca_strbuf_t out;
    sb_init(&out);
    expect_ok(pickle_write_buffer(root, &out));
    size_t clean = 0;
    for (size_t cut = 0; cut < out.len; cut++) {
        pv_doc_t *d = NULL;
        cca_status_t st = pickle_load_buffer(out.data, cut, &d);
        if (st == CCA_ERR_FORMAT && d == NULL)
            clean++;
        pv_doc_free(d);
    }
    expect_eq_u64(clean, out.len);
    /* Every single-byte corruption loads or fails cleanly. */
    for (size_t i = 0; i < out.len; i++) {
        for (int x = 1; x < 256; x <<= 1) {
            out.data[i] ^= (char)x;
            pv_doc_t *d = NULL;
            cca_status_t st = pickle_load_buffer(out.data, out.len, &d);
            expect_true(st == CCA_OK || st == CCA_ERR_FORMAT);
            pv_doc_free(d);
            out.data[i] ^= (char)x;
        }
    }
    /* The gzip form truncated anywhere fails cleanly too. */
    char gz_buf[128];
    const char *gz = tmp_path(gz_buf, sizeof(gz_buf), "trunc.pickle.gz");
    expect_ok(pickle_write_file(root, gz));
    FILE *f = fopen(gz, "rb");
    char buf[4096];
    size_t n = f ? fread(buf, 1, sizeof(buf), f) : 0;
    if (f)
        fclose(f);
    expect_true(n > 20);
    for (size_t cut = 2; cut < n; cut++) {
        pv_doc_t *d = NULL;
        cca_status_t st = pickle_load_buffer(buf, cut, &d);
        expect_true(st == CCA_ERR_FORMAT || (st == CCA_OK && cut >= n - 8));
        pv_doc_free(d);
    }
    unlink(gz);
    sb_free(&out);
    pv_doc_free(doc);
}

/* Deep nesting loads without recursion; writing and JSON refuse it cleanly. */
TEST(deep_nesting)
{
    size_t depth = 100000;
    char *p = malloc(2 * depth + 8);
    size_t n = 0;
    p[n++] = (char)0x80;
    p[n++] = 4;
    for (size_t i = 0; i < depth; i++)
        p[n++] = ']';
    for (size_t i = 0; i + 1 < depth; i++)
        p[n++] = 'a';
    p[n++] = '.';
    pv_doc_t *d = load(p, n);
    const pv_node_t *r = pv_doc_root(d);
    size_t levels = 0;
    while (r && pv_len(r) == 1) {
        r = pv_at(r, 0);
        levels++;
    }
    expect_eq_u64(levels, depth - 1);
    cca_strbuf_t out;
    sb_init(&out);
    expect_status(pickle_write_buffer(pv_doc_root(d), &out), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "nested deeper");
    expect_eq_u64(out.len, 0);
    expect_status(pv_to_json(pv_doc_root(d), &out, false), CCA_ERR_INVALID_ARGUMENT);
    sb_free(&out);
    pv_doc_free(d);
    free(p);
    /* A cycle through a list is written (memoized) but JSON stops at the depth limit. */
    d = LOAD("\x80\x04]\x94h\x00" "a.");
    sb_init(&out);
    expect_ok(pickle_write_buffer(pv_doc_root(d), &out));
    pv_doc_t *again = load(out.data, out.len);
    expect_true(pv_at(pv_doc_root(again), 0) == pv_doc_root(again));
    sb_free(&out);
    sb_init(&out);
    expect_status(pv_to_json(pv_doc_root(d), &out, true), CCA_ERR_INVALID_ARGUMENT);
    sb_free(&out);
    pv_doc_free(again);
    pv_doc_free(d);
    /* Exponentially shared tuple keys are refused, not hashed forever. */
    char k[200];
    n = 0;
    k[n++] = (char)0x80;
    k[n++] = 4;
    k[n++] = '}';
    k[n++] = 'N';
    for (int i = 0; i < 60; i++) {
        k[n++] = '2';
        k[n++] = (char)0x86;
    }
    k[n++] = 'N';
    k[n++] = 's';
    k[n++] = '.';
    expect_format_error(k, n, "unhashable dict key (tuple)");
}

/* ---- writer ------------------------------------------------------------------------------ */

static pv_node_t *sample_tree(pv_doc_t *doc)
{
    pv_node_t *root = pv_new_dict(doc);
    pv_node_t *events = pv_new_list(doc);
    for (int i = 0; i < 2500; i++) {
        pv_node_t *e = pv_new_dict(doc);
        pv_dict_set(doc, e, "action", pv_new_str(doc, i % 2 ? "alloc" : "free_completed"));
        pv_dict_set(doc, e, "addr", pv_new_u64(doc, 140251855060992ull + (uint64_t)i * 512));
        pv_dict_set(doc, e, "size", pv_new_int(doc, i * 1000));
        pv_dict_set(doc, e, "stream", pv_new_int(doc, i % 3 ? 0 : -1));
        pv_dict_set(doc, e, "frac", pv_new_float(doc, i / 7.0));
        pv_list_append(doc, events, e);
    }
    expect_ok(pv_dict_set(doc, root, "device_traces", events));
    pv_node_t *trio[3] = {pv_new_none(doc), pv_new_bool(doc, false), pv_new_u64(doc, UINT64_MAX)};
    expect_ok(pv_dict_set(doc, root, "tuple", pv_new_tuple(doc, 3, trio)));
    uint8_t big[20];
    for (int i = 0; i < 20; i++)
        big[i] = (uint8_t)(i * 13 + 1);
    expect_ok(pv_dict_set(doc, root, "bigint", pv_new_bigint(doc, big, sizeof(big))));
    expect_ok(pv_dict_set(doc, root, "min", pv_new_int(doc, INT64_MIN)));
    expect_ok(pv_dict_set(doc, root, "neg", pv_new_int(doc, -70000)));
    expect_ok(pv_dict_set(doc, root, "bytes", pv_new_bytes(doc, "\x00\xff\x10", 3)));
    char *long_text = malloc(70000);
    memset(long_text, 'q', 69999);
    long_text[69999] = '\0';
    expect_ok(pv_dict_set(doc, root, "long", pv_new_str(doc, long_text)));
    free(long_text);
    pv_node_t *stats = pv_new_dict(doc);
    for (int i = 0; i < 130; i++) {
        char key[32];
        snprintf(key, sizeof(key), "stat.%d", i);
        pv_dict_set(doc, stats, key, pv_new_int(doc, i));
    }
    pv_node_t *nk = pv_new_int(doc, 42);
    expect_ok(pv_dict_set_node(doc, stats, nk, pv_new_str(doc, "int key")));
    expect_ok(pv_dict_set(doc, root, "stats", stats));
    pv_doc_set_root(doc, root);
    return root;
}

TEST(writer_round_trip)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = sample_tree(doc);
    cca_strbuf_t out;
    sb_init(&out);
    expect_ok(pickle_write_buffer(root, &out));
    /* Protocol 4 header, frames, and the dict keys memoized (BINGET present). */
    expect_eq_u64((uint8_t)out.data[0], 0x80);
    expect_eq_u64((uint8_t)out.data[1], 4);
    expect_eq_u64((uint8_t)out.data[2], 0x95);
    expect_true(memmem(out.data, out.len, "\x94", 1) != NULL);
    expect_true(memmem(out.data, out.len, "\x8c\x06" "action", 8) != NULL);
    expect_true(memmem(out.data + 20, out.len - 20, "\x8c\x06" "action", 8) ==
                memmem(out.data, out.len, "\x8c\x06" "action", 8)); /* written once */
    pv_doc_t *d = load(out.data, out.len);
    const pv_node_t *r = pv_doc_root(d);
    const pv_node_t *events = pv_dict_get(r, "device_traces");
    expect_eq_u64(pv_len(events), 2500);
    uint64_t addr = 0;
    expect_true(pv_get_u64(pv_dict_get(pv_at(events, 2499), "addr"), &addr));
    expect_eq_u64(addr, 140251855060992ull + 2499 * 512);
    expect_true(pv_str_eq(pv_dict_get(pv_at(events, 1), "action"), "alloc"));
    expect_eq_i64(int_of(pv_dict_get(pv_at(events, 3), "stream")), -1);
    double f = 0;
    expect_true(pv_get_double(pv_dict_get(pv_at(events, 10), "frac"), &f));
    expect_eq_dbl(f, 10 / 7.0);
    const pv_node_t *t = pv_dict_get(r, "tuple");
    expect_eq_i64(pv_kind(t), PV_TUPLE);
    expect_true(pv_is_none(pv_at(t, 0)));
    uint64_t u = 0;
    expect_true(pv_get_u64(pv_at(t, 2), &u) && u == UINT64_MAX);
    const uint8_t *big;
    size_t big_len;
    expect_true(pv_get_bigint(pv_dict_get(r, "bigint"), &big, &big_len));
    expect_eq_u64(big_len, 20);
    expect_eq_u64(big[19], 19 * 13 + 1);
    expect_eq_i64(int_of(pv_dict_get(r, "min")), INT64_MIN);
    expect_eq_i64(int_of(pv_dict_get(r, "neg")), -70000);
    expect_eq_u64(pv_len(pv_dict_get(r, "long")), 69999);
    const pv_node_t *stats = pv_dict_get(r, "stats");
    expect_eq_u64(pv_len(stats), 131);
    expect_eq_i64(int_of(pv_dict_get(stats, "stat.129")), 129);
    expect_true(pv_str_eq(pv_dict_value_at(stats, 130), "int key"));
    /* Re-setting a key replaces it; the builder interns keys. */
    pv_node_t *sd = (pv_node_t *)pv_dict_get(root, "stats");
    expect_ok(pv_dict_set(doc, sd, "stat.5", pv_new_int(doc, -5)));
    expect_eq_u64(pv_len(sd), 131);
    expect_eq_i64(int_of(pv_dict_get(sd, "stat.5")), -5);
    /* Writing the reloaded tree gives the same bytes. */
    cca_strbuf_t again;
    sb_init(&again);
    expect_ok(pickle_write_buffer(r, &again));
    expect_eq_u64(again.len, out.len);
    expect_true(again.len == out.len && memcmp(again.data, out.data, out.len) == 0);
    /* File forms, plain and gzip. */
    char bufs[2][128];
    const char *paths[] = {tmp_path(bufs[0], sizeof(bufs[0]), "rt.pickle"),
                           tmp_path(bufs[1], sizeof(bufs[1]), "rt.pickle.gz")};
    for (int i = 0; i < 2; i++) {
        expect_ok(pickle_write_file(root, paths[i]));
        FILE *fh = fopen(paths[i], "rb");
        int c0 = fh ? fgetc(fh) : -1;
        if (fh)
            fclose(fh);
        expect_eq_i64(c0, i ? 0x1f : 0x80);
        pv_doc_t *fd = NULL;
        expect_ok(pickle_load_file(paths[i], &fd));
        expect_eq_u64(pv_len(pv_dict_get(pv_doc_root(fd), "device_traces")), 2500);
        pv_doc_free(fd);
        unlink(paths[i]);
    }
    sb_free(&again);
    pv_doc_free(d);
    sb_free(&out);
    pv_doc_free(doc);
}

TEST(builder_errors)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *list = pv_new_list(doc), *dict = pv_new_dict(doc);
    expect_status(pv_dict_set(doc, list, "k", pv_new_none(doc)), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "not a dict");
    expect_status(pv_list_append(doc, dict, pv_new_none(doc)), CCA_ERR_INVALID_ARGUMENT);
    expect_status(pv_dict_set_node(doc, dict, list, pv_new_none(doc)), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "unhashable");
    expect_status(pv_dict_set(doc, dict, "\xff", pv_new_none(doc)), CCA_ERR_INVALID_ARGUMENT);
    expect_status(pv_list_append(doc, list, NULL), CCA_ERR_INVALID_ARGUMENT);
    /* A failed pv_new_str is remembered and reported by the next set. */
    expect_true(pv_new_str(doc, "\xc3") == NULL);
    expect_contains(cca_last_error()->message, "UTF-8");
    expect_status(pv_dict_set(doc, dict, "k", pv_new_str(doc, "\xc3")), CCA_ERR_INVALID_ARGUMENT);
    expect_contains(cca_last_error()->message, "UTF-8");
    expect_status(pickle_write_buffer(NULL, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(pickle_write_file(dict, "/nonexistent-dir/x.pickle"), CCA_ERR_IO);
    expect_contains(cca_last_error()->message, "/nonexistent-dir/x.pickle");
    expect_contains(cca_last_error()->message, "No such file");
    expect_status(pickle_write_file(dict, "/nonexistent-dir/x.pickle.gz"), CCA_ERR_IO);
    pv_doc_t *d = (pv_doc_t *)0x1;
    expect_status(pickle_load_file("/nonexistent-dir/missing.pickle", &d), CCA_ERR_IO);
    expect_contains(cca_last_error()->message, "/nonexistent-dir/missing.pickle");
    expect_contains(cca_last_error()->message, "No such file");
    expect_true(d == NULL);
    expect_status(pickle_load_file("/tmp", &d), CCA_ERR_IO);
    expect_status(pickle_load_file(NULL, &d), CCA_ERR_INVALID_ARGUMENT);
    expect_status(pickle_load_buffer(NULL, 3, &d), CCA_ERR_INVALID_ARGUMENT);
    /* Format errors from a file name the file. */
    char bad_buf[128];
    const char *bad = tmp_path(bad_buf, sizeof(bad_buf), "bad.pickle");
    FILE *f = fopen(bad, "wb");
    if (f) {
        fputs("\x80\x04R.", f);
        fclose(f);
    }
    expect_status(pickle_load_file(bad, &d), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, bad);
    expect_contains(cca_last_error()->message, "unsupported pickle opcode 0x52");
    unlink(bad);
    pv_doc_free(doc);
}

/* Python's pickle module reads cca's output with the same keys, types and values. */
TEST(python_reads_output)
{
    if (system("python3 -c 'import pickle' >/dev/null 2>&1") != 0) {
        printf("  (python3 not available: skipped)\n");
        return;
    }
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = sample_tree(doc);
    pv_node_t *cyc = pv_new_list(doc);
    expect_ok(pv_list_append(doc, cyc, cyc));
    expect_ok(pv_dict_set(doc, root, "cycle", cyc));
    char bufs[2][128];
    const char *paths[] = {tmp_path(bufs[0], sizeof(bufs[0]), "py.pickle"),
                           tmp_path(bufs[1], sizeof(bufs[1]), "py.pickle.gz")};
    for (int i = 0; i < 2; i++) {
        expect_ok(pickle_write_file(root, paths[i]));
        char cmd[2048];
        snprintf(cmd, sizeof(cmd),
                 "python3 -c '\n"
                 "import gzip, pickle, sys\n"
                 "p = sys.argv[1]\n"
                 "d = pickle.load(gzip.open(p) if p.endswith(\".gz\") else open(p, \"rb\"))\n"
                 "ev = d[\"device_traces\"]\n"
                 "assert list(d) == [\"device_traces\", \"tuple\", \"bigint\", \"min\", \"neg\", \"bytes\", \"long\", \"stats\", \"cycle\"], list(d)\n"
                 "assert len(ev) == 2500 and list(ev[0]) == [\"action\", \"addr\", \"size\", \"stream\", \"frac\"]\n"
                 "assert ev[1][\"action\"] == \"alloc\" and ev[2499][\"addr\"] == 140251855060992 + 2499 * 512\n"
                 "assert ev[3][\"stream\"] == -1 and ev[10][\"frac\"] == 10 / 7.0 and type(ev[10][\"frac\"]) is float\n"
                 "assert d[\"tuple\"] == (None, False, 2**64 - 1)\n"
                 "assert d[\"bigint\"] == int.from_bytes(bytes((i * 13 + 1) %% 256 for i in range(20)), \"little\", signed=True)\n"
                 "assert d[\"min\"] == -2**63 and d[\"neg\"] == -70000 and d[\"bytes\"] == b\"\\x00\\xff\\x10\"\n"
                 "assert d[\"long\"] == \"q\" * 69999\n"
                 "assert d[\"stats\"][\"stat.129\"] == 129 and d[\"stats\"][42] == \"int key\" and len(d[\"stats\"]) == 131\n"
                 "assert d[\"cycle\"][0] is d[\"cycle\"]\n"
                 "' %s",
                 paths[i]);
        int rc = system(cmd);
        expect_eq_i64(rc, 0);
        unlink(paths[i]);
    }
    pv_doc_free(doc);
}

/* ---- JSON --------------------------------------------------------------------------------- */

TEST(json_exact)
{
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *root = pv_new_dict(doc);
    pv_node_t *pair[2] = {pv_new_int(doc, 1), pv_new_str(doc, "a\"b\\\n\x01")};
    pv_dict_set(doc, root, "t", pv_new_tuple(doc, 2, pair));
    pv_dict_set(doc, root, "f", pv_new_float(doc, 0.1));
    pv_dict_set(doc, root, "g", pv_new_float(doc, 3.0));
    pv_dict_set(doc, root, "inf", pv_new_float(doc, INFINITY));
    pv_dict_set(doc, root, "u", pv_new_u64(doc, UINT64_MAX));
    pv_dict_set(doc, root, "b", pv_new_bytes(doc, "abcd", 4));
    uint8_t big[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0xff}; /* -2^64 */
    pv_dict_set(doc, root, "big", pv_new_bigint(doc, big, 9));
    pv_dict_set(doc, root, "e", pv_new_list(doc));
    pv_dict_set(doc, root, "n", pv_new_none(doc));
    pv_dict_set_node(doc, root, pv_new_int(doc, 7), pv_new_bool(doc, true));
    pv_dict_set(doc, root, "s", pv_new_str(doc, "\xe2\x98\x83\xed\xa0\x80"));
    cca_strbuf_t out;
    sb_init(&out);
    expect_ok(pv_to_json(root, &out, false));
    expect_eq_str(out.data,
                  "{\"t\":[1,\"a\\\"b\\\\\\n\\u0001\"],\"f\":0.1,\"g\":3.0,\"inf\":null,"
                  "\"u\":18446744073709551615,\"b\":\"YWJjZA==\",\"big\":-18446744073709551616,"
                  "\"e\":[],\"n\":null,\"7\":true,\"s\":\"\xe2\x98\x83\\ud800\"}");
    sb_free(&out);
    sb_init(&out);
    pv_node_t *small = pv_new_dict(doc);
    pv_node_t *l = pv_new_list(doc);
    pv_list_append(doc, l, pv_new_int(doc, 1));
    pv_list_append(doc, l, pv_new_dict(doc));
    pv_dict_set(doc, small, "a", l);
    pv_dict_set(doc, small, "b", pv_new_float(doc, -2.5e-10));
    expect_ok(pv_to_json(small, &out, true));
    expect_eq_str(out.data, "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": -2.5e-10\n}");
    sb_free(&out);
    /* Big ints of many sizes print the digits Python prints. */
    sb_init(&out);
    uint8_t b2[3] = {0x00, 0x00, 0x80}; /* -8388608 */
    pv_bigint_to_decimal(b2, 3, &out);
    expect_eq_str(out.data, "-8388608");
    sb_free(&out);
    sb_init(&out);
    uint8_t b3[13] = {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01};
    pv_bigint_to_decimal(b3, 13, &out); /* 2^96 */
    expect_eq_str(out.data, "79228162514264337593543950336");
    sb_free(&out);
    expect_status(pv_to_json(NULL, &out, false), CCA_ERR_INVALID_ARGUMENT);
    pv_doc_free(doc);
}

/* "Billion laughs": lists holding the next one twice, shared through the memo. levels
 * 40: 2^41 values of JSON from 5 bytes a level; before, pv_to_json wrote until memory
 * ran out. Now refused at once, and a moderate sharing (under 2^20 values) is written. */
static pv_doc_t *laughs(int levels)
{
    char bytes[1024];
    size_t n = 0;
    bytes[n++] = (char)0x80, bytes[n++] = 4;
    bytes[n++] = ']', bytes[n++] = (char)0x94; /* memo 0: [] */
    for (int i = 1; i <= levels; i++) {
        /* [memo[i-1], memo[i-1]] into memo i */
        bytes[n++] = 'h', bytes[n++] = (char)(i - 1);
        bytes[n++] = 'h', bytes[n++] = (char)(i - 1);
        bytes[n++] = (char)0x86, bytes[n++] = (char)0x94;
    }
    bytes[n++] = '.';
    return load(bytes, n);
}

TEST(json_of_shared_values_is_bounded)
{
    for (int levels = 19; levels <= 40; levels += 21) {
        pv_doc_t *doc = laughs(levels);
        if (!doc)
            return;
        uint64_t values = 0, distinct = 0;
        expect_ok(pv_json_values(pv_doc_root(doc), &values, &distinct));
        expect_eq_u64(values, ((uint64_t)1 << (levels + 1)) - 1);
        expect_eq_u64(distinct, (uint64_t)levels + 1);
        cca_strbuf_t out;
        sb_init(&out);
        cca_status_t st = pv_to_json(pv_doc_root(doc), &out, false);
        if (levels == 19) { /* 2^20 - 1 values: under the bound, written whole */
            expect_ok(st);
            expect_eq_u64(out.len, 5 * ((size_t)1 << 19) - 3); /* len(i) = 2 len(i-1) + 3, len(0) = 2 */
        } else {
            expect_status(st, CCA_ERR_FORMAT);
            expect_contains(cca_last_error()->message, "shared values");
            expect_eq_u64(out.len, 0);
        }
        sb_free(&out);
        pv_doc_free(doc);
    }
    /* a value shared 1,000 times in a list of 1,100 entries (Python's pickler, protocol 4) */
    pv_doc_t *doc = pv_doc_new();
    pv_node_t *list = pv_new_list(doc), *shared = pv_new_list(doc);
    expect_ok(pv_list_append(doc, shared, pv_new_str(doc, "frame")));
    for (int i = 0; i < 1000; i++)
        expect_ok(pv_list_append(doc, list, shared));
    cca_strbuf_t out;
    sb_init(&out);
    expect_ok(pv_to_json(list, &out, false));
    expect_eq_u64(out.len, 2 + 1000 * 9 + 999);
    sb_free(&out);
    pv_doc_free(doc);
}

/* gzip (level 1) of n zero bytes, a MiB at a time, with its last `cut` bytes dropped. */
static uint8_t *gzip_zeros(uint64_t n, size_t cut, size_t *out_n)
{
    z_stream zs;
    memset(&zs, 0, sizeof(zs));
    if (deflateInit2(&zs, 1, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
        return NULL;
    size_t cap = (size_t)(n / 50) + 65536, piece = (size_t)1 << 20;
    uint8_t *out = malloc(cap), *in = calloc(1, piece);
    int zr = out && in ? Z_OK : Z_MEM_ERROR;
    zs.next_out = out;
    zs.avail_out = (uInt)cap;
    for (uint64_t left = n; zr == Z_OK;) {
        size_t k = left < piece ? (size_t)left : piece;
        zs.next_in = in;
        zs.avail_in = (uInt)k;
        left -= k;
        zr = deflate(&zs, left ? Z_NO_FLUSH : Z_FINISH);
        if (!left)
            break;
    }
    *out_n = zs.total_out > cut ? zs.total_out - cut : 0;
    deflateEnd(&zs);
    free(in);
    if (zr != Z_STREAM_END) {
        free(out);
        return NULL;
    }
    return out;
}

/* A gzip bomb: 1 GiB of zeros in a truncated gzip stream. The reader meets opcode 0x00
 * in the first inflated block and stops there; before, it inflated the whole stream
 * (1 GiB held) and failed on the truncation instead. */
TEST(gzip_bomb_rejected_at_its_first_opcode)
{
    size_t n = 0;
    uint8_t *gz = gzip_zeros((uint64_t)1 << 30, 64, &n);
    expect_true(gz != NULL && n > 1000);
    if (!gz)
        return;
    pv_doc_t *doc = (pv_doc_t *)0x1;
    expect_status(pickle_load_buffer(gz, n, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "unsupported pickle opcode 0x00 at offset 0");
    expect_true(doc == NULL);
    char path[512];
    FILE *f = fopen(tmp_path(path, sizeof(path), "bomb.pickle.gz"), "wb");
    expect_true(f != NULL && fwrite(gz, 1, n, f) == n);
    if (f)
        fclose(f);
    expect_status(pickle_load_file(path, &doc), CCA_ERR_FORMAT);
    expect_contains(cca_last_error()->message, "opcode 0x00 at offset 0");
    free(gz);
}

int main(void)
{
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(real_traces);
    RUN(scalars);
    RUN(strings_and_bytes);
    RUN(containers);
    RUN(stack_and_memo);
    RUN(unsupported_and_malformed);
    RUN(truncation_at_every_offset);
    RUN(deep_nesting);
    RUN(writer_round_trip);
    RUN(builder_errors);
    RUN(python_reads_output);
    RUN(json_exact);
    RUN(json_of_shared_values_is_bounded);
    RUN(gzip_bomb_rejected_at_its_first_opcode);
    rmdir(tmp_dir);
    return harness_done();
}
