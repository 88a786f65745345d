/*
 * pickle_stream.c - the pickle decoder's machine (pickle_decode.h): the
 * opcodes of protocols 0-5 for plain data, over pickle_input.c's window,
 * keeping tree values as pv trees, dropping skipped ones and handing the
 * dicts of records fields to pickle_records.c.
 *
 * Invariant: every value on the stack is a slot saying what became of it: a
 * scalar (strings interned once per distinct text), a value kept in the tree
 * (a pv node), a container dropped as it fills (skip), the top-level dict, a
 * records list (L1), an inner list of records (L2), or a record filling up.
 * A container's slot type is chosen when it begins and checked when its
 * parent takes it (see derive()); records live in a table reset whenever no
 * record is left on the stack, so memory stays bounded by one batch. Nothing
 * allocated depends on a length field beyond the data that can follow it.
 */
#include "pickle_decode.h"

/* ---- symbols ------------------------------------------------------------------------ */

int32_t sr_tag_of(const pk_handler_t *h, const char *data, size_t len)
{
    for (size_t t = 0; t < h->symbol_count; t++)
        if (strlen(h->symbols[t]) == len && !memcmp(h->symbols[t], data, len))
            return (int32_t)t;
    return -1;
}

static void *arena_get(sreader_t *r, size_t size)
{
    size = (size + 7) & ~(size_t)7;
    if ((size_t)(r->arena_end - r->arena_cur) < size) {
        size_t bytes = size > ARENA_CHUNK ? size : ARENA_CHUNK;
        arena_block_t *b = malloc(sizeof(*b) + 8 + bytes);
        if (!b)
            return NULL;
        b->next = r->blocks;
        r->blocks = b;
        r->arena_cur = (char *)b + ((sizeof(*b) + 7) & ~(size_t)7);
        r->arena_end = r->arena_cur + bytes;
    }
    void *p = r->arena_cur;
    r->arena_cur += size;
    return p;
}

static uint64_t sym_hash(const uint8_t *p, size_t n, uint8_t kind)
{
    uint64_t h = 0xcbf29ce484222325ull ^ kind;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static pk_sym_t *sym_new(sreader_t *r, const uint8_t *p, size_t n, uint8_t kind, uint64_t hash)
{
    pk_sym_t *s = arena_get(r, sizeof(*s) + n + 1);
    if (!s)
        return NULL;
    char *data = (char *)(s + 1);
    memcpy(data, p, n);
    data[n] = 0;
    s->data = data;
    s->len = n;
    s->hash = hash;
    s->kind = kind;
    s->tag = -1;
    s->memo_id = 0;
    s->node = NULL;
    if (kind == PV_STR)
        s->tag = sr_tag_of(r->h, (const char *)p, n);
    return s;
}

/*
 * The symbol for n bytes of kind (interned when short). A str is checked for
 * UTF-8 when its text is first met. Returns CCA_OK, CCA_ERR_FORMAT (invalid
 * UTF-8, for the opcode at off), CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t sr_sym_get(sreader_t *r, const uint8_t *p, size_t n, uint8_t kind, size_t off, int op,
                        const pk_sym_t **out)
{
    pk_sym_t *s;
    uint64_t word = 0;
    size_t slot = 0;
    if (n <= 8) {
        /* short texts ('N/A', '') recur in every event: one word compared */
        for (size_t i = 0; i < n; i++)
            word |= (uint64_t)p[i] << (8 * i);
        slot = (size_t)(((word ^ (n << 4) ^ kind) * 0x9e3779b97f4a7c15ull) >> 56);
        const pk_sym_t *c = r->recent[slot];
        if (c && c->word == word && c->len == n && c->kind == kind) {
            *out = c;
            return CCA_OK;
        }
    }
    if (n > SHORT_SYM_MAX) {
        if (kind == PV_STR && !pv_utf8_valid(p, n))
            return sr_error(r, off, "%s is not valid UTF-8", sr_op_name(op));
        if (!(s = sym_new(r, p, n, kind, 0)))
            return sr_oom();
        *out = s;
        return CCA_OK;
    }
    uint64_t h = sym_hash(p, n, kind);
    if (r->nsyms * 2 >= r->syms_cap) {
        size_t cap = r->syms_cap ? r->syms_cap * 2 : 1024;
        pk_sym_t **t = calloc(cap, sizeof(*t));
        if (!t)
            return sr_oom();
        for (size_t i = 0; i < r->syms_cap; i++) {
            pk_sym_t *e = r->syms[i];
            if (!e)
                continue;
            size_t j = e->hash & (cap - 1);
            while (t[j])
                j = (j + 1) & (cap - 1);
            t[j] = e;
        }
        free(r->syms);
        r->syms = t;
        r->syms_cap = cap;
    }
    size_t j = h & (r->syms_cap - 1);
    for (; (s = r->syms[j]) != NULL; j = (j + 1) & (r->syms_cap - 1))
        if (s->hash == h && s->len == n && s->kind == kind && !memcmp(s->data, p, n))
            break;
    if (!s) {
        if (kind == PV_STR && !pv_utf8_valid(p, n))
            return sr_error(r, off, "%s is not valid UTF-8", sr_op_name(op));
        if (!(s = sym_new(r, p, n, kind, h)))
            return sr_oom();
        s->word = word;
        r->syms[j] = s;
        r->nsyms++;
    }
    if (n <= 8)
        r->recent[slot] = s;
    *out = s;
    return CCA_OK;
}


/* ---- the stack ---------------------------------------------------------------------- */

static __attribute__((noinline)) bool stack_grow(sreader_t *r)
{
    return grow(&r->stack, &r->stack_cap, r->sp + 1, sizeof(slot_t), 256);
}

/*
 * A new slot on top of the stack for the caller to fill in place (building a
 * slot elsewhere and copying it stalls on store forwarding); NULL when out of
 * memory (raised).
 */
static inline slot_t *push_slot(sreader_t *r)
{
    if (__builtin_expect(r->sp == r->stack_cap, 0) && !stack_grow(r)) {
        sr_oom();
        return NULL;
    }
    return &r->stack[r->sp++];
}

static inline cca_status_t push(sreader_t *r, const slot_t *s)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    *d = *s;
    return CCA_OK;
}

static inline cca_status_t push_scalar(sreader_t *r, uint8_t kind, uint8_t flags, uint64_t bits)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    d->type = SL_SCALAR;
    d->kind = kind;
    d->flags = flags;
    d->n = 0;
    d->v.u = bits;
    return CCA_OK;
}

/* Push a str / bytes / big int symbol. */
static inline cca_status_t push_sym(sreader_t *r, const pk_sym_t *sym)
{
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    d->type = SL_SCALAR;
    d->kind = sym->kind;
    d->flags = 0;
    d->n = 0;
    d->v.sym = sym;
    return CCA_OK;
}

/* Drop the stack down to n items; a record table with no record left is reset. */
static void pop_to(sreader_t *r, size_t n)
{
    r->sp = n;
    if (n <= r->rec_base)
        r->rec_base = SIZE_MAX;
}

static size_t fence(const sreader_t *r)
{
    return r->nmarks ? r->marks[r->nmarks - 1] : 0;
}

static cca_status_t have(sreader_t *r, size_t off, int op, size_t count)
{
    if (r->sp - fence(r) >= count)
        return CCA_OK;
    return sr_error(r, off, "stack underflow in %s (needs %zu items)", sr_op_name(op), count);
}

static cca_status_t pop_mark(sreader_t *r, size_t off, int op, size_t *mark)
{
    if (!r->nmarks)
        return sr_error(r, off, "%s without a MARK", sr_op_name(op));
    *mark = r->marks[--r->nmarks];
    return CCA_OK;
}

/* ---- values into the tree and into records ---------------------------------------------- */

/* The tree node for a slot; NULL (error raised) when it was streamed or skipped. */
static pv_node_t *to_node(sreader_t *r, const slot_t *s, size_t off)
{
    pv_node_t *n = NULL;
    if (s->type == SL_NODE || s->type == SL_ROOT)
        return s->v.node; /* the top-level dict: as far as it is kept (as the memo has it) */
    if (s->type != SL_SCALAR) {
        sr_gone(r, off, "a %s of a streamed or skipped field is referenced where values are kept",
                slot_kind_name(s));
        return NULL;
    }
    if ((s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT) && s->v.sym->node)
        return s->v.sym->node; /* one node per symbol: the tree shares it, as the pickle did */
    switch (s->kind) {
    case PV_NONE: n = pv_new_none(r->doc); break;
    case PV_BOOL: n = pv_new_bool(r->doc, s->v.b); break;
    case PV_INT: n = (s->flags & SF_U64) ? pv_new_u64(r->doc, s->v.u) : pv_new_int(r->doc, s->v.i); break;
    case PV_FLOAT: n = pv_new_float(r->doc, s->v.f); break;
    case PV_STR:
    case PV_BYTES:
        n = pv_node_bytes(r->doc, (pv_kind_t)s->kind, s->v.sym->data, s->v.sym->len);
        ((pk_sym_t *)(uintptr_t)s->v.sym)->node = n; /* the reader's own symbol */
        break;
    case PV_BIGINT:
        n = pv_new_bigint(r->doc, (const uint8_t *)s->v.sym->data, s->v.sym->len);
        ((pk_sym_t *)(uintptr_t)s->v.sym)->node = n;
        break;
    default: break;
    }
    if (!n)
        sr_oom();
    return n;
}

/* ---- deciding what a new container becomes ---------------------------------------------- */

static cca_status_t new_tree_container(sreader_t *r, pv_kind_t kind, slot_t *out)
{
    out->type = SL_NODE;
    if (kind == PV_TUPLE)
        return CCA_OK; /* built from its items by the caller */
    out->v.node = kind == PV_LIST ? pv_new_list(r->doc) : pv_new_dict(r->doc);
    return out->v.node ? CCA_OK : sr_oom();
}

static inline cca_status_t new_record(sreader_t *r, size_t p, slot_t *out)
{
    if (r->rec_base == SIZE_MAX) {
        r->rec_base = p;
        r->nrecs = 0;
        r->nfields = 0;
    }
    if (!grow(&r->recs, &r->recs_cap, r->nrecs + 1, sizeof(rec_t), 1024))
        return sr_oom();
    r->recs[r->nrecs].start = r->nfields;
    r->recs[r->nrecs].count = 0;
    r->recs[r->nrecs].keys_gen = 0;
    out->type = SL_RECORD;
    out->v.rec = r->nrecs++;
    return CCA_OK;
}

static cca_status_t new_group(sreader_t *r, uint64_t group, slot_t *out)
{
    out->type = SL_L2;
    out->v.group = group;
    return sr_call_group(r, r->records_field->data, (size_t)group);
}

/* A top-level value that is not a dict, for a handler that wants one (dict_root). */
static cca_status_t not_dict_root(sreader_t *r, size_t off, pv_kind_t kind)
{
    return sr_error(r, off, "the top-level value (%s) is not a dict", pv_kind_name(kind));
}

/*
 * The slot of a new container of `kind` that will sit at stack index p (the
 * stack holds only what lies below it). Its parent is the list just below it
 * (APPEND style), the dict two below with a key between (SETITEM style; a dict
 * that already took items is passed over when a MARK offers another parent),
 * or else the container below the innermost MARK (APPENDS / SETITEMS style).
 */
static cca_status_t derive(sreader_t *r, size_t p, pv_kind_t kind, size_t off, slot_t *out)
{
    memset(out, 0, sizeof(*out));
    out->kind = (uint8_t)kind;
    if (p == 0) {
        if (kind != PV_DICT && !r->nmarks && r->h->dict_root)
            return not_dict_root(r, off, kind);
        if (kind == PV_DICT && !r->root_seen) {
            r->root_seen = true;
            out->type = SL_ROOT;
            out->v.node = pv_new_dict(r->doc);
            return out->v.node ? CCA_OK : sr_oom();
        }
        return new_tree_container(r, kind, out);
    }
    size_t f = fence(r), c;
    bool keyed = false, append_style = false;
    const slot_t *below = &r->stack[p - 1];
    if (p > f && is_container(below) && below->kind == PV_LIST) {
        c = p - 1;
        append_style = true;
    } else if (p > f + 1 && below->type == SL_SCALAR && is_container(&r->stack[p - 2]) &&
               r->stack[p - 2].kind == PV_DICT && (f == 0 || !(r->stack[p - 2].flags & SF_FILLED))) {
        c = p - 2;
        keyed = true;
    } else if (f > 0) {
        c = f - 1;
        keyed = (p - f) % 2 == 1;
    } else {
        return new_tree_container(r, kind, out);
    }
    const slot_t *parent = &r->stack[c];
    switch (parent->type) {
    case SL_NODE:
        return new_tree_container(r, kind, out);
    case SL_SKIP:
    case SL_RECORD:
        out->type = SL_SKIP;
        return CCA_OK;
    case SL_ROOT: {
        if (!keyed || below->type != SL_SCALAR || below->kind != PV_STR)
            return new_tree_container(r, kind, out);
        const pk_sym_t *key = below->v.sym;
        if (r->keep_all)
            return new_tree_container(r, kind, out); /* its mode is applied when the root takes it */
        pk_mode_t mode = r->h->field_mode ? r->h->field_mode(r->h->ctx, key->data, key->len) : PK_TREE;
        out->flags = SF_FIELD;
        r->dropped |= mode != PK_TREE;
        if (mode == PK_SKIP) {
            out->type = SL_SKIP;
            return CCA_OK;
        }
        if (mode != PK_RECORDS)
            return new_tree_container(r, kind, out);
        if (kind != PV_LIST)
            return sr_error(r, off, "field '%s' is a %s, not a list of records", key->data,
                            pv_kind_name(kind));
        out->type = SL_L1;
        r->records_field = key;
        return CCA_OK;
    }
    case SL_L1:
        if (kind == PV_DICT)
            return new_record(r, p, out);
        if (kind != PV_LIST)
            break;
        if (append_style)
            return new_group(r, parent->n, out);
        if (c == f - 1)
            return new_group(r, parent->n + (p - f), out);
        break;
    case SL_L2:
        if (kind == PV_DICT)
            return new_record(r, p, out);
        if (kind == PV_LIST && append_style && f > 0 && r->stack[f - 1].type == SL_L1)
            return new_group(r, r->stack[f - 1].n + (p - f), out);
        break;
    default:
        return new_tree_container(r, kind, out);
    }
    out->type = SL_SKIP; /* not a record: refused when its list takes it */
    return CCA_OK;
}

/*
 * Item `index` of a records field's list that is kept in the tree (shared
 * through the memo with a kept field): a record (a dict), or an inner list of
 * them (a group).
 */
static cca_status_t take_tree_item(sreader_t *r, size_t off, const pv_node_t *item, size_t index)
{
    if (pv_kind(item) == PV_DICT)
        return sr_deliver_node(r, item, 0, index);
    cca_status_t st = sr_call_group(r, r->records_field->data, index);
    for (size_t i = 0; i < pv_len(item) && st == CCA_OK; i++) {
        const pv_node_t *d = pv_at(item, i);
        if (pv_kind(d) != PV_DICT)
            return sr_error(r, off, "item %zu of a list of records is a %s, not a dict", i,
                            pv_kind_name(pv_kind(d)));
        st = sr_deliver_node(r, d, index, i);
    }
    return st;
}

/* list.append(item) for the items stack[from .. sp), then pop them. */
static cca_status_t take_items(sreader_t *r, size_t off, int op, slot_t *list, size_t from)
{
    cca_status_t st = CCA_OK;
    if (!is_container(list) || list->kind != PV_LIST)
        return sr_error(r, off, "%s on a %s, not a list", sr_op_name(op), slot_kind_name(list));
    if (r->sp > from)
        list->flags |= SF_FILLED;
    if (list->type == SL_NODE && !pv_list_reserve(r->doc, list->v.node, r->sp - from))
        return sr_oom(); /* room for the batch at once, as the tree keeps no array it outgrew */
    for (size_t i = from; i < r->sp && st == CCA_OK; i++) {
        slot_t *item = &r->stack[i];
        switch (list->type) {
        case SL_NODE: {
            pv_node_t *n = to_node(r, item, off);
            st = n ? pv_list_append(r->doc, list->v.node, n) : cca_last_error()->status;
            break;
        }
        case SL_SKIP:
            break;
        case SL_L1:
            if (item->type == SL_L2 && item->v.group == list->n) {
                list->n++;
            } else if (item->type == SL_RECORD) {
                st = sr_deliver(r, item, 0, list->n++);
            } else if (item->type == SL_NODE && (item->kind == PV_DICT || item->kind == PV_LIST)) {
                st = take_tree_item(r, off, item->v.node, list->n++);
            } else if (item->type == SL_SKIP && (item->kind == PV_DICT || item->kind == PV_LIST)) {
                st = sr_gone(r, off, "item %u of records field '%s' (a %s) was handed over before",
                             list->n, r->records_field->data, slot_kind_name(item));
            } else {
                st = sr_error(r, off, "item %u of records field '%s' (a %s) is not a list of records",
                              list->n, r->records_field->data, slot_kind_name(item));
            }
            break;
        case SL_L2:
            if (item->type == SL_RECORD)
                st = sr_deliver(r, item, list->v.group, list->n++);
            else if (item->type == SL_NODE && item->kind == PV_DICT) /* a dict shared with a kept field */
                st = sr_deliver_node(r, item->v.node, list->v.group, list->n++);
            else if (item->type == SL_SKIP && item->kind == PV_DICT) /* shared with an earlier record */
                st = sr_gone(r, off, "item %u of a list of records is a dict handed over before", list->n);
            else
                st = sr_error(r, off, "item %u of a list of records is a %s, not a dict", list->n,
                              slot_kind_name(item));
            break;
        default:
            st = sr_error(r, off, "%s on a %s, not a list", sr_op_name(op), slot_kind_name(list));
        }
    }
    pop_to(r, from);
    return st;
}

/*
 * Whether the top-level dict keeps k: v in the fields tree: a field whose mode
 * was applied when its value began keeps it if it became a tree; any other
 * value (a scalar, a value from the memo, a tree built before its place was
 * known) is kept, dropped or streamed now as its field's mode says.
 */
static bool root_keeps(sreader_t *r, size_t off, const slot_t *k, const slot_t *v, cca_status_t *st)
{
    if (v->flags & SF_FIELD)
        return v->type == SL_NODE;
    if (k->type != SL_SCALAR || k->kind != PV_STR || !r->h->field_mode)
        return true;
    pk_mode_t mode = r->h->field_mode(r->h->ctx, k->v.sym->data, k->v.sym->len);
    r->dropped |= mode != PK_TREE;
    if (mode == PK_RECORDS && v->type == SL_NODE)
        *st = sr_deliver_tree(r, off, k->v.sym, v->v.node);
    else if (mode == PK_RECORDS && v->type == SL_SKIP && v->kind == PV_LIST)
        *st = sr_gone(r, off, "field '%s' is a list of records dropped before", k->v.sym->data);
    else if (mode == PK_RECORDS)
        *st = sr_error(r, off, "field '%s' is a %s, not a list of records", k->v.sym->data,
                       slot_kind_name(v));
    return mode == PK_TREE;
}

/* dict[k] = v for the stack pairs above `from`, then pop them. */
static cca_status_t take_pairs(sreader_t *r, size_t off, int op, slot_t *dict, size_t from)
{
    cca_status_t st = CCA_OK;
    if (!is_container(dict) || dict->kind != PV_DICT)
        return sr_error(r, off, "%s on a %s, not a dict", sr_op_name(op), slot_kind_name(dict));
    if ((r->sp - from) % 2)
        return sr_error(r, off, "odd number of items for %s", sr_op_name(op));
    for (size_t i = from; i < r->sp; i += 2)
        if (r->stack[i].kind == PV_LIST || r->stack[i].kind == PV_DICT)
            return sr_error(r, off, "unhashable dict key (%s) in %s", slot_kind_name(&r->stack[i]),
                            sr_op_name(op));
    if (r->sp > from)
        dict->flags |= SF_FILLED;
    if (dict->type == SL_RECORD) {
        rec_t *rec = &r->recs[dict->v.rec];
        size_t n = r->sp - from;
        if (rec->count && rec->start + 2 * rec->count != r->nfields)
            return sr_error(r, off, "the fields of two records are interleaved");
        if (!rec->count)
            rec->start = r->nfields;
        if (!grow(&r->fields, &r->fields_cap, r->nfields + n, sizeof(slot_t), 4096))
            return sr_oom();
        memcpy(r->fields + r->nfields, r->stack + from, n * sizeof(slot_t));
        r->nfields += n;
        rec->count += n / 2;
        rec->keys_gen = 0; /* its keys now differ from those it was read with */
        pop_to(r, from);
        return CCA_OK;
    }
    if ((dict->type == SL_NODE || dict->type == SL_ROOT) &&
        !pv_dict_reserve(r->doc, dict->v.node, (r->sp - from) / 2))
        return sr_oom(); /* room for the batch at once */
    for (size_t i = from; i < r->sp && st == CCA_OK; i += 2) {
        slot_t *k = &r->stack[i], *v = &r->stack[i + 1];
        pv_node_t *kn, *vn;
        switch (dict->type) {
        case SL_SKIP:
            break;
        case SL_ROOT:
            if (!root_keeps(r, off, k, v, &st))
                break;
            __attribute__((fallthrough)); /* a tree field */
        case SL_NODE:
            kn = to_node(r, k, off);
            vn = kn ? to_node(r, v, off) : NULL;
            if (!kn || !vn) {
                st = cca_last_error()->status;
                break;
            }
            st = pv_dict_set_node(r->doc, dict->v.node, kn, vn);
            if (st == CCA_ERR_INVALID_ARGUMENT)
                st = sr_error(r, off, "unhashable dict key (%s) in %s", pv_kind_name(pv_kind(kn)),
                              sr_op_name(op));
            break;
        default:
            st = sr_error(r, off, "%s on a %s, not a dict", sr_op_name(op), slot_kind_name(dict));
        }
    }
    pop_to(r, from);
    return st;
}

/* A tuple of the n items on top of the stack. */
static cca_status_t make_tuple(sreader_t *r, size_t off, size_t n)
{
    size_t from = r->sp - n;
    slot_t t;
    cca_status_t st = derive(r, from, PV_TUPLE, off, &t);
    if (st)
        return st;
    if (t.type == SL_NODE) {
        pv_node_t *small[8];
        pv_node_t **items = n <= 8 ? small : malloc(n * sizeof(*items));
        if (!items)
            return sr_oom();
        for (size_t i = 0; i < n && st == CCA_OK; i++)
            if (!(items[i] = to_node(r, &r->stack[from + i], off)))
                st = cca_last_error()->status;
        if (st == CCA_OK && !(t.v.node = pv_new_tuple(r->doc, n, items)))
            st = sr_oom();
        if (items != small)
            free(items);
        if (st)
            return st;
    } else {
        t.type = SL_SKIP;
    }
    pop_to(r, from);
    return push(r, &t);
}

/* LIST / DICT: a container holding the items above the mark. */
static cca_status_t make_from_mark(sreader_t *r, size_t off, int op, size_t mark)
{
    slot_t c;
    size_t top = r->sp;
    r->sp = mark; /* derive() looks only below the container */
    cca_status_t st = derive(r, mark, op == OP_LIST ? PV_LIST : PV_DICT, off, &c);
    r->sp = top;
    if (st)
        return st;
    if (r->sp == r->stack_cap && !grow(&r->stack, &r->stack_cap, r->sp + 1, sizeof(slot_t), 256))
        return sr_oom();
    memmove(r->stack + mark + 1, r->stack + mark, (r->sp - mark) * sizeof(slot_t));
    r->stack[mark] = c;
    r->sp++;
    if (c.type == SL_RECORD && r->rec_base > mark)
        r->rec_base = mark;
    if (op == OP_LIST)
        return take_items(r, off, op, &r->stack[mark], mark + 1);
    return take_pairs(r, off, op, &r->stack[mark], mark + 1);
}

/* ---- memo ------------------------------------------------------------------------------------- */

/* Room for n memo entries, the new ones unset; false when out of memory. */
bool sr_memo_reserve(sreader_t *r, size_t n)
{
    if (n > SIZE_MAX / sizeof(*r->memo) ||
        !cca_zarray_grow((void **)&r->memo, &r->memo_bytes, n * sizeof(*r->memo)))
        return false;
    r->memo_room = r->memo_bytes / sizeof(*r->memo);
    return true;
}

/*
 * The memo_vals index of memo entry e (a symbol, a node with MEMO_NODE_BIT, a
 * dropped container's MEMO_GONE), added when new: a symbol and a dropped
 * container's kind keep theirs, a node gets a new one. 0 when out of memory.
 */
uint32_t sr_memo_id_add(sreader_t *r, uintptr_t e)
{
    uint32_t *known = NULL;
    if (e & 1) {
        if ((e >> 2) < 16)
            known = &r->gone_ids[e >> 2];
    } else if (!(e & MEMO_NODE_BIT)) {
        known = &((pk_sym_t *)e)->memo_id; /* the reader's own symbol, const only to the decoder */
    }
    if (known && *known)
        return *known;
    if (r->nvals == r->vals_cap) {
        if (r->nvals >= UINT32_MAX ||
            !grow(&r->memo_vals, &r->vals_cap, r->nvals + 1, sizeof(uintptr_t), 256))
            return 0;
        if (!r->nvals)
            r->memo_vals[r->nvals++] = 0; /* index 0: unset */
    }
    uint32_t id = (uint32_t)r->nvals++;
    r->memo_vals[id] = e;
    if (known)
        *known = id;
    return id;
}

/* memo[idx] = e. Returns CCA_OK, CCA_ERR_FORMAT (a bogus index), CCA_ERR_OUT_OF_MEMORY. */
static cca_status_t memo_store(sreader_t *r, size_t off, uint64_t idx, uintptr_t e)
{
    /* A writer numbers memo slots from 0; an index beyond the data read so far is bogus. */
    if (idx > r->in.base + r->in.pos)
        return sr_error(r, off, "memo index %llu out of range", (unsigned long long)idx);
    uint32_t id = sr_memo_id_of(r, e);
    if (!id || (idx >= r->memo_room && !sr_memo_reserve(r, (size_t)idx + 1)))
        return sr_oom();
    if (idx >= r->memo_len) {
        r->memo_len = (size_t)idx + 1;
        r->memo_count++;
    } else if (!r->memo[idx]) {
        r->memo_count++;
    } else {
        sr_keys_reset(&r->keys); /* a key's get may now read another value */
    }
    r->memo[idx] = id;
    return CCA_OK;
}

static cca_status_t memo_put(sreader_t *r, size_t off, uint64_t idx)
{
    if (r->sp <= fence(r))
        return sr_error(r, off, "memo store with an empty stack");
    const slot_t *s = &r->stack[r->sp - 1];
    uintptr_t e;
    if (s->type == SL_SCALAR && (s->kind == PV_STR || s->kind == PV_BYTES || s->kind == PV_BIGINT)) {
        e = (uintptr_t)s->v.sym;
    } else if (s->type == SL_SCALAR) {
        pv_node_t *n = to_node(r, s, off); /* boxed: scalars are rarely memoized */
        if (!n)
            return cca_last_error()->status;
        e = (uintptr_t)n | MEMO_NODE_BIT;
    } else if (s->type == SL_NODE || s->type == SL_ROOT) {
        e = (uintptr_t)s->v.node | MEMO_NODE_BIT; /* the top-level dict: as far as it is kept */
    } else {
        e = MEMO_GONE(s->kind);
    }
    return memo_store(r, off, idx, e);
}

static inline cca_status_t memo_get(sreader_t *r, size_t off, uint64_t idx)
{
    uintptr_t e = idx < r->memo_len ? r->memo_vals[r->memo[idx]] : 0;
    if (!e)
        return sr_error(r, off, "memo key %llu is not defined", (unsigned long long)idx);
    if (!(e & (1 | MEMO_NODE_BIT)))
        return push_sym(r, (const pk_sym_t *)e);
    slot_t *s = push_slot(r);
    if (!s)
        return CCA_ERR_OUT_OF_MEMORY;
    s->flags = 0;
    s->n = 0;
    if (e & 1) {
        s->type = SL_SKIP;
        s->kind = (uint8_t)(e >> 2);
        s->v.u = 0;
    } else {
        s->type = SL_NODE;
        s->v.node = (pv_node_t *)(e & ~MEMO_NODE_BIT);
        s->kind = (uint8_t)pv_kind(s->v.node);
    }
    return CCA_OK;
}

/*
 * Whether the `total` bytes of the opcode at pos are in the window. When they
 * are not and more data may come, the opcode is retried after a refill
 * (r->in.want); at the end of the data it is an error.
 */
static cca_status_t ready(sreader_t *r, size_t off, int op, uint64_t head, uint64_t n, bool *ok)
{
    uint64_t total = head + n;
    *ok = false;
    if (r->in.end - r->in.pos >= total) {
        *ok = true;
        return CCA_OK;
    }
    uint64_t avail = (uint64_t)(r->in.end - r->in.pos) + pk_input_left_bound(&r->in);
    if (total > avail && (op == OP_INT || op == OP_LONG))
        return sr_error(r, off, "truncated %s: no newline", sr_op_name(op));
    if (total > avail && avail >= head && (!r->in.gz || r->in.eof))
        return sr_error(r, off, "truncated %s: length %llu exceeds the %llu bytes left", sr_op_name(op),
                        (unsigned long long)n, (unsigned long long)(avail - head));
    if (total > avail)
        return sr_error(r, off, "truncated %s: length %llu exceeds the data left", sr_op_name(op),
                        (unsigned long long)n);
    r->in.want = (size_t)total;
    r->fast_limit = 0;
    return CCA_OK;
}

/*
 * A str or bytes of n >= LARGE_BLOB bytes (its opcode and length, head bytes,
 * at window offset off): read straight into a node of the tree, a window at a
 * time, so that the reader holds its bytes once, where they are kept.
 */
static cca_status_t read_large(sreader_t *r, size_t off, int op, size_t head, uint64_t n, pv_kind_t kind)
{
    bool ok;
    uint64_t avail = (uint64_t)(r->in.end - r->in.pos) + pk_input_left_bound(&r->in);
    if (head + n > avail || n > SIZE_MAX / 2)
        return ready(r, off, op, head, n, &ok); /* more than the data can hold: its error */
    uint64_t at = r->in.base + off; /* the opcode's offset in the whole data */
    pv_node_t *node = pv_node_alloc(r->doc, kind);
    char *data = node ? pv_arena_alloc(r->doc, (size_t)n + 1) : NULL;
    if (!data)
        return sr_oom();
    size_t got = 0;
    r->in.pos += head;
    for (;;) {
        size_t take = r->in.end - r->in.pos;
        if (take > n - got)
            take = (size_t)n - got;
        memcpy(data + got, r->in.buf + r->in.pos, take);
        r->in.pos += take;
        got += take;
        if (got == n)
            break;
        /* (window offsets below wrap so that base + offset is the opcode's) */
        if (r->in.eof)
            return sr_error(r, (size_t)(at - r->in.base),
                            "truncated %s: length %llu exceeds the %zu bytes left", sr_op_name(op),
                            (unsigned long long)n, got);
        size_t need = n - got < PK_WINDOW_DEFAULT ? (size_t)n - got : PK_WINDOW_DEFAULT;
        cca_status_t st = pk_input_fill(&r->in, need);
        if (st)
            return st;
        r->fast_limit = 0; /* the window moved: run() checks it again */
    }
    data[n] = 0;
    if (kind == PV_STR && !pv_utf8_valid((const uint8_t *)data, (size_t)n))
        return sr_error(r, (size_t)(at - r->in.base), "%s is not valid UTF-8", sr_op_name(op));
    node->v.s.data = data;
    node->v.s.len = (size_t)n;
    slot_t *d = push_slot(r);
    if (!d)
        return CCA_ERR_OUT_OF_MEMORY;
    memset(d, 0, sizeof(*d));
    d->type = SL_NODE;
    d->kind = (uint8_t)kind;
    d->v.node = node;
    return CCA_OK;
}

/* ---- the machine ------------------------------------------------------------------------------- */

static cca_status_t push_int_le(sreader_t *r, size_t off, int op, const uint8_t *b, size_t n)
{
    while (n > 1 && ((b[n - 1] == 0x00 && !(b[n - 2] & 0x80)) || (b[n - 1] == 0xff && (b[n - 2] & 0x80))))
        n--;
    if (n <= 8) {
        uint64_t u = le_bytes(b, (int)n);
        if (n && n < 8 && (b[n - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * n);
        return push_scalar(r, PV_INT, 0, u);
    }
    if (n == 9 && b[8] == 0)
        return push_scalar(r, PV_INT, SF_U64, le_bytes(b, 8));
    const pk_sym_t *sym;
    cca_status_t st = sr_sym_get(r, b, n, PV_BIGINT, off, op, &sym);
    return st ? st : push_sym(r, sym);
}

/* Text INT / LONG (line already in the window, without its newline). */
static cca_status_t push_text_int(sreader_t *r, size_t off, int op, const char *s, size_t len)
{
    if (op == OP_INT && len == 2 && s[0] == '0' && (s[1] == '0' || s[1] == '1'))
        return push_scalar(r, PV_BOOL, 0, s[1] == '1');
    if (op == OP_LONG && len && s[len - 1] == 'L')
        len--;
    size_t i = 0;
    bool neg = false;
    if (i < len && (s[i] == '-' || s[i] == '+'))
        neg = s[i++] == '-';
    if (i == len)
        return sr_error(r, off, "%s: no digits", sr_op_name(op));
    uint64_t mag = 0;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return sr_error(r, off, "%s: bad digit '%c'", sr_op_name(op), s[i]);
        unsigned d = (unsigned)(s[i] - '0');
        if (mag > (UINT64_MAX - d) / 10)
            return sr_error(r, off, "%s: integer beyond 64 bits is not supported", sr_op_name(op));
        mag = mag * 10 + d;
    }
    if (neg && mag > (uint64_t)INT64_MAX + 1)
        return sr_error(r, off, "%s: integer beyond 64 bits is not supported", sr_op_name(op));
    return push_scalar(r, PV_INT, (!neg && mag > (uint64_t)INT64_MAX) ? SF_U64 : 0,
                       neg ? (uint64_t)0 - mag : mag);
}

static cca_status_t push_container(sreader_t *r, size_t off, pv_kind_t kind)
{
    slot_t *s = push_slot(r); /* derive() looks only below it */
    if (!s)
        return CCA_ERR_OUT_OF_MEMORY;
    cca_status_t st = derive(r, r->sp - 1, kind, off, s);
    if (st == CCA_OK && kind == PV_TUPLE && s->type == SL_NODE) {
        if (!(s->v.node = pv_new_tuple(r->doc, 0, NULL)))
            st = sr_oom();
    } else if (kind == PV_TUPLE) {
        s->type = SL_SKIP;
    }
    if (st)
        pop_to(r, r->sp - 1);
    return st;
}

/*
 * Execute the opcode at pos. Sets r->in.want (and consumes nothing) when it needs
 * more data. checked: the window may hold less than FIXED_OP_MAX bytes.
 */
static inline __attribute__((always_inline)) cca_status_t step(sreader_t *r, bool *stop, bool checked)
{
    size_t off = r->in.pos;
    size_t left = r->in.end - r->in.pos;
    const uint8_t *p = r->in.buf + r->in.pos;
    int op = p[0];
    size_t mark = 0;
    bool ok = true;
    cca_status_t st = CCA_OK;
    /* fixed-size arguments: the window holds FIXED_OP_MAX bytes unless the data ends */
    static const uint8_t fixed[256] = {
        [OP_PROTO] = 2, [OP_FRAME] = 9, [OP_BININT1] = 2, [OP_BININT2] = 3, [OP_BININT] = 5,
        [OP_BINFLOAT] = 9, [OP_BINPUT] = 2, [OP_LONG_BINPUT] = 5, [OP_BINGET] = 2,
        [OP_LONG_BINGET] = 5, [OP_LONG1] = 2, [OP_LONG4] = 5, [OP_SHORT_BINUNICODE] = 2,
        [OP_SHORT_BINBYTES] = 2, [OP_BINUNICODE] = 5, [OP_BINBYTES] = 5, [OP_BINUNICODE8] = 9,
        [OP_BINBYTES8] = 9, [OP_BYTEARRAY8] = 9,
    };
    if (checked && fixed[op] > left)
        return sr_error(r, off, "truncated %s: needs %u argument bytes, %zu left", sr_op_name(op),
                        fixed[op] - 1u, left - 1);
    switch (op) {
    case OP_PROTO:
        if (p[1] > 5)
            return sr_error(r, off, "unsupported pickle protocol %d", p[1]);
        r->in.pos += 2;
        return CCA_OK;
    case OP_FRAME: {
        /* frames only group opcodes; the window does not need them, but a frame
         * longer than the data left is refused as pickle.c's reader does */
        uint64_t len = le64(p + 1);
        if (len > (uint64_t)(left - 9) + pk_input_left_bound(&r->in))
            return sr_error(r, off, "frame of %llu bytes exceeds the data left", (unsigned long long)len);
        r->in.pos += 9;
        return CCA_OK;
    }
    case OP_STOP:
        if ((st = have(r, off, op, 1)))
            return st;
        {
            slot_t *top = &r->stack[r->sp - 1];
            if (top->type != SL_ROOT && r->h->dict_root)
                return not_dict_root(r, off, (pv_kind_t)top->kind);
            if (top->type != SL_ROOT && (r->dropped || r->calls || r->calls_to_skip))
                return sr_error(r, off, "the pickle's value is not the dict whose fields were streamed");
            pv_node_t *root = top->type == SL_ROOT ? top->v.node : to_node(r, top, off);
            if (!root)
                return cca_last_error()->status;
            r->result = root;
        }
        r->in.pos += 1;
        *stop = true;
        r->fast_limit = 0;
        return CCA_OK;
    case OP_MARK:
        if (r->nmarks == r->marks_cap && !grow(&r->marks, &r->marks_cap, r->nmarks + 1, sizeof(size_t), 64))
            return sr_oom();
        r->marks[r->nmarks++] = r->sp;
        r->in.pos += 1;
        return CCA_OK;
    case OP_POP:
        if (r->nmarks && r->marks[r->nmarks - 1] == r->sp)
            r->nmarks--; /* as Python: POP right after MARK drops the mark */
        else if ((st = have(r, off, op, 1)))
            return st;
        else
            pop_to(r, r->sp - 1);
        r->in.pos += 1;
        return CCA_OK;
    case OP_POP_MARK:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        pop_to(r, mark);
        r->in.pos += 1;
        return CCA_OK;
    case OP_DUP:
        if ((st = have(r, off, op, 1)))
            return st;
        {
            slot_t copy = r->stack[r->sp - 1];
            st = push(r, &copy);
        }
        r->in.pos += 1;
        return st;
    case OP_NONE:
        r->in.pos += 1;
        return push_scalar(r, PV_NONE, 0, 0);
    case OP_NEWTRUE:
    case OP_NEWFALSE:
        r->in.pos += 1;
        return push_scalar(r, PV_BOOL, 0, op == OP_NEWTRUE);
    case OP_BININT1:
        r->in.pos += 2;
        return push_scalar(r, PV_INT, 0, p[1]);
    case OP_BININT2:
        r->in.pos += 3;
        return push_scalar(r, PV_INT, 0, le16(p + 1));
    case OP_BININT:
        r->in.pos += 5;
        return push_scalar(r, PV_INT, 0, (uint64_t)(int64_t)(int32_t)le32(p + 1));
    case OP_BINFLOAT: {
        uint64_t bits = 0;
        for (int i = 1; i <= 8; i++)
            bits = (bits << 8) | p[i];
        r->in.pos += 9;
        return push_scalar(r, PV_FLOAT, 0, bits);
    }
    case OP_LONG1:
    case OP_LONG4: {
        int width = op == OP_LONG1 ? 1 : 4;
        uint64_t n = op == OP_LONG1 ? p[1] : le32(p + 1);
        if (op == OP_LONG4 && (n & 0x80000000u))
            return sr_error(r, off, "LONG4 with a negative byte count");
        if (op == OP_LONG4 && !r->sp && !r->nmarks && r->h->dict_root)
            return not_dict_root(r, off, PV_INT);
        if (op == OP_LONG1 && n && n <= 8 && left >= 10 && !(p[1 + n] & 0x80)) {
            /* the common case (addresses, times): a non-negative integer of up to
             * 8 bytes, loaded at once from the window */
            r->in.pos += 2 + (size_t)n;
            return push_scalar(r, PV_INT, 0, le64(p + 2) & (~(uint64_t)0 >> (64 - 8 * n)));
        }
        if ((st = ready(r, off, op, 1 + (uint64_t)width, n, &ok)) || !ok)
            return st;
        r->in.pos += 1 + (size_t)width + (size_t)n;
        return push_int_le(r, off, op, p + 1 + width, (size_t)n);
    }
    case OP_INT:
    case OP_LONG: {
        const uint8_t *nl = memchr(p + 1, '\n', left - 1);
        if (!nl)
            return ready(r, off, op, (uint64_t)left + 1, 0, &ok); /* no newline yet */
        size_t len = (size_t)(nl - (p + 1));
        r->in.pos += len + 2;
        return push_text_int(r, off, op, (const char *)p + 1, len);
    }
    case OP_SHORT_BINUNICODE:
    case OP_SHORT_BINBYTES:
    case OP_BINUNICODE:
    case OP_BINBYTES:
    case OP_BINUNICODE8:
    case OP_BINBYTES8:
    case OP_BYTEARRAY8: {
        int width = fixed[op] - 1;
        bool is_str = op == OP_SHORT_BINUNICODE || op == OP_BINUNICODE || op == OP_BINUNICODE8;
        uint64_t n = width == 1 ? p[1] : width == 4 ? le32(p + 1) : le64(p + 1);
        if (n > UINT64_MAX / 2)
            return sr_error(r, off, "truncated %s: length %llu exceeds the data left", sr_op_name(op),
                            (unsigned long long)n);
        if (!r->sp && !r->nmarks && r->h->dict_root)
            return not_dict_root(r, off, is_str ? PV_STR : PV_BYTES);
        if (n >= LARGE_BLOB)
            return read_large(r, off, op, (size_t)width + 1, n, is_str ? PV_STR : PV_BYTES);
        if ((st = ready(r, off, op, 1 + (uint64_t)width, n, &ok)) || !ok)
            return st;
        const pk_sym_t *sym;
        if ((st = sr_sym_get(r, p + 1 + width, (size_t)n, is_str ? PV_STR : PV_BYTES, off, op, &sym)))
            return st;
        r->in.pos += 1 + (size_t)width + (size_t)n;
        return push_sym(r, sym);
    }
    case OP_EMPTY_DICT: {
        r->in.pos += 1;
        /* the next record of a batch (what derive() would decide, decided at once) */
        size_t f = fence(r);
        if (f > 0 && f <= r->sp && r->stack[f - 1].type == SL_L2 &&
            (r->sp == f || r->stack[r->sp - 1].type == SL_RECORD)) {
            slot_t *s = push_slot(r);
            if (!s)
                return CCA_ERR_OUT_OF_MEMORY;
            memset(s, 0, sizeof(*s));
            s->kind = PV_DICT;
            if ((st = new_record(r, r->sp - 1, s))) {
                pop_to(r, r->sp - 1);
                return st;
            }
        } else if ((st = push_container(r, off, PV_DICT))) {
            return st;
        }
        if (r->stack[r->sp - 1].type != SL_RECORD || !sr_record_fast(r, &r->stack[r->sp - 1]))
            return CCA_OK;
        /* the records that follow, read here as the steps of their EMPTY_DICTs would
         * (the top of the stack is a record of the batch, so each is one too) */
        while (r->in.pos < r->fast_limit && r->in.buf[r->in.pos] == OP_EMPTY_DICT) {
            r->in.pos += 1;
            slot_t *s = push_slot(r);
            if (!s)
                return CCA_ERR_OUT_OF_MEMORY;
            memset(s, 0, sizeof(*s));
            s->kind = PV_DICT;
            if ((st = new_record(r, r->sp - 1, s))) {
                pop_to(r, r->sp - 1);
                return st;
            }
            if (!sr_record_fast(r, s))
                break;
        }
        return CCA_OK;
    }
    case OP_EMPTY_LIST:
    case OP_EMPTY_TUPLE:
        r->in.pos += 1;
        return push_container(r, off, op == OP_EMPTY_LIST ? PV_LIST : PV_TUPLE);
    case OP_TUPLE1:
    case OP_TUPLE2:
    case OP_TUPLE3: {
        size_t n = (size_t)(op - OP_TUPLE1 + 1);
        if ((st = have(r, off, op, n)))
            return st;
        r->in.pos += 1;
        return make_tuple(r, off, n);
    }
    case OP_TUPLE:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        r->in.pos += 1;
        return make_tuple(r, off, r->sp - mark);
    case OP_LIST:
    case OP_DICT:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        r->in.pos += 1;
        return make_from_mark(r, off, op, mark);
    case OP_APPEND:
        if ((st = have(r, off, op, 2)))
            return st;
        r->in.pos += 1;
        return take_items(r, off, op, &r->stack[r->sp - 2], r->sp - 1);
    case OP_APPENDS:
    case OP_SETITEMS:
        if ((st = pop_mark(r, off, op, &mark)))
            return st;
        if (mark == 0 || mark - 1 < fence(r))
            return sr_error(r, off, "stack underflow in %s (no container below the MARK)", sr_op_name(op));
        r->in.pos += 1;
        if (op == OP_APPENDS)
            return take_items(r, off, op, &r->stack[mark - 1], mark);
        return take_pairs(r, off, op, &r->stack[mark - 1], mark);
    case OP_SETITEM:
        if ((st = have(r, off, op, 3)))
            return st;
        r->in.pos += 1;
        return take_pairs(r, off, op, &r->stack[r->sp - 3], r->sp - 2);
    case OP_BINPUT:
        r->in.pos += 2;
        return memo_put(r, off, p[1]);
    case OP_LONG_BINPUT:
        r->in.pos += 5;
        return memo_put(r, off, le32(p + 1));
    case OP_MEMOIZE:
        r->in.pos += 1;
        return memo_put(r, off, r->memo_count);
    case OP_BINGET:
        r->in.pos += 2;
        return memo_get(r, off, p[1]);
    case OP_LONG_BINGET:
        r->in.pos += 5;
        return memo_get(r, off, le32(p + 1));
    default:
        if (op >= 0x20 && op < 0x7f)
            return sr_error(r, off, "unsupported pickle opcode 0x%02x ('%c')", op, op);
        return sr_error(r, off, "unsupported pickle opcode 0x%02x", op);
    }
}

cca_status_t sr_run(sreader_t *r)
{
    bool stop = false;
    cca_status_t st;
    for (;;) {
        /* below fast_limit a whole fixed-size opcode is in the window and no
         * refill is pending (ready() and STOP lower the limit to 0) */
        while (r->in.pos < r->fast_limit)
            if ((st = step(r, &stop, false)))
                return st;
        if (stop)
            return CCA_OK;
        if (r->in.want || (r->in.end - r->in.pos < FIXED_OP_MAX && !r->in.eof)) {
            size_t need = r->in.want > FIXED_OP_MAX ? r->in.want : FIXED_OP_MAX;
            r->in.want = 0;
            if ((st = pk_input_fill(&r->in, need)))
                return st;
        }
        if (r->in.pos >= r->in.end)
            return sr_error(r, r->in.pos, "pickle ends without STOP");
        r->fast_limit = 0;
        if ((st = step(r, &stop, true)))
            return st;
        if (stop)
            return CCA_OK;
        if (!r->in.want && r->in.end >= FIXED_OP_MAX)
            r->fast_limit = r->in.end - FIXED_OP_MAX;
    }
}

