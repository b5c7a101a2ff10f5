"""The main process's side of the shared-memory transport: rebuilding a batch
as views of its slot, and handing the slot back.

The unpacker gives each batch a fresh ``SlotOwner`` view of its slot as owner,
and a weak reference to it; the callback, run when the last view of the batch
dies (in whatever thread drops it), flips the slot's state byte back to FREE,
or, for a slot bigger than ``_slots.WARM_BYTES``, gives back its pages past
that and flips it to COLD (the reuse rule, see ``_slots.py``).
Between epochs, ``trim()`` gives back the memory of every free slot but one small one
per worker (``IDLE_KEEP_BYTES``), and slots released while the loader is idle
follow suit.

A slot is first mapped here in ``_map`` (once per slot), and its pages go,
while the unpacker is open, only through ``_release_pages``; ``_let_go`` lets
go of whole arenas at ``close`` and ``renew``.

Ending: ``close()`` gives back the memory of every slot no batch in the user's
hands still uses, closes the descriptors, and frees the remaining slots as
their batches die.

With ``pins`` set (``pin_memory=True`` on CUDA), each slot is page-locked when
first mapped and its release waits for the copies from it (``_page_lock.py``).
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Any, Protocol

import numpy as np

from .. import _dropped_ctrl_c
from . import _arena, _layout, _page_lock, _slots
from ._packer import Inline, Plain, ShmFallbackWarning


class Arenas(Protocol):
    """What the unpacker reads from its channel (``_shm.ShmChannel``, which
    imports this module: the channel is named by what it provides)."""

    disabled_warning: str | None

    @property
    def fds(self) -> list[int]: ...

    def generation(self, worker_id: int) -> int: ...

    def close_descriptors(self) -> None: ...

# Slots still held by the user when their unpacker closed, until they die.
# Module-level so that the weak references that watch them stay reachable.
_HELD_AFTER_CLOSE: dict = {}

# The largest slot a worker keeps while the loader is idle between epochs.
# Bigger ones (image batches of 64 are ~10 MiB) are given back, as torch's
# loader holds no shared memory when idle; the next epoch's first batch per
# worker then fills a fresh slot, once.
IDLE_KEEP_BYTES = 1 << 20

# ``stats()["slot_table"]``'s names for a slot's state byte. A slot the worker
# gave back (PUNCHED, RETIRED) is not listed.
SLOT_STATES = {_slots.FREE: "free", _slots.COLD: "cold", _slots.IN_FLIGHT: "in use",
               _slots.FILLING: "filling"}


class Unpacker:
    """Main side: rebuilds batches as views of the slots and recycles the slots."""

    def __init__(self, channel: Arenas):
        self._channel = channel
        self._fds = channel.fds
        self._ctrl = [_slots.ControlBlock(fd) for fd in self._fds]
        self._cache: list[dict] = [dict() for _ in self._fds]
        self._lock = threading.Lock()
        self._warned = channel.disabled_warning is not None
        self.closed = False
        self.in_use = 0
        self.in_use_bytes = 0
        # in_use is counted up in the pin thread (unpack) and down in whatever
        # thread drops a batch, the releaser's included.
        self._count_lock = threading.Lock()
        # While the loader is idle (after trim()), a released slot gives its
        # memory back if its worker already has a free one. Not while batches
        # flow: reusing slots is what makes the transport fast.
        self.idle = False
        self._resting: set[int] = set()  # workers that build nothing more this epoch (rest())
        self.unpacked = 0
        self.fallbacks = 0
        self.released_bytes = 0  # pages given back from free slots (reuse rule, trim)
        self._pins: _page_lock.SlotPins | None = None

    @property
    def pins(self) -> _page_lock.SlotPins | None:
        """The page-locked slots (``_page_lock.enable``), or None."""
        return self._pins

    @pins.setter
    def pins(self, pins: _page_lock.SlotPins | None) -> None:
        self._pins = pins
        for ctrl in self._ctrl:  # their slots never go COLD: the workers keep their pages mapped
            ctrl.keeps_pages = pins is not None

    def _slot(self, w, idx, uid, off, cap):
        entry = self._cache[w].get(idx)
        if entry is None or entry.uid != uid:
            if _slots.uid_generation(uid) != self._channel.generation(w):
                raise RuntimeError(f"torchfeed transport: a batch from worker {w}'s previous "
                                   "arena arrived after the arena was renewed (a bug; please "
                                   "report it)")
            replaced = entry
            entry = self._cache[w][idx] = self._map(w, idx, uid, off, cap)
            if self.pins is not None:
                self.pins.adopt(entry, replaced, self._cache[w], self._ctrl[w].states)
        elif self.pins is not None:
            self.pins.sweep(self._cache[w], self._ctrl[w].states)
        return entry

    # -- where a slot is first mapped here, and where its pages go -------------
    def _map(self, w, idx, uid, off, cap) -> _slots.MainSlot:
        """Map slot ``idx`` of worker ``w`` (``cap`` bytes at ``off`` of its
        arena) in this process: the one place a slot is first mapped, once per
        slot (``uid``). A slot the worker gave back and made anew at the same
        index comes here again with a new uid; the old mapping goes when the
        last view of its last batch dies."""
        return _slots.MainSlot(self._fds[w], uid, off, cap,
                               self._release_fn(w, self._ctrl[w].states, idx, cap))

    def _release_pages(self, entry: _slots.MainSlot, start: int = 0) -> bool:
        """Give back the pages of a free slot from byte ``start`` to its end,
        keeping the slot and its mapping: the one place pages of a slot go
        while the unpacker is open (the reuse rule, and ``trim``). False if
        they could not be. ``close`` and ``renew`` let go of whole arenas
        (``_let_go``).

        A page-locked slot (``_page_lock.py``) keeps all its pages while it is
        a slot: CUDA holds them locked, so a page given back would leave the
        GPU reading the old page while the worker writes a new one, and
        unlocking and locking the slot again costs milliseconds each batch.
        Its pages go only with the whole slot, once it is unregistered."""
        if start and _page_lock.is_registered(entry.map):
            return False
        try:
            if not start:
                _page_lock.unregister(entry.map)  # free: the releaser's fence has passed
            entry.map.remove(start)
        except OSError:
            return False
        self.released_bytes += entry.cap - start
        return True

    def _release_fn(self, w, states, idx, cap):
        me = weakref.ref(self)
        FREE, COLD, IN_FLIGHT = _slots.FREE, _slots.COLD, _slots.IN_FLIGHT
        warm = _slots.warm_bytes(cap)
        pending: list[list] = [[]]  # the token of the batch in the slot (unpack)

        def give_back():
            self_ = me()
            if self_ is not None:
                self_.count_in_use(-1, -cap)
                cache = self_._cache[w] if not self_.closed else {}
                entry = cache.get(idx)
                if self_.idle or w in self_._resting:
                    # As trim() would: a slot over IDLE_KEEP_BYTES goes, and so does
                    # one whose worker has a free slot already. A snapshot: the pin
                    # thread may add a slot to the cache meanwhile.
                    if entry is not None and (cap > IDLE_KEEP_BYTES or any(
                            j != idx and states[j] in (FREE, COLD) for j in tuple(cache))):
                        if _punch(self_, entry, states, idx):
                            return
                elif warm < cap and entry is not None and self_._release_pages(entry, warm):
                    # The reuse rule: a huge slot keeps only its first ``warm`` bytes.
                    states[idx] = COLD
                    return
            states[idx] = FREE

        def release(_ref):
            # NOTE [ Ctrl-C in a release ]: this runs in whatever thread drops the
            # batch, mostly the main thread, where a Ctrl-C raises KeyboardInterrupt
            # at the next function call, here too.  CPython drops an exception
            # raised in a weakref callback (it prints "Exception ignored in"), so
            # the slot stayed in flight, its worker waited for it, and the Ctrl-C
            # was lost with it: the loop hung where torch's stops.  The state byte
            # is written last in give_back, with no call after it, so a slot still
            # in flight here was not handed back: no worker can have taken it again.
            # The Ctrl-C is kept for the main thread's next __next__ (_dropped_ctrl_c).
            # One that lands on this function's first line, before the try, drops
            # the whole release: the batch's token, emptied first thing here, is
            # then still full when the batch's watcher dies, and the next sweep of
            # _dropped_ctrl_c runs this release and keeps the Ctrl-C.
            try:
                pending[0].clear()
                give_back()
            except BaseException as exc:
                if states[idx] == IN_FLIGHT:
                    states[idx] = FREE  # its pages as they are: a worker's write fills a hole
                if not isinstance(exc, KeyboardInterrupt):
                    raise
                _dropped_ctrl_c.keep()
        release.pending, release.unpacker = pending, me  # type: ignore[attr-defined]
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
        for w in range(len(self._cache)):
            self._trim_worker(w)

    def rest(self, w: int) -> None:
        """Worker ``w`` builds nothing more this epoch: its free slots go now
        as ``trim`` would take them, while the other workers still build, and
        its slots in use follow as their batches are released, as while idle.
        Kept, their pages would go only when the iterator closes or trims,
        after the last batch, where nothing overlaps the work; torch's loader
        holds nothing of a batch once it is consumed."""
        if self.closed or w >= len(self._cache):  # a transport with no arenas (over budget)
            return
        self._resting.add(w)
        self._trim_worker(w)

    def _trim_worker(self, w: int) -> None:
        """``trim`` for worker ``w``'s free slots."""
        cache, states = self._cache[w], self._ctrl[w].states
        free = sorted((e.cap, idx) for idx, e in tuple(cache.items())
                      if states[idx] in (_slots.FREE, _slots.COLD))
        keep = 1 if free and free[0][0] <= IDLE_KEEP_BYTES else 0
        for _, idx in free[keep:]:
            _punch(self, cache[idx], states, idx)

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
        pending = getattr(entry.release, "pending", None)
        if pending is not None:  # None: page-locked, released by the releaser's thread
            token = [weakref.ref(entry.release)]
            pending[0] = token
            _dropped_ctrl_c.watch(owner, token)  # first: its callback runs after the release's
        entry.ref = weakref.ref(owner, entry.release)
        self.idle = False
        self._resting.discard(w)
        self.count_in_use(1, entry.cap)
        self.unpacked += 1
        return _layout.load(data, descs, owner)

    def count_in_use(self, batches: int, nbytes: int) -> None:
        with self._count_lock:
            self.in_use += batches
            self.in_use_bytes += nbytes

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

    def stats(self) -> dict:
        """Slot counters summed over the workers, plus this process's view.

        ``slots``/``bytes``: slots the workers hold now and their capacity
        (``worker_bytes``: the same, by worker); ``allocations``/``retired``:
        slots created/given back so far; ``in_use``/``in_use_bytes``: batches
        rebuilt here and still referenced; ``fallbacks``: batches that had no
        slot (inline, or torch's way); ``direct_bytes``: bytes stacked straight
        into slots by the direct collate.

        The slot accounting: ``slot_table`` lists every slot this process has
        mapped, as ``(worker, index, bytes, state, warm bytes)``, state one of
        ``SLOT_STATES``; ``reuse_bytes`` is what the free ones keep for their
        workers' next batches (``_slots.warm_bytes``), ``released_bytes`` the
        pages given back from free slots so far; ``page_locked_bytes`` the bytes of
        the mapped slots page-locked with CUDA now (``_page_lock.py``)."""
        tot: dict[str, Any] = {"slots": 0, "bytes": 0, "allocations": 0, "retired": 0, "packed": 0,
               "worker_fallbacks": 0, "direct_bytes": 0, "worker_bytes": [], "slot_table": [],
               "reuse_bytes": 0}
        if not self.closed:
            for w, ctrl in enumerate(self._ctrl):
                c = ctrl.counters
                tot["slots"] += int(c[_slots.C_SLOTS])
                tot["bytes"] += int(c[_slots.C_BYTES])
                tot["worker_bytes"].append(int(c[_slots.C_BYTES]))
                tot["allocations"] += int(c[_slots.C_ALLOCATIONS])
                tot["retired"] += int(c[_slots.C_RETIRED])
                tot["packed"] += int(c[_slots.C_PACKED])
                tot["worker_fallbacks"] += int(c[_slots.C_FALLBACKS])
                tot["direct_bytes"] += int(c[_slots.C_DIRECT])
                for idx, entry in sorted(tuple(self._cache[w].items())):
                    state = SLOT_STATES.get(int(ctrl.states[idx]))
                    if state is None:
                        continue  # given back
                    warm = (entry.cap if state != "cold" else _slots.warm_bytes(entry.cap))
                    if state in ("free", "cold"):
                        tot["reuse_bytes"] += warm
                    tot["slot_table"].append((w, idx, entry.cap, state, warm))
        locked = 0
        if self.pins is not None and not self.closed:
            locked = sum(_page_lock.locked_bytes(e.map) for c in self._cache for e in tuple(c.values()))
        tot.update(transport="shm", in_use=self.in_use, in_use_bytes=self.in_use_bytes,
                   page_locked_bytes=locked,
                   unpacked=self.unpacked, fallbacks=self.fallbacks, closed=self.closed,
                   released_bytes=self.released_bytes)
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
        self._channel.close_descriptors()

    def renew(self, w: int, old_fd: int) -> None:
        """Worker ``w`` has a fresh arena (``ShmChannel.renew``); let go of the old
        one, whose descriptor ``old_fd`` this closes."""
        cache, self._cache[w] = self._cache[w], {}
        self._ctrl[w] = _slots.ControlBlock(self._fds[w])
        self._ctrl[w].keeps_pages = self._pins is not None
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
                pending = getattr(entry.release, "pending", None)
                if pending is not None:
                    pending[0].clear()  # its release never runs now: nothing to sweep
                entry.release = None
                unpacker = weakref.ref(self) if counted else None
                callback = _punch_on_release(entry.map, key, unpacker, entry.cap)
                if self.pins is not None:
                    callback = self.pins.let_go(entry, True, callback)
                entry.ref = weakref.ref(owner, callback)
                del owner
            elif self.pins is not None and self.pins.let_go(entry, False, None):
                keep.append((entry.off, entry.cap))  # the releaser gives it back
        _arena.punch(fd, keep)


def _punch(unpacker: Unpacker, entry, states, idx) -> bool:
    """Give all of a free slot's memory back and tell its worker to forget the
    slot; False if it could not."""
    if not unpacker._release_pages(entry):
        return False
    states[idx] = _slots.PUNCHED
    return True


def _punch_on_release(shared_map, key, unpacker=None, cap=0):
    def release(_ref):
        try:
            _HELD_AFTER_CLOSE.pop(key, None)
            self_ = unpacker() if unpacker is not None else None
            if self_ is not None:
                self_.count_in_use(-1, -cap)
            try:
                _page_lock.unregister(shared_map)
                shared_map.remove()
            except Exception:  # noqa: BLE001 - the pages go back with the process anyway
                pass
        except KeyboardInterrupt:  # NOTE [ Ctrl-C in a release ]: the slot's arena is closed
            _dropped_ctrl_c.keep()
    return release
