#!/usr/bin/env bash
# OSU Micro-Benchmarks' osu_allgather, with its validation (-c) on every type (-T all), out of
# place and in place (-l), on 2-4 ranks under libciera_mpi.so: every line must say "Pass", and
# every rank's CIERA_STATS line must show calls served with none failed. Nothing is fetched:
# point OSU_SRC at an OSU 7.x source tree (the one with c/util and c/mpi/collective), or
# OSU_BIN at a built osu_allgather; without either this script says so and exits 0.
#
#   OSU_SRC=~/osu-micro-benchmarks-7.4 bench/osu_allgather.sh
#   NPS="2 3 4" ARGS="-c -T all -i 20 -x 5 -m 1:4194304" MODES="auto on" bench/osu_allgather.sh
set -euo pipefail

cd "$(dirname "$0")/.."
NPS=${NPS:-"2 3 4"}
ARGS=${ARGS:-"-c -T all -i 20 -x 5 -m 1:4194304"}
MODES=${MODES:-"auto on"}
OUT=${OUT:-$(mktemp -d /tmp/ciera-osu.XXXXXX)}
mkdir -p "$OUT"

if [ -z "${OSU_BIN:-}" ]; then
    if [ -z "${OSU_SRC:-}" ]; then
        echo "osu_allgather.sh: set OSU_SRC (an OSU 7.x source tree) or OSU_BIN; nothing run"
        exit 0
    fi
    . bench/need_mpi.sh
    echo "# building osu_allgather from $OSU_SRC" >&2
    u=$OSU_SRC/c/util
    mpicc -O2 -I "$u" -o "$OUT/osu_allgather" \
        "$OSU_SRC/c/mpi/collective/blocking/osu_allgather.c" "$u/osu_util.c" \
        "$u/osu_util_mpi.c" "$u/osu_util_graph.c" "$u/osu_util_papi.c" \
        "$u/osu_util_validation.c" -lm
    OSU_BIN=$OUT/osu_allgather
fi
cargo build --release -q -p ciera-mpi
LIB=$PWD/target/release/libciera_mpi.so
MPIRUN=(mpirun --oversubscribe)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)

failed=0
for np in $NPS; do
    for place in "" "-l"; do
        for mode in $MODES; do
            tag="np$np${place:+-inplace}-$mode"
            # shellcheck disable=SC2086 # ARGS is a list of options
            "${MPIRUN[@]}" -np "$np" -x LD_PRELOAD="$LIB" -x CIERA_STATS=1 \
                -x CIERA_COMPRESS="$mode" "$OSU_BIN" $ARGS $place >"$OUT/$tag.txt" 2>&1 ||
                { echo "$tag: osu_allgather exited $?"; failed=1; }
            pass=$(grep -c " Pass$" "$OUT/$tag.txt" || true)
            fail=$(grep -c " Fail$" "$OUT/$tag.txt" || true)
            served=$(grep -c "allgathers served by CIERA (.* 0 failed;" "$OUT/$tag.txt" || true)
            echo "$tag: $pass sizes Pass, $fail Fail; $served of $np ranks served with 0 failed"
            if [ "$fail" != 0 ] || [ "$pass" = 0 ] || [ "$served" != "$np" ]; then failed=1; fi
        done
    done
done
echo "# outputs in $OUT" >&2
exit $failed
