"""Writing a pack (``_buffer.py``): one sealed memfd for several containers
and arrays at once, each a part.

``write_pack(objects, name)`` writes each object as a part, in one pass over
its items: a container's records (one pickle per item; a dict's key and
value as two), their offsets and a dict's key index; an array's bytes,
page-aligned, in the array's own memory order. What several records hold
(``_dedup.py``) is written once, where it first comes, or as a record of the
pack's ``objects`` part, and the other records refer to it.

A column of only ``str``, only ``bytes`` or only ``int`` (within int64)
items, a dict's keys most often, is written as their UTF-8 bytes, bytes or
8-byte integers (``_buffer._CODECS``), in C, with no pickle per item; any
other column as one pickle per record, by a pickler reused from record to
record (its memo cleared between them). Records are moved into the memfd in
pieces of about ``FLUSH_BYTES``, so building a pack holds at most that much
besides the pack.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import sys
import time
from collections import defaultdict
from typing import NamedTuple

import numpy as np

from .. import _host
from . import _dedup
from ._buffer import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    PAGE,
    PYTHON,
    WITH_REFS,
    SharedBuffer,
    ref_record,
    seal,
    supported,
)
from ._records import RecordPickler, RefPickler
from ._stable_hash import key_hashes

PICKLE_PROTOCOL = 5
FLUSH_BYTES = 16 << 20


class Unpicklable(TypeError):
    """Part ``part`` cannot be written: record ``position`` cannot be pickled
    (a dict's key ``2i``, value ``2i + 1``), or -1: ``exc`` says why."""

    def __init__(self, part: int, position: int, exc: BaseException):
        super().__init__(str(exc))
        self.part, self.position = part, position


class Written(NamedTuple):
    buffer: SharedBuffer
    seconds: list  # per object, the CPU-side time its part took to write


def write_pack(objects: list, name: str | None) -> Written:
    """One pack holding each of ``objects`` (exact list, tuple, dict,
    defaultdict, or a plain numpy array) as part ``i``; the pack's shared
    objects are part ``len(objects)``."""
    writer = _PackWriter(name, len(objects))
    try:
        seconds = writer.write(objects)
        return Written(writer.finish(), seconds)
    finally:
        writer.abandon()


def _items(obj) -> list | None:
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return None


def _sealable_memfd(label: str) -> int:
    if not _host.SHARED_CONTAINERS:  # share_all asks first (_buffer.supported)
        raise RuntimeError(supported())
    return os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


class _PackWriter:
    def __init__(self, name: str | None, count: int):
        label = f"torchfeed-share-{name}" if name else "torchfeed-share"
        self.fd = _sealable_memfd(label)
        self._end = HEADER_BYTES
        self.parts: list = [None] * (count + 1)
        self.objects_part = count
        self._stored: dict = {}  # id of an object stored once -> (part, record)
        self._objects = io.BytesIO()
        self._object_offsets: list[int] = []
        self._object_pickler = RefPickler(self._objects, self._stored)

    # -- the file -------------------------------------------------------------------
    def _write(self, data, at: int) -> None:
        if not _host.SHARED_CONTAINERS:  # unreachable there: no memfd was made (__init__)
            raise RuntimeError(supported())
        view = memoryview(data).cast("B")
        while view:
            written = os.pwrite(self.fd, view, at)
            view = view[written:]
            at += written

    def append(self, data, align: int = 8) -> int:
        """Write ``data`` (a buffer) at the next ``align``-byte boundary; its offset."""
        at = -(-self._end // align) * align
        self._write(data, at)
        self._end = at + memoryview(data).nbytes
        return at

    def _flush(self, pending: io.BytesIO) -> int:
        with pending.getbuffer() as view:
            self._write(view, self._end)
            self._end += len(view)
        pending.seek(0)
        pending.truncate()
        return self._end

    # -- the parts ------------------------------------------------------------------
    def write(self, objects: list) -> list:
        values = [_items(obj) for obj in objects]
        plan = _dedup.plan(values)
        seconds = [0.0] * len(objects)
        # Containers whose items are other objects' lists (imgToAnns) last: the
        # objects they hold are then records of their own already.
        order = sorted(range(len(objects)), key=lambda i: plan.index_like[i])
        for i in order:
            began = time.perf_counter()
            obj = objects[i]
            try:
                if isinstance(obj, np.ndarray):
                    self.parts[i] = self._array(obj)
                elif isinstance(obj, dict):
                    self.parts[i] = self._mapping(i, obj, plan.flagged[i], plan.nested[i],
                                                  plan.shared)
                else:
                    self.parts[i] = self._sequence(i, obj, plan.flagged[i], plan.nested[i],
                                                   plan.shared)
            except Unpicklable:
                raise
            except (TypeError, ValueError, pickle.PicklingError, RecursionError) as exc:
                raise Unpicklable(i, -1, exc) from exc
            seconds[i] = time.perf_counter() - began
        return seconds

    def _sequence(self, part: int, items, flagged, nested, shared) -> tuple:
        column = self._column(part, items, flagged, nested, shared)
        return ("seq", type(items).__name__, len(items), (column,), 0, ())

    def _mapping(self, part: int, items: dict, flagged, nested, shared) -> tuple:
        hashes = key_hashes(items)
        order = np.argsort(hashes, kind="stable")
        index = np.concatenate([hashes[order], order.astype(np.int64)])
        try:
            keys = self._column(part, list(items), [], None, shared)
        except Unpicklable as exc:  # a dict's key i is record 2i, its value 2i + 1
            exc.position *= 2
            raise
        try:
            values = self._column(part, list(items.values()), flagged, nested, shared)
        except Unpicklable as exc:
            exc.position = 2 * exc.position + 1
            raise
        index_at = self.append(index) if len(index) else 0
        kind = "defaultdict" if isinstance(items, defaultdict) else "dict"
        return ("map", kind, len(items), (keys, values), index_at, ())

    def _column(self, part: int, values, flagged, nested, shared) -> tuple:
        """One column of records: ``(codec, offsets_at)``."""
        codec = _plain_codec(values) if not flagged else None
        if codec is not None:
            offsets = self._plain(values, codec)
        else:
            codec = "pickle"
            special = self._special(part, nested, shared) if flagged else None
            offsets = self._records(part, values, iter(flagged), special)
        return codec, self.append(offsets)

    def _plain(self, values: list, codec: str) -> np.ndarray:
        """A column of str, bytes or int items, written in C a chunk at a time."""
        offsets = [np.zeros(1, np.int64)]
        at = self._end
        for start in range(0, len(values), _CHUNK):
            chunk = values[start:start + _CHUNK]
            data: bytes
            if codec == "int":
                data = np.fromiter(chunk, np.int64, len(chunk)).tobytes()
                lengths = np.full(len(chunk), 8, np.int64)
            else:
                pieces = list(map(_encode, chunk)) if codec == "str" else chunk
                lengths = np.fromiter(map(len, pieces), np.int64, len(pieces))
                data = b"".join(pieces)
            self._write(data, self._end)
            self._end += len(data)
            offsets.append(np.cumsum(lengths) + offsets[-1][-1])
        return np.concatenate(offsets) + at

    def _records(self, part: int, records, flagged: list, special) -> np.ndarray:
        """Pickle each record, back to back, ``_CHUNK`` records at a time; their
        offsets (one more than records)."""
        pending = io.BytesIO()
        pickler = RecordPickler(pending, protocol=PICKLE_PROTOCOL)
        where, dump, forget, put = pending.tell, pickler.dump, pickler.clear_memo, pending.write
        chunks = [np.zeros(0, np.int64)]
        flags = iter(flagged)
        following = next(flags, -1)
        start = 0
        try:
            while start < len(records):
                chunk = records[start:start + _CHUNK]
                offsets: list[int] = []
                note = offsets.append
                if following < 0 or following >= start + len(chunk):
                    for record in chunk:  # the common case: one call per step, nothing else
                        note(where())
                        dump(record)
                        forget()
                else:
                    for position, record in enumerate(chunk, start):
                        note(where())
                        if position == following:
                            put(special(position, record))
                            following = next(flags, -1)
                        else:
                            dump(record)
                            forget()
                chunks.append(np.asarray(offsets, np.int64) + self._end)
                self._flush(pending)
                start += len(chunk)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
            raise Unpicklable(part, self._failing(records, start), exc) from exc
        return np.concatenate(chunks + [np.array([self._end], np.int64)])

    @staticmethod
    def _failing(records, start: int) -> int:
        """The first record from ``start`` on that cannot be pickled."""
        for position in range(start, len(records)):
            try:
                RecordPickler(io.BytesIO(), protocol=PICKLE_PROTOCOL).dump(records[position])
            except Exception:
                return position
        return start

    def _special(self, part: int, nested, shared):
        """The writer of a record that holds, or is, an object stored once."""
        stored = self._stored
        pending = io.BytesIO()
        plain = RecordPickler(pending, protocol=PICKLE_PROTOCOL)
        with_refs = RefPickler(pending, stored)

        def write(position: int, item) -> bytes:
            key = id(item)
            if key in shared and key in stored:
                return ref_record(*stored[key])
            inner = [e for e in _dedup.children(item, nested) if id(e) in shared]
            for obj in inner:
                if id(obj) not in stored:
                    self._store_object(obj)
            pending.seek(0)
            pending.truncate()
            if inner:
                pending.write(bytes([WITH_REFS]))
                with_refs.record(item)
            else:
                plain.dump(item)
                plain.clear_memo()
            if key in shared:
                stored[key] = (part, position)
            return pending.getvalue()

        return write

    def _store_object(self, obj) -> None:
        """``obj`` as a record of the objects part, referred to from now on."""
        self._object_offsets.append(self._objects.tell())
        self._objects.write(bytes([WITH_REFS]))
        self._object_pickler.record(obj)
        self._stored[id(obj)] = (self.objects_part, len(self._object_offsets) - 1)

    def _array(self, array: np.ndarray) -> tuple:
        # its own memory order (C, Fortran, or the closest dense one): no copy
        # when it is contiguous already, and the same strides when read back
        # C or Fortran order kept (the same strides when read back); any other, C
        fortran = array.flags.f_contiguous and not array.flags.c_contiguous
        dense = array if array.flags.c_contiguous or fortran else np.array(array, order="C")
        flat = dense.reshape(-1, order="F") if fortran else dense.reshape(-1)
        data = flat.view(np.uint8) if dense.size else b""
        data_at = self.append(data, PAGE)
        return ("array", "ndarray", dense.size, (), 0,
                (dense.dtype, dense.shape, dense.strides, data_at, dense.nbytes))

    # -- the end --------------------------------------------------------------------
    def finish(self) -> SharedBuffer:
        offsets = np.asarray(self._object_offsets + [self._objects.tell()], np.int64)
        base = self._end
        self._flush(self._objects)
        self.parts[self.objects_part] = ("objects", "", len(self._object_offsets),
                                         (("pickle", self.append(offsets + base)),), 0, ())
        directory = pickle.dumps(self.parts, protocol=PICKLE_PROTOCOL)
        directory_at = self.append(directory)
        header = HEADER.pack(MAGIC, 2, directory_at, len(directory), sys.hash_info.modulus, PYTHON)
        self._write(header, 0)
        os.ftruncate(self.fd, self._end)
        seal(self.fd)
        fd, self.fd = self.fd, -1
        return SharedBuffer(fd, populate=True)

    def abandon(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_CHUNK = 1 << 16
_encode = functools.partial(str.encode, encoding="utf-8", errors="surrogatepass")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _plain_codec(values: list) -> str | None:
    """"str", "bytes" or "int" where every item is exactly that (an int within
    int64), else None (pickle)."""
    if not values:
        return None
    kinds = set(map(type, values))
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is str:
        return "str"
    if kind is bytes:
        return "bytes"
    if kind is int and _INT64[0] <= min(values) and max(values) <= _INT64[1]:
        return "int"
    return None
