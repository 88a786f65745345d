/*
 * cli_util.c - what the subcommands share: sizes, JSON strings, checking an
 * input file before it is opened, and error lines that name a file once.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

int cli_parse_size(const char *text, size_t *out)
{
    if (!text || text[0] < '0' || text[0] > '9')
        return -1; /* no sign, no space, no empty string */
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno == ERANGE || end == text)
        return -1;
    unsigned shift = 0;
    switch (*end) {
    case '\0': break;
    case 'K': case 'k': shift = 10; end++; break;
    case 'M': case 'm': shift = 20; end++; break;
    case 'G': case 'g': shift = 30; end++; break;
    case 'T': case 't': shift = 40; end++; break;
    default: return -1;
    }
    if (shift && *end == 'i')
        end++;
    if (*end == 'B')
        end++;
    if (*end)
        return -1;
    if (v > (unsigned long long)(SIZE_MAX >> shift))
        return -1; /* the product would wrap */
    *out = (size_t)(v << shift);
    return 0;
}

void cli_json_string(FILE *out, const char *s)
{
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            fprintf(out, "\\%c", *s);
        else if (*s == '\n')
            fputs("\\n", out);
        else if ((unsigned char)*s < 0x20)
            fprintf(out, "\\u%04x", (unsigned char)*s);
        else
            fputc(*s, out);
    }
    fputc('"', out);
}

bool cli_input_ok(const char *cmd, const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "cca %s: cannot open %s: %s\n", cmd, path, strerror(errno));
        return false;
    }
    if (!S_ISREG(st.st_mode)) {
        fprintf(stderr, "cca %s: %s is not a regular file (a FIFO, device or folder cannot be read "
                "as a snapshot)\n", cmd, path);
        return false;
    }
    return true;
}

void cli_report_error(const char *cmd, const char *path)
{
    const char *msg = cca_last_error()->message;
    if (path && !strstr(msg, path))
        fprintf(stderr, "cca %s: %s: %s\n", cmd, path, msg);
    else
        fprintf(stderr, "cca %s: %s\n", cmd, msg);
}
