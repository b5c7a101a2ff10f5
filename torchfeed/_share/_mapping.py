"""``SharedMapping``: a dict shared read-only between processes.

Key ``i`` (in the dict's order) is record ``i`` of its part's key column, its
value record ``i`` of its value column (``_buffer.py``). The key index is two
int64 arrays after them: the keys' stable hashes (``_stable_hash.py``) sorted, and the key
number of each. A lookup hashes the key, bisects the sorted hashes, and
loads and compares only the keys of equal hash; reading a value loads a
fresh object.

A ``defaultdict``'s ``default_factory`` travels with the mapping: a missing
key gives ``default_factory()``, as a lookup in the original would, but the
shared dict does not grow.

Pickled by ``multiprocessing`` it travels as its pack's descriptor; by any
other pickler as the plain dict or defaultdict.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import ItemsView, Mapping, ValuesView
from multiprocessing import reduction
from typing import Any, Callable

from ._buffer import SharedBuffer, is_special, load_special
from ._equality import same_value
from ._readonly import OneBuffer, refusing
from ._records import refuse_inside_records
from ._stable_hash import UnstableKey, same_key, stable_hash

_SHORT_REPR = 6


@refuse_inside_records
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

    __slots__ = ("_buffer", "_part", "_view", "_offsets", "_loads", "_key_offsets", "_key_loads",
                 "_len", "_hashes", "_order", "default_factory", "original_type")
    _buffer: SharedBuffer
    _part: int
    _view: memoryview
    _offsets: memoryview
    _loads: Callable[[Any], Any]
    _key_offsets: memoryview
    _key_loads: Callable[[Any], Any]
    _len: int
    _hashes: memoryview
    _order: memoryview
    default_factory: Callable[[], Any] | None
    original_type: type

    def __init__(self, *args, **kwargs):
        raise TypeError("SharedMapping is made by torchfeed.share(a_dict)")

    @classmethod
    def _attach(cls, buffer: SharedBuffer, part: int, default_factory=None) -> "SharedMapping":
        entry = buffer.parts[part]
        self = object.__new__(cls)
        self._buffer, self._part = buffer, part
        self._view = buffer.view
        self._key_offsets, self._key_loads = buffer.column(part, 0)
        self._offsets, self._loads = buffer.column(part, 1)
        self._len = n = entry.items
        self._hashes = buffer.index(entry.index_at, n) if n else memoryview(b"").cast("q")
        self._order = buffer.index(entry.index_at + 8 * n, n) if n else self._hashes
        self.default_factory = default_factory
        self.original_type = defaultdict if entry.kind == "defaultdict" else dict
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind this mapping (all processes together)."""
        keys, values, n = self._key_offsets, self._offsets, self._len
        return (keys[n] - keys[0] + values[n] - values[0] + keys.nbytes + values.nbytes
                + 2 * self._hashes.nbytes)

    def _key(self, i: int):
        offsets = self._key_offsets
        return self._key_loads(self._view[offsets[i]:offsets[i + 1]])

    def _value(self, i: int):
        offsets = self._offsets
        data = self._view[offsets[i]:offsets[i + 1]]
        try:
            return self._loads(data)
        except Exception:
            if not is_special(data):
                raise
            return load_special(self._buffer, data)

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
            if same_key(self._key(i), key):
                return i
            at += 1
        return -1

    def __getitem__(self, key):
        i = self._find(key)
        if i < 0:
            if self.default_factory is not None:
                return self.default_factory()
            raise KeyError(key)
        return self._value(i)

    def __contains__(self, key) -> bool:
        return self._find(key) >= 0

    def get(self, key, default=None):
        i = self._find(key)
        return default if i < 0 else self._value(i)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        return self._buffer.records(self._part, column=0)

    def __reversed__(self):
        return self._buffer.records(self._part, self._len - 1, -1, -1, column=0)

    def values(self):
        return _SharedValues(self)

    def items(self):
        return _SharedItems(self)

    def _pairs(self):
        return zip(self._buffer.records(self._part, column=0), self._buffer.records(self._part))

    def __eq__(self, other):
        if isinstance(other, SharedMapping) and other._buffer is self._buffer \
                and other._part == self._part:
            return True
        if not isinstance(other, Mapping):
            return NotImplemented
        if len(other) != self._len:
            return False
        missing = object()
        for key, value in self._pairs():
            theirs = other.get(key, missing)
            if theirs is missing:
                theirs = next((v for k, v in other.items() if same_key(k, key)), missing)
            if theirs is missing or not same_value(value, theirs):
                return False
        return True

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

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
        if self.original_type is defaultdict:
            return defaultdict(self.default_factory, self._pairs())
        return dict(self._pairs())

    def __repr__(self) -> str:
        shown = itertools.islice(self._pairs(), _SHORT_REPR)
        head = [f"{k!r}: {v!r}" for k, v in shown]
        if self._len > _SHORT_REPR:
            head.append(f"... ({self._len} items)")
        return f"SharedMapping({{{', '.join(head)}}})"

    # -- pickling -------------------------------------------------------------------
    def __reduce_ex__(self, protocol):
        # any pickler but multiprocessing's: the plain dict or defaultdict
        if self.original_type is defaultdict:
            return defaultdict, (self.default_factory,), None, None, self._pairs()
        return dict, (), None, None, self._pairs()

    def _reduce_for_process(self):
        # multiprocessing's: the pack's descriptor (one, however many containers)
        return SharedMapping._attach, (self._buffer, self._part, self.default_factory)


reduction.ForkingPickler.register(SharedMapping, SharedMapping._reduce_for_process)


class _SharedValues(ValuesView):
    __slots__ = ()
    _mapping: SharedMapping

    def __iter__(self):
        mapping = self._mapping
        return mapping._buffer.records(mapping._part)

    def __contains__(self, value) -> bool:
        return any(same_value(v, value) for v in self)


class _SharedItems(ItemsView):
    __slots__ = ()
    _mapping: SharedMapping

    def __iter__(self):
        return self._mapping._pairs()


refusing(SharedMapping, {
    "__setitem__": "item assignment", "__delitem__": "item deletion", "__ior__": "|=",
    "update": "update", "pop": "pop", "popitem": "popitem", "setdefault": "setdefault",
    "clear": "clear",
})
