"""Shared-memory slots: one nameless memfd arena per worker, its control block,
the worker's slot pool and the main process's slot cache.

Arena. The main process creates one ``memfd`` per worker before the workers
start, so no file descriptor ever has to travel after start-up: workers get
theirs by fork inheritance or, with spawn and forkserver, as a descriptor
passed at start. A memfd has no name, so nothing appears in ``/dev/shm``, and
its memory is freed by the kernel once the last descriptor and mapping are
gone, however the processes ended. The worker grows its arena; the main
process maps each slot region of it the first time it sees the slot.

Layout of an arena file (its system calls: ``_arena.py``)::

    [0, 4096)          control block: 8-byte header (``keeps_pages``), counters,
                       one state byte per slot
    [65536, ...)       slot regions, each 64 KiB-aligned, allocated by the worker

A slot is a region of the arena plus an index into the control block. Its
state byte is ``FREE`` or ``COLD`` (the worker may write it) or ``IN_FLIGHT``
(a batch in it belongs to the main process). The worker flips FREE to IN_FLIGHT before it
sends a batch; the main process flips it back when the last view of that batch
dies. Ownership alternates, so one byte with no lock is enough. A slot the
worker has taken for the batch it is building is ``FILLING``, and one it gave
back is ``RETIRED``: to the main process, neither is free. At the end of an
epoch of a persistent loader, the main process gives the memory of every free
slot but one small one per worker back to the system and marks those ``PUNCHED``
(``Unpacker.trim``), and does the same for slots released while the loader is
idle, or while their worker has no batch left to build this epoch
(``Unpacker.rest``); the worker then forgets them. So an idle loader holds at most one slot
of at most 1 MiB per worker (``_unpacker.IDLE_KEEP_BYTES``).

While batches flow, slots are kept and reused: writing into pages already
there is several times faster than into fresh ones. The reuse rule
(``warm_bytes``) bounds what that costs for huge batches: a free slot keeps at
most ``WARM_BYTES`` (64 MiB) of its pages. When the batch of a bigger slot is
released, the main process gives back the pages past that and marks the slot
``COLD``; the worker gives it pages again (``refill``) when it next takes it,
writes a batch's bytes past the warm part through the arena's file
(``WorkerSlot.write``: ``pwrite``, no page fault), as it does for a new huge
slot's, and drops its own mapping of those pages once it has written a
batch (``WorkerPool.let_go_of_tail``), unless the main process keeps them
(``keeps_pages``).
The slot keeps its index, region and mappings, so the number of slots stays
what the batches alive at once need (``prefetch_factor + 1`` per worker
when the consumer keeps nothing) and nothing is mapped anew per batch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ._arena import (
    CTRL_BYTES,
    FIRST_REGION,
    REGION_ALIGN,
    SharedMap,
    allocate,
    drop_pages,
    punch_hole,
    refill,
    write_at,
)

KEEPS_PAGES_AT = 0  # a byte of the header, written by the main process only
STATES_AT = 64
MAX_SLOTS = CTRL_BYTES - STATES_AT
FREE, IN_FLIGHT, PUNCHED, FILLING, RETIRED, COLD = 0, 1, 2, 3, 4, 5

# The reuse rule (``warm_bytes``): a free slot keeps at most this many bytes
# of pages for its worker's next batch.
WARM_BYTES = 64 << 20


def warm_bytes(cap: int) -> int:
    """How many bytes at the start of a free slot of ``cap`` bytes keep their
    pages for the worker's next batch: all of them up to ``WARM_BYTES``.
    The pages past that go back to the system when the slot's batch is
    released, and the slot is then ``COLD``: the worker gives it pages again
    (``refill``) before its next batch, as torch's loader pays for a fresh
    segment for every batch. The slot itself, its index and its mappings stay."""
    return min(cap, WARM_BYTES)


# A free slot at least this much and 4x bigger than the batches it now carries
# is given back after SHRINK_AFTER such batches, and a right-sized one made.
SHRINK_MIN = 4 << 20
SHRINK_AFTER = 4

# A replacement worker (``max_worker_restarts``) gets a fresh arena; the uids of
# its slots carry the arena's generation in their high bits.
GENERATION_SHIFT = 40


def uid_generation(uid: int) -> int:
    return uid >> GENERATION_SHIFT


class NoSlot(NamedTuple):
    """Why ``WorkerPool.acquire`` had no slot for a batch."""

    kind: str  # "pool": max_slots held already; "budget": over the bytes; "oserror": allocation failed
    slot_bytes: int  # the slot it would have made
    pool_bytes: int  # what the pool would have held with it
    batch_bytes: int
    error: str = ""  # the OSError's text, for "oserror"

# int64 counters at byte 8 of the control block, written by the worker only.
C_ALLOCATIONS, C_RETIRED, C_BYTES, C_SLOTS, C_FALLBACKS, C_PACKED, C_DIRECT = range(7)
N_COUNTERS = 7


class ControlBlock:
    """The control page of one arena, mapped in this process."""

    __slots__ = ("map", "states", "counters")

    def __init__(self, fd: int):
        self.map = SharedMap(fd, CTRL_BYTES)
        a = self.map.array
        self.states = a[STATES_AT:STATES_AT + MAX_SLOTS]
        self.counters = a[8:8 + 8 * N_COUNTERS].view(np.int64)

    @property
    def keeps_pages(self) -> bool:
        """Set by the main process: a released slot keeps all its pages
        (page-locked slots, ``_page_lock.py``), so no slot goes ``COLD``."""
        return bool(self.map.array[KEEPS_PAGES_AT])

    @keeps_pages.setter
    def keeps_pages(self, value: bool) -> None:
        self.map.array[KEEPS_PAGES_AT] = 1 if value else 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class WorkerSlot:
    """A slot as the worker sees it: its region mapped read-write."""

    __slots__ = ("idx", "uid", "off", "cap", "arr", "u8", "last_used", "oversized", "_typed",
                 "fd", "file_from")

    def __init__(self, idx, uid, off, cap, arr, fd):
        self.idx, self.uid, self.off, self.cap, self.arr, self.fd = idx, uid, off, cap, arr, fd
        self.u8 = torch.from_numpy(arr)
        self.last_used = 0
        self.oversized = 0  # batches in a row far smaller than the slot
        self._typed = {}
        self.file_from = cap  # set by ``WorkerPool.acquire`` for each batch

    def write(self, off: int, data) -> None:
        """Write ``data`` (a C-contiguous numpy array of bytes) at byte ``off``.

        Bytes before ``file_from`` go through this process's mapping, whose
        pages are there from the slot's earlier batches. Bytes past it, in a
        huge slot, land in pages the worker does not map (its part of the
        slot that goes ``COLD``, or a new slot's): ``pwrite`` puts them in
        the arena with no page fault, where writing through the mapping
        faults every page in first (``benchmarks/transport_memory.py``)."""
        n = data.nbytes
        cut = min(n, max(0, self.file_from - off))
        if cut:
            self.arr[off:off + cut] = data[:cut]
        if cut < n:
            write_at(self.fd, data[cut:], self.off + off + cut)

    def typed(self, dtype):
        """The whole slot as a 1-D tensor of ``dtype`` (cached)."""
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self.u8.view(dtype)
        return t


class WorkerPool:
    """The slots of one worker: reuse, growth, trimming and the byte budget.

    ``acquire(n)`` returns a free slot of at least ``n`` bytes, preferring the
    one used most recently (its pages are mapped and warm in both processes).
    A slot that has stayed free for ``idle_batches`` acquisitions is given back,
    so the pool shrinks to what the consumer actually holds. A batch bigger than
    every free slot gets a new one, free slots too small for it given back
    first. A new slot is the batch's size while every batch so far has had the
    same size (a slot's headroom is memory no batch uses, in each of up to
    ``prefetch_factor + 1`` slots); once sizes vary, it gets 1/16 headroom, so
    batches a little bigger than the last still fit.
    """

    def __init__(self, fd: int, budget: int, max_slots: int, idle_batches: int,
                 generation: int = 0):
        self.fd = fd
        self.ctrl = ControlBlock(fd)
        self.states = self.ctrl.states
        self.counters = self.ctrl.counters
        self.budget = budget
        self.max_slots = min(max_slots, MAX_SLOTS)
        self.idle_batches = idle_batches
        self.slots: dict[int, WorkerSlot] = {}
        self.free_idx = list(range(MAX_SLOTS - 1, -1, -1))
        self.free_regions: list[tuple[int, int]] = []
        self.end = FIRST_REGION
        self.bytes = 0
        self.tick = 0
        self.last_nbytes = -1
        self.sizes_vary = False
        # A slot's uid names its arena's generation too (see ``uid_generation``).
        self.uid = generation << GENERATION_SHIFT

    def acquire(self, nbytes: int, exclude=None):
        """``(slot, None)``, or ``(None, NoSlot)`` when no slot can be had."""
        states = self.states
        best = None
        free = []
        punched = []
        for s in self.slots.values():
            state = states[s.idx]
            # FILLING: taken for a batch that was never sent (its collate
            # raised, say); this worker builds one batch at a time.
            if s is not exclude and (state == FREE or state == FILLING or state == COLD):
                free.append(s)
                # Warm slots first (their pages are still there), then the most recent.
                if s.cap >= nbytes and (best is None or (state != COLD, s.last_used)
                                        > (states[best.idx] != COLD, best.last_used)):
                    best = s
            elif state == PUNCHED:  # the main process gave its memory back
                punched.append(s)
        for s in punched:
            self.retire(s)
        self.tick += 1
        if nbytes != self.last_nbytes:
            self.sizes_vary = self.sizes_vary or self.last_nbytes >= 0  # for good, once seen
            self.last_nbytes = nbytes
        if best is not None and best.cap - nbytes >= SHRINK_MIN and best.cap > 4 * nbytes:
            # Grown for a batch far bigger than the ones it carries now.
            best.oversized += 1
            if best.oversized >= SHRINK_AFTER:
                free.remove(best)
                self.retire(best)
                best = None
        elif best is not None:
            best.oversized = 0
        if best is None:
            for s in free:
                if s.cap < nbytes:
                    self.retire(s)
            best, reason = self._create(nbytes)
            if best is None:
                return None, reason
        else:
            for s in free:
                if s is not best and self.tick - s.last_used > self.idle_batches:
                    self.retire(s)
        if states[best.idx] == COLD:
            warm = warm_bytes(best.cap)
            try:
                refill(self.fd, best.off + warm, best.cap - warm)
            except OSError as e:
                self.retire(best)
                return None, NoSlot("oserror", best.cap, self.bytes, nbytes, str(e))
        best.last_used = self.tick
        best.file_from = self._file_from(best.cap)
        states[best.idx] = FILLING
        return best, None

    def _file_from(self, cap: int) -> int:
        """Where this worker's part of a slot of ``cap`` bytes ends: the pages it
        keeps mapped between batches, those a free slot keeps for reuse
        (``warm_bytes``), or all of them in a slot that keeps its pages
        (``keeps_pages``). ``WorkerSlot.write`` writes past it through the
        file; ``let_go_of_tail`` drops the worker's mapping past it."""
        return cap if self.ctrl.keeps_pages else warm_bytes(cap)

    def _create(self, nbytes: int):
        headroom = nbytes // 16 if self.sizes_vary else 0
        cap = max(REGION_ALIGN, _round_up(nbytes + headroom, REGION_ALIGN))
        if not self.free_idx or len(self.slots) >= self.max_slots:
            return None, NoSlot("pool", cap, self.bytes + cap, nbytes)
        if self.bytes + cap > self.budget:
            return None, NoSlot("budget", cap, self.bytes + cap, nbytes)
        off = self._take_region(cap)
        try:
            allocate(self.fd, off, cap)
            # A slot that keeps its pages is mapped at once: its later batches
            # then write without a fault. A huge one is written as its pages
            # come (see ``refill``).
            arr = SharedMap(self.fd, cap, off, populate=cap <= WARM_BYTES).array
        except OSError as e:
            punch_hole(self.fd, off, cap)
            self._give_region(off, cap)
            return None, NoSlot("oserror", cap, self.bytes + cap, nbytes, str(e))
        idx = self.free_idx.pop()
        self.uid += 1
        slot = WorkerSlot(idx, self.uid, off, cap, arr, self.fd)
        self.slots[idx] = slot
        self.bytes += cap
        c = self.counters
        c[C_ALLOCATIONS] += 1
        c[C_BYTES] = self.bytes
        c[C_SLOTS] = len(self.slots)
        return slot, None

    def retire(self, slot: WorkerSlot) -> None:
        """Give a free slot's memory back to the system."""
        del self.slots[slot.idx]
        self.states[slot.idx] = RETIRED
        punch_hole(self.fd, slot.off, slot.cap)
        slot.u8 = slot.arr = slot._typed = None  # unmapped once no view is left
        self.free_idx.append(slot.idx)
        self._give_region(slot.off, slot.cap)
        self.bytes -= slot.cap
        c = self.counters
        c[C_RETIRED] += 1
        c[C_BYTES] = self.bytes
        c[C_SLOTS] = len(self.slots)

    def _take_region(self, cap: int) -> int:
        for i, (off, size) in enumerate(self.free_regions):
            if size >= cap:
                if size == cap:
                    del self.free_regions[i]
                else:
                    self.free_regions[i] = (off + cap, size - cap)
                return off
        off = self.end
        self.end += cap
        return off

    def _give_region(self, off: int, cap: int) -> None:
        if off + cap == self.end:
            self.end = off
        else:
            self.free_regions.append((off, cap))

    def let_go_of_tail(self, slot: WorkerSlot) -> None:
        """Drop this worker's page-table entries for the part of a huge slot
        that goes ``COLD`` once its batch is consumed; call once the batch is
        written. The pages stay in the arena for the main process to read;
        torch's worker likewise unmaps a batch once sent. Without this the
        main process's ``MADV_REMOVE`` tears these entries down, in the
        consumer's thread. Page-locked slots keep every page (``keeps_pages``)."""
        kept = self._file_from(slot.cap)
        if kept < slot.cap:
            drop_pages(slot.arr.ctypes.data + kept, slot.cap - kept)

    def close(self) -> None:
        for s in self.slots.values():
            s.u8 = s.arr = s._typed = None
        self.slots.clear()


class MainSlot:
    """A slot as the main process sees it: its region mapped, and the hook that
    hands it back to the worker when the last view of its batch dies."""

    __slots__ = ("uid", "off", "cap", "map", "base", "release", "ref", "__weakref__")

    def __init__(self, fd, uid, off, cap, release):
        self.uid, self.off, self.cap, self.release = uid, off, cap, release
        # A slot of at most WARM_BYTES keeps its pages: mapping them all now
        # makes every later read of it fault-free. A bigger one loses most of
        # them each time its batch is released, and is read as torch's are.
        self.map = SharedMap(fd, cap, off, populate=cap <= WARM_BYTES)
        self.base = self.map.array
        self.ref = None
