"""The shared-memory transport: channel, worker-side packer, main-side unpacker.

``ShmChannel`` is created in the main process before the workers start and is
passed to each of them as a process argument. It owns one memfd arena per
worker (``_slots.py``); pickling it for spawn or forkserver passes the
descriptors with the process, fork inherits them.

A packed batch is a tuple ``(worker_id, slot_idx, slot_uid, offset, capacity,
pickle_bytes, leaf_descriptors)``: a few hundred bytes, whatever the batch
size. A batch that finds every slot of its worker's pool held by the consumer
(``max_slots_per_worker`` batches kept, as ``list(loader)`` keeps them) is sent
``Inline``: its leaves travel inside the message and live in the main
process's own memory, so keeping thousands of batches costs no shared memory
and no file descriptor per batch. A batch that cannot have a slot for lack of
shared memory (budget exhausted, allocation failed) is sent as ``Plain(batch)``
through torch's own reductions instead; the main process warns once per
channel when that happens.

Recycling: the unpacker gives each batch a fresh ``SlotOwner`` view of its
slot as owner, and a weak reference to it; the callback, run when the last
view of the batch dies (in whatever thread drops it), flips the slot's state
byte back to FREE. ``discard(payload)`` frees a slot whose batch will never be
built.

Restarts: a worker replaced after a crash (``max_worker_restarts``) gets a
fresh arena from ``ShmChannel.renew``, never the dead worker's, whose slots may
hold batches the user keeps; the old arena's memory goes back as those die.
Slot uids carry the arena's generation, so a stale message cannot be read
from the new arena.

Ending: ``Unpacker.close()`` gives back the memory of every slot no batch in
the user's hands still uses, closes the descriptors, and frees the remaining
slots as their batches die. If the main process is killed, the workers' exit
closes the last descriptors and the kernel frees everything: there is no name
to leak.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from multiprocessing import reduction
from typing import Any

import numpy as np
import torch

from . import _layout, _slots, _space
from ._collate import DirectCollate, is_default_collate

# Slots still held by the user when their unpacker closed, until they die.
# Module-level so that the weak references that watch them stay reachable.
_HELD_AFTER_CLOSE: dict = {}

# The largest slot a worker keeps while the loader is idle between epochs.
# Bigger ones (image batches of 64 are ~10 MiB) are given back, as torch's
# loader holds no shared memory when idle; the next epoch's first batch per
# worker then fills a fresh slot, once.
IDLE_KEEP_BYTES = 1 << 20


class ShmFallbackWarning(UserWarning):
    """Some batches went through torch's transport for lack of shared memory."""


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


def _close_fds(fds, owner_pid):
    if os.getpid() != owner_pid:
        return
    for i, fd in enumerate(fds):
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
            fds[i] = -1


class ShmChannel:
    kind = "shm"

    def __init__(self, num_workers: int, budget: int, budget_source: str,
                 max_slots: int, idle_batches: int, disabled_warning=None):
        self.num_workers = num_workers
        self.budget = budget
        self.budget_source = budget_source
        self.max_slots = max_slots
        self.idle_batches = idle_batches
        self.disabled_warning = disabled_warning
        self._creator_pid = os.getpid()
        self._owner_pid = os.getpid()
        self._fds = []
        self._generations = [0] * num_workers  # bumped when a worker's arena is renewed
        if disabled_warning is None:
            try:
                for w in range(num_workers):
                    self._fds.append(_slots.create_arena(w))
            except BaseException:
                _close_fds(self._fds, self._owner_pid)
                raise
        self._unpacker: Unpacker | None = None
        self._finalizer = weakref.finalize(self, _close_fds, self._fds, self._owner_pid)
        if disabled_warning is not None:
            warnings.warn(disabled_warning, ShmFallbackWarning, stacklevel=3)

    def __getstate__(self):
        if self._unpacker is not None and self._unpacker.closed:
            raise RuntimeError("torchfeed: this transport channel is closed")
        st = dict(self.__dict__)
        st["_fds"] = [reduction.DupFd(fd) for fd in self._fds]
        st["_unpacker"] = None
        st["_finalizer"] = None
        return st

    def __setstate__(self, st):
        st["_fds"] = [d.detach() for d in st["_fds"]]
        st["_owner_pid"] = os.getpid()
        self.__dict__.update(st)
        self._finalizer = weakref.finalize(self, _close_fds, self._fds, self._owner_pid)

    def renew(self, worker_id: int) -> None:
        """Give worker ``worker_id`` a fresh, empty arena (main process, before a
        replacement worker starts).

        A replacement starts its slots from scratch; in the dead worker's arena
        it would write over batches the user still holds. The old arena's slots
        that no batch uses are given back now, the rest when their batches die.
        """
        if self.disabled_warning is not None:
            return
        if os.getpid() != self._creator_pid:
            raise RuntimeError("torchfeed: only the main process may renew an arena")
        fd = _slots.create_arena(worker_id)
        old, self._fds[worker_id] = self._fds[worker_id], fd
        self._generations[worker_id] += 1
        if self._unpacker is not None and not self._unpacker.closed:
            self._unpacker.renew(worker_id, old)
        elif old >= 0:
            os.close(old)

    # -- worker side -------------------------------------------------------
    def packer(self, worker_id: int) -> "Packer":
        """The packer of worker ``worker_id``; call once, in that worker."""
        if not 0 <= worker_id < self.num_workers:
            raise ValueError(f"worker_id {worker_id} out of range for {self.num_workers} workers")
        if self.disabled_warning is not None:
            return Packer(worker_id, None, self, owns_fd=False)
        fd = self._fds[worker_id]
        if fd < 0:
            raise RuntimeError(f"torchfeed: worker {worker_id}'s arena is already taken or closed")
        in_worker = os.getpid() != self._creator_pid
        if in_worker:
            # The packer owns its arena from here on; the other workers' arenas
            # are none of this process's business.
            for w, other in enumerate(self._fds):
                if other >= 0 and w != worker_id:
                    os.close(other)
                self._fds[w] = -1
        return Packer(worker_id, fd, self, owns_fd=in_worker)

    # -- main side -----------------------------------------------------------
    def unpacker(self) -> "Unpacker":
        """The main process's unpacker (one per channel)."""
        if self._unpacker is None:
            self._unpacker = Unpacker(self)
        return self._unpacker

    def stats(self) -> dict:
        return self.unpacker().stats()

    def close(self) -> None:
        if self._unpacker is not None:
            self._unpacker.close()
        else:
            self._finalizer()


class Packer:
    """Worker side: writes batches into this worker's slots."""

    # A tuple from pack() is a message of plain data (ints, bytes, tuples),
    # never the user's batch: the worker may pickle it with pickle's C pickler.
    plain_tuples = True

    def __init__(self, worker_id: int, fd, channel: ShmChannel, owns_fd: bool):
        self.worker_id = worker_id
        self._fd = fd if owns_fd else None
        self._num_workers = channel.num_workers
        self._warned = False
        self.pool = None
        if fd is not None:
            self.pool = _slots.WorkerPool(fd, channel.budget // max(1, channel.num_workers),
                                          channel.max_slots, channel.idle_batches,
                                          channel._generations[worker_id])
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
            slot, reason = self.pool.acquire(need, exclude=reserved)
            if slot is None and reason[0] == "pool":
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
                return Plain(batch, self._warning(reason))
            if reserved is not None:  # the batch outgrew the reserved slot: copy it all
                p = _layout.dump(batch, 0, direct, copy_direct=True)
            _layout.copy_leaves(p.leaves, slot)
        c.expected_nbytes = need
        pool = self.pool
        pool.states[slot.idx] = _slots.IN_FLIGHT
        pool.counters[_slots.C_PACKED] += 1
        return (self.worker_id, slot.idx, slot.uid, slot.off, slot.cap, p.data, p.descs)

    def _warning(self, reason):
        """The one warning for this worker's first shortage of shared memory.

        A full pool is not a shortage and never gets here: the batch goes
        ``Inline`` quietly (``stats()["fallbacks"]`` counts it).
        """
        kind = reason[0]
        if self._warned:
            return None
        self._warned = True
        w = self.worker_id
        source = self._channel_budget[1]
        if kind == "budget":
            check = _space.SpaceCheck(
                False, reason[1], self.pool.budget,
                f"{source}, split evenly across {self._num_workers} workers",
                _space.dev_shm_free())
            return check.message(f"worker {w}'s slots (batches of {_space.human(reason[3])})")
        return (f"torchfeed: worker {w} could not allocate {_space.human(reason[2])} of shared "
                f"memory ({reason[1]}); batches that do not fit go through torch's transport, "
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


class Unpacker:
    """Main side: rebuilds batches as views of the slots and recycles the slots."""

    def __init__(self, channel: ShmChannel):
        self._channel = channel
        self._fds = channel._fds
        self._ctrl = [_slots.ControlBlock(fd) for fd in self._fds]
        self._cache: list[dict] = [dict() for _ in self._fds]
        self._lock = threading.Lock()
        self._warned = channel.disabled_warning is not None
        self.closed = False
        self.in_use = 0
        self.in_use_bytes = 0
        # While the loader is idle (after trim()), a released slot gives its
        # memory back if its worker already has a free one. Not while batches
        # flow: reusing slots is what makes the transport fast.
        self.idle = False
        self.unpacked = 0
        self.fallbacks = 0

    def _slot(self, w, idx, uid, off, cap):
        entry = self._cache[w].get(idx)
        if entry is None or entry.uid != uid:
            if _slots.uid_generation(uid) != self._channel._generations[w]:
                raise RuntimeError(f"torchfeed transport: a batch from worker {w}'s previous "
                                   "arena arrived after the arena was renewed (a bug; please "
                                   "report it)")
            entry = _slots.MainSlot(self._fds[w], uid, off, cap,
                                    self._release_fn(w, self._ctrl[w].states, idx, cap))
            self._cache[w][idx] = entry
        return entry

    def _release_fn(self, w, states, idx, cap):
        me = weakref.ref(self)
        FREE = _slots.FREE

        def release(_ref):
            self_ = me()
            if self_ is not None:
                self_.in_use -= 1
                self_.in_use_bytes -= cap
                cache = self_._cache[w] if self_.idle and not self_.closed else {}
                # A snapshot: the pin thread may add a slot to the cache meanwhile.
                for j in tuple(cache):
                    if j != idx and states[j] == FREE:
                        # Idle, and the worker has a free slot already.
                        entry = cache.get(idx)
                        if entry is not None and _punch(entry, states, idx):
                            return
                        break
            states[idx] = FREE
        return release

    def trim(self) -> None:
        """Give back the memory of every free slot but one per worker: the
        smallest, and only while it is at most ``IDLE_KEEP_BYTES``. A slot
        grown for a huge batch goes even when it is its worker's only one:
        the worker's last small batches may all have gone into it, and an
        idle loader should not sit on it. Call only while no worker builds a
        batch: between epochs."""
        if self.closed:
            return
        self.idle = True  # and batches released while idle follow suit
        for w, cache in enumerate(self._cache):
            states = self._ctrl[w].states
            free = sorted((e.cap, idx) for idx, e in cache.items() if states[idx] == _slots.FREE)
            keep = 1 if free and free[0][0] <= IDLE_KEEP_BYTES else 0
            for _, idx in free[keep:]:
                _punch(cache[idx], states, idx)

    def unpack(self, payload):
        """The batch carried by ``payload``: zero-copy views of its slot."""
        if type(payload) is not tuple:
            return self._plain(payload)
        if self.closed:
            raise RuntimeError("torchfeed: unpack() after the transport was closed")
        w, idx, uid, off, cap, data, descs = payload
        entry = self._slot(w, idx, uid, off, cap)
        if entry.ref is not None and entry.ref() is not None:
            raise RuntimeError(f"torchfeed transport: worker {w} reused slot {idx} while a "
                               "batch in it was still alive (a bug; please report it)")
        owner = entry.base.view(_layout.SlotOwner)
        entry.ref = weakref.ref(owner, entry.release)
        self.idle = False
        self.in_use += 1
        self.in_use_bytes += entry.cap
        self.unpacked += 1
        return _layout.load(data, descs, owner)

    def _plain(self, payload):
        if type(payload) is Inline:
            self.fallbacks += 1
            owner = np.frombuffer(payload.buf, np.uint8).view(_layout.SlotOwner)
            return _layout.load(payload.data, payload.descs, owner)
        if type(payload) is not Plain:
            raise TypeError(f"torchfeed: not a transport payload: {type(payload).__name__}")
        self.fallbacks += 1
        if payload.warning is not None and not self._warned:
            self._warned = True
            warnings.warn(payload.warning, ShmFallbackWarning, stacklevel=3)
        return payload.batch

    def discard(self, payload) -> None:
        """Free the slot of a payload that will never be unpacked."""
        if type(payload) is tuple and not self.closed:
            w, idx, uid = payload[0], payload[1], payload[2]
            if _slots.uid_generation(uid) == self._channel._generations[w]:
                entry = self._cache[w].get(idx)
                if entry is not None and entry.uid != uid:
                    # Stale: it maps the region of a slot since retired, which
                    # trim() must never give back.
                    del self._cache[w][idx]
                self._ctrl[w].states[idx] = _slots.FREE

    def stats(self) -> dict:
        """Slot counters summed over the workers, plus this process's view.

        ``slots``/``bytes``: slots the workers hold now and their capacity;
        ``allocations``/``retired``: slots created/given back so far;
        ``in_use``/``in_use_bytes``: batches rebuilt here and still referenced;
        ``fallbacks``: batches that had no slot (inline, or torch's way);
        ``direct_bytes``: bytes stacked straight into slots by the direct collate."""
        tot: dict[str, Any] = {"slots": 0, "bytes": 0, "allocations": 0, "retired": 0, "packed": 0,
               "worker_fallbacks": 0, "direct_bytes": 0}
        if not self.closed:
            for ctrl in self._ctrl:
                c = ctrl.counters
                tot["slots"] += int(c[_slots.C_SLOTS])
                tot["bytes"] += int(c[_slots.C_BYTES])
                tot["allocations"] += int(c[_slots.C_ALLOCATIONS])
                tot["retired"] += int(c[_slots.C_RETIRED])
                tot["packed"] += int(c[_slots.C_PACKED])
                tot["worker_fallbacks"] += int(c[_slots.C_FALLBACKS])
                tot["direct_bytes"] += int(c[_slots.C_DIRECT])
        tot.update(transport="shm", in_use=self.in_use, in_use_bytes=self.in_use_bytes,
                   unpacked=self.unpacked, fallbacks=self.fallbacks, closed=self.closed)
        return tot

    def close(self) -> None:
        """Release everything; slots of batches the user still holds go when those die."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for w, fd in enumerate(self._fds):
            if fd >= 0:
                self._let_go(self._cache[w], fd, counted=False)
        self._cache = [dict() for _ in self._fds]
        self._ctrl = []
        self._channel._finalizer()

    def renew(self, w: int, old_fd: int) -> None:
        """Worker ``w`` has a fresh arena (``ShmChannel.renew``); let go of the old
        one, whose descriptor ``old_fd`` this closes."""
        cache, self._cache[w] = self._cache[w], {}
        self._ctrl[w] = _slots.ControlBlock(self._fds[w])
        if old_fd >= 0:
            self._let_go(cache, old_fd, counted=True)
            os.close(old_fd)

    def _let_go(self, cache: dict, fd: int, counted: bool) -> None:
        """Give back the memory of arena ``fd``: now for slots no batch uses, when
        its batch dies for each slot still in the user's hands. ``counted``: those
        batches still count in ``in_use`` until they die."""
        keep = []
        for entry in cache.values():
            owner = entry.ref() if entry.ref is not None else None
            if owner is not None:
                keep.append((entry.off, entry.cap))
                key = id(entry)
                _HELD_AFTER_CLOSE[key] = entry
                entry.release = None
                unpacker = weakref.ref(self) if counted else None
                entry.ref = weakref.ref(owner, _punch_on_release(entry.map, key, unpacker,
                                                                 entry.cap))
                del owner
        _slots.punch(fd, keep)


def _punch(entry, states, idx) -> bool:
    """Give a free slot's memory back and tell its worker; False if it could not."""
    try:
        entry.map.remove()
    except OSError:
        return False
    states[idx] = _slots.PUNCHED
    return True


def _punch_on_release(shared_map, key, unpacker=None, cap=0):
    def release(_ref):
        _HELD_AFTER_CLOSE.pop(key, None)
        self_ = unpacker() if unpacker is not None else None
        if self_ is not None:
            self_.in_use -= 1
            self_.in_use_bytes -= cap
        try:
            shared_map.remove()
        except Exception:  # noqa: BLE001 - the pages go back with the process anyway
            pass
    return release
