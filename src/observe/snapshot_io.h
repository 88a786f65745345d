/*
 * snapshot_io.h - building, rendering and writing snapshot trees (shared by
 * snapshot_write.c, svg.c and the device allocator's dumps, device/snapshot.c,
 * which hands the live state over as plain data).
 */
#ifndef CCA_SNAPSHOT_IO_H
#define CCA_SNAPSHOT_IO_H

#include "pickle.h"
#include "settings.h"

/* What a snapshot is made of: plain data, gathered by the device allocator. */
typedef struct snapshot_parts {
    const cca_snapshot_t *snapshot;      /* every segment and block (cca_snapshot) */
    const cca_trace_entry_t *entries;    /* the history (cca_history_get) */
    size_t entry_count;
    int device_count;                    /* device_traces lists, one per device */
    const cca_settings_t *settings;      /* the settings in force */
    size_t total_memory;                 /* device 0's, bytes (cca_meta, for cca replay) */
    double fraction;                     /* device 0's memory fraction; 0: none set */
} snapshot_parts_t;

/*
 * parts as PyTorch's snapshot tree; *out owns it (pv_doc_free). Returns
 * CCA_OK, CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t snapshot_tree(const snapshot_parts_t *parts, pv_doc_t **out);

typedef enum { SNAPSHOT_PICKLE, SNAPSHOT_JSON, SNAPSHOT_SVG } snapshot_format_t;
/* Write a snapshot tree to path as format. Returns CCA_OK, CCA_ERR_IO, CCA_ERR_OUT_OF_MEMORY. */
cca_status_t snapshot_write_doc(const pv_doc_t *doc, snapshot_format_t format, const char *path);
/* CCA_ERR_INVALID_ARGUMENT naming entry point what if path is NULL or empty, else CCA_OK. */
cca_status_t snapshot_check_path(const char *path, const char *what);

/*
 * Draw a snapshot tree (PyTorch's or cca's) as one self-contained SVG:
 * memory over time by allocation for each device trace, then the segment
 * map. Returns CCA_OK, CCA_ERR_FORMAT (no segments list),
 * CCA_ERR_OUT_OF_MEMORY.
 */
cca_status_t svg_render(const pv_node_t *root, cca_strbuf_t *out);

/* Write len bytes of text to path. Returns CCA_OK or CCA_ERR_IO. */
cca_status_t snapshot_write_text(const char *path, const char *text, size_t len);

#endif /* CCA_SNAPSHOT_IO_H */
