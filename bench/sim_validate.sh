#!/usr/bin/env bash
# Measures the Allgather configurations `ciera sim --validate` predicts, then runs it: the
# model's prediction beside each measurement, with the error.
#   - one "node": N ranks in a network namespace whose loopback is shaped with tbf (all ranks
#     share the link, TCP), N in NRANKS, at each rate in RATES;
#   - 2 nodes x 2 ranks (bench/netns_nodes.sh: a namespace per node, egress shaped, shared
#     memory inside a node) under mpirun, flat ring and hierarchical, at each rate;
# at the sizes in SIZES, raw and the compressed modes in MODES (`ciera perf --trace` modes,
# forced so that every timed call compresses), on the peak-LR window of the bundled trace slice.
# Every received bit is checked (the `wrong` column). Needs root, ip, tc; mpirun for the
# 2-node rows (skipped, with a line saying so, without it).
#
#   bench/sim_validate.sh                       # writes target/sim-validate/runs.jsonl
#   RATES="1gbit 2500mbit" NRANKS="2 4" SIZES="4M 16M 64M" MODES=raw,exp-on bench/sim_validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-1gbit 2500mbit}
NRANKS=${NRANKS:-2 4}
SIZES=${SIZES:-4M 16M 64M}
MODES=${MODES:-raw,exp-on}
ITERS=${ITERS:-20}  # timed calls per row (median): the first calls after warm-up run slower
ONE_NODE_RUN=${ONE_NODE_RUN:-1}  # 0: skip the one-node rows
NODES_RUN=${NODES_RUN:-1}        # 0: skip the 2-node rows
OUT=${OUT:-target/sim-validate}
rm -rf "$OUT" && mkdir -p "$OUT/trace"
cargo build --release --quiet --bin ciera
CIERA=$PWD/target/release/ciera
TRACE=${TRACE:-tests/data/olmoe-slice}
for f in "$TRACE"/step_0010[0-2].safetensors; do ln -s "$PWD/$f" "$OUT/trace/"; done
TR=$PWD/$OUT/trace

gbit() { # 2500mbit -> 2.5
    case $1 in
    *gbit) echo "${1%gbit}" ;;
    *mbit) python3 -c "print(${1%mbit} / 1000)" ;;
    *) echo "rate $1: use Ngbit or Nmbit" >&2; exit 2 ;;
    esac
}
# tag FILE NODES RANKS_PER_NODE ALGO RATE: add the run's configuration to perf's JSON rows.
tag() {
    python3 - "$@" <<'PY' >>"$OUT/runs.jsonl"
import json, sys
f, nodes, rpn, algo, rate, trace = sys.argv[1:7]
for line in open(f):
    if line.startswith("{"):
        r = json.loads(line)
        r.update(nodes=int(nodes), ranks_per_node=int(rpn), algo=algo, rate_gbit=float(rate), trace=trace)
        print(json.dumps(r))
PY
}
sizes_args() { # perf takes -b MIN -e MAX -f FACTOR; run each size on its own
    echo "-b $1 -e $1"
}

NS=ciera-simval-$$
# What moving a byte costs this host's cores: one TCP stream on a namespace's loopback (jumbo
# frames, as shaped below) and between two namespaced nodes; unshaped (a stream bound by the
# cores: a byte costs a side 1 / its rate), and shaped to each rate in RATES (bound by the link:
# the cores' busy time per byte, from /proc/stat, less the busy time at rest). Under tbf a byte
# costs the cores more than unshaped (more wake-ups and smaller batches per byte).
probe() { # probe NS_SERVER NS_SENDER HOST OUTFILE
    ip netns exec "$1" python3 bench/tcp_probe.py serve "$3" 5201 >"$4" &
    local p=$!
    sleep 0.5
    ip netns exec "$2" python3 bench/tcp_probe.py send "$3" 5201 2
    wait $p
}
. bench/shaped_lo.sh
loopback_ns() { # loopback_ns [RATE]: the one-node namespace, its loopback shaped to RATE
    shaped_lo_up "$NS" "${1:-}"
    ip netns exec "$NS" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 # as bench/netns_nodes.sh
}
mkdir -p "$OUT/probe"
python3 bench/tcp_probe.py idle 2 >"$OUT/probe/idle.json"
loopback_ns
probe "$NS" "$NS" 127.0.0.1 "$OUT/probe/loopback.json"
ip netns del "$NS"
bench/netns_nodes.sh up 2 >&2
probe ciera-node1 ciera-node0 10.77.0.2 "$OUT/probe/veth.json"
bench/netns_nodes.sh down
for RATE in $RATES; do
    G=$(gbit "$RATE")
    if [ "$ONE_NODE_RUN" = 1 ]; then
        loopback_ns "$RATE"
        probe "$NS" "$NS" 127.0.0.1 "$OUT/probe/loopback@$G.json"
        ip netns del "$NS"
    fi
    if [ "$NODES_RUN" = 1 ]; then
        bench/netns_nodes.sh up 2 "$RATE" >&2
        probe ciera-node1 ciera-node0 10.77.0.2 "$OUT/probe/veth@$G.json"
        bench/netns_nodes.sh down
    fi
done
python3 - "$OUT/probe" >"$OUT/probe.json" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
idle = json.load(open(f"{d}/idle.json"))["busy_per_s"]
out = {
    "loopback_tcp_bps": json.load(open(f"{d}/loopback.json"))["tcp_bps"],
    "veth_tcp_bps": json.load(open(f"{d}/veth.json"))["tcp_bps"],
    "idle_busy_per_s": idle,
    "shaped": [],
}
for f in sorted(glob.glob(f"{d}/*@*.json")):
    link, rate = os.path.basename(f)[:-5].split("@")
    r = json.load(open(f))
    cpu = max(r["busy_s"] - idle * r["seconds"], 0.0) / r["bytes"]
    out["shaped"].append({"link": link, "rate_gbit": float(rate), "tcp_bps": r["tcp_bps"], "cpu_s_per_byte": cpu})
print(json.dumps(out))
PY
cat "$OUT/probe.json" >&2

cleanup() {
    ip netns del "$NS" 2>/dev/null || true
    bench/netns_nodes.sh down >/dev/null 2>&1 || true
}
trap cleanup EXIT
for RATE in $RATES; do
    [ "$ONE_NODE_RUN" = 1 ] || break
    G=$(gbit "$RATE")
    loopback_ns "$RATE"
    for N in $NRANKS; do
        for S in $SIZES; do
            echo "# 1 node, $N ranks, $RATE, $S" >&2
            # shellcheck disable=SC2046
            ip netns exec "$NS" env CIERA_TRANSPORT=tcp "$CIERA" perf --trace "$TR" -n "$N" \
                $(sizes_args "$S") -i "$ITERS" -w 3 --modes "$MODES" --json >"$OUT/run.json"
            tag "$OUT/run.json" 1 "$N" ring "$G" "$TR"
        done
    done
    ip netns del "$NS"
done

if [ "$NODES_RUN" = 1 ] && command -v mpirun >/dev/null 2>&1; then
    for RATE in $RATES; do
        G=$(gbit "$RATE")
        bench/netns_nodes.sh up 2 "$RATE" >&2
        bench/netns_nodes.sh hostfile 2 2 >"$OUT/hostfile"
        for algo in ring hier; do
            for S in $SIZES; do
                echo "# 2 nodes x 2 ranks, $RATE, $algo, $S" >&2
                # shellcheck disable=SC2046
                mpirun --allow-run-as-root --oversubscribe --hostfile "$OUT/hostfile" -np 4 \
                    --mca plm_rsh_agent "$PWD/bench/netns_rsh.sh" \
                    --mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24 \
                    -x CIERA_ROOT=10.77.0.1:29500 \
                    -x "CIERA_SECRET=$(head -c32 /dev/urandom | od -An -tx1 | tr -d ' \n')" \
                    -x CIERA_TIMEOUT=120 -x CIERA_ALGO=$algo \
                    "$CIERA" perf --trace "$TR" $(sizes_args "$S") -i "$ITERS" -w 3 \
                    --modes "$MODES" --json >"$OUT/run.json"
                tag "$OUT/run.json" 2 2 "$algo" "$G" "$TR"
            done
        done
        bench/netns_nodes.sh down >&2
    done
else
    echo "# 2-node rows skipped: NODES_RUN=$NODES_RUN, mpirun $(command -v mpirun || echo missing)" >&2
fi

"$CIERA" sim --validate "$OUT"
