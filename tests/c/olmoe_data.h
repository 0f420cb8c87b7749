/* The bundled OLMoE slice (tests/data/olmoe-slice) for the C test programs: safetensors read
 * just enough to find one bf16 tensor, and the step files of a folder in order. The includer
 * defines FAIL(...) (print, exit 1) first. */
#ifndef CIERA_TEST_OLMOE_DATA_H_
#define CIERA_TEST_OLMOE_DATA_H_

#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


static int cmp_str(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

/* Loads tensor `name` (must be BF16) from a safetensors file; returns its element count. */
static size_t load_bf16_tensor(const char* path, const char* name, uint16_t** out) {
    FILE* f = fopen(path, "rb");
    if (!f) FAIL("opening %s: %s", path, strerror(errno));
    uint64_t hlen = 0;
    if (fread(&hlen, 8, 1, f) != 1 || hlen > (1u << 24)) FAIL("%s: bad safetensors header length", path);
    char* header = calloc(hlen + 1, 1);
    if (fread(header, hlen, 1, f) != 1) FAIL("%s: short header", path);
    char key[256];
    snprintf(key, sizeof key, "\"%s\"", name);
    char* at = strstr(header, key);
    if (!at) FAIL("%s: no tensor %s", path, name);
    char* dt = strstr(at, "\"dtype\"");
    char* offs = strstr(at, "\"data_offsets\"");
    if (!dt || !offs || strncmp(strchr(dt + 7, '"'), "\"BF16\"", 6) != 0) FAIL("%s: %s is not BF16", path, name);
    unsigned long long a = 0, b = 0;
    if (sscanf(strchr(offs, '[') + 1, "%llu , %llu", &a, &b) != 2 || b <= a || (b - a) % 2) FAIL("%s: bad data_offsets", path);
    size_t n = (size_t)(b - a) / 2;
    *out = malloc(b - a);
    if (fseek(f, (long)(8 + hlen + a), SEEK_SET) != 0 || fread(*out, 2, n, f) != n) FAIL("%s: short data", path);
    free(header);
    fclose(f);
    return n;
}

/* The names of the *.safetensors files of `dir`, sorted (at most `max`; strdup'ed). */
static int list_step_files(const char* dir, char** names, int max) {
    DIR* d = opendir(dir);
    if (!d) FAIL("opening %s: %s", dir, strerror(errno));
    int nfiles = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL && nfiles < max) {
        size_t l = strlen(e->d_name);
        if (l > 12 && strcmp(e->d_name + l - 12, ".safetensors") == 0) names[nfiles++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, nfiles, sizeof names[0], cmp_str);
    return nfiles;
}

#endif
