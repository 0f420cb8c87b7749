/* Test data shared by the C test programs: bf16 bit patterns that drift slowly from one
 * iteration to the next, as weights do between training steps. Every rank can compute every
 * other rank's shard, so each received byte is checked against its expected value. */
#ifndef CIERA_TEST_BF16_DATA_H_
#define CIERA_TEST_BF16_DATA_H_

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The bf16 (upper 16 bits, truncated) of a value that depends on rank, index and iteration. */
static inline uint16_t bf16_value(int rank, size_t i, int iter) {
    float f = sinf(0.013f * (float)i + 0.7f * (float)rank) * (1.0f + 0.0005f * (float)iter) +
              0.0001f * (float)iter;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static inline void fill_bf16(uint16_t* out, int rank, size_t count, int iter) {
    for (size_t i = 0; i < count; i++) out[i] = bf16_value(rank, i, iter);
}

/* Index of the first element of rank r's block that differs from the expected data, or -1. */
static inline long check_bf16(const uint16_t* got, int rank, size_t count, int iter) {
    for (size_t i = 0; i < count; i++)
        if (got[i] != bf16_value(rank, i, iter)) return (long)i;
    return -1;
}

#endif
