"""``SharedSequence``: a list or tuple shared read-only between processes.

Item ``i`` is record ``i`` of its part of a pack (``_buffer.py``); reading it
loads a fresh object (one ``pickle.loads``, or for a list of only strings,
bytes or ints, one decode), so reading writes no shared page. It compares, hashes
(a tuple's), slices, adds and repeats as the list or tuple it was built
from (NaN items included, ``_equality.py``); slices and arithmetic give
plain lists or tuples.

Pickled by ``multiprocessing`` it travels as its pack's descriptor; by any
other pickler (``pickle.dumps``, ``torch.save``) as the plain list or tuple.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from multiprocessing import reduction
from typing import Any, Callable

from ._buffer import SharedBuffer, is_special, load_special
from ._equality import same_value
from ._readonly import OneBuffer, refusing
from ._records import refuse_inside_records

_SHORT_REPR = 6


@refuse_inside_records
class SharedSequence(OneBuffer, Sequence):
    """A read-only list or tuple whose items live once in shared memory.

    Made by `torchfeed.share` from a list or tuple (not constructed directly:
    ``SharedSequence(...)`` raises ``TypeError``); equal to the list (or
    tuple) it was built from, and it compares, hashes (a tuple's), slices,
    adds and repeats as that one does.  ``shared[i]`` is a fresh object on
    each read, a slice a plain list (or tuple).  ``original_type`` is
    ``list`` or ``tuple``.

    Raises:
        TypeError: on any write (``shared[i] = x``, ``append``, ``extend``,
            ``sort``, ...), naming the operation and how to get a mutable
            copy (``list(shared)``).
        IndexError: an index out of range, as a list's.
    """

    __slots__ = ("_buffer", "_part", "_view", "_offsets", "_loads", "_len", "original_type")
    _buffer: SharedBuffer
    _part: int
    _view: memoryview
    _offsets: memoryview
    _loads: Callable[[Any], Any]
    _len: int
    original_type: type

    def __init__(self, *args, **kwargs):
        raise TypeError("SharedSequence is made by torchfeed.share(a_list_or_tuple)")

    @classmethod
    def _attach(cls, buffer: SharedBuffer, part: int) -> "SharedSequence":
        self = object.__new__(cls)
        self._buffer, self._part = buffer, part
        self._view = buffer.view
        self._offsets, self._loads = buffer.column(part)
        self._len = buffer.parts[part].items
        self.original_type = tuple if buffer.parts[part].kind == "tuple" else list
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind this sequence (all processes together)."""
        offsets = self._offsets
        return offsets[self._len] - offsets[0] + offsets.nbytes

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        try:
            i = operator.index(i)
        except TypeError:
            if isinstance(i, slice):
                return self.original_type(self._buffer.records(self._part, *i.indices(self._len)))
            raise TypeError(f"{self.original_type.__name__} indices must be integers or "
                            f"slices, not {type(i).__name__}") from None
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"{self.original_type.__name__} index out of range")
        offsets = self._offsets
        data = self._view[offsets[i]:offsets[i + 1]]
        try:
            return self._loads(data)
        except Exception:
            if not is_special(data):
                raise
            return load_special(self._buffer, data)

    def __iter__(self):
        return self._buffer.records(self._part, 0, self._len)

    def __reversed__(self):
        return self._buffer.records(self._part, self._len - 1, -1, -1)

    def __contains__(self, value) -> bool:
        return any(same_value(item, value) for item in self)

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        begin, end, _ = slice(start, stop).indices(self._len)
        for i, item in enumerate(self._buffer.records(self._part, begin, end), begin):
            if same_value(item, value):
                return i
        raise ValueError(f"{value!r} is not in {self.original_type.__name__}")

    def count(self, value) -> int:
        return sum(1 for item in self if same_value(item, value))

    # -- as the original compares ------------------------------------------------
    def _comparable(self, other):
        if isinstance(other, SharedSequence):
            if other.original_type is not self.original_type:
                return None
            return other if other._buffer is self._buffer and other._part == self._part \
                else other.original_type(other)
        return other if isinstance(other, self.original_type) else None

    def __eq__(self, other):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        if mine is self:
            return True
        return len(mine) == self._len and all(map(same_value, self, mine))

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def _order(self, other, compare):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        return compare(self.original_type(self), mine)

    def __lt__(self, other):
        return self._order(other, operator.lt)

    def __le__(self, other):
        return self._order(other, operator.le)

    def __gt__(self, other):
        return self._order(other, operator.gt)

    def __ge__(self, other):
        return self._order(other, operator.ge)

    def __hash__(self):
        if self.original_type is list:
            raise TypeError("unhashable type: 'SharedSequence' (a shared list)")
        return hash(tuple(self))

    def __add__(self, other):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        return self.original_type(self) + self.original_type(mine)

    def __radd__(self, other):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        return self.original_type(mine) + self.original_type(self)

    def __mul__(self, n):
        return self.original_type(self) * n

    __rmul__ = __mul__

    def copy(self):
        """A plain, mutable copy (a ``list``; a ``tuple`` for a shared tuple)."""
        return self.original_type(self)

    def __repr__(self) -> str:
        head = [repr(x) for x in self._buffer.records(self._part, 0, min(self._len, _SHORT_REPR))]
        if self._len > _SHORT_REPR:
            head.append(f"... ({self._len} items)")
        open_, close = ("(", ",)" if self._len == 1 else ")") if self.original_type is tuple else ("[", "]")
        return f"SharedSequence({open_}{', '.join(head)}{close})"

    # -- pickling -------------------------------------------------------------------
    def __reduce_ex__(self, protocol):
        # any pickler but multiprocessing's: the plain list or tuple
        if self.original_type is tuple:
            return tuple, (tuple(self),)
        return list, (), None, iter(self)

    def _reduce_for_process(self):
        # multiprocessing's: the pack's descriptor (one, however many containers)
        return SharedSequence._attach, (self._buffer, self._part)


reduction.ForkingPickler.register(SharedSequence, SharedSequence._reduce_for_process)

refusing(SharedSequence, {
    "__setitem__": "item assignment", "__delitem__": "item deletion",
    "__iadd__": "+=", "__imul__": "*=", "append": "append", "extend": "extend",
    "insert": "insert", "pop": "pop", "remove": "remove", "clear": "clear",
    "sort": "sort", "reverse": "reverse",
})
