#!/usr/bin/env bash
# Two (or more) "nodes" of 2 ranks each on one machine (bench/netns_nodes.sh: a network
# namespace per node, egress shaped with tbf), all launched by one mpirun
# (bench/netns_rsh.sh): the flat ring against the hierarchical schedule, raw and compressed,
# on the bundled trace's peak-learning-rate steps (`ciera perf --trace`, every bit checked),
# and MPI_Allgather (Open MPI over TCP, bench/mpi_allgather.c) under the same mpirun. Needs
# root, ip, tc, mpirun, mpicc; the release build (cargo build --release).
#
#   bench/multinode_compare.sh [NODES (2)] [RATE (1gbit)] [SIZE (16M)] [ITERS (10)]
set -euo pipefail
cd "$(dirname "$0")/.."
NODES=${1:-2}
RATE=${2:-1gbit}
SIZE=${3:-16M}
ITERS=${4:-10}
OUT=target/multinode
rm -rf "$OUT" && mkdir -p "$OUT/trace"
CIERA=$PWD/target/release/ciera
[ -x "$CIERA" ] || cargo build --release --quiet
mpicc -O2 -o "$OUT/mpi_allgather" bench/mpi_allgather.c
# The peak-learning-rate window of the bundled slice (or TRACE=dir for another).
TRACE=${TRACE:-tests/data/olmoe-slice}
for f in "$TRACE"/step_0010[0-2].safetensors; do ln -s "$PWD/$f" "$OUT/trace/"; done
trap 'bench/netns_nodes.sh down >/dev/null 2>&1 || true' EXIT
bench/netns_nodes.sh up "$NODES" "$RATE"
bench/netns_nodes.sh hostfile "$NODES" 2 >"$OUT/hostfile"
NP=$((2 * NODES))
run() { # run ENV... -- PROGRAM ARGS...
    local envs=()
    while [ "$1" != -- ]; do envs+=(-x "$1"); shift; done
    shift
    mpirun --allow-run-as-root --oversubscribe --hostfile "$OUT/hostfile" -np "$NP" \
        --mca plm_rsh_agent "$PWD/bench/netns_rsh.sh" \
        --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 \
        --mca btl tcp,self,vader \
        -x CIERA_ROOT=10.77.0.1:29500 -x "CIERA_SECRET=$(head -c32 /dev/urandom | od -An -tx1 | tr -d ' \n')" \
        -x CIERA_TIMEOUT=120 "${envs[@]}" "$@"
}
echo "# $NODES nodes x 2 ranks, $RATE between nodes (tbf on each node's egress), $SIZE gathered, peak-LR steps 100-102"
for algo in ring hier; do
    run CIERA_ALGO=$algo -- "$CIERA" perf --trace "$PWD/$OUT/trace" -b "$SIZE" -e "$SIZE" \
        -i "$ITERS" -w 3 --modes raw,exp,delta --json >"$OUT/$algo.json"
done
run -- "$OUT/mpi_allgather" -b "$SIZE" -e "$SIZE" -i "$ITERS" -w 3 -d uint8 -c 1 >"$OUT/mpi.txt"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for algo in ("ring", "hier"):
    for line in open(f"{out}/{algo}.json"):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            rows[(algo, r["mode"])] = r
mpi = [l.split() for l in open(f"{out}/mpi.txt") if l.strip() and not l.startswith("#")]
mpi_us = float(mpi[-1][3])
flat_raw = rows[("ring", "raw")]["time_us"]
print("| schedule | mode | time ms | wire ratio | vs flat raw | vs MPI | wrong |")
print("|---|---|---|---|---|---|---|")
for (algo, mode), r in sorted(rows.items()):
    print(f"| {algo} | {mode} | {r['time_us'] / 1e3:.1f} | {r['wire_ratio']:.2f} | "
          f"{flat_raw / r['time_us']:.2f}x | {mpi_us / r['time_us']:.2f}x | {r['wrong']} |")
print(f"| MPI_Allgather | raw | {mpi_us / 1e3:.1f} | 1.00 | {flat_raw / mpi_us:.2f}x | 1.00x | {mpi[-1][-1]} |")
PY
