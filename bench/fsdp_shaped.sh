#!/usr/bin/env bash
# FSDP2 training of python/examples/fsdp2_moe.py over a slow network, gloo's all-gathers against
# CIERA's: a network namespace whose loopback is shaped with tbf (default 1 Gbit/s), torchrun
# inside it, gloo over TCP for everything but the all-gathers, CIERA over TCP for those
# (CIERA_TRANSPORT=tcp, so the ranks do not use shared memory). Prints per run the time per
# step and the all-gather time per step (slowest rank), CIERA's wire ratio, and whether the two
# runs' losses and parameters are bit-identical. Needs root (ip netns, tc) and torch in .venv.
#
#   bench/fsdp_shaped.sh [RANKS (2)] [RATE (1gbit)] [STEPS (12)] [extra example args...]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-2}
RATE=${2:-1gbit}
STEPS=${3:-12}
shift $(($# < 3 ? $# : 3))
ARGS=(--dim 256 --layers 2 --experts 8 --batch 2 --steps "$STEPS" --time-gathers "$@")
PY=${CIERA_VENV:-.venv}/bin
OUT=target/fsdp-bench
rm -rf "$OUT" && mkdir -p "$OUT/pkg/ciera"
cargo build --release --quiet -p ciera-python
cp python/ciera/*.py "$OUT/pkg/ciera/"
cp target/release/lib_ciera.so "$OUT/pkg/ciera/_ciera.abi3.so"
NS=ciera-fsdp-$$
ip netns add "$NS"
trap 'ip netns del "$NS" 2>/dev/null || true' EXIT
ip netns exec "$NS" ip link set lo up
ip netns exec "$NS" ip link set lo mtu 9000
ip netns exec "$NS" tc qdisc add dev lo root tbf rate "$RATE" burst 64kb latency 10ms
echo "# $N ranks, loopback shaped to $RATE; fsdp2_moe.py ${ARGS[*]}"
for comm in gloo ciera; do
    ip netns exec "$NS" env PYTHONPATH="$PWD/$OUT/pkg" OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo \
        CIERA_TRANSPORT=tcp "$PY/torchrun" --standalone --nproc-per-node "$N" \
        python/examples/fsdp2_moe.py --comm "$comm" "${ARGS[@]}" >"$OUT/$comm.out" 2>"$OUT/$comm.err"
done
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
runs = {c: open(f"{out}/{c}.out").read().splitlines() for c in ("gloo", "ciera")}
def outcome(lines):
    return sorted(l for l in lines if l.startswith("step ") or " params " in l)
def slowest(lines, pat):
    v = [float(m.group(1)) for l in lines for m in [re.search(pat, l)] if m]
    return max(v) if v else float("nan")
print("| run | time per step ms | all-gathers per step ms | wire ratio |")
print("|---|---|---|---|")
t = {}
for c, lines in runs.items():
    step = slowest(lines, r"time per step ([0-9.]+) ms")
    ag = slowest(lines, r"all-gathers ([0-9.]+) ms")
    t[c] = (step, ag)
    ratio = [json.loads(l.split(" ciera ", 1)[1])["ratio"] for l in lines if " ciera {" in l]
    print(f"| {c} | {step:.1f} | {ag:.1f} | {min(ratio):.2f} |" if ratio else f"| {c} | {step:.1f} | {ag:.1f} | - |")
print(f"step time gloo/ciera {t['gloo'][0] / t['ciera'][0]:.2f}x, all-gather time gloo/ciera {t['gloo'][1] / t['ciera'][1]:.2f}x")
same = outcome(runs["gloo"]) == outcome(runs["ciera"]) and outcome(runs["gloo"])
print("losses and parameters bit-identical:", "yes" if same else "NO")
sys.exit(0 if same else 1)
PY
