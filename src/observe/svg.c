/*
 * svg.c - self-contained SVG pictures of a snapshot tree (PyTorch's or
 * cca's): memory over time by allocation (like _memory_viz's trace_plot:
 * each allocation a band from its alloc to its free_completed, stacked in
 * allocation order, so the top of the stack is the active bytes) and the
 * segment map (like segment_plot: one row per segment, blocks coloured by
 * state), once at the peak of each trace's reserved memory (rebuilt from its
 * segment and block events) and once as the snapshot's segments list has it.
 *
 * The output needs nothing outside the file: no script, no external font
 * or stylesheet; tooltips are <title> elements. Its size is bounded: the
 * time axis has at most PLOT_COLUMNS columns, only the PLOT_BANDS largest
 * allocations get their own band (the rest are summed into one grey band at
 * the bottom), and at most MAP_ROWS segments are drawn.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "snapshot_io.h"

#define PLOT_COLUMNS 600
#define PLOT_BANDS 400
#define PLOT_WIDTH 900.0
#define PLOT_HEIGHT 300.0
#define MARGIN_LEFT 90.0
#define MAP_ROWS 1000
#define MAP_LABEL 270.0
#define MAP_WIDTH 720.0
#define ROW_HEIGHT 12.0
#define MAX_PLOTTED_DEVICES 8

static const char *const palette[] = {
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
    "#b07aa1", "#ff9da7", "#9c755f", "#1f77b4", "#2ca02c", "#d62728",
};
#define PALETTE_SIZE (sizeof(palette) / sizeof(palette[0]))

static uint64_t get_u64(const pv_node_t *dict, const char *key)
{
    const pv_node_t *n = pv_dict_get(dict, key);
    uint64_t v = 0;
    int64_t s;
    if (n && !pv_get_u64(n, &v) && pv_get_int(n, &s))
        v = (uint64_t)s;
    return v;
}

/* PyTorch's style of size: "20.0MiB". */
static void fmt_size(uint64_t bytes, char *buf, size_t len)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)bytes;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, len, u ? "%.1f%s" : "%.0f%s", v, units[u]);
}

static void xml_text(cca_strbuf_t *sb, const char *s, size_t n)
{
    for (size_t i = 0; i < n && s[i]; i++) {
        switch (s[i]) {
        case '&': sb_append(sb, "&amp;"); break;
        case '<': sb_append(sb, "&lt;"); break;
        case '>': sb_append(sb, "&gt;"); break;
        case '"': sb_append(sb, "&quot;"); break;
        default:
            if ((unsigned char)s[i] >= 0x20 || s[i] == '\n' || s[i] == '\t')
                sb_appendn(sb, &s[i], 1);
        }
    }
}

/* ---- memory over time ----------------------------------------------------------- */

typedef struct band {
    uint64_t addr, size;
    size_t start, end;       /* event steps: [start, end) */
    size_t col0, col1;       /* columns: [col0, col1) */
    bool drawn;              /* has its own band */
} band_t;

/* Open-addressing map: address -> index of the live band. */
typedef struct addr_map {
    uint64_t *keys;
    size_t *vals;
    size_t cap;
} addr_map_t;

static bool map_init(addr_map_t *m, size_t n)
{
    m->cap = 16;
    while (m->cap < n * 2)
        m->cap <<= 1;
    m->keys = calloc(m->cap, sizeof(*m->keys));
    m->vals = calloc(m->cap, sizeof(*m->vals));
    return m->keys && m->vals;
}

/* Slot of key (key + 1 stored, so 0 marks empty); deletions use SIZE_MAX values. */
static size_t map_slot(const addr_map_t *m, uint64_t key)
{
    size_t i = (size_t)((key + 1) * 0x9e3779b97f4a7c15ull >> 20) & (m->cap - 1);
    while (m->keys[i] && m->keys[i] != key + 1)
        i = (i + 1) & (m->cap - 1);
    return i;
}

static int band_by_size(const void *a, const void *b)
{
    const band_t *const *x = a, *const *y = b;
    if ((*x)->size != (*y)->size)
        return (*x)->size > (*y)->size ? -1 : 1;
    return (*x)->start < (*y)->start ? -1 : (*x)->start > (*y)->start;
}

static double col_x(size_t c, size_t cols)
{
    return MARGIN_LEFT + PLOT_WIDTH * (double)c / (double)cols;
}

/* The first column whose step (rep, increasing) is at or past step t; cols if none. */
static size_t first_column_at(const size_t *rep, size_t cols, size_t t)
{
    size_t lo = 0, hi = cols;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (rep[mid] < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* A byte count drawn as a double, back as bytes (clamped). */
static uint64_t bytes_of(double v)
{
    return v <= 0 ? 0 : v >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)v;
}

/* A band's polygon: its bottom edge left to right, its top edge back. */
static void draw_band(cca_strbuf_t *sb, const band_t *b, const double *base, size_t cols,
                      double y0, double scale, const char *colour, const char *title)
{
    sb_printf(sb, "<polygon fill=\"%s\" points=\"", colour);
    for (int edge = 0; edge < 2; edge++) {
        size_t c = edge == 0 ? b->col0 : b->col1 - 1;
        for (;;) {
            /* a run of columns with the same base */
            size_t r = c;
            if (edge == 0)
                while (r + 1 < b->col1 && base[(r + 1) - b->col0] == base[c - b->col0])
                    r++;
            else
                while (r > b->col0 && base[(r - 1) - b->col0] == base[c - b->col0])
                    r--;
            double y = y0 - (base[c - b->col0] + (edge ? (double)b->size : 0)) * scale;
            double xa = edge == 0 ? col_x(c, cols) : col_x(c + 1, cols);
            double xb = edge == 0 ? col_x(r + 1, cols) : col_x(r, cols);
            sb_printf(sb, "%.1f,%.2f %.1f,%.2f ", xa, y, xb, y);
            if (edge == 0 ? r + 1 >= b->col1 : r == b->col0)
                break;
            c = edge == 0 ? r + 1 : r - 1;
        }
    }
    sb_append(sb, "\"><title>");
    sb_append(sb, title);
    sb_append(sb, "</title></polygon>\n");
}

/* One device's trace plot at vertical offset top; returns its height, or -1 on no memory. */
static double trace_plot(cca_strbuf_t *sb, const pv_node_t *trace, int device, double top)
{
    size_t n = pv_len(trace);
    band_t *bands = calloc(n ? n : 1, sizeof(*bands));
    band_t **order = calloc(n ? n : 1, sizeof(*order));
    addr_map_t map = {0};
    double *summ = NULL, *stack_top = NULL, *base = NULL, *active = NULL;
    size_t *rep = NULL;
    double height = -1;
    if (!bands || !order || !map_init(&map, n))
        goto out;
    size_t nb = 0, steps = 0;
    for (size_t i = 0; i < n; i++) {
        const pv_node_t *e = pv_at(trace, i);
        const pv_node_t *action = pv_dict_get(e, "action");
        if (pv_str_eq(action, "alloc")) {
            uint64_t addr = get_u64(e, "addr");
            band_t *b = &bands[nb];
            b->addr = addr;
            b->size = get_u64(e, "size");
            b->start = steps++;
            b->end = SIZE_MAX;
            size_t slot = map_slot(&map, addr);
            map.keys[slot] = addr + 1;
            map.vals[slot] = nb++;
        } else if (pv_str_eq(action, "free_completed")) {
            uint64_t addr = get_u64(e, "addr");
            size_t slot = map_slot(&map, addr);
            if (map.keys[slot] && map.vals[slot] != SIZE_MAX) {
                bands[map.vals[slot]].end = ++steps;
                map.vals[slot] = SIZE_MAX;
            }
        }
    }
    if (!nb) {
        sb_printf(sb, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"13\">device %d: no allocations in the "
                  "trace</text>\n", MARGIN_LEFT, top + 16, device);
        height = 28;
        goto out;
    }
    /* Each column shows one step: the one of its steps with the most active bytes, so
     * that a peak lasting a single step keeps its height. A band is drawn in the
     * columns whose step it spans (a contiguous run, or none). Sums are doubles: sizes
     * from a file may be anything up to 2^64 - 1, and a picture needs no more than 53
     * bits of them. */
    size_t cols = steps < PLOT_COLUMNS ? steps : PLOT_COLUMNS;
    active = calloc(steps + 1, sizeof(*active));
    rep = calloc(cols, sizeof(*rep));
    if (!active || !rep)
        goto out;
    for (size_t i = 0; i < nb; i++) {
        band_t *b = &bands[i];
        if (b->end == SIZE_MAX)
            b->end = steps;
        active[b->start] += (double)b->size;
        active[b->end] -= (double)b->size;
    }
    double running = 0;
    for (size_t t = 0, c = 0; t < steps; t++) {
        running += active[t];
        active[t] = running;
        c = t * cols / steps;
        if (t == 0 || t * cols / steps != (t - 1) * cols / steps || active[t] > active[rep[c]])
            rep[c] = t;
    }
    size_t visible = 0;
    for (size_t i = 0; i < nb; i++) {
        band_t *b = &bands[i];
        b->col0 = first_column_at(rep, cols, b->start);
        b->col1 = first_column_at(rep, cols, b->end);
        if (b->col1 > b->col0)
            order[visible++] = b;
    }
    qsort(order, visible, sizeof(*order), band_by_size);
    for (size_t i = 0; i < visible && i < PLOT_BANDS; i++)
        order[i]->drawn = true;
    summ = calloc(cols + 1, sizeof(*summ));
    stack_top = calloc(cols, sizeof(*stack_top));
    base = calloc(cols, sizeof(*base));
    if (!summ || !stack_top || !base)
        goto out;
    for (size_t i = 0; i < nb; i++)
        if (!bands[i].drawn && bands[i].col1 > bands[i].col0) {
            summ[bands[i].col0] += (double)bands[i].size; /* a difference array first */
            summ[bands[i].col1] -= (double)bands[i].size;
        }
    running = 0;
    for (size_t c = 0; c < cols; c++) {
        running += summ[c];
        summ[c] = running > 0 ? running : 0;
        stack_top[c] = summ[c];
    }
    /* the stack height: drawn bands in allocation order on top of the summary band */
    double peak = 1;
    for (size_t i = 0; i < nb; i++)
        if (bands[i].drawn)
            for (size_t c = bands[i].col0; c < bands[i].col1; c++)
                stack_top[c] += (double)bands[i].size;
    for (size_t c = 0; c < cols; c++)
        if (stack_top[c] > peak)
            peak = stack_top[c];
    double y0 = top + 24 + PLOT_HEIGHT, scale = PLOT_HEIGHT / (double)peak;
    char s_peak[32], s_half[32];
    fmt_size(bytes_of(peak), s_peak, sizeof(s_peak));
    fmt_size(bytes_of(peak / 2), s_half, sizeof(s_half));
    sb_printf(sb, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"14\" font-weight=\"bold\">device %d: "
              "active memory over time by allocation (%zu allocations, %zu drawn)</text>\n",
              MARGIN_LEFT, top + 16, device, nb, visible < PLOT_BANDS ? visible : (size_t)PLOT_BANDS);
    sb_printf(sb, "<g font-size=\"11\" text-anchor=\"end\"><text x=\"%.0f\" y=\"%.1f\">%s</text>"
              "<text x=\"%.0f\" y=\"%.1f\">%s</text><text x=\"%.0f\" y=\"%.1f\">0</text></g>\n",
              MARGIN_LEFT - 6, y0 - PLOT_HEIGHT + 4, s_peak, MARGIN_LEFT - 6,
              y0 - PLOT_HEIGHT / 2 + 4, s_half, MARGIN_LEFT - 6, y0 + 4);
    sb_printf(sb, "<rect x=\"%.0f\" y=\"%.1f\" width=\"%.0f\" height=\"%.0f\" fill=\"none\" "
              "stroke=\"#999\"/>\n", MARGIN_LEFT, y0 - PLOT_HEIGHT, PLOT_WIDTH, PLOT_HEIGHT);
    /* the summary band */
    for (size_t c = 0; c < cols; c++)
        base[c] = 0;
    sb_printf(sb, "<text x=\"%.0f\" y=\"%.0f\" font-size=\"11\" text-anchor=\"end\">each column: "
              "the step of its %zu with the most active bytes</text>\n", MARGIN_LEFT + PLOT_WIDTH,
              top + 16, (steps + cols - 1) / cols);
    bool any_summ = false;
    for (size_t c = 0; c < cols && !any_summ; c++)
        any_summ = summ[c] > 0;
    if (any_summ) {
        sb_append(sb, "<polygon fill=\"#bbbbbb\" points=\"");
        for (size_t c = 0; c < cols; c++)
            sb_printf(sb, "%.1f,%.2f %.1f,%.2f ", col_x(c, cols), y0 - summ[c] * scale,
                      col_x(c + 1, cols), y0 - summ[c] * scale);
        sb_printf(sb, "%.1f,%.2f %.1f,%.2f\"><title>%zu smaller allocations, summed</title>"
                  "</polygon>\n", col_x(cols, cols), y0, col_x(0, cols), y0,
                  visible > PLOT_BANDS ? visible - PLOT_BANDS : (size_t)0);
    }
    for (size_t c = 0; c < cols; c++)
        stack_top[c] = summ[c];
    size_t k = 0;
    for (size_t i = 0; i < nb; i++) {
        band_t *b = &bands[i];
        if (!b->drawn)
            continue;
        for (size_t c = b->col0; c < b->col1; c++) {
            base[c - b->col0] = stack_top[c];
            stack_top[c] += (double)b->size;
        }
        char title[96], s_size[32];
        fmt_size(b->size, s_size, sizeof(s_size));
        snprintf(title, sizeof(title), "0x%llx: %s (%llu bytes), events %zu-%zu",
                 (unsigned long long)b->addr, s_size, (unsigned long long)b->size, b->start, b->end);
        draw_band(sb, b, base, cols, y0, scale, palette[k++ % PALETTE_SIZE], title);
    }
    sb_printf(sb, "<text x=\"%.0f\" y=\"%.1f\" font-size=\"11\">time (allocator events, %zu in "
              "all)</text>\n", MARGIN_LEFT, y0 + 16, steps);
    height = 24 + PLOT_HEIGHT + 28;
out:
    free(bands);
    free(order);
    free(map.keys);
    free(map.vals);
    free(summ);
    free(stack_top);
    free(base);
    free(active);
    free(rep);
    return height;
}

/* ---- the segments at the peak of reserved memory ------------------------------------- */

/* A segment (or a contiguous mapped range of an expandable one) as the trace builds it. */
typedef struct range {
    uint64_t addr, size;
    bool expandable;
} range_t;

typedef struct ranges {
    range_t *v;            /* sorted by address, disjoint */
    size_t n, cap;
} ranges_t;

/* Index of the first range ending past addr. */
static size_t ranges_find(const ranges_t *r, uint64_t addr)
{
    size_t lo = 0, hi = r->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r->v[mid].addr + r->v[mid].size <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static bool ranges_insert(ranges_t *r, size_t at, range_t x)
{
    if (r->n == r->cap) {
        size_t cap = r->cap ? 2 * r->cap : 64;
        range_t *v = realloc(r->v, cap * sizeof(*v));
        if (!v)
            return false;
        r->v = v;
        r->cap = cap;
    }
    memmove(&r->v[at + 1], &r->v[at], (r->n - at) * sizeof(*r->v));
    r->v[at] = x;
    r->n++;
    return true;
}

/* Add [addr, addr + size); a mapped range joins the expandable ranges it touches. */
static bool ranges_add(ranges_t *r, uint64_t addr, uint64_t size, bool expandable)
{
    if (!size || addr + size < addr)
        return true; /* nothing, or past the address space: not drawn */
    size_t at = ranges_find(r, addr);
    if (at < r->n && r->v[at].addr < addr + size)
        return true; /* overlaps what is there: an inconsistent trace, left as it is */
    if (expandable && at > 0 && r->v[at - 1].expandable && r->v[at - 1].addr + r->v[at - 1].size == addr) {
        r->v[at - 1].size += size;
        if (at < r->n && r->v[at].expandable && r->v[at].addr == addr + size) {
            r->v[at - 1].size += r->v[at].size;
            memmove(&r->v[at], &r->v[at + 1], (r->n - at - 1) * sizeof(*r->v));
            r->n--;
        }
        return true;
    }
    if (expandable && at < r->n && r->v[at].expandable && r->v[at].addr == addr + size) {
        r->v[at].addr = addr;
        r->v[at].size += size;
        return true;
    }
    return ranges_insert(r, at, (range_t){addr, size, expandable});
}

/* Take [addr, addr + size) out (a segment freed, or part of a mapped range unmapped). */
static bool ranges_remove(ranges_t *r, uint64_t addr, uint64_t size)
{
    size_t at = ranges_find(r, addr);
    if (at == r->n || r->v[at].addr > addr || addr + size < addr)
        return true; /* not there: an inconsistent trace, left as it is */
    range_t *x = &r->v[at];
    uint64_t end = addr + size, xend = x->addr + x->size;
    if (end >= xend) {
        if (x->addr == addr) {
            memmove(&r->v[at], &r->v[at + 1], (r->n - at - 1) * sizeof(*r->v));
            r->n--;
        } else {
            x->size = addr - x->addr;
        }
        return true;
    }
    if (x->addr == addr) {
        x->addr = end;
        x->size = xend - end;
        return true;
    }
    x->size = addr - x->addr; /* a hole in the middle: two ranges */
    return ranges_insert(r, at + 1, (range_t){end, xend - end, x->expandable});
}

/* A block live at the peak. */
typedef struct peak_block {
    uint64_t addr, size;
    bool pending;          /* freed, its free not completed */
} peak_block_t;

static int block_by_addr(const void *a, const void *b)
{
    const peak_block_t *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

typedef enum { ACT_OTHER, ACT_ALLOC, ACT_FREE_REQ, ACT_FREE_DONE, ACT_SEG_ALLOC, ACT_SEG_FREE,
               ACT_MAP, ACT_UNMAP } act_t;

static act_t action_of(const pv_node_t *e)
{
    const pv_node_t *a = pv_kind(e) == PV_DICT ? pv_dict_get(e, "action") : NULL;
    static const char *const names[] = {"alloc", "free_requested", "free_completed", "segment_alloc",
                                        "segment_free", "segment_map", "segment_unmap"};
    for (size_t i = 0; a && i < sizeof(names) / sizeof(names[0]); i++)
        if (pv_str_eq(a, names[i]))
            return (act_t)(ACT_ALLOC + i);
    return ACT_OTHER;
}

/*
 * The segments of one device's trace at the peak of its reserved memory (the
 * segments its events allocate and map; of the moments at the highest
 * reservation, the first with the most bytes allocated), blocks coloured by
 * state, at vertical offset top. Returns its height (0: the trace has no
 * segment events), or -1 on no memory.
 */
static double peak_map(cca_strbuf_t *sb, const pv_node_t *trace, int device, double top)
{
    size_t n = pv_len(trace), peak_at = SIZE_MAX;
    double reserved = 0, allocated = 0, best = 0, best_alloc = -1;
    for (size_t i = 0; i < n; i++) {
        const pv_node_t *e = pv_at(trace, i);
        double size = (double)get_u64(e, "size");
        switch (action_of(e)) {
        case ACT_ALLOC: allocated += size; break;
        case ACT_FREE_DONE: allocated -= size; break;
        case ACT_SEG_ALLOC: case ACT_MAP: reserved += size; break;
        case ACT_SEG_FREE: case ACT_UNMAP: reserved -= size; break;
        default: continue;
        }
        if (reserved > best || (reserved == best && reserved > 0 && allocated > best_alloc)) {
            best = reserved;
            best_alloc = allocated;
            peak_at = i;
        }
    }
    if (peak_at == SIZE_MAX)
        return 0;
    ranges_t segs = {0};
    addr_map_t map = {0};
    peak_block_t *blocks = calloc(n ? n : 1, sizeof(*blocks));
    size_t nb = 0;
    double height = -1;
    bool ok = blocks && map_init(&map, n);
    for (size_t i = 0; ok && i <= peak_at; i++) {
        const pv_node_t *e = pv_at(trace, i);
        uint64_t addr = get_u64(e, "addr"), size = get_u64(e, "size");
        size_t slot;
        switch (action_of(e)) {
        case ACT_ALLOC:
            slot = map_slot(&map, addr);
            map.keys[slot] = addr + 1;
            map.vals[slot] = nb;
            blocks[nb++] = (peak_block_t){addr, size, false};
            break;
        case ACT_FREE_REQ: case ACT_FREE_DONE:
            slot = map_slot(&map, addr);
            if (map.keys[slot] && map.vals[slot] != SIZE_MAX) {
                blocks[map.vals[slot]].pending = true;
                if (action_of(e) == ACT_FREE_DONE) {
                    blocks[map.vals[slot]].size = 0; /* gone */
                    map.vals[slot] = SIZE_MAX;
                }
            }
            break;
        case ACT_SEG_ALLOC: ok = ranges_add(&segs, addr, size, false); break;
        case ACT_MAP: ok = ranges_add(&segs, addr, size, true); break;
        case ACT_SEG_FREE: case ACT_UNMAP: ok = ranges_remove(&segs, addr, size); break;
        default: break;
        }
    }
    if (!ok)
        goto out;
    size_t live = 0;
    for (size_t i = 0; i < nb; i++)
        if (blocks[i].size)
            blocks[live++] = blocks[i];
    qsort(blocks, live, sizeof(*blocks), block_by_addr);
    char s_res[32], s_alloc[32];
    fmt_size(bytes_of(best), s_res, sizeof(s_res));
    fmt_size(bytes_of(best_alloc), s_alloc, sizeof(s_alloc));
    sb_printf(sb, "<text x=\"10\" y=\"%.0f\" font-size=\"14\" font-weight=\"bold\">device %d at the peak "
              "of reserved memory: %s reserved, %s allocated, after event %zu of %zu (%zu segments)"
              "</text>\n", top + 16, device, s_res, s_alloc, peak_at, n, segs.n);
    double y = top + 24;
    size_t rows = segs.n < MAP_ROWS ? segs.n : MAP_ROWS;
    for (size_t r = 0; r < rows; r++) {
        const range_t *g = &segs.v[r];
        char s_total[32];
        fmt_size(g->size, s_total, sizeof(s_total));
        sb_printf(sb, "<text x=\"10\" y=\"%.1f\" font-size=\"10\" font-family=\"monospace\">%d 0x%llx %s%s"
                  "</text>\n<rect x=\"%.0f\" y=\"%.1f\" width=\"%.0f\" height=\"%.0f\" fill=\"#cfe8cf\" "
                  "stroke=\"#999\" stroke-width=\"0.5\"><title>segment 0x%llx: %s at the peak</title></rect>\n",
                  y + ROW_HEIGHT - 2, device, (unsigned long long)g->addr, s_total,
                  g->expandable ? " expandable" : "", MAP_LABEL, y, MAP_WIDTH, ROW_HEIGHT,
                  (unsigned long long)g->addr, s_total);
        /* the live blocks inside it (the rest of the row is free: the background) */
        size_t lo = 0, hi = live;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            if (blocks[mid].addr < g->addr)
                lo = mid + 1;
            else
                hi = mid;
        }
        for (size_t j = lo; j < live && blocks[j].addr - g->addr < g->size; j++) {
            const peak_block_t *b = &blocks[j];
            uint64_t off = b->addr - g->addr, size = b->size < g->size - off ? b->size : g->size - off;
            double x = MAP_LABEL + MAP_WIDTH * (double)off / (double)g->size;
            double w = MAP_WIDTH * (double)size / (double)g->size;
            char s_size[32];
            fmt_size(b->size, s_size, sizeof(s_size));
            sb_printf(sb, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\" "
                      "stroke=\"#fff\" stroke-width=\"0.3\"><title>0x%llx: %s, %s</title></rect>\n", x, y,
                      w < 0.3 ? 0.3 : w, ROW_HEIGHT, b->pending ? "#ff9f1c" : "#d62728",
                      (unsigned long long)b->addr, s_size, b->pending ? "active_pending_free" : "active_allocated");
        }
        y += ROW_HEIGHT + 2;
    }
    if (rows < segs.n) {
        sb_printf(sb, "<text x=\"10\" y=\"%.1f\" font-size=\"11\">%zu more segments not drawn</text>\n",
                  y + 10, segs.n - rows);
        y += 16;
    }
    height = y - top + 8;
out:
    free(segs.v);
    free(blocks);
    free(map.keys);
    free(map.vals);
    return height;
}

/* ---- segment map ------------------------------------------------------------------- */

static const char *state_colour(const pv_node_t *state)
{
    if (pv_str_eq(state, "active_allocated"))
        return "#d62728";
    if (pv_str_eq(state, "active_pending_free"))
        return "#ff9f1c";
    return "#cfe8cf";
}

static double segment_map(cca_strbuf_t *sb, const pv_node_t *segments, double top)
{
    size_t n = pv_len(segments);
    sb_printf(sb, "<text x=\"10\" y=\"%.0f\" font-size=\"14\" font-weight=\"bold\">segments "
              "in the snapshot (%zu): one row each, blocks in address order</text>\n", top + 16, n);
    double legend_y = top + 24;
    const char *names[] = {"active_allocated", "active_pending_free", "inactive"};
    const char *colours[] = {"#d62728", "#ff9f1c", "#cfe8cf"};
    for (int i = 0; i < 3; i++)
        sb_printf(sb, "<rect x=\"%.0f\" y=\"%.0f\" width=\"10\" height=\"10\" fill=\"%s\" "
                  "stroke=\"#666\" stroke-width=\"0.5\"/><text x=\"%.0f\" y=\"%.0f\" "
                  "font-size=\"11\">%s</text>\n", 10.0 + 180.0 * i, legend_y, colours[i],
                  24.0 + 180.0 * i, legend_y + 9, names[i]);
    double y = legend_y + 18;
    size_t rows = n < MAP_ROWS ? n : MAP_ROWS;
    for (size_t i = 0; i < rows; i++) {
        const pv_node_t *seg = pv_at(segments, i);
        uint64_t total = get_u64(seg, "total_size");
        const pv_node_t *type = pv_dict_get(seg, "segment_type");
        const char *t = "";
        pv_get_str(type, &t, NULL);
        char s_total[32], s_active[32];
        fmt_size(total, s_total, sizeof(s_total));
        fmt_size(get_u64(seg, "active_size"), s_active, sizeof(s_active));
        sb_printf(sb, "<text x=\"10\" y=\"%.1f\" font-size=\"10\" font-family=\"monospace\">"
                  "%llu 0x%llx %s ", y + ROW_HEIGHT - 2,
                  (unsigned long long)get_u64(seg, "device"),
                  (unsigned long long)get_u64(seg, "address"), s_total);
        xml_text(sb, t, strlen(t)); /* (a file's own string) */
        sb_append(sb, "</text>\n");
        sb_printf(sb, "<rect x=\"%.0f\" y=\"%.1f\" width=\"%.0f\" height=\"%.0f\" fill=\"#f4f4f4\" "
                  "stroke=\"#999\" stroke-width=\"0.5\"><title>segment 0x%llx: %s, %s active"
                  "</title></rect>\n", MAP_LABEL, y, MAP_WIDTH, ROW_HEIGHT,
                  (unsigned long long)get_u64(seg, "address"), s_total, s_active);
        const pv_node_t *blocks = pv_dict_get(seg, "blocks");
        uint64_t offset = 0;
        for (size_t j = 0; total && j < pv_len(blocks); j++) {
            const pv_node_t *b = pv_at(blocks, j);
            uint64_t size = get_u64(b, "size");
            double x = MAP_LABEL + MAP_WIDTH * (double)offset / (double)total;
            double w = MAP_WIDTH * (double)size / (double)total;
            const pv_node_t *state = pv_dict_get(b, "state");
            const char *st = "inactive";
            pv_get_str(state, &st, NULL);
            char s_size[32];
            fmt_size(size, s_size, sizeof(s_size));
            sb_printf(sb, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\" "
                      "stroke=\"#fff\" stroke-width=\"0.3\"><title>0x%llx: %s, requested %llu, ",
                      x, y, w < 0.3 ? 0.3 : w, ROW_HEIGHT, state_colour(state),
                      (unsigned long long)(get_u64(seg, "address") + offset), s_size,
                      (unsigned long long)get_u64(b, "requested_size"));
            xml_text(sb, st, strlen(st));
            sb_append(sb, "</title></rect>\n");
            offset += size;
        }
        y += ROW_HEIGHT + 2;
    }
    if (rows < n) {
        sb_printf(sb, "<text x=\"10\" y=\"%.1f\" font-size=\"11\">%zu more segments not drawn</text>\n",
                  y + 10, n - rows);
        y += 16;
    }
    return y - top + 8;
}

cca_status_t svg_render(const pv_node_t *root, cca_strbuf_t *out)
{
    const pv_node_t *segments = root ? pv_dict_get(root, "segments") : NULL;
    if (!segments || pv_kind(segments) != PV_LIST)
        return cca_raise(CCA_ERR_FORMAT, "not a memory snapshot: no segments list");
    const pv_node_t *traces = pv_dict_get(root, "device_traces");
    cca_strbuf_t body;
    sb_init(&body);
    double y = 10;
    size_t ndev = traces && pv_kind(traces) == PV_LIST ? pv_len(traces) : 0;
    for (size_t d = 0; d < ndev && d < MAX_PLOTTED_DEVICES; d++) {
        const pv_node_t *trace = pv_at(traces, d);
        if (pv_kind(trace) != PV_LIST || (pv_len(trace) == 0 && ndev > 1))
            continue;
        double h = trace_plot(&body, trace, (int)d, y);
        double hp = h < 0 ? h : peak_map(&body, trace, (int)d, y + h);
        if (h < 0 || hp < 0) {
            sb_free(&body);
            return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory drawing a snapshot");
        }
        y += h + hp;
    }
    y += segment_map(&body, segments, y);
    sb_printf(out, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
              "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
              "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
              "<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n",
              MAP_LABEL + MAP_WIDTH + 20, y, MAP_LABEL + MAP_WIDTH + 20, y);
    if (body.data)
        sb_appendn(out, body.data, body.len);
    sb_append(out, "</svg>\n");
    bool failed = body.failed;
    sb_free(&body);
    if (failed || out->failed)
        return cca_raise(CCA_ERR_OUT_OF_MEMORY, "out of host memory drawing a snapshot");
    return CCA_OK;
}
