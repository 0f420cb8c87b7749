"""Weights that drift as in training, gathered by mpi4py with fresh numpy arrays every step (what
an mpi4py program does: nothing stays at one address), run under libciera_mpi.so by
tests/capi_mpi.rs. Every gathered tensor must be bit-exact: fp32 out of place, the same values'
high halves as bf16 (MPI_UINT16_T with CIERA_MPI_16BIT=bf16), and fp32 in place.

    mpirun -np 3 -x LD_PRELOAD=.../libciera_mpi.so python3 tests/py/mpi4py_drift.py [COUNT] [STEPS]
"""
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
count = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20


def initial(r):
    rng = np.random.default_rng(1000 + r)
    return (rng.standard_normal(count) * 0.02).astype(np.float32)


def step_of(w, r, step):
    # AdamW near peak learning rate: every weight moves by about lr, so most keep their
    # exponent and many move by a few ulps.
    rng = np.random.default_rng([r, step])
    update = np.sign(rng.standard_normal(count)).astype(np.float32) * np.float32(1e-4)
    return (w - update).astype(np.float32)


weights = [initial(r) for r in range(n)]
wrong = 0
for step in range(steps):
    weights = [step_of(w, r, step) for r, w in enumerate(weights)]
    want = np.concatenate(weights)

    send = weights[rank].copy()  # a fresh send array every step
    recv = np.empty(n * count, dtype=np.float32)  # and a fresh output
    comm.Allgather([send, MPI.FLOAT], [recv, MPI.FLOAT])
    wrong += recv.view(np.uint32).tobytes() != want.view(np.uint32).tobytes()

    high = (want.view(np.uint32) >> 16).astype(np.uint16)
    send16 = high[rank * count:(rank + 1) * count].copy()
    recv16 = np.empty(n * count, dtype=np.uint16)
    comm.Allgather([send16, MPI.UINT16_T], [recv16, MPI.UINT16_T])
    wrong += recv16.tobytes() != high.tobytes()

    inplace = np.empty(n * count, dtype=np.float32)
    inplace[rank * count:(rank + 1) * count] = weights[rank]
    comm.Allgather(MPI.IN_PLACE, [inplace, MPI.FLOAT])
    wrong += inplace.view(np.uint32).tobytes() != want.view(np.uint32).tobytes()

verdict = "OK" if wrong == 0 else "WRONG"
print(f"mpi4py_drift rank {rank}: {verdict} {3 * steps} allgathers, {wrong} wrong", flush=True)
