#!/usr/bin/env bash
# The first Allgather of a large tensor and the memory it takes (issue 20 item 12), under the
# MPI interposer, against the same program's raw calls:
#   mpi   plain Open MPI
#   raw   libciera_mpi.so with CIERA_COMPRESS=off (our raw call: the baseline of the ratio)
#   ciera libciera_mpi.so with the defaults (the first call fills every cache)
# For each size and type it prints, per configuration, the first call's time (slowest rank,
# median of REPEAT runs), the second (warm) call's time, and the peak resident set of the
# largest rank, then first(ciera)/first(raw) and the peak minus the buffers, to hold against
# the caches' size (n x shard for full-value caches, as documented for CIERA_CACHE_MB).
# A first call touches fresh memory (the output, and for ciera the caches): where page faults
# are slow (this VM: about 1 GB/s) they dominate all three first-call columns.
#
#   bench/first_call.sh                         # 2 ranks; 256M float, 1000M bf16
#   NP=2 REPEAT=3 CASES="1100M:float 1000M:bf16" bench/first_call.sh
set -euo pipefail

cd "$(dirname "$0")/.."
NP=${NP:-2}
REPEAT=${REPEAT:-3}
CASES=${CASES:-"256M:float 1000M:bf16"}
OUT=${OUT:-$(mktemp -d /tmp/ciera-first-call.XXXXXX)}
mkdir -p "$OUT"

. bench/need_mpi.sh
echo "# building libciera_mpi.so (release) and bench/first_call.c" >&2
cargo build --release -q -p ciera-mpi
mpicc -O2 -o "$OUT/first_call" bench/first_call.c
LIB=$PWD/target/release/libciera_mpi.so
MPIRUN=(mpirun --oversubscribe -np "$NP")
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

printf "%-7s %-6s %-6s %12s %12s %12s\n" size type config first_ms second_ms peak_MiB
for case in $CASES; do
    size=${case%%:*}
    type=${case##*:}
    for i in $(seq "$REPEAT"); do
        for cfg in mpi raw ciera; do
            env=()
            case $cfg in
            raw) env=(-x LD_PRELOAD="$LIB" -x CIERA_COMPRESS=off) ;;
            ciera) env=(-x LD_PRELOAD="$LIB") ;;
            esac
            [ "$type" = bf16 ] && env+=(-x CIERA_MPI_16BIT=bf16)
            "${MPIRUN[@]}" "${env[@]}" "$OUT/first_call" -s "$size" -d "$type" -i 2 \
                >"$OUT/$size-$type-$cfg-$i.txt"
        done
    done
    for cfg in mpi raw ciera; do
        files=("$OUT/$size-$type-$cfg-"*.txt)
        if grep -q WRONG "${files[@]}"; then
            echo "WRONG results: ${files[*]}" >&2
            exit 1
        fi
        first=$(awk '$1 == 1 {print $2}' "${files[@]}" | median)
        second=$(awk '$1 == 2 {print $2}' "${files[@]}" | median)
        peak=$(sed -n 's/.*(VmHWM, largest rank) \([0-9]*\) MiB.*/\1/p' "${files[@]}" | sort -n | tail -1)
        buffers=$(sed -n 's/.*buffers \([0-9]*\) MiB.*/\1/p' "${files[0]}")
        printf "%-7s %-6s %-6s %12s %12s %12s\n" "$size" "$type" "$cfg" "$first" "$second" "$peak"
        eval "first_$cfg=$first; peak_$cfg=$peak"
    done
    awk -v c="$first_ciera" -v r="$first_raw" -v p="$peak_ciera" -v b="$buffers" \
        'BEGIN {printf "# %s %s: first call ciera/raw %.2fx; peak - buffers %d MiB\n", "'"$size"'", "'"$type"'", c / r, p - b}'
done
echo "# runs kept in $OUT" >&2
