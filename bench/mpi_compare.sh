#!/usr/bin/env bash
# Side-by-side Allgather: `ciera perf` vs MPI_Allgather (Open MPI), same sizes, iterations,
# columns and bus-bandwidth formula, for 2 and 4 ranks on this host:
#   shm: ours CIERA_TRANSPORT=shm  vs  Open MPI's default (vader shared memory, CMA single copy)
#   tcp: ours CIERA_TRANSPORT=tcp  vs  Open MPI with --mca btl tcp,self
# Prints, per size: our busbw, MPI's busbw, their ratio (and both times), then the acceptance
# checks: ratio >= 1.0 (shm) / >= 0.9 (tcp) for every size >= 1 MiB, 8-byte time within 2x.
#
# Buffers, over shm: each library allocates its own. Ours come from `ciera perf -R 1`
# (ciera::SharedBuffer: peers on the host copy straight out of them, like nccl-tests -R with
# ncclMemAlloc); MPI's from MPI_Alloc_mem *and* from malloc, MPI keeping the better of the two
# per size. The acceptance ratio is ours (shared buffers) / MPI; a second ratio column shows
# ours with plain heap buffers (-R 0, what a caller passing malloc'd memory gets), for
# information. Over TCP every side uses heap buffers (shared ones change nothing there), and
# each its own congestion control: ours CIERA_TCP_CONGESTION (auto: cubic or reno per socket
# where the kernel's default is bbr, whose pacing delays bursts), Open MPI the kernel's default
# (printed below; CIERA_TCP_CONGESTION=system gives ours the same).
#
# Each configuration runs REPEAT times, alternating ours and MPI's, and each side keeps its
# best time per size (the machine is shared; best-of-N treats both sides alike).
#
#   bench/mpi_compare.sh                      # defaults below
#   REPEAT=5 NPS="2 4" TRANSPORTS="shm tcp" MINBYTES=8 MAXBYTES=64M FACTOR=2 ITERS=20 bench/mpi_compare.sh
set -euo pipefail

cd "$(dirname "$0")/.."
REPEAT=${REPEAT:-5}
NPS=${NPS:-"2 4"}
TRANSPORTS=${TRANSPORTS:-"shm tcp"}
MINBYTES=${MINBYTES:-8}
MAXBYTES=${MAXBYTES:-64M}
FACTOR=${FACTOR:-2}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
DTYPE=uint8 # 1-byte elements so every size down to 8 bytes divides among 2 and 4 ranks
OUT=${OUT:-$(mktemp -d /tmp/ciera-mpi-compare.XXXXXX)}
mkdir -p "$OUT"

. bench/need_mpi.sh

echo "# building ciera (release) and bench/mpi_allgather.c" >&2
cargo build --release --quiet --bin ciera >&2
TARGET=${CARGO_TARGET_DIR:-target}
CIERA="$TARGET/release/ciera"
mpicc -O2 -o "$OUT/mpi_allgather" bench/mpi_allgather.c

ARGS=(-b "$MINBYTES" -e "$MAXBYTES" -f "$FACTOR" -w "$WARMUP" -d "$DTYPE" -c 0)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)

# Keep, per size, the best (lowest) time of all files given; print "size time busbw".
best() {
    awk '!/^#/ && NF >= 6 { if (!($1 in t) || $4 < t[$1]) { t[$1] = $4; b[$1] = $6 } }
         END { for (s in t) print s, t[s], b[s] }' "$@" | sort -n
}

echo "# kernel TCP congestion control: $(cat /proc/sys/net/ipv4/tcp_congestion_control 2>/dev/null || echo unknown); CIERA_TCP_CONGESTION=${CIERA_TCP_CONGESTION:-auto}"
status=0
summary=()
for transport in $TRANSPORTS; do
    for np in $NPS; do
        tag="$transport-np$np"
        for ((i = 1; i <= REPEAT; i++)); do
            if [[ $transport == tcp ]]; then
                CIERA_TRANSPORT=tcp "$CIERA" perf -n "$np" -i "$ITERS" "${ARGS[@]}" >"$OUT/ours-$tag-$i.txt"
                "${MPIRUN[@]}" --mca btl tcp,self -np "$np" "$OUT/mpi_allgather" -i "$ITERS" "${ARGS[@]}" >"$OUT/mpi-$tag-$i.txt"
            else
                CIERA_TRANSPORT=shm "$CIERA" perf -n "$np" -i "$ITERS" -R 1 "${ARGS[@]}" >"$OUT/ours-$tag-$i.txt"
                "${MPIRUN[@]}" -np "$np" "$OUT/mpi_allgather" -i "$ITERS" -R 1 "${ARGS[@]}" >"$OUT/mpi-$tag-$i.txt"
                CIERA_TRANSPORT=shm "$CIERA" perf -n "$np" -i "$ITERS" -R 0 "${ARGS[@]}" >"$OUT/heap-$tag-$i.txt"
                "${MPIRUN[@]}" -np "$np" "$OUT/mpi_allgather" -i "$ITERS" -R 0 "${ARGS[@]}" >"$OUT/mpi-malloc-$tag-$i.txt"
            fi
        done
        best "$OUT"/ours-"$tag"-*.txt >"$OUT/ours-$tag.best"
        best "$OUT"/mpi-*"$tag"-*.txt >"$OUT/mpi-$tag.best"
        if [[ $transport == tcp ]]; then
            cp "$OUT/ours-$tag.best" "$OUT/heap-$tag.best"
        else
            best "$OUT"/heap-"$tag"-*.txt >"$OUT/heap-$tag.best"
        fi
        if [[ $transport == shm ]]; then
            need=1.0
            what="ours CIERA_TRANSPORT=shm -R 1 vs Open MPI default (vader), better of MPI_Alloc_mem and malloc"
        else
            need=0.9
            what="ours CIERA_TRANSPORT=tcp vs Open MPI --mca btl tcp,self"
        fi
        echo
        echo "== $transport, $np ranks: $what; best of $REPEAT runs, $ITERS iters =="
        printf "%12s %12s %12s %8s %11s %11s %12s %10s\n" "size(B)" "ours busbw" "MPI busbw" "ratio" "ours us" "MPI us" "heap busbw" "heap/MPI"
        result=$(join "$OUT/ours-$tag.best" "$OUT/mpi-$tag.best" | join - "$OUT/heap-$tag.best" | sort -n | awk -v need="$need" -v np="$np" -v tr="$transport" '
            {
                size = $1; ot = $2; ob = $3; mt = $4; mb = $5; hb = $7
                ratio = (mb > 0) ? ob / mb : 0
                hratio = (mb > 0) ? hb / mb : 0
                flag = ""
                if (size >= 1048576 && ratio < need) { flag = "  < " need; bad++ }
                if (size == 8) { lat = ot / mt; if (lat > 2.0) { flag = flag "  latency " sprintf("%.2f", lat) "x MPI"; bad++ } else { latok = sprintf("%.2f", lat) } }
                printf "%12d %12.3f %12.3f %8.2f %11.2f %11.2f %12.3f %10.2f%s\n", size, ob, mb, ratio, ot, mt, hb, hratio, flag
            }
            END { printf "RESULT %s np=%d: %s (8-byte time ratio ours/MPI %s)\n", tr, np, bad ? "FAIL" : "PASS", latok ? latok : "see above" }')
        echo "$result" | grep -v '^RESULT'
        line=$(echo "$result" | grep '^RESULT' | sed 's/^RESULT //')
        summary+=("$line")
        [[ $line == *FAIL* ]] && status=1
    done
done
echo
echo "== acceptance: busbw ratio >= 1.0 (shm) / >= 0.9 (tcp) for sizes >= 1 MiB; 8-byte time <= 2x MPI =="
printf '%s\n' "${summary[@]}"
echo "# raw outputs in $OUT"
exit $status
