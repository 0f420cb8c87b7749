"""A small Mixture-of-Experts transformer trained with FSDP2, its all-gathers through CIERA
(``--comm ciera``) or the process group (``--comm gloo``), on CPU.

    torchrun --nproc-per-node 2 python/examples/fsdp2_moe.py --comm ciera --steps 20

``--comm ciera-backend`` instead registers CIERA as a torch.distributed backend and uses it
as the default process group: FSDP2's own all-gathers then reach CIERA without the hook.

Byte-level language model on a bundled text (the repository's ARCHITECTURE.md): token
embedding, causal self-attention, and a top-2-of-4-experts MoE feed-forward per layer. FSDP2
shards every block and the root; MixedPrecisionPolicy gathers bf16 parameters (fp32 master
weights, fp32 gradient reduction), which is what CIERA compresses. Each rank trains on its
own slice of every batch.

Prints, from rank 0, one line per step ("step N loss X" with the loss's exact float), and
from every rank a SHA-256 of its final parameter shards and, with CIERA, its statistics as
JSON. The same seed gives the same bits with either --comm: CIERA's all-gather is lossless.
"""

import argparse
import ctypes
import hashlib
import json
import os
import struct
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    """Top-k routing over `experts` experts; each token's output is the gate-weighted sum of
    its k experts' outputs."""

    def __init__(self, d, h, experts, k):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))
        self.k = k

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        gates = F.softmax(self.router(flat), dim=-1)
        weight, index = gates.topk(self.k, dim=-1)
        weight = weight / weight.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = index == e  # (tokens, k)
            rows = hit.any(dim=-1).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                # Keep every expert in the graph, so every rank's gradients cover the same
                # parameters.
                out = out + 0.0 * expert(flat[:1]).sum()
                continue
            w = (weight * hit).sum(dim=-1)[rows].unsqueeze(-1)
            out = out.index_add(0, rows, w * expert(flat[rows]))
        return out.reshape(b, t, d)


class Block(nn.Module):
    def __init__(self, d, heads, h, experts, k):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoE(d, h, experts, k)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.moe(self.ln2(x))


class Model(nn.Module):
    def __init__(self, vocab, d, layers, heads, h, experts, k, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, h, experts, k) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def corpus():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "ARCHITECTURE.md")
    with open(path, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


class TimedAllGather:
    """Times another FSDP2 all-gather (CIERA's, or the process group's as FSDP2 runs it by
    default), so both runs report all-gather time per step the same way."""

    def __init__(self, inner, clock):
        self.inner, self.clock = inner, clock

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        t0 = time.perf_counter()
        work = self.inner(output_tensor, input_tensor, group, async_op=False)
        self.clock[0] += time.perf_counter() - t0
        return work


def say(line):
    """One line in one write, so the ranks' lines never interleave."""
    os.write(1, (line + "\n").encode())


def params_digest(model):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        raw = local.detach().contiguous().view(torch.uint8)
        h.update(name.encode())
        h.update(ctypes.string_at(raw.data_ptr(), raw.numel()))  # no numpy needed
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--comm",
        choices=("ciera", "gloo", "ciera-backend"),
        default="ciera",
        help="ciera: FSDP2's all-gather hook; ciera-backend: init_process_group('ciera'), "
        "whose all-gathers are CIERA's and the rest gloo's",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--time-gathers", action="store_true", help="time every all-gather (bench)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    if args.comm == "ciera-backend":
        import ciera.torch

        ciera.torch.register_backend()
        dist.init_process_group("ciera")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)
    model = Model(256, args.dim, args.layers, 4, 2 * args.dim, args.experts, 2, args.ctx)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    comm = None
    if args.comm == "ciera":
        import ciera
        import ciera.torch

        comm = ciera.Communicator.from_torch()
        ciera.torch.attach(model, comm)
    gather_clock = [0.0]
    if args.time_gathers:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        for m in model.modules():
            if isinstance(m, FSDPModule):
                inner = m._get_fsdp_state()._fsdp_param_group._all_gather_comm
                m.set_custom_all_gather(TimedAllGather(inner or DefaultAllGather(), gather_clock))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    data = corpus()
    gen = torch.Generator().manual_seed(args.seed + 1)
    t_steps = 0.0
    for step in range(args.steps):
        # The same global batch on every rank; each trains on its own slice.
        starts = torch.randint(0, data.numel() - args.ctx - 1, (world * args.batch,), generator=gen)
        mine = starts[rank * args.batch : (rank + 1) * args.batch]
        x = torch.stack([data[s : s + args.ctx] for s in mine])
        y = torch.stack([data[s + 1 : s + args.ctx + 1] for s in mine])
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        t_steps += time.perf_counter() - t0
        # The mean loss over ranks, exactly as every rank computes it.
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            bits = struct.unpack("<I", struct.pack("<f", total.item() / world))[0]
            say(f"step {step} loss {total.item() / world!r} bits {bits:08x}")
    say(f"rank {rank} params {params_digest(model)}")
    gathers = f", all-gathers {1e3 * gather_clock[0] / args.steps:.1f} ms" if args.time_gathers else ""
    say(f"rank {rank} time per step {1e3 * t_steps / args.steps:.1f} ms{gathers}")
    if args.comm == "ciera-backend":
        comm = dist.distributed_c10d._get_default_group().comm
    if comm is not None:
        say(f"rank {rank} ciera {json.dumps(comm.stats(), sort_keys=True)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
