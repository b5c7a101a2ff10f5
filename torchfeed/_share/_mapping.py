"""``SharedMapping``: a dict shared read-only between processes.

Key ``i`` (in the dict's order) is record ``2i`` of the buffer, its value
record ``2i + 1``. The key index is two int64 arrays after the records: the
keys' stable hashes (``_stable_hash.py``) sorted, and the key number of
each. A lookup hashes the key, bisects the sorted hashes, and loads and
compares only the keys of equal hash; reading a value loads a fresh object.

A ``defaultdict``'s ``default_factory`` travels with the mapping: a missing
key gives ``default_factory()``, as a lookup in the original would, but the
shared dict does not grow.
"""

from __future__ import annotations

import bisect
import itertools
import pickle
import sys
from collections import defaultdict
from collections.abc import ItemsView, Mapping, ValuesView
from typing import Any, Callable

import numpy as np

from ._buffer import BufferWriter, SharedBuffer
from ._readonly import OneBuffer, refusing
from ._stable_hash import UnstableKey, stable_hash

_SHORT_REPR = 6


def build_mapping(items: dict, name: str | None) -> "SharedMapping":
    hashes = np.fromiter(map(stable_hash, items), dtype=np.int64, count=len(items))
    order = np.argsort(hashes, kind="stable")
    index = np.concatenate([hashes[order], order.astype(np.int64)])
    writer = BufferWriter(name)
    try:
        writer.write_records(itertools.chain.from_iterable(items.items()))
        buffer = writer.finish("dict", len(items), index)
    except BaseException as exc:
        writer.abandon()
        position = getattr(exc, "position", None)
        if position is not None:
            what = "key" if position % 2 == 0 else "value"
            raise TypeError(f"torchfeed.share: the {what} of the dict's item {position // 2} "
                            f"cannot be pickled: {exc}. Shared items are stored pickled; "
                            f"leave this dict unshared, or make its items picklable."
                            ) from exc.__cause__
        raise
    factory = items.default_factory if isinstance(items, defaultdict) else None
    return SharedMapping._attach(buffer, factory)


class SharedMapping(OneBuffer, Mapping):
    """A read-only dict whose keys and values live once in shared memory.

    Made by `torchfeed.share` from a dict or defaultdict (not constructed
    directly: ``SharedMapping(...)`` raises ``TypeError``); equal to the dict
    it was built from, in the same order, with ``keys()``, ``values()``,
    ``items()``, ``get``, ``in`` and ``|`` as a dict's.  Values come back as
    fresh objects on each read.  A shared ``defaultdict`` keeps
    ``default_factory``: a missing key gives ``default_factory()``, not
    inserted.  ``original_type`` is ``dict`` or ``defaultdict``.

    Raises:
        TypeError: on any write (``shared[k] = v``, ``update``, ``pop``,
            ``setdefault``, ...), naming the operation and how to get a mutable
            copy (``dict(shared)``).
        KeyError: a missing key, as a dict's (without ``default_factory``).
    """

    __slots__ = ("_buffer", "_view", "_offsets", "_len", "_hashes", "_order",
                 "default_factory", "original_type")
    _buffer: SharedBuffer
    _view: memoryview
    _offsets: memoryview
    _len: int
    _hashes: memoryview
    _order: memoryview
    default_factory: Callable[[], Any] | None
    original_type: type

    def __init__(self, *args, **kwargs):
        raise TypeError("SharedMapping is made by torchfeed.share(a_dict)")

    @classmethod
    def _attach(cls, buffer: SharedBuffer, default_factory=None) -> "SharedMapping":
        header = buffer.header
        if header.hash_modulus != sys.hash_info.modulus:
            # built where numbers hash differently (another platform): reindex
            values = dict(_pairs(buffer))
            return build_mapping(values if default_factory is None
                                 else defaultdict(default_factory, values), None)
        self = object.__new__(cls)
        self._buffer = buffer
        self._view, self._offsets = buffer.view, buffer.offsets
        self._len = n = header.items
        self._hashes = buffer.index(header.index_at, n) if n else memoryview(b"").cast("q")
        self._order = buffer.index(header.index_at + 8 * n, n) if n else self._hashes
        self.default_factory = default_factory
        self.original_type = defaultdict if default_factory is not None else dict
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind this mapping (all processes together)."""
        return self._buffer.nbytes

    def _record(self, r: int):
        offsets = self._offsets
        return pickle.loads(self._view[offsets[r]:offsets[r + 1]])

    def _find(self, key) -> int:
        """The key number of ``key``, or -1."""
        try:
            h = stable_hash(key)
        except UnstableKey:
            return -1  # no such key can be in a shared dict
        hashes, order = self._hashes, self._order
        at = bisect.bisect_left(hashes, h)
        while at < self._len and hashes[at] == h:
            i = order[at]
            stored = self._record(2 * i)
            if stored is key or stored == key:
                return i
            at += 1
        return -1

    def __getitem__(self, key):
        i = self._find(key)
        if i < 0:
            if self.default_factory is not None:
                return self.default_factory()
            raise KeyError(key)
        return self._record(2 * i + 1)

    def __contains__(self, key) -> bool:
        return self._find(key) >= 0

    def get(self, key, default=None):
        i = self._find(key)
        return default if i < 0 else self._record(2 * i + 1)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return self._buffer.records(0, 2 * self._len, 2)

    def __reversed__(self):
        return self._buffer.records(2 * self._len - 2, -1, -2)

    def values(self):
        return _SharedValues(self)

    def items(self):
        return _SharedItems(self)

    def __eq__(self, other):
        if isinstance(other, SharedMapping) and other._buffer is self._buffer:
            return True
        if not isinstance(other, Mapping):
            return NotImplemented
        if len(other) != self._len:
            return False
        missing = object()
        return all(other.get(k, missing) == v for k, v in _pairs(self._buffer))

    __hash__ = None  # type: ignore[assignment]

    def __or__(self, other):
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) | dict(other.items())

    def __ror__(self, other):
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(other.items()) | dict(self.items())

    def copy(self) -> dict:
        """A plain, mutable copy (a ``defaultdict`` for a shared defaultdict)."""
        if self.default_factory is not None:
            return defaultdict(self.default_factory, self.items())
        return dict(self.items())

    def __repr__(self) -> str:
        shown = itertools.islice(_pairs(self._buffer), _SHORT_REPR)
        head = [f"{k!r}: {v!r}" for k, v in shown]
        if self._len > _SHORT_REPR:
            head.append(f"... ({self._len} items)")
        return f"SharedMapping({{{', '.join(head)}}})"

    # -- one buffer, whatever the copy --------------------------------------------
    def __reduce__(self):
        # the buffer travels as a descriptor (ForkingPickler) or as its bytes
        return SharedMapping._attach, (self._buffer, self.default_factory)


def _pairs(buffer: SharedBuffer):
    records = buffer.records()
    return zip(records, records)


class _SharedValues(ValuesView):
    __slots__ = ()
    _mapping: SharedMapping

    def __iter__(self):
        mapping = self._mapping
        return mapping._buffer.records(1, 2 * mapping._len, 2)


class _SharedItems(ItemsView):
    __slots__ = ()
    _mapping: SharedMapping

    def __iter__(self):
        return _pairs(self._mapping._buffer)


refusing(SharedMapping, {
    "__setitem__": "item assignment", "__delitem__": "item deletion", "__ior__": "|=",
    "update": "update", "pop": "pop", "popitem": "popitem", "setdefault": "setdefault",
    "clear": "clear",
})
