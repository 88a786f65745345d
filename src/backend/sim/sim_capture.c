/*
 * sim_capture.c - the simulated backend's model of a captured graph, enough
 * for the allocator's graph_capture_record_stream_reuse: captures with ids,
 * nodes with their dependencies, and the terminal nodes of each capturing
 * stream (what work queued on it next would depend on). malloc_async and
 * free_async on a capturing stream become nodes of its capture, as
 * cudaMallocAsync / cudaFreeAsync nodes (sim_multi.c). Tests drive it
 * (cca_sim_capture_begin / work / join / end); the allocator reads it
 * through stream_capture_info and graph_node_dependencies.
 * Invariant: a stream is in the capture list exactly while it is marked
 * capturing by these calls; node handles are indices + 1 into the node
 * array, never reused while the backend lives.
 */
#include <stdlib.h>
#include <string.h>

#include "simulator.h"

typedef struct sim_node {
    uint64_t *deps;          /* handles of the nodes it depends on */
    size_t ndeps;
} sim_node_t;

typedef struct sim_cap_stream {
    uint64_t stream;         /* stream handle */
    uint64_t capture_id;
    cca_graph_node_t *terms; /* its terminal nodes */
    size_t nterms;
} sim_cap_stream_t;

struct sim_graph {
    sim_node_t *nodes;
    size_t nnodes, node_cap;
    sim_cap_stream_t *streams;
    size_t nstreams, stream_cap;
    uint64_t next_capture_id;
};

static cca_status_t sim_stream_capture_info(void *ctx, int device, cca_stream_t stream, int *status,
                                            uint64_t *capture_id, const cca_graph_node_t **terminals,
                                            size_t *count);

/* The simulated backend's state behind b (its table has this file's operation), or NULL. */
static sim_ctx_t *sim_ctx_of(cca_backend_t *b)
{
    return b && b->stream_capture_info == sim_stream_capture_info ? b->ctx : NULL;
}

void sim_capture_free(sim_ctx_t *c)
{
    sim_graph_t *g = c->graph;
    if (!g)
        return;
    for (size_t i = 0; i < g->nnodes; i++)
        free(g->nodes[i].deps);
    for (size_t i = 0; i < g->nstreams; i++)
        free(g->streams[i].terms);
    free(g->nodes);
    free(g->streams);
    free(g);
    c->graph = NULL;
}

/* The graph state, created on first use (lock held). NULL: out of host memory. */
static sim_graph_t *graph_of(sim_ctx_t *c)
{
    if (!c->graph) {
        c->graph = calloc(1, sizeof(*c->graph));
        if (c->graph)
            c->graph->next_capture_id = 1;
    }
    return c->graph;
}

static sim_cap_stream_t *find_stream(sim_graph_t *g, cca_stream_t stream)
{
    for (size_t i = 0; g && i < g->nstreams; i++)
        if (g->streams[i].stream == (uint64_t)(uintptr_t)stream)
            return &g->streams[i];
    return NULL;
}

/* Add a capturing stream (lock held). NULL: out of host memory. */
static sim_cap_stream_t *add_stream(sim_ctx_t *c, sim_graph_t *g, cca_stream_t stream, uint64_t id)
{
    if (g->nstreams == g->stream_cap) {
        size_t cap = g->stream_cap ? g->stream_cap * 2 : 4;
        sim_cap_stream_t *grown = realloc(g->streams, cap * sizeof(*grown));
        if (!grown)
            return NULL;
        g->streams = grown;
        g->stream_cap = cap;
    }
    uint64_t key = (uint64_t)(uintptr_t)stream;
    if (!simmap_get(&c->capturing, key)) {
        if (!simmap_reserve(&c->capturing))
            return NULL;
        simmap_put(&c->capturing, key, (void *)1);
    }
    sim_cap_stream_t *cs = &g->streams[g->nstreams++];
    memset(cs, 0, sizeof(*cs));
    cs->stream = key;
    cs->capture_id = id;
    return cs;
}

static cca_status_t bad_stream(const char *fn, cca_stream_t stream, const char *why)
{
    return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: stream %p %s", fn, (void *)stream, why);
}

cca_status_t cca_sim_capture_begin(cca_backend_t *backend, cca_stream_t stream)
{
    sim_ctx_t *c = sim_ctx_of(backend);
    if (!c)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", __func__);
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&c->lock);
    sim_graph_t *g = graph_of(c);
    if (g && find_stream(g, stream))
        st = bad_stream(__func__, stream, "is capturing already");
    else if (!g || !add_stream(c, g, stream, g->next_capture_id++))
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", __func__);
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* A node on capturing stream cs depending on its terminals becomes its only terminal (lock held). */
static bool add_node_locked(sim_graph_t *g, sim_cap_stream_t *cs)
{
    if (g->nnodes == g->node_cap) {
        size_t cap = g->node_cap ? g->node_cap * 2 : 64;
        sim_node_t *grown = realloc(g->nodes, cap * sizeof(*grown));
        if (!grown)
            return false;
        g->nodes = grown;
        g->node_cap = cap;
    }
    cca_graph_node_t *term = malloc(sizeof(*term));
    uint64_t *deps = cs->nterms ? malloc(cs->nterms * sizeof(*deps)) : NULL;
    if (!term || (cs->nterms && !deps)) {
        free(term);
        free(deps);
        return false;
    }
    for (size_t i = 0; i < cs->nterms; i++)
        deps[i] = (uint64_t)(uintptr_t)cs->terms[i];
    g->nodes[g->nnodes] = (sim_node_t){deps, cs->nterms};
    g->nnodes++;
    term[0] = (cca_graph_node_t)(uintptr_t)g->nnodes; /* handle: index + 1 */
    free(cs->terms);
    cs->terms = term;
    cs->nterms = 1;
    return true;
}

bool sim_capture_node_locked(sim_ctx_t *c, cca_stream_t stream, bool add_node, uint64_t *capture_id)
{
    sim_cap_stream_t *cs = find_stream(c->graph, stream);
    *capture_id = cs ? cs->capture_id : 0;
    return !cs || !add_node || add_node_locked(c->graph, cs);
}

size_t cca_sim_capture_nodes(cca_backend_t *backend)
{
    sim_ctx_t *c = sim_ctx_of(backend);
    if (!c)
        return 0;
    pthread_mutex_lock(&c->lock);
    size_t n = c->graph ? c->graph->nnodes : 0;
    pthread_mutex_unlock(&c->lock);
    return n;
}

cca_status_t cca_sim_capture_work(cca_backend_t *backend, cca_stream_t stream)
{
    sim_ctx_t *c = sim_ctx_of(backend);
    if (!c)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", __func__);
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&c->lock);
    sim_graph_t *g = c->graph;
    sim_cap_stream_t *cs = find_stream(g, stream);
    if (!cs)
        st = bad_stream(__func__, stream, "is not capturing");
    else if (!add_node_locked(g, cs))
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", __func__);
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t cca_sim_capture_join(cca_backend_t *backend, cca_stream_t dst, cca_stream_t src)
{
    sim_ctx_t *c = sim_ctx_of(backend);
    if (!c)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", __func__);
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&c->lock);
    sim_graph_t *g = c->graph;
    sim_cap_stream_t *s = find_stream(g, src);
    if (!s) {
        st = bad_stream(__func__, src, "is not capturing");
        goto out_unlock;
    }
    uint64_t id = s->capture_id;
    sim_cap_stream_t *d = find_stream(g, dst);
    if (d && d->capture_id != id) {
        st = bad_stream(__func__, dst, "is in another capture");
        goto out_unlock;
    }
    if (!d && !(d = add_stream(c, g, dst, id))) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", __func__);
        goto out_unlock;
    }
    s = find_stream(g, src); /* add_stream may have moved it */
    cca_graph_node_t *terms = realloc(d->terms, (d->nterms + s->nterms + 1) * sizeof(*terms));
    if (!terms) {
        st = cca_raise(CCA_ERR_OUT_OF_MEMORY, "%s: out of host memory", __func__);
        goto out_unlock;
    }
    d->terms = terms;
    for (size_t i = 0; i < s->nterms; i++) {
        bool present = false;
        for (size_t j = 0; j < d->nterms && !present; j++)
            present = d->terms[j] == s->terms[i];
        if (!present)
            d->terms[d->nterms++] = s->terms[i];
    }
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

cca_status_t cca_sim_capture_end(cca_backend_t *backend, cca_stream_t stream)
{
    sim_ctx_t *c = sim_ctx_of(backend);
    if (!c)
        return cca_raise(CCA_ERR_INVALID_ARGUMENT, "%s: the backend is not a simulated backend", __func__);
    cca_status_t st = CCA_OK;
    pthread_mutex_lock(&c->lock);
    sim_graph_t *g = c->graph;
    sim_cap_stream_t *cs = find_stream(g, stream);
    if (!cs) {
        st = bad_stream(__func__, stream, "is not capturing");
    } else {
        uint64_t id = cs->capture_id;
        size_t kept = 0;
        for (size_t i = 0; i < g->nstreams; i++) {
            if (g->streams[i].capture_id != id) {
                g->streams[kept++] = g->streams[i];
                continue;
            }
            simmap_remove(&c->capturing, g->streams[i].stream);
            free(g->streams[i].terms);
        }
        g->nstreams = kept;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

/* stream_capture_info: marked streams without a modelled capture have id 0 and no node. */
static cca_status_t sim_stream_capture_info(void *ctx, int device, cca_stream_t stream, int *status,
                                            uint64_t *capture_id, const cca_graph_node_t **terminals,
                                            size_t *count)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_STREAM_CAPTURE_INFO);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_STREAM_CAPTURE_INFO, device);
        goto out_unlock;
    }
    sim_cap_stream_t *cs = find_stream(c->graph, stream);
    bool marked = simmap_get(&c->capturing, (uint64_t)(uintptr_t)stream) != NULL;
    *status = marked ? CCA_CAPTURE_ACTIVE : CCA_CAPTURE_NONE;
    *capture_id = cs ? cs->capture_id : 0;
    *terminals = cs ? cs->terms : NULL;
    *count = cs ? cs->nterms : 0;
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

static cca_status_t sim_graph_node_dependencies(void *ctx, int device, cca_graph_node_t node,
                                                cca_graph_node_t *deps, size_t *count)
{
    sim_ctx_t *c = ctx;
    pthread_mutex_lock(&c->lock);
    cca_status_t st = sim_enter_locked(c, CCA_OP_GRAPH_NODE_DEPENDENCIES);
    if (st != CCA_OK)
        goto out_unlock;
    if (device < 0 || device >= c->device_count) {
        st = sim_bad_device(c, CCA_OP_GRAPH_NODE_DEPENDENCIES, device);
        goto out_unlock;
    }
    uint64_t h = (uint64_t)(uintptr_t)node;
    if (!c->graph || h == 0 || h > c->graph->nnodes) {
        st = cca_backend_error(CCA_ERR_BACKEND, 1, "graph_node_dependencies: %p is not a node",
                               node);
        goto out_unlock;
    }
    const sim_node_t *n = &c->graph->nodes[h - 1];
    if (!deps) {
        *count = n->ndeps;
    } else {
        size_t k = *count < n->ndeps ? *count : n->ndeps;
        for (size_t i = 0; i < k; i++)
            deps[i] = (cca_graph_node_t)(uintptr_t)n->deps[i];
        *count = k;
    }
out_unlock:
    pthread_mutex_unlock(&c->lock);
    return st;
}

void sim_capture_install(cca_backend_t *b)
{
    b->stream_capture_info = sim_stream_capture_info;
    b->graph_node_dependencies = sim_graph_node_dependencies;
}
