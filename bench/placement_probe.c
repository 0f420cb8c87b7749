/*
 * placement_probe: does this host's CPU placement favour shared-memory rings or single-copy
 * (CMA) right now?  Plain C, no CIERA code: two processes pinned to CPUs 0 and 1 do a 2-rank,
 * out-of-place allgather of 1 MiB (512 KiB per rank) over and over, alternating two ways:
 *
 *   ring: each copies its shard into a 512 KiB shared ring in 256 KiB pieces while copying
 *         the peer's out of the other ring (two user-space copies per byte, like our rings);
 *   cma:  each reads the peer's unchanged send buffer with process_vm_readv (one kernel
 *         copy per byte, like Open MPI's vader/CMA path and our single copy).
 *
 * Both also copy their own shard. Each round prints the mean time per call of each way. On the
 * 2-core dev VM (2026-12-02) the ring column jumped between 56-62 µs and 208-350 µs from one
 * second to the next (the hypervisor moves the vCPUs between places that share a cache and
 * places that do not) while the cma column stayed at 86-125 µs. See ARCHITECTURE.md, "Single
 * copy over shm".
 *
 *   cc -O2 -o /tmp/placement_probe bench/placement_probe.c && /tmp/placement_probe [rounds]
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define SHARD (512u << 10)
#define RING (512u << 10)
#define PIECE (256u << 10)
#define ITERS 200

struct ring {
    _Atomic unsigned long head __attribute__((aligned(64)));
    _Atomic unsigned long tail __attribute__((aligned(64)));
};

struct shared {
    _Atomic long arrived[2][8]; /* one cache line each */
    pid_t pid[2];
    char *send[2];
    struct ring ctl[2];
};

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void barrier(struct shared *s, int me, long *gen) {
    ++*gen;
    atomic_store(&s->arrived[me][0], *gen);
    while (atomic_load(&s->arrived[1 - me][0]) < *gen)
        ;
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 10;
    struct shared *s = mmap(0, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *rings = mmap(0, 2 * RING, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s == MAP_FAILED || rings == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    memset(s, 0, sizeof *s);
    int me = fork() == 0;
    cpu_set_t cs;
    CPU_ZERO(&cs);
    CPU_SET(me, &cs);
    if (sched_setaffinity(0, sizeof cs, &cs) != 0)
        perror("sched_setaffinity (continuing unbound)");
    /* Page-aligned, so that no memcpy here runs into glibc's slow `rep movsb` case on AMD
     * (destination 1-31 bytes past the source modulo 4096; see transport/src/copy.rs). */
    char *send = aligned_alloc(4096, SHARD), *recv = aligned_alloc(4096, 2 * SHARD);
    memset(send, me + 1, SHARD);
    memset(recv, 0, 2 * SHARD);
    s->pid[me] = getpid();
    s->send[me] = send;
    long gen = 0;
    barrier(s, me, &gen);
    pid_t peer = s->pid[1 - me];
    char *mine = rings + me * RING, *theirs = rings + (1 - me) * RING;
    struct ring *out = &s->ctl[me], *in = &s->ctl[1 - me];
    unsigned long head = 0, tail = 0;
    if (me == 0)
        printf("# round   ring us/call   cma us/call\n");
    for (int r = 0; r < rounds; r++) {
        double t_ring = 0, t_cma = 0;
        for (int way = 0; way < 2; way++) {
            barrier(s, me, &gen);
            double t0 = now_us();
            for (int it = 0; it < ITERS; it++) {
                memcpy(recv + me * SHARD, send, SHARD);
                if (way == 0) {
                    size_t sent = 0, got = 0;
                    while (sent < SHARD || got < SHARD) {
                        if (sent < SHARD && head - atomic_load_explicit(&out->tail, memory_order_acquire) + PIECE <= RING) {
                            memcpy(mine + head % RING, send + sent, PIECE);
                            head += PIECE;
                            sent += PIECE;
                            atomic_store_explicit(&out->head, head, memory_order_release);
                        }
                        if (got < SHARD && atomic_load_explicit(&in->head, memory_order_acquire) - tail >= PIECE) {
                            memcpy(recv + (1 - me) * SHARD + got, theirs + tail % RING, PIECE);
                            tail += PIECE;
                            got += PIECE;
                            atomic_store_explicit(&in->tail, tail, memory_order_release);
                        }
                    }
                } else {
                    struct iovec l = {recv + (1 - me) * SHARD, SHARD}, rv = {s->send[1 - me], SHARD};
                    if (process_vm_readv(peer, &l, 1, &rv, 1, 0) != (ssize_t)SHARD) {
                        perror("process_vm_readv");
                        return 1;
                    }
                }
                barrier(s, me, &gen); /* a call ends when both have everything */
            }
            double us = (now_us() - t0) / ITERS;
            if (way == 0)
                t_ring = us;
            else
                t_cma = us;
        }
        if (me == 0)
            printf("%7d %14.1f %13.1f\n", r, t_ring, t_cma);
        fflush(stdout);
    }
    if (me == 1)
        _exit(0);
    wait(0);
    return 0;
}
