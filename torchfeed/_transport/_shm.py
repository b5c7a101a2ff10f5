"""The shared-memory transport's channel: the arenas, and who may use which.

``ShmChannel`` is created in the main process before the workers start and is
passed to each of them as a process argument. It owns one memfd arena per
worker (``_slots.py``); pickling it for spawn or forkserver passes the
descriptors with the process, fork inherits them. In a worker, ``packer()``
keeps that worker's arena and closes the others (``_packer.py``); in the main
process, ``unpacker()`` maps the slots the workers fill (``_unpacker.py``).

Restarts: a worker replaced after a crash (``max_worker_restarts``) gets a
fresh arena from ``ShmChannel.renew``, never the dead worker's, whose slots may
hold batches the user keeps; the old arena's memory goes back as those die.
Slot uids carry the arena's generation, so a stale message cannot be read
from the new arena.

If the main process is killed, the workers' exit closes the last descriptors
and the kernel frees everything: there is no name to leak.
"""

from __future__ import annotations

import os
import warnings
import weakref
from multiprocessing import reduction

from .. import _host
from . import _arena
from ._packer import Packer, ShmFallbackWarning
from ._unpacker import Unpacker


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
                    self._fds.append(_arena.create_arena(w))
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
        if not _host.HAS_FD_PASSING:  # no channel exists there: no memfd
            raise RuntimeError(f"torchfeed: shared-memory slots cannot be sent on {_host.PLATFORM}")
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
        fd = _arena.create_arena(worker_id)
        old, self._fds[worker_id] = self._fds[worker_id], fd
        self._generations[worker_id] += 1
        if self._unpacker is not None and not self._unpacker.closed:
            self._unpacker.renew(worker_id, old)
        elif old >= 0:
            os.close(old)

    @property
    def fds(self) -> list[int]:
        """The arenas' descriptors, by worker (-1 where closed); ``renew``
        replaces one in place."""
        return self._fds

    def generation(self, worker_id: int) -> int:
        """How many times worker ``worker_id``'s arena was renewed."""
        return self._generations[worker_id]

    def close_descriptors(self) -> None:
        """Close this process's arena descriptors (once; the unpacker's end)."""
        self._finalizer()

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
