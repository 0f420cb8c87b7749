"""CIERA for PyTorch: FSDP2's all-gathers through CIERA.

FSDP2 (``torch.distributed.fsdp.fully_shard``, torch 2.9+) lets each FSDP module choose the
object that runs its parameter all-gather (``FSDPModule.set_custom_all_gather``). Give every
FSDP module of a model its own :class:`AllGather`, each with its own key, and the module's
all-gathers (once in forward, again in backward) find their caches every iteration, whatever
buffer FSDP2 allocates for them::

    import ciera, ciera.torch
    comm = ciera.Communicator.from_torch()      # after dist.init_process_group(...)
    model = ...; fully_shard(...)               # as usual
    ciera.torch.attach(model, comm)             # every FSDP module gathers through CIERA
    ...
    print(comm.stats())                         # calls, wire ratio, hit rate

Keys are given in the order of ``model.modules()``, which every rank walks alike. CPU tensors
are gathered on the host; CUDA tensors through CIERA's device path, ordered on the current
stream as NCCL would. Reduce-scatters and every other collective stay with the process group.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _FSDPAllGather

from . import Communicator

__all__ = ["AllGather", "all_gather_into_tensor", "attach", "dtype_code"]

# torch dtypes CIERA gathers, by NCCL's numbering (what libciera takes).
_CODES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
for _name, _code in (("float8_e4m3fn", 10), ("float8_e5m2", 11)):
    if hasattr(torch, _name):
        _CODES[getattr(torch, _name)] = _code


def dtype_code(dtype):
    """NCCL's number for a torch dtype CIERA gathers; TypeError naming any other."""
    try:
        return _CODES[dtype]
    except KeyError:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in _CODES))
        raise TypeError(f"CIERA cannot gather {dtype} tensors (it gathers {supported})") from None


def all_gather_into_tensor(comm, output, input, key=None):
    """``dist.all_gather_into_tensor`` through CIERA: every rank's ``input`` (same numel and
    dtype everywhere) lands in ``output`` (world size times as many elements), rank r's at
    r * input.numel(). In place when ``input`` is that slice of ``output``. ``key`` names the
    tensor (the same key every iteration) so its cache is found whatever buffer it arrives
    in; results never depend on it. Errors name the problem (TypeError, ValueError)."""
    if not isinstance(output, torch.Tensor) or not isinstance(input, torch.Tensor):
        raise TypeError("output and input must be torch tensors")
    if output.dtype != input.dtype:
        raise TypeError(f"output is {output.dtype} but input is {input.dtype}")
    code = dtype_code(input.dtype)
    for name, t in (("output", output), ("input", input)):
        if not t.is_contiguous():
            raise ValueError(f"{name} tensor is not contiguous (strides {tuple(t.stride())})")
    if output.device != input.device:
        raise ValueError(f"output is on {output.device} but input is on {input.device}")
    if output.device.type not in ("cpu", "cuda"):
        raise ValueError(f"CIERA gathers CPU or CUDA tensors, not {output.device.type} ones")
    if output.numel() != input.numel() * comm.size:
        raise ValueError(
            f"output has {output.numel()} elements; {comm.size} ranks x {input.numel()} input "
            f"elements need {input.numel() * comm.size}"
        )
    stream = 0
    if output.is_cuda:
        stream = torch.cuda.current_stream(output.device).cuda_stream
    comm.all_gather(input.data_ptr(), output.data_ptr(), input.numel(), code, key, stream)


class AllGather(_FSDPAllGather):
    """The all-gather of one FSDP module, for ``FSDPModule.set_custom_all_gather``.

    ``key`` names the module's parameter group; give each module its own (:func:`attach`
    does), the same on every rank."""

    def __init__(self, comm: Communicator, key: int):
        self.comm = comm
        self.key = int(key)

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if group is not None and (group.size() != self.comm.size or group.rank() != self.comm.rank):
            raise ValueError(
                f"FSDP's process group is rank {group.rank()} of {group.size()}, but the CIERA "
                f"communicator is rank {self.comm.rank} of {self.comm.size}: make the "
                "communicator from the same group (Communicator.from_torch(group))"
            )
        all_gather_into_tensor(self.comm, output_tensor, input_tensor, key=self.key)
        # Done (CPU), or ordered on the current stream (CUDA): nothing to wait for.
        return None


# Keys of attach(), apart from those a caller picks for its own tensors.
KEY_BASE = 0xC1E7A << 20


def attach(model, comm: Communicator, first_key: int = KEY_BASE):
    """Gives every FSDP module of ``model`` (``fully_shard`` applied) its own
    :class:`AllGather` with keys ``first_key``, ``first_key + 1``, ... in the order of
    ``model.modules()``. Returns how many modules it attached."""
    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_custom_all_gather(AllGather(comm, first_key + n))
            n += 1
    if n == 0:
        raise ValueError("the model has no FSDP modules (apply fully_shard first)")
    return n
