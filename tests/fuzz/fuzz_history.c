/*
 * fuzz_history.c - libFuzzer target for the history's PyTorch records:
 * annotations with fields, compile contexts (a stack per device), user
 * metadata (one per device), beside allocations on two simulated devices,
 * the history switched on and off at any size. Each input byte picks an
 * operation; strings come from the input (any bytes but NUL, not UTF-8 as
 * often as not).
 *
 * A model of the compile stacks and the metadata (both kept by cca across
 * inputs and across cca_shutdown, as by PyTorch for the life of the process,
 * so the model lives as long; each input starts by popping the stacks empty)
 * says what each allocation's history entry must
 * carry; every annotation is recorded on the current device alone and read
 * back from the history must give its fields in order and its name as context; a snapshot written from the history must
 * list exactly the annotations in external_annotations and none in
 * device_traces, with each entry's compile context and metadata. Any
 * violation aborts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca_backend.h"
#include "pickle.h"

#include "fuzz_check.h"

enum { DEVICES = 2, MAX_DEPTH = 64, MAX_STR = 12, MAX_FIELDS = 4 };

/* The model: what cca keeps for the life of the process. */
static char stack[DEVICES][MAX_DEPTH][MAX_STR + 1];
static int depth[DEVICES];
static int overflow[DEVICES]; /* pushes the model could not hold (then it stops checking) */
static char metadata[DEVICES][MAX_STR + 1];
static bool metadata_set[DEVICES];

typedef struct reader {
    const uint8_t *data;
    size_t size, pos;
} reader_t;

static uint8_t next(reader_t *r)
{
    return r->pos < r->size ? r->data[r->pos++] : 0;
}

/* A string of up to MAX_STR input bytes (NUL bytes read as 'x'). */
static void next_string(reader_t *r, char *out)
{
    size_t len = next(r) % (MAX_STR + 1);
    for (size_t i = 0; i < len; i++) {
        uint8_t c = next(r);
        out[i] = c ? (char)c : 'x';
    }
    out[len] = '\0';
}

static bool history_on;

/* The history's last entry is the annotation just recorded, on the current device d (where
 * it was recorded on every device, the last was device 1's). */
static void check_last_annotation(int d, size_t fields)
{
    cca_trace_entry_t *e = NULL;
    size_t n = 0;
    CHECK(cca_history_get(&e, &n) == CCA_OK, "history_get: %s", cca_last_error()->message);
    CHECK(n >= 1 && e[n - 1].action == CCA_TRACE_USER_DEFINED, "no annotation last (%zu entries)", n);
    CHECK(e[n - 1].device == d, "annotation on device %d, current %d", e[n - 1].device, d);
    const char *k, *v;
    CHECK(fields == 0 || cca_trace_entry_field_at(&e[n - 1], fields - 1, &k, &v), "field %zu missing", fields);
    cca_history_free(e);
}

/* The last alloc entry of device d must carry the model's top and metadata. */
static void check_last_alloc(int d, size_t size)
{
    cca_trace_entry_t *e = NULL;
    size_t n = 0;
    CHECK(cca_history_get(&e, &n) == CCA_OK, "history_get: %s", cca_last_error()->message);
    const cca_trace_entry_t *last = NULL;
    for (size_t i = n; i-- > 0;)
        if (e[i].action == CCA_TRACE_ALLOC && e[i].device == d && e[i].size == size) {
            last = &e[i];
            break;
        }
    CHECK(last, "no alloc entry of %zu bytes on device %d (%zu entries)", size, d, n);
    if (!overflow[d]) {
        if (depth[d])
            CHECK(last->compile_context && !strcmp(last->compile_context, stack[d][depth[d] - 1]),
                  "compile context '%s', model '%s'", last->compile_context ? last->compile_context : "(none)",
                  stack[d][depth[d] - 1]);
        else
            CHECK(!last->compile_context, "compile context '%s' with the stack empty", last->compile_context);
    }
    if (metadata_set[d])
        CHECK(last->user_metadata && !strcmp(last->user_metadata, metadata[d]), "metadata '%s', model '%s'",
              last->user_metadata ? last->user_metadata : "(none)", metadata[d]);
    else
        CHECK(!last->user_metadata, "metadata '%s' never set", last->user_metadata);
    cca_history_free(e);
}

/* Every annotation of the history reads back; the snapshot lists them apart. */
static void check_history_and_snapshot(const char *path)
{
    cca_trace_entry_t *e = NULL;
    size_t n = 0, annotations = 0;
    CHECK(cca_history_get(&e, &n) == CCA_OK, "history_get");
    for (size_t i = 0; i < n; i++) {
        if (e[i].action != CCA_TRACE_USER_DEFINED)
            continue;
        annotations++;
        const char *k, *v, *name = NULL;
        size_t f = 0;
        for (; cca_trace_entry_field_at(&e[i], f, &k, &v); f++) {
            CHECK(*k, "an empty key");
            if (!name && !strcmp(k, "name"))
                name = v;
            CHECK(cca_trace_entry_field(&e[i], k), "field '%s' not found by key", k);
        }
        CHECK(f <= MAX_FIELDS + 2, "%zu fields", f);
        CHECK(!strcmp(e[i].context, name ? name : ""), "context '%s', name '%s'", e[i].context,
              name ? name : "");
    }
    cca_history_free(e);
    CHECK(cca_dump_snapshot(path) == CCA_OK, "dump: %s", cca_last_error()->message);
    pv_doc_t *doc = NULL;
    CHECK(pickle_load_file(path, &doc) == CCA_OK, "load: %s", cca_last_error()->message);
    const pv_node_t *root = pv_doc_root(doc);
    const pv_node_t *ann = pv_dict_get(root, "external_annotations");
    CHECK(ann && pv_len(ann) == annotations, "%zu annotations written, %zu recorded",
          ann ? pv_len(ann) : 0, annotations);
    const pv_node_t *traces = pv_dict_get(root, "device_traces");
    for (size_t d = 0; traces && d < pv_len(traces); d++)
        for (size_t i = 0; i < pv_len(pv_at(traces, d)); i++) {
            const pv_node_t *t = pv_at(pv_at(traces, d), i);
            CHECK(!pv_str_eq(pv_dict_get(t, "action"), "user_defined"), "an annotation in device_traces");
            CHECK(pv_dict_get(t, "compile_context") && pv_dict_get(t, "user_metadata"), "a trace entry's keys");
        }
    pv_doc_free(doc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    reader_t r = {data, size, 0};
    cca_backend_t *sim = NULL;
    cca_sim_config_t cfg = {0};
    cfg.devices = DEVICES;
    cfg.total_memory = 1ull << 30;
    cca_shutdown();
    CHECK(cca_sim_create(&cfg, &sim) == CCA_OK, "sim");
    CHECK(cca_init_with_backend(sim, "") == CCA_OK, "init: %s", cca_last_error()->message);
    char path[64];
    snprintf(path, sizeof(path), "/tmp/fuzz_history_%d.pickle", (int)getpid());
    /* the stacks emptied (the model knows their depth), so that they stay bounded */
    CHECK(cca_record_history(true, NULL, NULL, 1, CCA_RECORD_CONTEXT_NEVER) == CCA_OK, "record_history");
    for (int d = 0; d < DEVICES; d++) {
        CHECK(cca_set_device(d) == CCA_OK, "set_device");
        for (int k = depth[d] + overflow[d]; k > 0; k--)
            CHECK(cca_pop_compile_context() == CCA_OK, "pop");
        depth[d] = overflow[d] = 0;
    }
    int device = 0;
    CHECK(cca_set_device(0) == CCA_OK, "set_device");
    history_on = false;
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    for (int steps = 0; r.pos < r.size && steps < 256; steps++) {
        uint8_t b = next(&r);
        switch (b % 8) {
        case 0:
            CHECK(cca_record_history(true, NULL, NULL, 1 + next(&r) % 64, CCA_RECORD_CONTEXT_NEVER) == CCA_OK,
                  "record_history");
            history_on = true;
            break;
        case 1:
            CHECK(cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER) == CCA_OK, "history off");
            history_on = false;
            break;
        case 2: {
            char keys[MAX_FIELDS][MAX_STR + 1], values[MAX_FIELDS][MAX_STR + 1];
            const char *kp[MAX_FIELDS], *vp[MAX_FIELDS];
            size_t count = (b >> 3) % (MAX_FIELDS + 1);
            bool valid = true;
            for (size_t i = 0; i < count; i++) {
                next_string(&r, keys[i]);
                next_string(&r, values[i]);
                kp[i] = keys[i];
                vp[i] = values[i];
                valid &= keys[i][0] != '\0';
            }
            cca_status_t st = cca_record_annotation_fields(kp, vp, count);
            CHECK(st == (valid ? CCA_OK : CCA_ERR_INVALID_ARGUMENT), "annotation: %s", cca_status_str(st));
            if (valid && history_on)
                check_last_annotation(device, count);
            break;
        }
        case 3: {
            char text[MAX_STR + 1];
            next_string(&r, text);
            CHECK(cca_push_compile_context(text) == CCA_OK, "push");
            if (history_on) {
                if (depth[device] < MAX_DEPTH && !overflow[device])
                    memcpy(stack[device][depth[device]++], text, sizeof(text));
                else
                    overflow[device]++;
            }
            break;
        }
        case 4:
            CHECK(cca_pop_compile_context() == CCA_OK, "pop");
            if (history_on) {
                if (overflow[device])
                    overflow[device]--;
                else if (depth[device])
                    depth[device]--;
            }
            break;
        case 5: {
            char text[MAX_STR + 1];
            next_string(&r, text);
            CHECK(cca_set_user_metadata(text) == CCA_OK, "set metadata");
            memcpy(metadata[device], text, sizeof(text));
            metadata_set[device] = true;
            char *back = NULL;
            CHECK(cca_get_user_metadata(&back) == CCA_OK && !strcmp(back, text), "metadata read back");
            free(back);
            break;
        }
        case 6: {
            device = (b >> 3) & 1;
            CHECK(cca_set_device(device) == CCA_OK, "set_device");
            size_t bytes = 512 * (size_t)(1 + next(&r));
            void *p = NULL;
            CHECK(cca_malloc(&p, bytes, NULL) == CCA_OK, "malloc: %s", cca_last_error()->message);
            if (history_on)
                check_last_alloc(device, bytes);
            CHECK(cca_free(p) == CCA_OK, "free");
            break;
        }
        default:
            if (history_on)
                check_history_and_snapshot(path);
            break;
        }
    }
    if (history_on)
        check_history_and_snapshot(path);
    cca_record_history(false, NULL, NULL, 0, CCA_RECORD_CONTEXT_NEVER);
    unlink(path);
    cca_shutdown();
    return 0;
}
