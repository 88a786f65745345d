/*
 * pickle_records.c - the records of the pickle decoder (pickle_decode.h):
 * handing each dict of a records field to the handler (from the record table,
 * or from a tree), and the fast path that reads a record's body whole.
 */
#include "pickle_decode.h"

/* As to_value, inline for the common case (a scalar). */
static inline void to_value_fast(const pk_handler_t *h, const slot_t *s, pk_value_t *v)
{
    if (s->type != SL_SCALAR || s->kind == PV_BOOL) {
        sr_to_value(h, s, v);
        return;
    }
    v->kind = s->kind;
    v->is_u64 = (s->flags & SF_U64) != 0;
    v->node = NULL;
    if (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT) {
        v->data = s->v.sym->data;
        v->len = s->v.sym->len;
        v->tag = s->v.sym->tag;
        v->num.u = 0;
    } else {
        v->data = NULL;
        v->len = 0;
        v->tag = -1;
        v->num.u = s->v.u;
    }
}

void sr_to_value(const pk_handler_t *h, const slot_t *s, pk_value_t *v)
{
    v->kind = s->kind;
    v->is_u64 = s->type == SL_SCALAR && (s->flags & SF_U64);
    v->tag = -1;
    v->num.u = 0;
    v->data = NULL;
    v->len = 0;
    v->node = NULL;
    if (s->type == SL_SCALAR) {
        if (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT) {
            v->data = s->v.sym->data;
            v->len = s->v.sym->len;
            v->tag = s->v.sym->tag;
        } else if (s->kind == PV_BOOL) {
            v->num.b = s->v.b;
        } else {
            v->num.u = s->v.u;
        }
        return;
    }
    if (s->type != SL_NODE)
        return;
    const pv_node_t *n = s->v.node;
    v->node = n;
    v->kind = (uint8_t)pv_kind(n);
    const uint8_t *bytes;
    switch (pv_kind(n)) {
    case PV_BOOL: pv_get_bool(n, &v->num.b); break;
    case PV_INT:
        v->is_u64 = pv_is_u64(n);
        if (v->is_u64)
            pv_get_u64(n, &v->num.u);
        else
            pv_get_int(n, &v->num.i);
        break;
    case PV_FLOAT: pv_get_double(n, &v->num.f); break;
    case PV_STR:
        pv_get_str(n, &v->data, &v->len);
        v->tag = sr_tag_of(h, v->data, v->len);
        break;
    case PV_BYTES:
        pv_get_bytes(n, &bytes, &v->len);
        v->data = (const char *)bytes;
        break;
    case PV_BIGINT:
        pv_get_bigint(n, &bytes, &v->len);
        v->data = (const char *)bytes;
        break;
    default: break;
    }
}

bool pk_record_field(const pk_record_t *record, size_t i, pk_field_t *out)
{
    if (!record || !out || !record->priv)
        return false;
    const rec_view_t *view = record->priv;
    if (i >= view->count)
        return false;
    sr_to_value(view->h, &view->pairs[2 * i], &out->key);
    sr_to_value(view->h, &view->pairs[2 * i + 1], &out->value);
    return true;
}

/* ---- taking items into containers ----------------------------------------------------------- */

/*
 * sr_deliver()'s plan for a record whose keys are the key template's whole: the
 * tagged fields (of a key given twice, the last) and their tags, taken from the
 * template's keys. Needs symbol_count <= 64.
 */
static void plan_build(key_template_t *t)
{
    uint64_t tags = 0;
    size_t n = 0;
    for (size_t i = 0; i < t->count; i++) {
        const slot_t *k = &t->key[i];
        if (k->kind != PV_STR || k->v.sym->tag < 0)
            continue;
        uint8_t tag = (uint8_t)k->v.sym->tag;
        size_t j = n;
        if (tags & ((uint64_t)1 << tag))
            for (j = 0; t->plan_tag[j] != tag; j++)
                ;
        else
            n++;
        t->plan_pos[j] = (uint8_t)i;
        t->plan_tag[j] = tag;
        tags |= (uint64_t)1 << tag;
    }
    t->plan_count = n;
    t->plan_tags = tags;
    t->plan_gen = t->gen;
}

/*
 * Hand a record to the handler: by_tag[t] points at the value of the last field
 * whose key has tag t (its pk_value_t in tag_values), NULL where none has.
 * With up to 64 symbols, by_tag holds exactly the tags of tags_set between
 * calls, so that only the changes are written.
 */
cca_status_t sr_deliver(sreader_t *r, const slot_t *rs, uint64_t group, size_t index)
{
    if (__builtin_expect(r->calls++ < r->calls_to_skip, 0))
        return CCA_OK; /* a first reading handed it over */
    const rec_t *rec = &r->recs[rs->v.rec];
    const slot_t *pairs = r->fields + rec->start;
    size_t nsym = r->h->symbol_count;
    uint64_t set = 0;
    const pk_value_t **by_tag = r->by_tag;
    pk_value_t *tag_values = r->tag_values;
    if (nsym <= 64 && rec->keys_gen && rec->keys_gen == r->keys.gen) {
        /* the template's keys: their tags are known */
        key_template_t *t = &r->keys;
        if (t->plan_gen != t->gen)
            plan_build(t);
        for (size_t j = 0; j < t->plan_count; j++)
            to_value_fast(r->h, &pairs[2 * t->plan_pos[j] + 1], &tag_values[t->plan_tag[j]]);
        set = t->plan_tags;
    } else {
        if (nsym > 64)
            memset(r->by_tag, 0, nsym * sizeof(*r->by_tag));
        size_t count = rec->count;
        for (size_t i = 0; i < count; i++) { /* locals: the stores below could alias the reader */
            const slot_t *k = &pairs[2 * i];
            int32_t t;
            const char *text;
            size_t len;
            if (k->type == SL_SCALAR && k->kind == PV_STR)
                t = k->v.sym->tag;
            else if (k->type == SL_NODE && pv_get_str(k->v.node, &text, &len))
                t = sr_tag_of(r->h, text, len);
            else
                continue;
            if (t < 0)
                continue;
            to_value_fast(r->h, &pairs[2 * i + 1], &tag_values[t]);
            by_tag[t] = &tag_values[t];
            set |= (uint64_t)1 << (t & 63);
        }
    }
    if (nsym <= 64) {
        for (uint64_t m = r->tags_set & ~set; m; m &= m - 1)
            by_tag[__builtin_ctzll(m)] = NULL;
        for (uint64_t m = set & ~r->tags_set; m; m &= m - 1)
            by_tag[__builtin_ctzll(m)] = &tag_values[__builtin_ctzll(m)];
        r->tags_set = set;
    }
    rec_view_t view = {r->h, pairs, rec->count};
    pk_record_t out = {
        .field = r->records_field->data,
        .group = (size_t)group,
        .index = index,
        .count = rec->count,
        .by_tag = r->by_tag,
        .priv = &view,
    };
    return r->h->record ? r->h->record(r->h->ctx, &out) : CCA_OK;
}

/* The handler's group callback, unless a first reading (sr_rerun) made this call already. */
cca_status_t sr_call_group(sreader_t *r, const char *field, size_t group)
{
    if (r->calls++ < r->calls_to_skip || !r->h->group)
        return CCA_OK;
    return r->h->group(r->h->ctx, field, group);
}

/* One record kept in the tree (a dict shared through the memo, or of a field that
 * arrived as a tree): its pairs go past the record table's end, which stays as it is. */
cca_status_t sr_deliver_node(sreader_t *r, const pv_node_t *dict, uint64_t group, size_t index)
{
    size_t n = 2 * pv_len(dict);
    if (!grow(&r->fields, &r->fields_cap, r->nfields + n, sizeof(slot_t), 4096) ||
        !grow(&r->recs, &r->recs_cap, r->nrecs + 1, sizeof(rec_t), 1024))
        return sr_oom();
    slot_t *pairs = r->fields + r->nfields;
    for (size_t j = 0; j < pv_len(dict); j++) {
        const pv_node_t *kv[2] = {pv_dict_key_at(dict, j), pv_dict_value_at(dict, j)};
        for (int e = 0; e < 2; e++) {
            slot_t *f = &pairs[2 * j + (size_t)e];
            memset(f, 0, sizeof(*f));
            f->type = SL_NODE;
            f->kind = (uint8_t)pv_kind(kv[e]);
            f->v.node = (pv_node_t *)(uintptr_t)kv[e];
        }
    }
    rec_t *rec = &r->recs[r->nrecs];
    rec->start = r->nfields;
    rec->count = pv_len(dict);
    rec->keys_gen = 0;
    slot_t rs = {.type = SL_RECORD, .kind = PV_DICT};
    rs.v.rec = r->nrecs;
    return sr_deliver(r, &rs, group, index);
}

/* The records of a records field that arrived as a tree (a shape decided only
 * at its end, as protocol 0's LIST / DICT build it, or read again whole by
 * sr_rerun): delivered from the tree. */
cca_status_t sr_deliver_tree(sreader_t *r, size_t off, const pk_sym_t *key, const pv_node_t *list)
{
    cca_status_t st = CCA_OK;
    r->records_field = key;
    if (pv_kind(list) != PV_LIST)
        return sr_error(r, off, "field '%s' is a %s, not a list of records", key->data,
                        pv_kind_name(pv_kind(list)));
    bool nested = pv_len(list) && pv_kind(pv_at(list, 0)) == PV_LIST;
    for (size_t g = 0; g < pv_len(list) && st == CCA_OK; g++) {
        const pv_node_t *inner = nested ? pv_at(list, g) : list;
        if (nested && pv_kind(inner) != PV_LIST)
            return sr_error(r, off, "item %zu of records field '%s' is not a list of records", g, key->data);
        if (nested && (st = sr_call_group(r, key->data, g)))
            break;
        for (size_t i = 0; i < pv_len(inner) && st == CCA_OK; i++) {
            const pv_node_t *d = pv_at(inner, i);
            if (pv_kind(d) != PV_DICT)
                return sr_error(r, off, "item %zu of a list of records is a %s, not a dict", i,
                                pv_kind_name(pv_kind(d)));
            st = sr_deliver_node(r, d, nested ? g : 0, i);
        }
        if (!nested)
            break;
    }
    return st;
}

/* Empty the key template: no entry matches any bytes. */
void sr_keys_reset(key_template_t *t)
{
    for (size_t i = 0; i < FAST_FIELDS; i++) {
        t->op[i] = ~(uint64_t)0;
        t->mask[i] = 0;
    }
    t->count = 0;
    t->gen++;
}


/* ---- records read whole ------------------------------------------------------------------- */

typedef struct pending_memo {
    uint64_t idx;
    uintptr_t e;
} pending_memo_t;

/* Whether the fast path's next MEMOIZE (at idx = memo_count + pending stores) may
 * store: its pending stores all lie below idx, so only the memo itself can hold it. */
static inline bool fast_memo_free(const sreader_t *r, uint64_t idx)
{
    return idx >= r->memo_len || !r->memo[idx];
}

/* The memo entry idx as the fast path sees it: pending stores first. 0: unset. */
static inline uintptr_t fast_memo(const sreader_t *r, const pending_memo_t *pm, int npm, uint64_t idx)
{
    if (idx < r->memo_count)
        return r->memo_vals[r->memo[idx]]; /* pending stores all lie at or above the count (<= memo_len) */
    for (int i = npm - 1; i >= 0; i--)
        if (pm[i].idx == idx)
            return pm[i].e;
    return idx < r->memo_len ? r->memo_vals[r->memo[idx]] : 0;
}

/*
 * One plain scalar at *p (and its memo store, if one follows) into *d, for
 * record_fast; false for anything else. The tests run from the most common
 * opcode of PyTorch's event dicts down; the window holds FIXED_OP_MAX bytes
 * at *p.
 */
static inline __attribute__((always_inline)) bool fast_scalar(sreader_t *r, const uint8_t **pp,
                                                              const uint8_t *end, slot_t *d,
                                                              pending_memo_t *pm, int *npm,
                                                              uint64_t *memo_next)
{
    const uint8_t *p = *pp;
    uint8_t op = *p;
    if (op == OP_LONG_BINGET || op == OP_BINGET) {
        uint64_t idx = op == OP_BINGET ? p[1] : le32(p + 1);
        uintptr_t e = idx < r->memo_count ? r->memo_vals[r->memo[idx]] : fast_memo(r, pm, *npm, idx);
        if (!e || (e & (1 | MEMO_NODE_BIT)))
            return false;
        const pk_sym_t *sym = (const pk_sym_t *)e;
        *d = (slot_t){.type = SL_SCALAR, .kind = sym->kind, .v.sym = sym};
        p += op == OP_BINGET ? 2 : 5;
    } else if (op == OP_LONG1) {
        size_t len = p[1];
        if (!len || len > 8 || (p[1 + len] & 0x80))
            return false;
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * len))};
        p += 2 + len;
    } else if (op == OP_BININT1) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = p[1]};
        p += 2;
    } else if (op == OP_SHORT_BINUNICODE) {
        size_t len = p[1];
        if ((size_t)(end - p) < 2 + len + 1)
            return false;
        /* the same short text as last time ('N/A' in every PyTorch event): one word
         * compared (the 8 bytes at p + 2 lie in the window, p being below its limit) */
        const pk_sym_t *sym = r->last_short;
        uint64_t word = len && len <= 8 ? le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * len)) : 0;
        if (!sym || len > 8 || sym->len != len || sym->word != word) {
            if (sr_sym_get(r, p + 2, len, PV_STR, (size_t)(p - r->in.buf), OP_SHORT_BINUNICODE, &sym) != CCA_OK)
                return false; /* the general path raises it again */
            if (len <= 8)
                r->last_short = sym;
        }
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_STR, .v.sym = sym};
        p += 2 + len;
    } else if (op == OP_BININT2) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.u = le16(p + 1)};
        p += 3;
    } else if (op == OP_BININT) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_INT, .v.i = (int32_t)le32(p + 1)};
        p += 5;
    } else if (op == OP_NONE) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_NONE};
        p += 1;
    } else if (op == OP_NEWTRUE || op == OP_NEWFALSE) {
        *d = (slot_t){.type = SL_SCALAR, .kind = PV_BOOL, .v.b = op == OP_NEWTRUE};
        p += 1;
    } else {
        return false;
    }
    if (*p == OP_MEMOIZE) {
        if (d->kind != PV_STR || !fast_memo_free(r, *memo_next))
            return false; /* a memoized number (boxed by the general path), or a set slot */
        pm[(*npm)++] = (pending_memo_t){(*memo_next)++, (uintptr_t)d->v.sym};
        p++;
    }
    *pp = p;
    return true;
}

/*
 * Put into the template the keys at the positions set in `learn`: memo gets
 * (op[i] their bytes) of a record just committed, kv its pairs. A position
 * past the template's end is left out, so that its entries stay contiguous.
 */
static void keys_learn(sreader_t *r, uint32_t learn, const uint64_t *op, const slot_t *kv)
{
    key_template_t *t = &r->keys;
    for (; learn; learn &= learn - 1) {
        size_t i = (size_t)__builtin_ctz(learn);
        if (i > t->count)
            break;
        t->op[i] = op[i];
        t->len[i] = (op[i] & 0xff) == OP_BINGET ? 2 : 5;
        t->mask[i] = ~(uint64_t)0 >> (64 - 8 * t->len[i]);
        t->key[i] = kv[2 * i];
        if (i == t->count)
            t->count++;
    }
    t->gen++;
}

/*
 * A record (a dict of a records list) whose EMPTY_DICT was just pushed: read
 * its body - an optional memo store, MARK, key / value pairs of plain scalars
 * each with an optional memo store, SETITEMS - in one go, with the effect the
 * opcodes one by one would have. Anything else (another opcode, the window
 * ending, an error to report) leaves everything as it was and returns false,
 * and the general path reads the record.
 */
bool sr_record_fast(sreader_t *r, slot_t *rec_slot)
{
    const uint8_t *p = r->in.buf + r->in.pos, *end = r->in.buf + r->in.end;
    pending_memo_t pm[2 * FAST_FIELDS + 1];
    int npm = 0;
    uint64_t memo_next = r->memo_count;
    size_t n = 0;
    /* the pairs are written in place after the record table's last field,
     * and counted in only when the whole body was read */
    if (end - p < FIXED_OP_MAX + KEY_GET_MAX ||
        !grow(&r->fields, &r->fields_cap, r->nfields + 2 * FAST_FIELDS, sizeof(slot_t), 4096))
        return false;
    slot_t *kv = r->fields + r->nfields;
    const uint8_t *limit = end - FIXED_OP_MAX;
    const uint8_t *key_limit = limit - KEY_GET_MAX; /* a template key leaves p below limit */
    /* the memo store of the dict itself */
    if (p < end && *p == OP_MEMOIZE) {
        if (!fast_memo_free(r, memo_next))
            return false; /* MEMOIZE onto a set slot: one by one it would not count */
        pm[npm++] = (pending_memo_t){memo_next++, MEMO_GONE(PV_DICT)};
        p++;
    }
    if (p >= end || *p != OP_MARK)
        return false;
    p++;
    /* a key, then its value: the key as the template has it at its position, else
     * read as a value is (a second site of the same tests, so that each site's
     * branches learn their own pattern); keys new to the template are noted */
    const key_template_t *t = &r->keys;
    bool templated = true;          /* every key so far read from the template */
    uint32_t learn = 0;             /* positions of memo-get keys the template lacks */
    uint64_t learn_op[FAST_FIELDS]; /* their bytes (set where `learn` has a bit) */
    for (;;) {
        if (__builtin_expect(p > key_limit || n == 2 * FAST_FIELDS, 0))
            return false;
        if (*p == OP_SETITEMS) {
            p++;
            break;
        }
        size_t i = n / 2;
        if ((le64(p) & t->mask[i]) == t->op[i]) {
            kv[n] = t->key[i];
            p += t->len[i];
        } else {
            const uint8_t *key = p;
            if (!fast_scalar(r, &p, end, &kv[n], pm, &npm, &memo_next) || __builtin_expect(p > limit, 0))
                return false;
            templated = false;
            if ((*key == OP_BINGET && p - key == 2) || (*key == OP_LONG_BINGET && p - key == 5)) {
                learn |= (uint32_t)1 << i;
                learn_op[i] = le64(key) & (~(uint64_t)0 >> (64 - 8 * (p - key)));
            }
        }
        if (!fast_scalar(r, &p, end, &kv[n + 1], pm, &npm, &memo_next))
            return false;
        n += 2;
    }
    rec_t *rec = &r->recs[rec_slot->v.rec];
    /* commit: the memo stores (MEMOIZE numbers them from the count, as one by one);
     * the memo grows first, so that no store can fail half way */
    if (npm && memo_next > r->memo_room && !sr_memo_reserve(r, (size_t)memo_next))
        return false; /* out of memory: the general path raises it */
    uint32_t ids[2 * FAST_FIELDS + 1];
    for (int i = 0; i < npm; i++)
        if (!(ids[i] = sr_memo_id_of(r, pm[i].e)))
            return false; /* likewise (values added stay unused) */
    for (int i = 0; i < npm; i++) {
        r->memo[pm[i].idx] = ids[i];
        r->memo_count++;
    }
    if (npm && memo_next > r->memo_len)
        r->memo_len = (size_t)memo_next;
    rec->keys_gen = templated && n / 2 == t->count ? t->gen : 0;
    if (learn)
        keys_learn(r, learn, learn_op, kv);
    rec->start = r->nfields;
    rec->count = n / 2;
    r->nfields += n;
    if (n)
        rec_slot->flags |= SF_FILLED;
    r->in.pos = (size_t)(p - r->in.buf);
    return true;
}