/* MPI_Allgather timings with `ciera perf`'s conventions, so bench/mpi_compare.sh can put the two
 * side by side: the same sizes, iterations, columns and bus-bandwidth formula.
 *
 *   mpirun -np 4 ./mpi_allgather -b 8 -e 64M -f 2 -i 20 -w 5 -d uint8 [-c 1] [-R 1] [--json]
 *
 * size = total gathered bytes (nranks * count * typesize, rounded down to a multiple of that);
 * count = elements each rank contributes (nccl-tests' all_gather_perf prints the same);
 * time = the slowest rank's mean time per call; algbw = size / time;
 * busbw = algbw * (nranks - 1) / nranks (as nccl-tests' all_gather_perf).
 * -c 1 fills every rank's buffer with a pattern of (rank, index, iteration) after timing,
 * gathers it twice more and counts the elements that differ (#wrong, summed over ranks).
 * -R 1 takes the buffers from MPI_Alloc_mem instead of malloc (the counterpart of
 * `ciera perf -R 1`: each library's own memory).
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static size_t parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v < 0) {
        fprintf(stderr, "mpi_allgather: bad size '%s'\n", s);
        exit(2);
    }
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; break;
    case 'm': case 'M': v *= 1024.0 * 1024.0; break;
    case 'g': case 'G': v *= 1024.0 * 1024.0 * 1024.0; break;
    case '\0': break;
    default:
        fprintf(stderr, "mpi_allgather: bad size suffix in '%s'\n", s);
        exit(2);
    }
    return (size_t)v;
}

struct dtype_name {
    const char *name;
    MPI_Datatype type;
    size_t size;
};

static const struct dtype_name DTYPES[] = {
    {"int8", MPI_INT8_T, 1},   {"uint8", MPI_UINT8_T, 1},   {"int32", MPI_INT32_T, 4},
    {"uint32", MPI_UINT32_T, 4}, {"int64", MPI_INT64_T, 8}, {"uint64", MPI_UINT64_T, 8},
    {"half", MPI_UINT16_T, 2}, {"float", MPI_FLOAT, 4},     {"double", MPI_DOUBLE, 8},
    {"bfloat16", MPI_UINT16_T, 2},
};

/* The same element pattern as `ciera perf -c 1` (any pattern would do; byte compare only). */
static uint64_t pattern(uint64_t rank, uint64_t index, uint64_t iter) {
    uint64_t x = rank * 0x9E3779B97F4A7C15ull ^ index * 0xC2B2AE3D27D4EB4Full ^ iter * 0x165667B19E3779F9ull;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    return x;
}

static void fill(unsigned char *buf, size_t count, size_t ts, int rank, int iter) {
    for (size_t i = 0; i < count; i++) {
        uint64_t v = pattern((uint64_t)rank, i, (uint64_t)iter);
        memcpy(buf + i * ts, &v, ts); /* little-endian low bytes, as ciera perf */
    }
}

int main(int argc, char **argv) {
    size_t minbytes = 32u << 20, maxbytes = 32u << 20;
    double factor = 2.0;
    int iters = 20, warmup = 5, check = 0, json = 0, alloc_mem = 0;
    const struct dtype_name *dt = &DTYPES[7];

    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) { json = 1; continue; }
        if (!v) { if (rank == 0) fprintf(stderr, "mpi_allgather: %s needs a value\n", a); MPI_Abort(MPI_COMM_WORLD, 2); }
        if (!strcmp(a, "-b")) minbytes = parse_size(v);
        else if (!strcmp(a, "-e")) maxbytes = parse_size(v);
        else if (!strcmp(a, "-f")) factor = atof(v);
        else if (!strcmp(a, "-i") || !strcmp(a, "-n") || !strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "-w")) warmup = atoi(v);
        else if (!strcmp(a, "-c")) check = atoi(v);
        else if (!strcmp(a, "-R")) alloc_mem = atoi(v);
        else if (!strcmp(a, "-d")) {
            dt = NULL;
            for (size_t k = 0; k < sizeof DTYPES / sizeof DTYPES[0]; k++)
                if (!strcmp(DTYPES[k].name, v)) dt = &DTYPES[k];
            if (!dt) { if (rank == 0) fprintf(stderr, "mpi_allgather: unknown type %s\n", v); MPI_Abort(MPI_COMM_WORLD, 2); }
        } else { if (rank == 0) fprintf(stderr, "mpi_allgather: unknown option %s\n", a); MPI_Abort(MPI_COMM_WORLD, 2); }
        i++;
    }
    if (factor <= 1.0) factor = 2.0;
    if (iters < 1) iters = 1;

    size_t ts = dt->size;
    size_t max_count = maxbytes / ts / (size_t)nranks;
    unsigned char *sendbuf = NULL, *recvbuf = NULL;
    if (alloc_mem) {
        if (MPI_Alloc_mem((MPI_Aint)(max_count * ts + 1), MPI_INFO_NULL, &sendbuf) != MPI_SUCCESS ||
            MPI_Alloc_mem((MPI_Aint)(max_count * ts * (size_t)nranks + 1), MPI_INFO_NULL, &recvbuf) != MPI_SUCCESS)
            sendbuf = recvbuf = NULL;
    } else {
        sendbuf = malloc(max_count * ts + 1);
        recvbuf = malloc(max_count * ts * (size_t)nranks + 1);
    }
    if (!sendbuf || !recvbuf) { fprintf(stderr, "mpi_allgather: out of memory\n"); MPI_Abort(MPI_COMM_WORLD, 1); }
    memset(sendbuf, 1, max_count * ts + 1);
    memset(recvbuf, 0, max_count * ts * (size_t)nranks + 1);

    if (rank == 0 && !json) {
        printf("# mpi_allgather: MPI_Allgather, %d ranks, iters %d, warmup %d, check %d, buffers %s\n#\n", nranks, iters, warmup,
               check, alloc_mem ? "MPI_Alloc_mem" : "malloc");
        printf("# %10s %12s %8s %10s %12s %12s %8s\n", "size", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
    }
    double busbw_sum = 0;
    int nsizes = 0;
    long long wrong_total = 0;
    for (size_t bytes = minbytes; bytes <= maxbytes;) {
        size_t count = bytes / ts / (size_t)nranks;
        size_t size = count * ts * (size_t)nranks;
        for (int i = 0; i < warmup; i++)
            MPI_Allgather(sendbuf, (int)count, dt->type, recvbuf, (int)count, dt->type, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allgather(sendbuf, (int)count, dt->type, recvbuf, (int)count, dt->type, MPI_COMM_WORLD);
        double mine = (MPI_Wtime() - t0) / iters, slowest = 0;
        MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);

        long long wrong = -1;
        if (check) {
            long long mine_wrong = 0;
            for (int it = 0; it < 2; it++) {
                fill(sendbuf, count, ts, rank, it);
                memset(recvbuf, 0xA5, size);
                MPI_Allgather(sendbuf, (int)count, dt->type, recvbuf, (int)count, dt->type, MPI_COMM_WORLD);
                for (int r = 0; r < nranks; r++)
                    for (size_t i = 0; i < count; i++) {
                        uint64_t v = pattern((uint64_t)r, i, (uint64_t)it);
                        if (memcmp(recvbuf + ((size_t)r * count + i) * ts, &v, ts)) mine_wrong++;
                    }
            }
            MPI_Allreduce(&mine_wrong, &wrong, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
            wrong_total += wrong;
        }

        double algbw = slowest > 0 ? (double)size / slowest / 1e9 : 0;
        double busbw = algbw * (double)(nranks - 1) / (double)nranks;
        busbw_sum += busbw;
        nsizes++;
        if (rank == 0) {
            if (json) {
                printf("{\"size\":%zu,\"count\":%zu,\"type\":\"%s\",\"time_us\":%.3f,\"algbw\":%.4f,\"busbw\":%.4f,\"wrong\":", size,
                       count * (size_t)nranks, dt->name, slowest * 1e6, algbw, busbw);
                if (check) printf("%lld}\n", wrong); else printf("null}\n");
            } else {
                printf("  %10zu %12zu %8s %10.2f %12.3f %12.3f", size, count, dt->name, slowest * 1e6, algbw, busbw);
                if (check) printf(" %8lld\n", wrong); else printf(" %8s\n", "N/A");
            }
            fflush(stdout);
        }
        size_t next = (size_t)((double)bytes * factor);
        if (next <= bytes) next = bytes + 1;
        bytes = next;
    }
    if (rank == 0 && !json) {
        printf("# Out of bounds values : %lld %s\n", check ? wrong_total : 0, wrong_total ? "FAILED" : "OK");
        printf("# Avg bus bandwidth    : %.4f\n#\n", nsizes ? busbw_sum / nsizes : 0);
    }
    if (alloc_mem) {
        MPI_Free_mem(sendbuf);
        MPI_Free_mem(recvbuf);
    } else {
        free(sendbuf);
        free(recvbuf);
    }
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}
