"""The memory behind a shared container: one sealed memfd, written once, then
mapped read-only by every process that holds the container.

Layout of the file (every integer little-endian int64)::

    header (64 bytes): magic, kind, items, records, offsets_at, index_at, hash_modulus
    records            one pickle each, back to back, from byte 64
    offsets            records + 1 offsets: record r is [offsets[r], offsets[r+1])
    index              what the kind keeps besides (a dict's key index, ``_mapping.py``)

A record is written by one ``Pickler`` whose memo is cleared after each
record, so each record loads alone, with one ``pickle.loads`` of a slice of
the mapping: a reader builds fresh objects and never writes a shared page.

Lifetime: the memfd has no name, so nothing can be left in ``/dev/shm``; its
memory goes back when the last descriptor and the last mapping of it go,
whichever process held them, a SIGKILLed one included. After writing, the
file is sealed (``F_SEAL_WRITE``/``GROW``/``SHRINK``): no process can change
it, and a process that opens it through ``/proc/<pid>/fd`` (another rank,
``_ranks.py``) maps exactly what was written.

Pickling: ``multiprocessing``'s ``ForkingPickler`` (spawn and forkserver
process arguments, ``multiprocessing`` and ``torch.multiprocessing`` queues)
sends a ``SharedBuffer`` as a duplicated descriptor (``reduction.DupFd``): a
handle of a few hundred bytes whatever the data's size. Any other pickler
(``pickle.dumps``, ``torch.save``) writes the buffer's bytes, so the pickle
loads anywhere, into a new buffer.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import struct
import sys
import weakref
from multiprocessing import reduction
from typing import Iterable, NamedTuple

import numpy as np

from .. import _host
from .._transport import _arena

MAGIC = b"TFSHARE1"
HEADER = struct.Struct("<8s8sqqqqq")
HEADER_BYTES = 64
PICKLE_PROTOCOL = 5
# Records are pickled into memory and moved into the memfd in pieces of about
# this size, so building a buffer holds at most this much besides the buffer.
FLUSH_BYTES = 32 << 20


class Header(NamedTuple):
    kind: str            # "list", "tuple", "dict", "ndarray"
    items: int           # items of the container (a dict's keys)
    records: int         # pickled records (a dict keeps two per key)
    offsets_at: int      # where the records' offsets start
    index_at: int        # where the kind's index starts (0: none)
    hash_modulus: int    # sys.hash_info.modulus where a dict's index was built


def supported() -> str | None:
    """Why shared containers cannot be built here, or None."""
    if not _host.SHARED_CONTAINERS:
        return (f"torchfeed.share needs memfd_create and file seals (Linux 3.17 or later), "
                f"which this host ({_host.PLATFORM}) lacks")
    if sys.byteorder != "little":
        return "torchfeed.share needs a little-endian machine"
    return None


class _Unpicklable(TypeError):
    def __init__(self, position: int, exc: BaseException):
        super().__init__(str(exc))
        self.position = position


class BufferWriter:
    """A new buffer being written: records first, then the offsets and the
    kind's index, then the header; ``finish`` seals it and maps it."""

    def __init__(self, name: str | None):
        label = f"torchfeed-share-{name}" if name else "torchfeed-share"
        self.fd = _sealable_memfd(label)
        self._end = HEADER_BYTES
        self.offsets: np.ndarray = np.zeros(1, np.int64)

    def write_records(self, items: Iterable) -> None:
        """Pickle each of ``items`` as one record (call once)."""
        pending = io.BytesIO()
        pickler = pickle.Pickler(pending, protocol=PICKLE_PROTOCOL)
        pickler.dispatch_table = _RECORD_REDUCERS  # consulted only for non-builtin types
        offsets: list[int] = []
        note, where, dump, forget = offsets.append, pending.tell, pickler.dump, pickler.clear_memo
        base = self._end
        position = -1
        try:
            for position, item in enumerate(items):
                note(base + where())
                dump(item)
                forget()
                if where() >= FLUSH_BYTES:
                    base = self._flush(pending)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise _Unpicklable(position, exc) from exc
        note(base + where())
        self._flush(pending)
        self.offsets = np.asarray(offsets, dtype=np.int64) if offsets else np.array([self._end], np.int64)

    def _flush(self, pending: io.BytesIO) -> int:
        with pending.getbuffer() as view:
            _arena.write_at(self.fd, view, self._end)
            self._end += len(view)
        pending.seek(0)
        pending.truncate()
        return self._end

    def append(self, data, align: int = 8) -> int:
        """Write ``data`` (a buffer) at the next ``align``-byte boundary; its offset."""
        at = -(-self._end // align) * align
        _arena.write_at(self.fd, data, at)
        self._end = at + memoryview(data).nbytes
        return at

    def finish(self, kind: str, items: int, index: bytes | np.ndarray | None = None
               ) -> "SharedBuffer":
        offsets_at = self.append(self.offsets)
        index_at = self.append(index) if index is not None and len(index) else 0
        header = HEADER.pack(MAGIC, kind.encode(), items, len(self.offsets) - 1, offsets_at,
                             index_at, sys.hash_info.modulus)
        _arena.write_at(self.fd, header, 0)
        os.ftruncate(self.fd, max(self._end, HEADER_BYTES))
        _seal(self.fd)
        fd, self.fd = self.fd, -1
        return SharedBuffer(fd, populate=True)

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _sealable_memfd(label: str) -> int:
    if not _host.SHARED_CONTAINERS:
        raise RuntimeError(supported())
    return os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def _seal(fd: int) -> None:
    """No process may write, grow or shrink ``fd`` from now on (Linux's file seals)."""
    if not _host.HAS_SEALING:
        raise RuntimeError(supported())
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE)


def _refuse_nested(buffer):
    raise TypeError("a shared container cannot hold another one (each read would copy it "
                    "into new shared memory); share the plain data in one piece")


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class SharedBuffer:
    """A sealed memfd mapped read-only: ``view`` (a memoryview of the whole
    file, mapped at ``address``), ``header``, ``offsets`` (int64 memoryview),
    ``nbytes``.

    Owns one descriptor, closed when the buffer is garbage; the mapping lives
    on while any view of it does (``_arena.SharedMap``).

    The process that writes a buffer maps all of it at once (``populate``):
    a page mapped by two processes counts as shared, so a worker that alone
    reads some part of the buffer does not see that part in its private
    memory (USS, what ``stats()`` and the copy-on-read warning read). Other
    processes map pages as they read them."""

    __slots__ = ("fd", "nbytes", "address", "view", "header", "offsets", "_finalizer",
                 "__weakref__")

    def __init__(self, fd: int, populate: bool = False):
        self.fd = fd
        self._finalizer = weakref.finalize(self, _close, fd)
        self.nbytes = os.fstat(fd).st_size
        mapping = _arena.SharedMap(fd, self.nbytes, populate=populate, writable=False)
        self.address = mapping.addr
        self.view = memoryview(mapping.array)
        magic, kind, *rest = HEADER.unpack_from(self.view, 0)
        if magic != MAGIC:
            raise ValueError("torchfeed.share: this memory is not a shared container's "
                             "(or was written by another torchfeed version)")
        self.header = Header(kind.rstrip(b"\0").decode(), *rest)
        at = self.header.offsets_at
        self.offsets = self.view[at:at + 8 * (self.header.records + 1)].cast("q")

    def record(self, r: int):
        """Record ``r``, loaded: a fresh object."""
        offsets = self.offsets
        return pickle.loads(self.view[offsets[r]:offsets[r + 1]])

    def records(self, start: int = 0, stop: int | None = None, step: int = 1):
        """Records ``start``, ``start + step``, ... before ``stop``, loaded."""
        offsets, view, loads = self.offsets, self.view, pickle.loads
        stop = self.header.records if stop is None else stop
        for r in range(start, stop, step):
            yield loads(view[offsets[r]:offsets[r + 1]])

    def index(self, at: int, count: int) -> memoryview:
        """``count`` int64s of the kind's index from byte ``at``."""
        return self.view[at:at + 8 * count].cast("q")

    # -- handles --------------------------------------------------------------
    @classmethod
    def open_path(cls, path: str) -> "SharedBuffer":
        """The buffer another process holds, through ``/proc/<pid>/fd/<fd>``."""
        if not _host.HAS_PROC:
            raise OSError(f"no /proc on this host ({_host.PLATFORM})")
        return cls(os.open(path, os.O_RDONLY | os.O_CLOEXEC))

    def reduce_for_process(self):
        """ForkingPickler's reduction: a duplicate of the descriptor."""
        if not _host.HAS_FD_PASSING:  # no buffer exists there: no memfd
            raise TypeError(f"a shared container cannot be sent on {_host.PLATFORM}")
        return SharedBuffer._from_handle, (reduction.DupFd(self.fd),)

    @staticmethod
    def _from_handle(dup) -> "SharedBuffer":
        return SharedBuffer(dup.detach())

    def __reduce__(self):
        # Storage (pickle.dumps, torch.save): the bytes themselves.
        return _buffer_from_bytes, (bytes(self.view),)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _buffer_from_bytes(data: bytes) -> SharedBuffer:
    writer = BufferWriter(None)
    try:
        _arena.write_at(writer.fd, data, 0)
        os.ftruncate(writer.fd, len(data))
        _seal(writer.fd)
        fd, writer.fd = writer.fd, -1
    except BaseException:
        writer.abandon()
        raise
    return SharedBuffer(fd, populate=True)


reduction.ForkingPickler.register(SharedBuffer, SharedBuffer.reduce_for_process)
_RECORD_REDUCERS = {**copyreg.dispatch_table, SharedBuffer: _refuse_nested}
