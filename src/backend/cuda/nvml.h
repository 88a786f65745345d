/*
 * nvml.h - optional NVML queries (processes using a GPU and their memory),
 * with libnvidia-ml loaded at run time. Without NVML every query reports
 * "not available" and callers degrade gracefully.
 */
#ifndef CCA_NVML_H
#define CCA_NVML_H

#include <stdbool.h>

#include "internal.h"

/*
 * Append to out, for each process using device (CUDA ordinal), the part of
 * PyTorch's out-of-memory message that names it: "Including memory not
 * allocated by cca, this process has X memory in use. " for this process and
 * "Process <pid> has X memory in use. " for others. Returns false (nothing
 * appended) when NVML is absent or fails. Thread-safe.
 */
bool nvml_process_usage(int device, cca_strbuf_t *out);

/* Format a byte count as PyTorch's format_size ("512 bytes", "1.50 MiB"). */
void nvml_format_size(cca_strbuf_t *out, unsigned long long bytes);

#endif /* CCA_NVML_H */
