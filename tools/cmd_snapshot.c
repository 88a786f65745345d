/*
 * cmd_snapshot.c - `cca snapshot FILE --json [OUT] | --svg OUT`: convert
 * a memory snapshot (PyTorch's torch.cuda.memory._snapshot() pickle, or one
 * cca wrote) to JSON, or draw it as a self-contained SVG.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cca.h"
#include "cli.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: cca snapshot FILE --json [OUT.json]\n"
            "       cca snapshot FILE --svg OUT.svg\n"
            "FILE is a memory snapshot pickle (.pickle or .pickle.gz) from PyTorch\n"
            "(torch.cuda.memory._dump_snapshot) or cca (cca_dump_snapshot, cca replay --snapshot).\n"
            "--json writes its content as JSON to OUT (-o OUT alike), or prints it; --svg draws\n"
            "the memory over time by allocation and the segment map.\n");
}

int cmd_snapshot(int argc, char **argv)
{
    const char *path = NULL, *svg = NULL, *out = NULL;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc && argv[i + 1][0] != '-';
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = true;
            /* --json OUT once FILE is known (before it, the next argument is FILE) */
            if (path && has_value && !out)
                out = argv[++i];
        } else if ((!strcmp(a, "--svg") || !strcmp(a, "-o")) && !has_value) {
            fprintf(stderr, "cca snapshot: %s needs a value\n", a);
            return 2;
        } else if (!strcmp(a, "--svg")) {
            svg = argv[++i];
        } else if (!strcmp(a, "-o")) {
            if (out) {
                fprintf(stderr, "cca snapshot: the JSON goes to one file (%s)\n", out);
                return 2;
            }
            out = argv[++i];
        } else if (a[0] == '-' || path) {
            fprintf(stderr, "cca snapshot: unexpected argument '%s'\n", a);
            usage(stderr);
            return 2;
        } else {
            path = a;
        }
    }
    if (!path || json == (svg != NULL) || (out && !json)) {
        usage(stderr);
        return 2;
    }
    if (!cli_input_ok("snapshot", path))
        return 1;
    if (svg) {
        if (cca_snapshot_file_to_svg(path, svg) != CCA_OK) {
            cli_report_error("snapshot", path);
            return 1;
        }
        return 0;
    }
    char *text = NULL;
    if (cca_snapshot_file_to_json(path, &text) != CCA_OK) {
        cli_report_error("snapshot", path);
        return 1;
    }
    FILE *f = out ? fopen(out, "w") : stdout;
    if (!f) {
        fprintf(stderr, "cca snapshot: cannot open %s for writing\n", out);
        free(text);
        return 1;
    }
    bool ok = fputs(text, f) >= 0;
    if (out)
        ok = fclose(f) == 0 && ok;
    free(text);
    if (!ok) {
        fprintf(stderr, "cca snapshot: cannot write the JSON to %s\n", out ? out : "the standard output");
        return 1;
    }
    return 0;
}
