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

__all__ = [
    "AllGather",
    "ProcessGroupCiera",
    "all_gather_into_tensor",
    "attach",
    "dtype_code",
    "register_backend",
]

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


# ---- a torch.distributed backend ---------------------------------------------------------------

from torch._C._distributed_c10d import _create_work_from_future  # noqa: E402
from torch.futures import Future  # noqa: E402


def _done(result):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class ProcessGroupCiera(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose all-gathers run through CIERA and whose
    other collectives run through an inner gloo group on the same store: what
    ``init_process_group("ciera")`` makes after :func:`register_backend`. For code that calls
    ``dist.all_gather_into_tensor`` / ``dist.all_gather`` itself (DeepSpeed ZeRO-3, FSDP2
    without the hook). Tensors are keyed by address (each parameter buffer its own cache);
    results never depend on it. CPU tensors; CUDA ones through CIERA's device path."""

    def __init__(self, store, rank, size, timeout, group_name=None):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
        # The inner gloo group is this group's CPU backend as C++ sees it (what carries the
        # group's name, which device meshes look groups up by); calls made from Python (every
        # dist.* function) reach the methods below first.
        cpu = torch.device("cpu")
        self._register_backend(cpu, dist.ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        if group_name:
            self._set_group_name(group_name)
        key = "ciera/uid"
        if rank == 0:
            from . import unique_id

            store.set(key, unique_id())
        # Every rank reads it back (rank 0 too: one code path).
        self.comm = Communicator(bytes(store.get(key)), size, rank)

    def getBackendName(self):
        return "ciera"

    # All-gathers: CIERA.
    def _allgather_base(self, output, input, opts=None):
        all_gather_into_tensor(self.comm, output, input)
        return _done(output)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for o, i in zip(outputs, inputs):
            all_gather_into_tensor(self.comm, o, i)
        return _done(outputs)

    def allgather(self, output_tensors, input_tensors, opts=None):
        # One input per rank of ours, gathered into a list of world-size tensors.
        for outs, inp in zip(output_tensors, input_tensors):
            if len(outs) != self.comm.size:
                raise ValueError(f"all_gather wants {self.comm.size} output tensors, got {len(outs)}")
            flat = torch.empty((self.comm.size,) + tuple(inp.shape), dtype=inp.dtype, device=inp.device)
            all_gather_into_tensor(self.comm, flat.view(-1), inp.contiguous().view(-1))
            for r, o in enumerate(outs):
                o.copy_(flat[r])
        return _done(output_tensors)

    # Everything else: the inner gloo group.
    def allreduce(self, tensors, opts=dist.AllreduceOptions()):
        return self._gloo.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=dist.AllreduceCoalescedOptions()):
        return self._gloo.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, opts=dist.BroadcastOptions()):
        return self._gloo.broadcast(tensors, opts)

    def reduce(self, tensors, opts=dist.ReduceOptions()):
        return self._gloo.reduce(tensors, opts)

    def reduce_scatter(self, outputs, inputs, opts=dist.ReduceScatterOptions()):
        return self._gloo.reduce_scatter(outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts=dist.ReduceScatterOptions()):
        return self._gloo._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=dist.ReduceScatterOptions()):
        return self._gloo.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def barrier(self, opts=dist.BarrierOptions()):
        return self._gloo.barrier(opts)

    def gather(self, outputs, inputs, opts=dist.GatherOptions()):
        return self._gloo.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts=dist.ScatterOptions()):
        return self._gloo.scatter(outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=dist.AllToAllOptions()):
        return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def send(self, tensors, dst, tag):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._gloo.recv_anysource(tensors, tag)


def register_backend(name="ciera"):
    """Makes ``dist.init_process_group("ciera")`` (or ``name``) give a
    :class:`ProcessGroupCiera` on CPU: all-gathers through CIERA, the rest through gloo."""

    def create(opts, _pg_options):
        return ProcessGroupCiera(opts.store, opts.group_rank, opts.group_size, opts.timeout, opts.group_id)

    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu"])
