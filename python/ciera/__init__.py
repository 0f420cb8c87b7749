"""CIERA: a lossless, cross-iteration compressed Allgather for sharded training.

Every rank caches what it received last iteration; a sender ships only what changed, and the
receivers rebuild every tensor bit for bit. This package is the Python face of libciera:

- :class:`Communicator`: a CIERA communicator (``Communicator.from_torch()`` joins the
  processes of a ``torch.distributed`` process group, no launcher of its own needed).
- :mod:`ciera.torch`: ``AllGather``, the object FSDP2's ``set_custom_all_gather`` hook takes,
  and :func:`ciera.torch.attach`, which gives every FSDP2 module of a model its own.

Configuration comes from the environment, as for every CIERA communicator (``CIERA_COMPRESS``,
``CIERA_TRANSPORT``, ``CIERA_CACHE_MB``, ...; see the repository's README).
"""

from ._ciera import UNIQUE_ID_BYTES, unique_id
from ._ciera import Communicator as _NativeCommunicator

__all__ = ["Communicator", "unique_id", "UNIQUE_ID_BYTES"]


class Communicator(_NativeCommunicator):
    """A communicator of ``nranks`` processes, this one ``rank``, all passing the same
    ``unique_id`` (bytes from :func:`unique_id`, made by one of them)."""

    @classmethod
    def from_torch(cls, group=None, store=None, tag="default"):
        """Joins the processes of a ``torch.distributed`` process group (default: the world).

        Rank 0 of the group makes the unique id and hands it to the others through
        ``store`` (default: the default process group's store), under a key made of ``tag``
        and the group's ranks; every rank of the group must call this, with the same tag.
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
        rank = dist.get_rank(group)
        nranks = dist.get_world_size(group)
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(nranks))
        key = "ciera/uid/%s/%s" % (tag, ",".join(str(r) for r in ranks))
        if rank == 0:
            uid = unique_id()
            store.set(key, uid)
        else:
            uid = bytes(store.get(key))
        return cls(uid, nranks, rank)
