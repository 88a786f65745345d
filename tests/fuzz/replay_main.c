/*
 * replay_main.c - the driver that replays a fuzz target's corpus without
 * libFuzzer: every regular file under each directory (or each file) named on
 * the command line goes through LLVMFuzzerTestOneInput once, in name order,
 * so `make test` runs the corpora under ASan/UBSan. A missing corpus is a
 * failure. Ends with "N inputs replayed".
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s: %s\n", path, strerror(errno));
        return 1;
    }
    size_t cap = 4096, len = 0;
    uint8_t *data = malloc(cap);
    size_t got;
    while (data && (got = fread(data + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            uint8_t *bigger = realloc(data, cap * 2);
            if (!bigger) {
                free(data);
                data = NULL;
                break;
            }
            data = bigger;
            cap *= 2;
        }
    }
    fclose(f);
    if (!data) {
        fprintf(stderr, "out of memory reading %s\n", path);
        return 1;
    }
    /* Copy to an exact-size block so ASan sees reads past the end. */
    uint8_t *exact = malloc(len ? len : 1);
    if (!exact) {
        free(data);
        return 1;
    }
    memcpy(exact, data, len);
    free(data);
    LLVMFuzzerTestOneInput(exact, len);
    free(exact);
    return 0;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int replay_dir(const char *dir, size_t *count)
{
    DIR *d = opendir(dir);
    if (!d) {
        fprintf(stderr, "cannot open corpus %s: %s\n", dir, strerror(errno));
        return 1;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    int failed = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            char **bigger = realloc(names, cap * sizeof(*names));
            if (!bigger) {
                failed = 1;
                break;
            }
            names = bigger;
        }
        if (!(names[n] = strdup(e->d_name))) {
            failed = 1;
            break;
        }
        n++;
    }
    closedir(d);
    if (n)
        qsort(names, n, sizeof(*names), by_name);
    for (size_t i = 0; i < n; i++) {
        size_t plen = strlen(dir) + strlen(names[i]) + 2;
        char *path = malloc(plen);
        if (!path) {
            failed = 1;
        } else {
            snprintf(path, plen, "%s/%s", dir, names[i]);
            struct stat st;
            if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                failed |= replay_file(path);
                (*count)++;
            }
        }
        free(path);
        free(names[i]);
    }
    free(names);
    return failed;
}

int main(int argc, char **argv)
{
    size_t count = 0;
    int failed = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s corpus-dir-or-file...\n", argv[0]);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "missing corpus %s: %s\n", argv[i], strerror(errno));
            failed = 1;
        } else if (S_ISDIR(st.st_mode)) {
            failed |= replay_dir(argv[i], &count);
        } else {
            failed |= replay_file(argv[i]);
            count++;
        }
    }
    printf("%zu inputs replayed%s\n", count, failed ? " (with errors)" : "");
    return failed;
}
