/*
 * error.c - status names, the thread-local last-error record, the output sink
 * and the assertion handler. cca_raise_at is the one place errors are raised.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local cca_error_t last_error;

static cca_output_fn output_fn;
static void *output_arg;

const char *cca_status_str(cca_status_t status)
{
    switch (status) {
    case CCA_OK: return "CCA_OK";
    case CCA_ERR_INVALID_ARGUMENT: return "CCA_ERR_INVALID_ARGUMENT";
    case CCA_ERR_INVALID_POINTER: return "CCA_ERR_INVALID_POINTER";
    case CCA_ERR_OUT_OF_MEMORY: return "CCA_ERR_OUT_OF_MEMORY";
    case CCA_ERR_BACKEND: return "CCA_ERR_BACKEND";
    case CCA_ERR_NOT_SUPPORTED: return "CCA_ERR_NOT_SUPPORTED";
    case CCA_ERR_BAD_SETTINGS: return "CCA_ERR_BAD_SETTINGS";
    case CCA_ERR_NOT_INITIALIZED: return "CCA_ERR_NOT_INITIALIZED";
    case CCA_ERR_NO_DEVICE: return "CCA_ERR_NO_DEVICE";
    case CCA_ERR_NOT_READY: return "CCA_ERR_NOT_READY";
    case CCA_ERR_IO: return "CCA_ERR_IO";
    case CCA_ERR_FORMAT: return "CCA_ERR_FORMAT";
    case CCA_ERR_BUSY: return "CCA_ERR_BUSY";
    case CCA_ERR_INTERNAL: return "CCA_ERR_INTERNAL";
    }
    return "CCA_ERR_UNKNOWN";
}

const cca_error_t *cca_last_error(void)
{
    return &last_error;
}

void cca_clear_error(void)
{
    memset(&last_error, 0, sizeof(last_error));
}

void cca_error_restore(const cca_error_t *saved)
{
    last_error = *saved;
}

cca_status_t cca_raise_vat(const char *file, int line, cca_status_t status, long backend_code,
                           const char *fmt, va_list ap)
{
    last_error.status = status;
    last_error.file = file;
    last_error.line = line;
    last_error.backend_code = backend_code;
    vsnprintf(last_error.message, sizeof(last_error.message), fmt, ap);
    return status;
}

cca_status_t cca_raise_at(const char *file, int line, cca_status_t status, long backend_code,
                          const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cca_raise_vat(file, line, status, backend_code, fmt, ap);
    va_end(ap);
    return status;
}

cca_status_t cca_backend_error(cca_status_t status, long raw_code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    cca_raise_vat("backend", 0, status, raw_code, fmt, ap);
    va_end(ap);
    return status;
}

void cca_register_output(cca_output_fn fn, void *arg)
{
    output_fn = fn;
    output_arg = arg;
}

void cca_output(const char *text)
{
    if (output_fn)
        output_fn(text, output_arg);
    else
        fputs(text, stderr);
}

void cca_outputf(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    cca_output(buf);
}

void cca_assert_fail(const char *expr, const char *file, int line, const char *func)
{
    /* An assertion is a bug in cca, never a user error: stop here. */
    fprintf(stderr, "cca: assertion failed: %s (%s:%d, %s)\n", expr, file, line, func);
    abort();
}
