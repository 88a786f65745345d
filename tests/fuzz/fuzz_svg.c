/*
 * fuzz_svg.c - fuzz target for drawing a snapshot (`cca_snapshot_file_to_svg`):
 * any input either draws an SVG that is one well-formed document (it begins
 * with the XML declaration and ends with </svg>, and holds no "nan" or "inf"
 * coordinate) or is refused with a status; sizes anywhere up to 2^64 - 1 must
 * not overflow (UBSan) and nothing may leak (ASan).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cca.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char in[64], out[64];
    snprintf(in, sizeof(in), "/tmp/cca_fuzz_svg_%ld.pickle", (long)getpid());
    snprintf(out, sizeof(out), "/tmp/cca_fuzz_svg_%ld.svg", (long)getpid());
    FILE *f = fopen(in, "wb");
    if (!f)
        return 0;
    size_t n = fwrite(data, 1, size, f);
    fclose(f);
    if (n != size) {
        unlink(in);
        return 0;
    }
    cca_status_t st = cca_snapshot_file_to_svg(in, out);
    unlink(in);
    if (st != CCA_OK)
        return 0;
    f = fopen(out, "rb");
    if (!f)
        abort();
    static char text[1 << 22];
    size_t len = fread(text, 1, sizeof(text) - 1, f);
    bool whole = feof(f);
    fclose(f);
    unlink(out);
    text[len] = '\0';
    if (strncmp(text, "<?xml", 5) || (whole && (len < 7 || strcmp(text + len - 7, "</svg>\n"))) ||
        strstr(text, "nan") || strstr(text, "inf,") || strstr(text, ",inf")) {
        fprintf(stderr, "fuzz_svg: a malformed picture\n");
        abort();
    }
    return 0;
}
