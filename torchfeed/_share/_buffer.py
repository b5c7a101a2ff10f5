"""The memory behind shared data: one sealed memfd, a *pack*, that holds one or
more shared containers and arrays, written once (``_writer.py``), then mapped
read-only by every process that holds any of them.

Layout of the file (integers little-endian)::

    header (64 bytes)  magic, format, directory_at, directory_len, hash_modulus, python
    records            pickles, back to back (each container's, and shared objects')
    offsets, indexes   per container: where each record starts, a dict's key index
    array data         each array's bytes, page-aligned
    directory          a pickle of plain tuples: what each part is and where it lies

A part is a container (``("seq", ...)``, ``("map", ...)``), an array
(``("array", ...)``) or the pack's shared objects (``("objects", ...)``):
what several records hold is stored once, as a record of its own, and the
others refer to it (``_writer.py``). A container's records form columns: a
sequence's items, a dict's keys and its values. A column's records load
alone, each with one call on a slice of the mapping (its ``codec``: a
``pickle``, or for a column of only ``str``, ``bytes`` or ``int`` items their
UTF-8 bytes, bytes, or 8-byte integers, with no pickle at all), into fresh
objects; a pickle record that refers to others starts with a byte no pickle
starts with (``REF``, ``WITH_REFS``) and loads through ``load_special``.

Lifetime: the memfd has no name, so nothing can be left in ``/dev/shm``; its
memory goes back when the last descriptor and the last mapping of it go,
whichever process held them, a SIGKILLed one included. After writing, the
file is sealed (``F_SEAL_WRITE``/``GROW``/``SHRINK``), and every process that
maps it checks the seals first (``open_path`` included: another rank's
descriptor, ``_ranks.py``): no process can change what the others read.

One descriptor per pack and process: a handle that arrives for a pack this
process holds already (the same inode) reuses it, so batches or queues that
carry shared data never pile up descriptors or mappings.

Pickling: ``multiprocessing``'s ``ForkingPickler`` (spawn and forkserver
process arguments, ``multiprocessing`` and ``torch.multiprocessing`` queues)
sends a ``SharedBuffer`` as a duplicated descriptor (``reduction.DupFd``).
Containers and arrays pickle as their plain values under any other pickler
(``_sequence.py``, ``_mapping.py``, ``_arrays.py``), so a buffer itself is
never pickled there.

Linux-only names (``fcntl``, ``os.memfd_create``, libc's ``mmap``) are looked
up inside functions, so importing this module works everywhere.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import struct
import sys
import weakref
from multiprocessing import reduction
from typing import Callable, NamedTuple

import numpy as np

from .. import _host
from .._libc import MAP_FAILED, libc

MAGIC = b"TFSHARE2"
HEADER = struct.Struct("<8sqqqqq")
HEADER_BYTES = 64
PAGE = 4096
PYTHON = sys.hexversion >> 16  # what wrote it: a dict's index holds this Python's number hashes

# A pickle column's record that refers to others: the first byte says how (no
# pickle starts with either).
REF = 0xFF        # then "<qq": the record is record (part, r), stored once elsewhere
WITH_REFS = 0xFE  # then a pickle whose persistent ids (part, r) name records stored elsewhere
_REF_AT = struct.Struct("<qq")


class Part(NamedTuple):
    """One entry of a pack's directory."""

    what: str            # "seq", "map", "array", "objects"
    kind: str            # "list", "tuple", "dict", "defaultdict", "ndarray", ""
    items: int           # a container's items (a dict's keys), an array's elements
    columns: tuple       # ((codec, offsets_at), ...): a dict's keys, then the items
    index_at: int        # a dict's key index (0: none)
    extra: tuple         # arrays: (dtype, shape, strides, data_at, nbytes); else ()


def supported() -> str | None:
    """Why shared containers cannot be built here, or None."""
    if not _host.SHARED_CONTAINERS:
        return (f"torchfeed.share needs memfd_create and file seals (Linux 3.17 or later), "
                f"which this host ({_host.PLATFORM}) lacks")
    if sys.byteorder != "little":
        return "torchfeed.share needs a little-endian machine"
    return None


def seals(final: bool = True) -> int:
    """The seals every pack carries (and, ``final``, the seal on the seals)."""
    if not _host.HAS_SEALING:
        raise RuntimeError(supported())
    import fcntl
    needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
    return needed | fcntl.F_SEAL_SEAL if final else needed


def seal(fd: int) -> None:
    """No process may write, grow or shrink ``fd`` from now on (Linux's file seals)."""
    if not _host.HAS_SEALING:
        raise RuntimeError(supported())
    import fcntl
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals())


def _check_seals(fd: int) -> None:
    if not _host.HAS_SEALING:
        raise RuntimeError(supported())
    import fcntl
    try:
        present = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ValueError(f"torchfeed.share: this memory cannot be sealed ({exc}), so another "
                         f"process could change it; it is not a shared container's") from None
    missing = seals(final=False) & ~present
    if missing:
        raise ValueError("torchfeed.share: this memory is not sealed against writes, growing "
                         "and shrinking, so another process could change it under its "
                         "readers; only sealed memory is mapped")


def map_file(fd: int, offset: int, length: int, *, private: bool = False,
             populate: bool = False) -> np.ndarray:
    """``length`` bytes of ``fd`` from ``offset`` (page-aligned), as a uint8 array
    that owns the mapping: unmapped when the last view of it dies. No
    descriptor is kept (Python's ``mmap`` keeps one per mapping before 3.13).

    Shared: read-only. ``private``: copy-on-write, writable: a write costs
    this process a private page and changes nothing another process sees.
    ``populate`` maps every page now (readable, so a private mapping's pages
    stay the file's until written: populating it writable would copy them)."""
    if not _host.SHARED_CONTAINERS:  # no pack exists to map here
        raise RuntimeError(supported())
    import ctypes
    import mmap
    lib = libc()
    length = max(length, 1)
    kind = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
    flags = kind | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    addr = lib.mmap(None, length, mmap.PROT_READ, flags, fd, offset)
    if addr in (None, MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {length} bytes of shared memory failed: {os.strerror(e)}")
    if private and lib.mprotect(addr, length, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
        e = ctypes.get_errno()
        lib.munmap(addr, length)
        raise OSError(e, f"mprotect of a copy-on-write mapping failed: {os.strerror(e)}")
    # a ctypes array has the buffer protocol; numpy's stubs do not list ctypes
    array = np.frombuffer((ctypes.c_ubyte * length).from_address(addr), np.uint8)  # type: ignore[call-overload]
    if not private:
        array.flags.writeable = False  # a write would be a SIGSEGV, not an error
    fin = weakref.finalize(array, lib.munmap, addr, length)
    fin.atexit = False  # exiting unmaps anyway; earlier could pull memory from live views
    return array


# Every pack this process maps, by (device, inode): a handle for one of them
# reuses it (one descriptor and one mapping per pack and process).
_open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class SharedBuffer:
    """A sealed memfd mapped read-only: ``view`` (a memoryview of the whole
    file, mapped at ``address``), ``parts`` (its directory), ``nbytes``.

    Owns one descriptor, closed when the buffer is garbage; the mapping lives
    on while any view of it does.

    The process that writes a pack maps all of it at once (``populate``): a
    page mapped by two processes counts as shared, so a worker that alone
    reads some part of the pack does not see that part in its private memory
    (USS, what ``stats()`` and the copy-on-read warning read). Other processes
    map pages as they read them."""

    __slots__ = ("fd", "nbytes", "address", "view", "parts", "key", "_loaders", "_finalizer",
                 "__weakref__")

    def __init__(self, fd: int, populate: bool = False):
        self.fd = fd
        self._finalizer = weakref.finalize(self, _close, fd)
        try:
            self._map(populate)
        except BaseException:
            self._finalizer()  # closes the descriptor, once
            raise
        _open.setdefault(self.key, self)

    def _map(self, populate: bool) -> None:
        fd = self.fd
        _check_seals(fd)
        st = os.fstat(fd)
        self.nbytes, self.key = st.st_size, (st.st_dev, st.st_ino)
        if self.nbytes < HEADER_BYTES:
            raise ValueError("torchfeed.share: this memory is not a shared container's")
        mapping = map_file(fd, 0, self.nbytes, populate=populate)
        self.address = mapping.ctypes.data
        self.view = memoryview(mapping)  # type: ignore[arg-type]
        magic, _format, directory_at, directory_len, modulus, python = HEADER.unpack_from(self.view, 0)
        if magic != MAGIC:
            raise ValueError("torchfeed.share: this memory is not a shared container's "
                             "(or was written by another torchfeed version)")
        if python != PYTHON or modulus != sys.hash_info.modulus:
            raise ValueError("torchfeed.share: this memory was written by another Python "
                             f"({python >> 8}.{python & 0xFF}); share the data again here")
        self.parts = [Part(*p) for p in
                      pickle.loads(self.view[directory_at:directory_at + directory_len])]
        self._loaders: dict[tuple, tuple] = {}

    def column(self, part: int, column: int = -1) -> tuple[memoryview, Callable]:
        """A column's offsets (one more than its records) and its codec's
        ``loads``; the last column, the items, by default."""
        key = (part, column)
        loader = self._loaders.get(key)
        if loader is None:
            p = self.parts[part]
            codec, at = p.columns[column]
            offsets = self.view[at:at + 8 * (p.items + 1)].cast("q")
            loader = self._loaders[key] = (offsets, loads_for(codec))
        return loader

    def index(self, at: int, count: int) -> memoryview:
        """``count`` int64s of a part's index from byte ``at``."""
        return self.view[at:at + 8 * count].cast("q")

    def load(self, part: int, r: int, refs: dict | None = None):
        """Record ``r`` of ``part``'s items, loaded: fresh objects."""
        offsets, loads = self.column(part)
        data = self.view[offsets[r]:offsets[r + 1]]
        try:
            return loads(data)
        except Exception:
            if not is_special(data):
                raise
            return load_special(self, data, refs)

    def records(self, part: int, start: int = 0, stop: int | None = None, step: int = 1,
                column: int = -1):
        """Records ``start``, ``start + step``, ... of a column before ``stop``, loaded."""
        offsets, loads = self.column(part, column)
        view = self.view
        if stop is None:
            stop = len(offsets) - 1
        for r in range(start, stop, step):
            data = view[offsets[r]:offsets[r + 1]]
            try:
                record = loads(data)
            except Exception:
                if not is_special(data):
                    raise
                record = load_special(self, data)
            yield record

    def map_private(self, offset: int, length: int) -> tuple[np.ndarray, int]:
        """A copy-on-write mapping of ``length`` bytes from ``offset``: the
        uint8 array that owns it, and where ``offset`` lies in it."""
        start = offset - offset % PAGE
        return map_file(self.fd, start, offset - start + length, private=True), offset - start

    # -- handles --------------------------------------------------------------
    @classmethod
    def open_path(cls, path: str) -> "SharedBuffer":
        """The pack another process holds, through ``/proc/<pid>/fd/<fd>``;
        refused unless it is sealed (``ValueError``)."""
        if not _host.HAS_PROC:
            raise OSError(f"no /proc on this host ({_host.PLATFORM})")
        return _adopt(os.open(path, os.O_RDONLY | os.O_CLOEXEC))

    def reduce_for_process(self):
        """ForkingPickler's reduction: a duplicate of the descriptor."""
        if not _host.HAS_FD_PASSING:  # no pack exists there: no memfd
            raise TypeError(f"a shared container cannot be sent on {_host.PLATFORM}")
        return _from_handle, (reduction.DupFd(self.fd),)

    def __reduce__(self):
        raise TypeError("a SharedBuffer is sent only to processes of this machine "
                        "(multiprocessing); shared containers pickle as their values")

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _adopt(fd: int) -> SharedBuffer:
    """The buffer for descriptor ``fd``, which this call owns: the one this
    process maps already for the same memory (``fd`` closed), or a new one."""
    try:
        st = os.fstat(fd)
        existing = _open.get((st.st_dev, st.st_ino))
    except BaseException:
        _close(fd)
        raise
    if existing is not None:
        _close(fd)
        return existing
    return SharedBuffer(fd)  # owns fd from here, and closes it if it fails


def _from_handle(dup) -> SharedBuffer:
    return _adopt(dup.detach())


_CODECS: dict[str, Callable] = {
    "pickle": pickle.loads,
    "str": functools.partial(str, encoding="utf-8", errors="surrogatepass"),
    "bytes": bytes,
    "int": functools.partial(int.from_bytes, byteorder="little", signed=True),
}


def loads_for(codec: str) -> Callable:
    return _CODECS[codec]


def is_special(data: memoryview) -> bool:
    return len(data) > 0 and data[0] >= WITH_REFS


def load_special(buffer: SharedBuffer, data: memoryview, refs: dict | None = None):
    """A record that refers to records stored elsewhere in ``buffer``
    (``REF``, ``WITH_REFS``, see ``is_special``).
    ``refs``: what this read loaded already, so that an object a record
    holds twice comes back as one object, as in the original."""
    first = data[0] if len(data) else -1
    if first == REF:
        part, r = _REF_AT.unpack_from(data, 1)
        return buffer.load(part, r, refs)
    if first == WITH_REFS:
        loaded = {} if refs is None else refs

        def persistent_load(pid):
            part, r = pid
            if pid not in loaded:
                loaded[pid] = buffer.load(part, r, loaded)
            return loaded[pid]

        unpickler = pickle.Unpickler(io.BytesIO(data[1:]))
        unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        return unpickler.load()
    raise ValueError(f"torchfeed.share: a record of unknown form (first byte {first})")


def ref_record(part: int, r: int) -> bytes:
    return bytes([REF]) + _REF_AT.pack(part, r)


reduction.ForkingPickler.register(SharedBuffer, SharedBuffer.reduce_for_process)
