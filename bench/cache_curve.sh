#!/usr/bin/env bash
# Wire ratio and speedup against the cache budget (CIERA_CACHE_MB), on a model: every iteration
# gathers LAYERS layers of every bf16 tensor of one window of the trace, one after another, each
# its own tensor and caches (`ciera perf --trace --layers`), so the caches' demand is the sum
# over all of them. NRANKS ranks talk TCP over a loopback shaped with tbf (bench/shaped_lo.sh)
# at each RATE; raw and MODE (default auto: what users get) take turns iteration by iteration in
# one run per budget, so every speedup is a ratio measured in the same run. Budgets are
# fractions of the full-value caches' demand (integer MiB; "unlimited" = 4096, the default).
# Every bit is checked. Prints, per rate and budget: the budget, the caches' peak bytes, the
# cache modes the tensors' policies hold, the misses (sources whose cache had been evicted:
# they send FILL frames), the timed calls that sent frames (the others went raw), the wire ratio, the time per call and per iteration, and the speedup
# over raw (median of REPEAT runs, and their min-max). Needs root (ip netns, tc).
#
#   bench/cache_curve.sh
#   RATES="1gbit 5gbit" REPEAT=2 LAYERS=8 SIZE=4M WINDOW=100 bench/cache_curve.sh
#   FRACTIONS="0 0.5 1" MODE=full bench/cache_curve.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-1gbit}
NRANKS=${NRANKS:-4}
LAYERS=${LAYERS:-8}
SIZE=${SIZE:-4M}          # gathered per layer, split among its tensors as the trace's
ITERS=${ITERS:-8}
WARMUP=${WARMUP:-10}      # fill, raw probe, the frame levels, the exponent-cache trial
REPEAT=${REPEAT:-2}
MODE=${MODE:-auto}
FRACTIONS=${FRACTIONS:-0 0.125 0.25 0.5 0.75 1 1.5 unlimited}
TRACE=${TRACE:-../shared/traces/olmoe-mini-s0}
[[ -d $TRACE ]] || TRACE=tests/data/olmoe-slice
WINDOW=${WINDOW:-100}     # the first step of the window replayed (100: peak learning rate)
OUT=${OUT:-$(mktemp -d /tmp/ciera-cache-curve.XXXXXX)}
mkdir -p "$OUT"
NS=ciera-cache-$$

cargo build --release --quiet --bin ciera >&2
TARGET=${CARGO_TARGET_DIR:-target}
CIERA=$(realpath "$TARGET/release/ciera")

# One window of the trace: its consecutive steps from WINDOW on.
SLICE="$OUT/trace"
mkdir -p "$SLICE"
TRACE=$(realpath "$TRACE")
for ((s = WINDOW; ; s++)); do
    f=$(printf '%s/step_%05d.safetensors' "$TRACE" "$s")
    [[ -f $f ]] || break
    ln -sf "$f" "$SLICE/"
done
(($(ls "$SLICE" | wc -l) >= 2)) || { echo "no two consecutive steps from $WINDOW in $TRACE" >&2; exit 2; }

# The full-value caches' demand (MiB): what the budgets are fractions of.
FULL=$("$CIERA" perf --trace "$SLICE" -n "$NRANKS" --layers "$LAYERS" -b "$SIZE" -e "$SIZE" \
    -i 1 -w 0 --modes raw --json | python3 -c 'import json,sys; print(json.loads(sys.stdin.readline())["demand_full"] / 2**20)')
BUDGETS=$(python3 -c "import sys; print(' '.join('4096' if f == 'unlimited' else str(round(float(f) * $FULL)) for f in sys.argv[1:]))" $FRACTIONS)
echo "# $NRANKS ranks, $LAYERS layers x $SIZE, window $WINDOW of $TRACE; full-value demand $FULL MiB; budgets (MiB): $BUDGETS; out $OUT" >&2

. bench/shaped_lo.sh
trap 'shaped_lo_down "$NS"' EXIT
for rate in $RATES; do
    shaped_lo_up "$NS" "$rate"
    for ((r = 1; r <= REPEAT; r++)); do
        for mb in $BUDGETS; do
            ip netns exec "$NS" env CIERA_TRANSPORT=tcp CIERA_CACHE_MB="$mb" "$CIERA" perf \
                --trace "$SLICE" -n "$NRANKS" --layers "$LAYERS" -b "$SIZE" -e "$SIZE" \
                -i "$ITERS" -w "$WARMUP" --modes "raw,$MODE" --json |
                python3 -c 'import json,sys
for l in sys.stdin:
    if l.startswith("{"):
        o = json.loads(l); o["rate"] = sys.argv[1]; o["repeat"] = int(sys.argv[2]); print(json.dumps(o))' \
                    "$rate" "$r" >>"$OUT/rows.json"
            echo "# $rate run $r budget $mb MiB done $(date -u +%H:%M:%S)" >&2
        done
    done
    shaped_lo_down "$NS"
done

python3 - "$OUT/rows.json" "$MODE" <<'PY'
import json, sys, statistics as st
rows = [json.loads(l) for l in open(sys.argv[1])]
mode = sys.argv[2]
MIB = 2**20
r0 = rows[0]
print(f"# {r0['nranks']} ranks, {r0['layers']} layers x {len(r0['tensors'])} {r0['type']} tensors "
      f"({r0['size'] / MIB:.0f} MiB gathered per iteration in {r0['layers'] * len(r0['tensors'])} calls), window {r0['window']}")
print(f"# caches needed on every rank: full {r0['demand_full'] / MIB:.1f} MiB, "
      f"delta {r0['demand_delta'] / MIB:.1f} MiB, exp {r0['demand_exp'] / MIB:.1f} MiB")
print(f"# mode {mode} vs raw in the same run; times: mean over timed iterations of the slowest rank;"
      f" median of {len({r['repeat'] for r in rows})} runs [min-max]; cache MiB: peak, largest of the runs;"
      f" caches: how many tensors' policies hold each cache mode at the end of the last run")
wrong = sum(r["wrong"] for r in rows)
for rate in dict.fromkeys(r["rate"] for r in rows):
    print(f"\n## {rate}")
    print(f"{'budget MiB':>10} {'x full':>6} {'cache MiB':>9} {'caches (last run)':>22} {'misses':>7} {'framed':>7} {'wire':>5} "
          f"{'raw ms/it':>9} {mode + ' ms/it':>10} {mode + ' us/call':>12} {'speedup':>20}")
    by_budget = {}
    for r in rows:
        if r["rate"] == rate:
            by_budget.setdefault(r["cache_budget"], {}).setdefault(r["repeat"], {})[r["mode"]] = r
    for budget in sorted(by_budget):
        reps = [v for v in by_budget[budget].values() if "raw" in v and mode in v]
        ours = [v[mode] for v in reps]
        sp = [v["raw"]["time_us"] / v[mode]["time_us"] for v in reps]
        med = lambda xs: st.median(xs)
        rng = lambda xs, f: f"[{f(min(xs))}-{f(max(xs))}]"
        unlimited = budget >= 4096 * MIB
        label = "unlimited" if unlimited else f"{budget / MIB:.0f}"
        frac = "-" if unlimited else f"{budget / r0['demand_full']:.2f}"
        caches = ", ".join(sorted((ours[-1]["chose"] or "-").split(", ")))
        print(f"{label:>10} {frac:>6} "
              f"{max(o['cache_bytes_peak'] for o in ours) / MIB:>9.1f} {caches:>22} "
              f"{med([o['misses'] for o in ours]):>7.0f} "
              f"{med([o['compressed_calls'] for o in ours]):>3.0f}/{ours[0]['timed_calls']:<3} "
              f"{med([o['wire_ratio'] for o in ours]):>5.2f} "
              f"{med([v['raw']['time_us'] for v in reps]) / 1e3:>9.1f} {med([o['time_us'] for o in ours]) / 1e3:>10.1f} "
              f"{med([o['call_us'] for o in ours]):>12.0f} "
              f"{med(sp):>6.2f}x {rng(sp, lambda x: f'{x:.2f}'):>13}")
print(f"\n# wrong elements: {wrong}")
PY
echo "# rows in $OUT/rows.json" >&2
