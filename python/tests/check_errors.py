"""Bad input to ciera.torch gives a Python exception naming the problem, never a crash or a
wrong tensor; a good call on one rank is exact. Run by tests/torch_fsdp.rs; prints
"check_errors: OK N checks"."""

import torch

import ciera
import ciera.torch as ct

comm = ciera.Communicator(ciera.unique_id(), 1, 0)
checks = 0


def expect(exc, needle, f):
    global checks
    try:
        f()
    except exc as e:
        assert needle in str(e), f"{exc.__name__} {e!r} does not mention {needle!r}"
        checks += 1
        return
    raise AssertionError(f"no {exc.__name__} mentioning {needle!r}")


gather = ct.all_gather_into_tensor
c64 = torch.zeros(4, dtype=torch.complex64)
expect(TypeError, "complex64", lambda: gather(comm, c64, c64))
expect(TypeError, "bool", lambda: gather(comm, torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)))
expect(TypeError, "bfloat16", lambda: gather(comm, torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)))
expect(ValueError, "elements", lambda: gather(comm, torch.zeros(5), torch.zeros(4)))
expect(ValueError, "input tensor is not contiguous", lambda: gather(comm, torch.zeros(4), torch.zeros(4, 2)[:, 0]))
expect(ValueError, "output tensor is not contiguous", lambda: gather(comm, torch.zeros(8)[::2], torch.zeros(4)))
expect(TypeError, "torch tensors", lambda: gather(comm, [0.0], torch.zeros(1)))
# The native layer checks what it is handed, whatever the Python side let through.
buf = torch.zeros(16)
p = buf.data_ptr()
expect(ValueError, "overlaps", lambda: comm.all_gather(p + 8, p, 4, 7))
expect(ValueError, "NULL", lambda: comm.all_gather(0, p, 4, 7))
expect(TypeError, "dtype code 99", lambda: comm.all_gather(p, p, 4, 99))
expect(ValueError, "unique id has", lambda: ciera.Communicator(b"short", 1, 0))
expect(ValueError, "rank 3 of 2", lambda: ciera.Communicator(ciera.unique_id(), 2, 3))
# A good call, out of place and in place, bit for bit (NaN payloads and -0.0 included).
x = torch.tensor([1.5, -0.0, float("nan"), 3e38], dtype=torch.float32)
x.view(torch.int32)[2] = 0x7FC12345
out = torch.empty(4)
gather(comm, out, x)
assert torch.equal(out.view(torch.int32), x.view(torch.int32)), (out, x)
y = x.clone()
gather(comm, y, y)
assert torch.equal(y.view(torch.int32), x.view(torch.int32))
checks += 2
assert comm.async_error() is None
print(f"check_errors: OK {checks} checks")
