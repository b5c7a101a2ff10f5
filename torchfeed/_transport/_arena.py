"""An arena's memory at the level of system calls: the memfd itself,
mappings that hold no descriptor, and pages given back (``punch_hole``,
``SharedMap.remove``) or taken again (``refill``). What the regions of an
arena mean, slots and their states, is ``_slots.py``'s.

Every region is allocated with ``posix_fallocate`` before it is mapped, so a
shortage is an ``OSError`` (ENOSPC/ENOMEM), never a SIGBUS on first touch.
Freed regions are punched out of the file (``fallocate(PUNCH_HOLE)``, or
``MADV_REMOVE`` through a mapping once the descriptor is closed), which returns
the memory even when some other process, a forked child say, still holds the
descriptor or a mapping. Mappings are made with libc (see :class:`SharedMap`)
so that they hold no descriptor: the main process keeps exactly one
descriptor per worker while the iterator runs, and none after it ends.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import weakref

import numpy as np

from .. import _host
from .._libc import MAP_FAILED, libc

CTRL_BYTES = mmap.PAGESIZE
REGION_ALIGN = 1 << 16
FIRST_REGION = REGION_ALIGN

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _no_slots(what: str) -> OSError:
    return OSError(errno.ENOSYS, f"{what} needs Linux's memfd_create, fallocate and MADV_REMOVE, "
                                 f"which this host ({_host.PLATFORM}) lacks")


def create_arena(worker_id: int) -> int:
    """A new, empty arena for one worker; returns its descriptor."""
    if not _host.SHM_SLOTS:
        raise _no_slots("a shared-memory arena")
    fd = os.memfd_create(f"torchfeed-transport-w{worker_id}", os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, CTRL_BYTES)
    except BaseException:
        os.close(fd)
        raise
    return fd


class SharedMap:
    """``length`` bytes of ``fd`` from ``offset``, mapped shared and read-write
    (read-only with ``writable=False``: ``torchfeed.share``'s containers).

    Python's ``mmap.mmap`` keeps a duplicate of the descriptor for as long as
    the mapping lives (before Python 3.13), which would cost one descriptor
    per slot and keep descriptors open in the user's batches after the
    iterator ends. This maps with libc instead: ``array`` (a uint8 numpy
    array) is the mapping; the memory is unmapped when the last view of
    ``array`` dies, and no descriptor is held.
    """

    __slots__ = ("addr", "length", "array")
    # (libc's madvise, MADV_REMOVE), bound on the class once libc is loaded: a
    # batch kept to the end of the program dies while the interpreter tears
    # modules down, and the class outlives this module's globals.
    _madvise_remove: tuple = ()

    def __init__(self, fd: int, length: int, offset: int = 0, populate: bool = False,
                 writable: bool = True):
        addr = _map_shared(fd, length, offset, populate, writable)
        self.addr, self.length = addr, length
        # a ctypes array has the buffer protocol; numpy's stubs do not list ctypes
        self.array = np.frombuffer((ctypes.c_ubyte * length).from_address(addr), np.uint8)  # type: ignore[call-overload]
        if not writable:
            self.array.flags.writeable = False  # a write would be a SIGSEGV, not an error
        fin = weakref.finalize(self.array, libc().munmap, addr, length)
        fin.atexit = False  # exiting unmaps anyway; earlier could pull memory from live views

    def remove(self, start: int = 0) -> None:
        """Give the pages from ``start`` (page-aligned) to the end back to the
        system (later reads see zeros); only where the slots exist
        (``MADV_REMOVE``, bound by ``__init__``)."""
        if start >= self.length:
            return
        madvise, remove = self._madvise_remove
        if madvise(self.addr + start, self.length - start, remove) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))


def _map_shared(fd: int, length: int, offset: int, populate: bool, writable: bool) -> int:
    """libc's ``mmap`` of ``length`` bytes of ``fd`` at ``offset``, shared: its address."""
    if not _host.HAS_LIBC:
        raise _no_slots("a shared mapping without a descriptor")
    lib = libc()
    if not SharedMap._madvise_remove and _host.HAS_MADV_REMOVE:
        SharedMap._madvise_remove = (lib.madvise, mmap.MADV_REMOVE)
    flags = mmap.MAP_SHARED | (_MAP_POPULATE if populate else 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    addr = lib.mmap(None, length, prot, flags, fd, offset)
    if addr in (None, MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {length} bytes of shared memory failed: {os.strerror(e)}")
    return addr


def drop_pages(addr: int, length: int) -> None:
    """This process's page-table entries for ``length`` bytes at ``addr`` of
    a shared mapping, dropped; the pages stay in the arena for the other
    processes that map them, and come back on the next touch."""
    if not _host.SHM_SLOTS:
        raise _no_slots("dropping a slot's pages")
    libc().madvise(addr, length, mmap.MADV_DONTNEED)


def allocate(fd: int, off: int, length: int) -> None:
    """Pages for ``length`` bytes at ``off`` of arena ``fd``, now (``posix_fallocate``):
    a shortage is an ``OSError`` here, never a SIGBUS when they are touched."""
    if not _host.SHM_SLOTS:
        raise _no_slots("a slot's pages")
    os.posix_fallocate(fd, off, length)


def refill(fd: int, off: int, length: int) -> None:
    """Give back pages to ``length`` bytes of a slot whose pages were released
    (``COLD``): ``off`` in arena ``fd``.

    ``posix_fallocate``, so that a shortage is an ``OSError`` here and never
    a SIGBUS while the batch is written (a memfd write fault can raise one
    under ``vm.overcommit_memory=2``). The worker then writes them through
    the file (``write_at``), with no fault and no mapping in its process:
    on the 2-core test machine (kernel 6.18), mapping them first
    (``MAP_POPULATE``, ``MADV_POPULATE_WRITE``) cost more than the faults it
    saved, and writing through the file costs less than either."""
    if length > 0:
        allocate(fd, off, length)


def write_at(fd: int, data, offset: int) -> None:
    """Write ``data`` (a C-contiguous buffer) at ``offset`` of arena ``fd``
    with ``pwrite``, not through a mapping: the kernel copies into the
    arena's pages with no page fault and no page-table entry in this process
    (``WorkerPool.write`` says when that pays). The GIL is released meanwhile."""
    if not (_host.SHM_SLOTS or _host.SHARED_CONTAINERS):
        raise _no_slots("writing shared memory through its file")
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give back the memory of ``[offset, offset+length)`` of ``fd``."""
    if not _host.SHM_SLOTS:
        raise _no_slots("punching a hole")
    if length <= 0:
        return
    if libc().fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        if e not in (errno.EBADF,):
            raise OSError(e, os.strerror(e))


def punch(fd: int, keep=()) -> None:
    """Give back the memory of every slot region of arena ``fd`` except ``keep``.

    ``keep`` is a list of ``(offset, length)`` regions still referenced by
    batches the user holds.
    """
    size = os.fstat(fd).st_size
    start = FIRST_REGION
    for off, length in sorted(keep):
        punch_hole(fd, start, off - start)
        start = max(start, off + length)
    punch_hole(fd, start, size - start)
