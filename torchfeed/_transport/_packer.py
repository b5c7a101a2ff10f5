"""The worker's side of the shared-memory transport: packing a batch into a
slot, and the payloads that carry a batch without one.

A packed batch is a tuple ``(worker_id, slot_idx, slot_uid, offset, capacity,
pickle_bytes, leaf_descriptors)``: a few hundred bytes, whatever the batch
size. A batch that finds every slot of its worker's pool held by the consumer
(``max_slots_per_worker`` batches kept, as ``list(loader)`` keeps them) is sent
``Inline``: its leaves travel inside the message and live in the main
process's own memory, so keeping thousands of batches costs no shared memory
and no file descriptor per batch. A batch that cannot have a slot for lack of
shared memory (budget exhausted, allocation failed) is sent as ``Plain(batch)``
through torch's own reductions instead, with the one warning that says why.
"""

from __future__ import annotations

import os
from typing import Protocol

import numpy as np
import torch

from . import _layout, _slots, _space
from ._collate import DirectCollate, is_default_collate


class PoolSettings(Protocol):
    """What a packer reads from its channel (``_shm.ShmChannel``, which
    imports this module: the channel is named by what it provides)."""

    num_workers: int
    budget: int
    budget_source: str
    max_slots: int
    idle_batches: int

    def generation(self, worker_id: int) -> int: ...


class ShmFallbackWarning(UserWarning):
    """Some batches went through torch's transport for lack of shared memory.

    Warned once per iterator, with what was asked, what the budget allows and
    how to raise it (``TORCHFEED_SHM_LIMIT``) or silence it (``transport="torch"``);
    filter it by this category, ``torchfeed.ShmFallbackWarning``.
    """


class Plain:
    """A batch sent through torch's own reductions, and the reason, if it needs saying."""

    __slots__ = ("batch", "warning")

    def __init__(self, batch, warning=None):
        self.batch = batch
        self.warning = warning

    def __reduce__(self):
        return (Plain, (self.batch, self.warning))


class Inline:
    """A batch carried inside its message: its pickle, its leaf descriptors and
    ``buf``, a bytearray holding every leaf at the descriptors' offsets."""

    __slots__ = ("data", "descs", "buf")

    def __init__(self, data, descs, buf):
        self.data, self.descs, self.buf = data, descs, buf

    def __reduce__(self):
        return (Inline, (self.data, self.descs, self.buf))


class _BufferSlot:
    """A bytearray dressed as a slot, for ``_layout.copy_leaves``."""

    def __init__(self, nbytes):
        self.buf = bytearray(-(-nbytes // _layout.ALIGN) * _layout.ALIGN)
        self.arr = np.frombuffer(self.buf, np.uint8)
        self._u8 = torch.from_numpy(self.arr) if nbytes else None

    def typed(self, dtype):
        return self._u8.view(dtype)

    def write(self, off: int, data) -> None:
        self.arr[off:off + data.nbytes] = data


class Packer:
    """Worker side: writes batches into this worker's slots."""

    # A tuple from pack() is a message of plain data (ints, bytes, tuples),
    # never the user's batch: the worker may pickle it with pickle's C pickler.
    plain_tuples = True

    def __init__(self, worker_id: int, fd, channel: PoolSettings, owns_fd: bool):
        self.worker_id = worker_id
        self._fd = fd if owns_fd else None
        self._num_workers = channel.num_workers
        self._warned = False
        self.pool = None
        if fd is not None:
            self.pool = _slots.WorkerPool(fd, channel.budget // max(1, channel.num_workers),
                                          channel.max_slots, channel.idle_batches,
                                          channel.generation(worker_id))
            self._channel_budget = (channel.budget, channel.budget_source)
        self._collate = DirectCollate(self.pool)

    def choose_collate(self, collate_fn):
        """The collate function this worker should call: for torch's
        ``default_collate``, a ``DirectCollate`` (same result, stacked straight
        into a slot); any other function unchanged."""
        if self.pool is not None and is_default_collate(collate_fn):
            return self._collate
        return collate_fn

    def collate(self, samples):
        """``default_collate(samples)``, with tensors stacked straight into a slot."""
        return self._collate(samples)

    def pack(self, batch):
        """The message that carries ``batch`` to the main process."""
        reserved = self._collate.slot
        try:
            return self._pack(batch)
        finally:
            if reserved is not None and self.pool is not None:
                states = self.pool.states
                if states[reserved.idx] == _slots.FILLING:  # not the slot that was sent
                    states[reserved.idx] = _slots.FREE

    def _pack(self, batch):
        c = self._collate
        reserved, c.slot = c.slot, None
        direct, c.direct = c.direct, {}
        if self.pool is None:
            return Plain(batch)
        if reserved is not None:
            p = _layout.dump(batch, c.used, direct)
        else:
            p = _layout.dump(batch)
        need = p.end
        if reserved is not None and need <= reserved.cap:
            slot = reserved
            _layout.copy_leaves(p.leaves, slot)
            self.pool.counters[_slots.C_DIRECT] += c.used
        else:
            slot, no_slot = self.pool.acquire(need, exclude=reserved)
            if slot is None and no_slot.kind == "pool":
                # The consumer holds every slot: the batch goes in the message.
                if reserved is not None:
                    p = _layout.dump(batch, 0, direct, copy_direct=True)
                inline = _BufferSlot(p.end)
                _layout.copy_leaves(p.leaves, inline)
                self.pool.counters[_slots.C_FALLBACKS] += 1
                return Inline(p.data, p.descs, inline.buf)
            if slot is None:
                # The batch leaves through torch's reductions, later, from the
                # queue's feeder thread: it must not point into a slot this
                # worker may reuse meanwhile.
                for t, _ in direct.values():
                    t.set_(t.clone())
                self.pool.counters[_slots.C_FALLBACKS] += 1
                return Plain(batch, self._warning(no_slot))
            if reserved is not None:  # the batch outgrew the reserved slot: copy it all
                p = _layout.dump(batch, 0, direct, copy_direct=True)
            _layout.copy_leaves(p.leaves, slot)
        c.expected_nbytes = need
        pool = self.pool
        pool.states[slot.idx] = _slots.IN_FLIGHT
        pool.let_go_of_tail(slot)
        pool.counters[_slots.C_PACKED] += 1
        return (self.worker_id, slot.idx, slot.uid, slot.off, slot.cap, p.data, p.descs)

    def _warning(self, no_slot: _slots.NoSlot):
        """The one warning for this worker's first shortage of shared memory.

        A full pool is not a shortage and never gets here: the batch goes
        ``Inline`` quietly (``stats()["fallbacks"]`` counts it).
        """
        kind = no_slot.kind
        if self._warned:
            return None
        self._warned = True
        w = self.worker_id
        source = self._channel_budget[1]
        if kind == "budget":
            check = _space.SpaceCheck(
                False, no_slot.pool_bytes, self.pool.budget,
                f"{source}, split evenly across {self._num_workers} workers",
                _space.dev_shm_free())
            return check.message(f"worker {w}'s slots (batches of {_space.human(no_slot.batch_bytes)})")
        return (f"torchfeed: worker {w} could not allocate {_space.human(no_slot.slot_bytes)} of shared "
                f"memory ({no_slot.error}); batches that do not fit go through torch's transport, "
                f"which puts them in /dev/shm. Free memory, or pass transport='torch'.")

    def close(self) -> None:
        self._collate.reset(None)
        self._collate.pool = None  # the pool's mappings go with its last reference
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
