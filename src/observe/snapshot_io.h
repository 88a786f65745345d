/*
 * snapshot_io.h - building, rendering and writing snapshot trees (shared by
 * snapshot_write.c and svg.c).
 */
#ifndef CCA_SNAPSHOT_IO_H
#define CCA_SNAPSHOT_IO_H

#include "pickle.h"

/* The live allocator's state and history as PyTorch's snapshot tree. */
cca_status_t snapshot_build(pv_doc_t **out);

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
