#!/usr/bin/env bash
# The compressed Allgather on a slow network, on one machine: a network namespace whose loopback
# is shaped with tbf (the kernel has tbf, not netem), and in it, side by side on the same trace
# tensor and sizes:
#   ours raw                  (CIERA_COMPRESS=off, TCP)
#   ours exp / full / delta   (auto, exponent / full-value / delta cache, TCP; MODES picks them,
#                             any of `ciera perf --trace`'s modes: exp-on, full-on, delta-on
#                             force compression)
#   MPI_Allgather             (Open MPI, --mca btl tcp,self)
# For every window of consecutive steps of the trace it prints the times, the ratios raw/ours
# and MPI/ours, and ours/wire: the speedup over raw as a share of the wire ratio (how much of
# what the bytes saved the call kept). Needs root (ip netns, tc). Every bit ours receives is checked.
# Timing: ours starts every call after a barrier and reports the mean over calls of the slowest
# rank's time (a raw call ends on each rank at a different time; averaging per rank first made
# raw look faster than the link allows); MPI reports back-to-back calls, slowest rank (OSU style).
# Wire limit for reference: 1 Gbit/s carries 4 ranks x 16 MiB raw (48 MiB over the one shaped
# loopback) in ~403 ms.
#
#   bench/shaped_compare.sh                                 # 1 Gbit/s, 4 ranks, 16 MiB
#   RATE=1gbit NRANKS=4 SIZE=16M ITERS=5 TRACE=../shared/traces/olmoe-mini-s0 bench/shaped_compare.sh
#   MODES=raw,delta,delta-on bench/shaped_compare.sh            # raw is always run (the baseline)
#   MPI=0 CIERA=.gpu/bin/ciera bench/shaped_compare.sh    # no MPI baseline, a prebuilt ciera (a
#                                                         # machine without cargo or Open MPI)
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${RATE:-1gbit}
NRANKS=${NRANKS:-4}
SIZE=${SIZE:-16M}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-5}  # the fill, the raw probe, the first compressed call and a probe of the other frame family
REPEAT=${REPEAT:-1}
TRACE=${TRACE:-../shared/traces/olmoe-mini-s0}
[[ -d $TRACE ]] || TRACE=tests/data/olmoe-slice
TENSOR=${TENSOR:-}
MODES=${MODES:-raw,exp,full,delta}
# raw is the baseline of every ratio: run it whether named or not.
[[ ,$MODES, == *,raw,* ]] || MODES=raw,$MODES
OUT=${OUT:-$(mktemp -d /tmp/ciera-shaped.XXXXXX)}
MPI=${MPI:-1}
mkdir -p "$OUT"
: >"$OUT/mpi.txt"
NS=ciera-shaped-$$

if [[ -n ${CIERA:-} ]]; then
    CIERA=$(realpath "$CIERA")
else
    cargo build --release --quiet --bin ciera >&2
    TARGET=${CARGO_TARGET_DIR:-target}
    CIERA=$(realpath "$TARGET/release/ciera")
fi
if [[ $MPI != 0 ]]; then
    . bench/need_mpi.sh
    mpicc -O2 -o "$OUT/mpi_allgather" bench/mpi_allgather.c
fi

. bench/shaped_lo.sh
trap 'shaped_lo_down "$NS"' EXIT
shaped_lo_up "$NS" "$RATE"
echo "# netns $NS: loopback shaped with tbf rate $RATE; $NRANKS ranks; $SIZE gathered; trace $TRACE; modes $MODES" >&2

T_ARGS=(--trace "$TRACE" -n "$NRANKS" -b "$SIZE" -e "$SIZE" -i "$ITERS" -w "$WARMUP" --modes "$MODES" --json)
[[ -n $TENSOR ]] && T_ARGS+=(--tensor "$TENSOR")
for ((r = 1; r <= REPEAT; r++)); do
    ip netns exec "$NS" env CIERA_TRANSPORT=tcp "$CIERA" perf "${T_ARGS[@]}" >>"$OUT/ours.json"
    [[ $MPI == 0 ]] && continue
    ip netns exec "$NS" mpirun --allow-run-as-root --oversubscribe -np "$NRANKS" --mca btl tcp,self \
        --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
        "$OUT/mpi_allgather" -b "$SIZE" -e "$SIZE" -i "$ITERS" -w "$WARMUP" -d uint8 -c 0 >>"$OUT/mpi.txt"
done

python3 - "$OUT/ours.json" "$OUT/mpi.txt" "$MODES" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
modes = [m for m in sys.argv[3].split(",") if m and m != "raw"]
mpi = [l.split() for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")]
mpi_us = min(float(r[3]) for r in mpi) if mpi else float("nan")
best = {}
for r in rows:
    k = (r["window"], r["mode"])
    if k not in best or r["time_us"] < best[k]["time_us"]:
        best[k] = r
wins = sorted({r["window"] for r in rows}, key=lambda w: int(w.split("-")[0]))
wrong = sum(r["wrong"] for r in rows)
print(f"# {rows[0]['tensor'] if rows else '?'}, {rows[0]['nranks'] if rows else '?'} ranks, "
      f"{rows[0]['size'] if rows else '?'} bytes gathered; MPI_Allgather (tcp) "
      + (f"{mpi_us/1e3:.1f} ms" if mpi else "not run (MPI=0)"))
# Per mode: time, wire ratio, raw/mode and MPI/mode (speedups).
cols = [("raw ms", lambda w, g: f"{g(w, 'raw') / 1e3:.1f}")]
for m in modes:
    cols += [
        (f"{m} ms", lambda w, g, m=m: f"{g(w, m) / 1e3:.1f}"),
        (f"wire {m}", lambda w, g, m=m: f"{g(w, m, 'wire_ratio'):.2f}"),
        (f"raw/{m}", lambda w, g, m=m: f"{g(w, 'raw') / g(w, m):.2f}x"),
        # The speedup's share of the wire ratio: 1.00 where the call is as fast as its bytes
        # allow, less where coding (or anything else) is not hidden behind the wire.
        (f"{m}/wire", lambda w, g, m=m: f"{g(w, 'raw') / g(w, m) / g(w, m, 'wire_ratio'):.2f}"),
    ]
    if mpi:
        cols.append((f"mpi/{m}", lambda w, g, m=m: f"{mpi_us / g(w, m):.2f}x"))
g = lambda w, m, key="time_us": best.get((w, m), {}).get(key, float("nan"))
width = [max(len(name), 8) for name, _ in cols]
print(f"{'window':>9} " + " ".join(f"{name:>{k}}" for (name, _), k in zip(cols, width)))
for w in wins:
    print(f"{w:>9} " + " ".join(f"{cell(w, g):>{k}}" for (_, cell), k in zip(cols, width)))
print(f"# wrong elements: {wrong}")
PY
echo "# raw outputs in $OUT" >&2
