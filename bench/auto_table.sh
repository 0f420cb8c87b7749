#!/usr/bin/env bash
# `auto` (the configuration users get) against the best fixed mode, per link rate and trace
# window: 4 ranks over TCP on a tbf-shaped loopback at each RATES entry (bench/shaped_compare.sh,
# modes raw, auto, exp-on and full-on taking turns call by call in one run), and unshaped:
# raw and auto over a run of CALLS calls with no warm-up, so auto's fill, probe, calibration
# and trials all count. Prints one table: per cell auto's speed over the best fixed mode's
# (best of raw, exp-on, full-on; unshaped: over raw) and what auto chose. Needs root (netns).
#
#   bench/auto_table.sh                        # 1, 2.5 and 5 Gbit/s, then unshaped
#   RATES=1gbit ITERS=40 bench/auto_table.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RATES=${RATES:-1gbit,2500mbit,5gbit}
ITERS=${ITERS:-20}
WARMUP=${WARMUP:-5}
CALLS=${CALLS:-100}
NRANKS=${NRANKS:-4}
SIZE=${SIZE:-16M}
TRACE=${TRACE:-../shared/traces/olmoe-mini-s0}
[[ -d $TRACE ]] || TRACE=tests/data/olmoe-slice
OUT=${OUT:-$(mktemp -d /tmp/ciera-auto.XXXXXX)}
mkdir -p "$OUT"
cargo build --release --quiet --bin ciera >&2
CIERA=$(realpath "${CARGO_TARGET_DIR:-target}/release/ciera")

IFS=, read -ra rates <<<"$RATES"
for r in "${rates[@]}"; do
    echo "# $r ..." >&2
    RATE=$r NRANKS=$NRANKS SIZE=$SIZE ITERS=$ITERS WARMUP=$WARMUP TRACE=$TRACE \
        MODES=raw,auto,exp-on,full-on OUT="$OUT/$r" bench/shaped_compare.sh >"$OUT/$r.txt"
done
echo "# unshaped ..." >&2
CIERA_TRANSPORT=tcp "$CIERA" perf --trace "$TRACE" -n "$NRANKS" -b "$SIZE" -e "$SIZE" \
    -i "$CALLS" -w 0 --modes raw,auto --json >"$OUT/unshaped.json"

python3 - "$OUT" "$RATES" <<'PY'
import json, os, sys
out, rates = sys.argv[1], sys.argv[2].split(",")
def rows(path):
    return [json.loads(l) for l in open(path) if l.startswith("{")]
def table(rs, fixed):
    best, chose = {}, {}
    for r in rs:
        k = (r["window"], r["mode"])
        if k not in best or r["time_us"] < best[k]:
            best[k] = r["time_us"]
        if r["mode"] == "auto":
            chose[r["window"]] = r.get("chose", "?")
    wins = sorted({w for w, _ in best}, key=lambda w: int(w.split("-")[0]))
    cells = {}
    for w in wins:
        f = min((best[(w, m)], m) for m in fixed if (w, m) in best)
        cells[w] = (f[0] / best[(w, "auto")], f[1], chose.get(w, "?"))
    return wins, cells
cols = [(r, table(rows(os.path.join(out, r, "ours.json")), ["raw", "exp-on", "full-on"]))
        for r in rates]
cols.append(("unshaped", table(rows(os.path.join(out, "unshaped.json")), ["raw"])))
wins = cols[0][1][0]
wrong = sum(r["wrong"] for r in rows(os.path.join(out, "unshaped.json")))
wrong += sum(r["wrong"] for c in rates for r in rows(os.path.join(out, c, "ours.json")))
print("# auto's speed / the best fixed mode's (raw, exp-on, full-on; unshaped: raw over the")
print("# whole run, trials included); the best fixed mode in brackets")
print(f"{'window':>9} " + " ".join(f"{c:>20}" for c, _ in cols))
ok = True
for w in wins:
    cells = []
    for _, (_, t) in cols:
        v, m, _ = t.get(w, (float("nan"), "?", ""))
        ok &= v >= 0.95
        cells.append(f"{v:.2f} ({m})")
    print(f"{w:>9} " + " ".join(f"{c:>20}" for c in cells))
print("# what auto chose:")
for c, (_, t) in cols:
    for w in wins:
        print(f"#   {c} {w}: {t.get(w, (0, 0, '?'))[2]}")
print(f"# every cell >= 0.95: {'yes' if ok else 'no'}; wrong elements: {wrong}")
PY
echo "# raw outputs in $OUT" >&2
