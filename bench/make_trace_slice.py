#!/usr/bin/env python3
"""Cut the small real-trace slice bundled in tests/data/olmoe-slice from a full trace.

Keeps, for 4 windows of 3 consecutive steps (warm-up, peak LR, mid decay, end of schedule),
the first 96 rows of attn.qkv and the first 48 rows of expert 0 of experts.w1, as fp32 and
bf16, exactly as stored in the trace (no re-casting). Standard library only.

usage: bench/make_trace_slice.py [TRACE_DIR] [OUT_DIR]
       bench/make_trace_slice.py --whole TENSOR TRACE_DIR OUT_DIR
The second form keeps one tensor (e.g. layers.1.attn.qkv.bf16), whole, from every step of the
trace: a small copy of the full windows for a machine that lacks the trace (the device run,
bench/gpu_check.sh shaped).
"""
import json, os, struct, sys

args = sys.argv[1:]
WHOLE = None
if args[:1] == ["--whole"]:
    if len(args) != 4:
        sys.exit(__doc__)
    WHOLE, args = args[1], args[2:]
SRC = args[0] if len(args) > 0 else os.path.join(os.path.dirname(__file__), "../../shared/traces/olmoe-mini-s0")
OUT = args[1] if len(args) > 1 else os.path.join(os.path.dirname(__file__), "../tests/data/olmoe-slice")
STEPS = [0, 1, 2, 100, 101, 102, 300, 301, 302, 597, 598, 599]
# tensor -> number of leading elements to keep (row-major prefix)
KEEP = {"layers.1.attn.qkv": (96, 128), "layers.1.experts.w1": (48, 256)}
SIZE = {"F32": 4, "BF16": 2}
if WHOLE:
    STEPS = sorted(int(f[5:10]) for f in os.listdir(SRC)
                   if f.startswith("step_") and f.endswith(".safetensors"))

def read(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]

os.makedirs(OUT, exist_ok=True)
for step in STEPS:
    hdr, data = read(os.path.join(SRC, f"step_{step:05d}.safetensors"))
    out_hdr, blobs, off = {"__metadata__": dict(hdr.get("__metadata__", {}), source="olmoe-mini-s0 slice")}, [], 0
    for name in sorted(k for k in hdr if k != "__metadata__"):
        base, suffix = name.rsplit(".", 1)
        t = hdr[name]
        if WHOLE:
            if name != WHOLE:
                continue
            shape = t["shape"]
            nbytes = t["data_offsets"][1] - t["data_offsets"][0]
        elif base in KEEP:
            shape = list(KEEP[base])
            nbytes = shape[0] * shape[1] * SIZE[t["dtype"]]
        else:
            continue
        s = t["data_offsets"][0]
        blobs.append(data[s:s + nbytes])
        out_hdr[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [off, off + nbytes]}
        off += nbytes
    h = json.dumps(out_hdr, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(OUT, f"step_{step:05d}.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
print(f"wrote {len(STEPS)} snapshots to {OUT}")
