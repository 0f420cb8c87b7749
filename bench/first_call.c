/* The cost of the first MPI_Allgather on a large tensor, and the memory it takes: the check for
 * issue 20 item 12 (first, cache-filling call at most about twice a raw call; peak memory
 * within the buffers plus CIERA_CACHE_MB). Run by bench/first_call.sh with plain Open MPI and
 * under LD_PRELOAD=libciera_mpi.so.
 *
 *   mpirun -np 2 ./first_call -s 1100M [-i 4] [-d float|bf16] [--fresh]
 *
 * -s: bytes each rank contributes; -d: floats, or bf16 (the high halves of the same floats,
 * sent as MPI_UINT16_T: run with CIERA_MPI_16BIT=bf16 so the interposer codes them as bf16); -i: calls (values drift a little between calls,
 * as weights do between steps); --fresh: a newly allocated send buffer every call (what mpi4py
 * with numpy does). Prints, per call, the slowest rank's time and whether every element was
 * exact on every rank, then the largest peak resident set (VmHWM) of any rank and the bytes of
 * its buffers.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v <= 0) {
        fprintf(stderr, "first_call: bad size '%s'\n", s);
        exit(2);
    }
    if (*end == 'K' || *end == 'k') v *= 1024.0;
    else if (*end == 'M' || *end == 'm') v *= 1024.0 * 1024.0;
    else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024.0 * 1024.0;
    else if (*end != '\0') {
        fprintf(stderr, "first_call: bad size suffix in '%s'\n", s);
        exit(2);
    }
    return (size_t)v;
}

/* Element i of rank r at call c: a weight that moves by a few ulps per step. */
static float value(int r, size_t i, int c) {
    float base = (float)((i * 2654435761u) % 100000) * 1e-5f + (float)r;
    return base + (float)c * 1e-6f * (float)(1 + (int)(i % 7));
}

/* The element as `es` bytes: the float, or its high half (bf16, truncated). */
static void element(int r, size_t i, int c, size_t es, unsigned char *out) {
    float v = value(r, i, c);
    uint32_t u;
    memcpy(&u, &v, 4);
    if (es == 2) {
        uint16_t h = (uint16_t)(u >> 16);
        memcpy(out, &h, 2);
    } else {
        memcpy(out, &u, 4);
    }
}

static long vm_hwm_kib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) kib = strtol(line + 6, NULL, 10);
    fclose(f);
    return kib;
}

int main(int argc, char **argv) {
    size_t bytes = 256u << 20;
    int iters = 4, fresh = 0;
    size_t es = 4;
    MPI_Init(&argc, &argv);
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "-s") && a + 1 < argc) bytes = parse_size(argv[++a]);
        else if (!strcmp(argv[a], "-i") && a + 1 < argc) iters = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--fresh")) fresh = 1;
        else if (!strcmp(argv[a], "-d") && a + 1 < argc) {
            a++;
            if (!strcmp(argv[a], "bf16")) es = 2;
            else if (!strcmp(argv[a], "float")) es = 4;
            else {
                fprintf(stderr, "first_call: -d float or bf16\n");
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        }
        else {
            fprintf(stderr, "usage: first_call -s SIZE [-i N] [-d float|bf16] [--fresh]\n");
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    MPI_Datatype type = es == 2 ? MPI_UINT16_T : MPI_FLOAT;
    size_t count = bytes / es;
    unsigned char *send = malloc(count * es);
    unsigned char *recv = malloc(count * es * (size_t)n);
    if (!send || !recv) {
        fprintf(stderr, "first_call: rank %d cannot allocate %zu bytes\n", rank, bytes * (n + 1));
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0)
        printf("# %d ranks, %zu bytes (%zu %s) per rank%s\n# call  time_ms  exact\n", n,
               count * es, count, es == 2 ? "bf16" : "floats",
               fresh ? ", a fresh send buffer every call" : "");
    for (int c = 0; c < iters; c++) {
        if (fresh && c > 0) {
            /* Hold the old one until the new one exists, so the address changes. */
            unsigned char *next = malloc(count * es);
            if (!next) MPI_Abort(MPI_COMM_WORLD, 1);
            free(send);
            send = next;
        }
        for (size_t i = 0; i < count; i++) element(rank, i, c, es, send + i * es);
        MPI_Barrier(MPI_COMM_WORLD);
        double t = MPI_Wtime();
        MPI_Allgather(send, (int)count, type, recv, (int)count, type, MPI_COMM_WORLD);
        t = MPI_Wtime() - t;
        long wrong = 0;
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < count; i++) {
                unsigned char want[4];
                element(r, i, c, es, want);
                if (memcmp(recv + ((size_t)r * count + i) * es, want, es) != 0) wrong++;
            }
        double tmax;
        long wrong_all;
        MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        MPI_Reduce(&wrong, &wrong_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) printf("%6d %8.1f  %s\n", c + 1, tmax * 1e3, wrong_all ? "WRONG" : "yes");
        if (rank == 0) fflush(stdout);
    }
    long hwm = vm_hwm_kib(), hwm_max;
    MPI_Reduce(&hwm, &hwm_max, 1, MPI_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("# peak resident (VmHWM, largest rank) %.0f MiB; buffers %.0f MiB per rank\n",
               hwm_max / 1024.0, (double)bytes * (n + 1) / 1048576.0);
    free(send);
    free(recv);
    MPI_Finalize();
    return 0;
}
