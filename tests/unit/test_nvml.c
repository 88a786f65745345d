/*
 * test_nvml.c - the NVML-based reports without NVML: PyTorch's size format,
 * and the "not found" degradation of cca_list_gpu_processes and of the OOM
 * message part. CCA_NVML_LIBRARY points at a library that does not exist, so
 * the result is the same on machines with a GPU.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv under -std=c11 */
#endif
#include <stdlib.h>

#include "harness.h"
#include "nvml.h"

static char *formatted(unsigned long long bytes)
{
    static char text[64];
    cca_strbuf_t sb;
    sb_init(&sb);
    nvml_format_size(&sb, bytes);
    snprintf(text, sizeof(text), "%s", sb.data ? sb.data : "");
    sb_free(&sb);
    return text;
}

TEST(format_size_units)
{
    expect_eq_str(formatted(0), "0 bytes");
    expect_eq_str(formatted(512), "512 bytes");
    /* The unit changes just above each power, as PyTorch's format_size. */
    expect_eq_str(formatted(1024), "1024 bytes");
    expect_eq_str(formatted(1025), "1.00 KiB");
    expect_eq_str(formatted(1536), "1.50 KiB");
    expect_eq_str(formatted(1048576), "1024.00 KiB");
    expect_eq_str(formatted(1048577), "1.00 MiB");
    expect_eq_str(formatted(20ULL * 1048576), "20.00 MiB");
    expect_eq_str(formatted(1073741824ULL), "1024.00 MiB");
    expect_eq_str(formatted(3ULL * 1073741824ULL / 2), "1.50 GiB");
    expect_eq_str(formatted(80ULL * 1073741824ULL), "80.00 GiB");
}

TEST(list_without_nvml)
{
    char *text = NULL;
    expect_ok(cca_list_gpu_processes(0, &text));
    expect_eq_str(text, "NVML not found, unable to list processes");
    free(text);
}

TEST(list_bad_arguments)
{
    char *text = (char *)"untouched";
    expect_status(cca_list_gpu_processes(0, NULL), CCA_ERR_INVALID_ARGUMENT);
    expect_status(cca_list_gpu_processes(-1, &text), CCA_ERR_INVALID_ARGUMENT);
    expect_eq_str(text, "untouched");
    expect_contains(cca_last_error()->message, "device -1");
}

TEST(process_usage_without_nvml)
{
    cca_strbuf_t sb;
    sb_init(&sb);
    sb_append(&sb, "prefix. ");
    expect_false(nvml_process_usage(0, &sb));
    expect_eq_str(sb.data, "prefix. ");
    sb_free(&sb);
}

int main(void)
{
    setenv("CCA_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1", 1);
    RUN(format_size_units);
    RUN(list_without_nvml);
    RUN(list_bad_arguments);
    RUN(process_usage_without_nvml);
    return harness_done();
}
