"""``SharedSequence``: a list or tuple shared read-only between processes.

Item ``i`` is record ``i`` of the buffer (``_buffer.py``); reading it loads a
fresh object, so reading writes no shared page. It compares, hashes (a
tuple's), slices, adds and repeats as the list or tuple it was built from;
slices and arithmetic give plain lists or tuples.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Sequence

from ._buffer import BufferWriter, SharedBuffer
from ._readonly import OneBuffer, refusing

_SHORT_REPR = 6


def build_sequence(items: list | tuple, name: str | None) -> "SharedSequence":
    writer = BufferWriter(name)
    try:
        writer.write_records(items)
        buffer = writer.finish(type(items).__name__, len(items))
    except BaseException as exc:
        writer.abandon()
        position = getattr(exc, "position", None)
        if position is not None:
            raise TypeError(f"torchfeed.share: item {position} of the {type(items).__name__} "
                            f"cannot be pickled: {exc}. Shared items are stored pickled; "
                            f"leave this {type(items).__name__} unshared, or make its items "
                            f"picklable.") from exc.__cause__
        raise
    return SharedSequence._attach(buffer)


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

    __slots__ = ("_buffer", "_view", "_offsets", "_len", "original_type")
    _buffer: SharedBuffer
    _view: memoryview
    _offsets: memoryview
    _len: int
    original_type: type

    def __init__(self, *args, **kwargs):
        raise TypeError("SharedSequence is made by torchfeed.share(a_list_or_tuple)")

    @classmethod
    def _attach(cls, buffer: SharedBuffer) -> "SharedSequence":
        self = object.__new__(cls)
        self._buffer = buffer
        self._view, self._offsets = buffer.view, buffer.offsets
        self._len = buffer.header.items
        self.original_type = tuple if buffer.header.kind == "tuple" else list
        return self

    @property
    def nbytes(self) -> int:
        """Bytes of shared memory behind this sequence (all processes together)."""
        return self._buffer.nbytes

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.original_type(self._buffer.records(*i.indices(self._len)))
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"{self.original_type.__name__} indices must be integers or "
                            f"slices, not {type(i).__name__}") from None
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"{self.original_type.__name__} index out of range")
        offsets = self._offsets
        return pickle.loads(self._view[offsets[i]:offsets[i + 1]])

    def __iter__(self):
        return self._buffer.records(0, self._len)

    def __reversed__(self):
        return self._buffer.records(self._len - 1, -1, -1)

    # -- as the original compares ------------------------------------------------
    def _comparable(self, other):
        if isinstance(other, SharedSequence):
            if other.original_type is not self.original_type:
                return None
            return other if other._buffer is self._buffer else other.original_type(other)
        return other if type(other) is self.original_type else None

    def __eq__(self, other):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        if mine is self:
            return True
        return len(mine) == self._len and all(a == b for a, b in zip(self, mine))

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
        return self.original_type(self) + mine

    def __radd__(self, other):
        mine = self._comparable(other)
        if mine is None:
            return NotImplemented
        return mine + self.original_type(self)

    def __mul__(self, n):
        return self.original_type(self) * n

    __rmul__ = __mul__

    def copy(self):
        """A plain, mutable copy (a ``list``; a ``tuple`` for a shared tuple)."""
        return self.original_type(self)

    def __repr__(self) -> str:
        head = [repr(x) for x in self._buffer.records(0, min(self._len, _SHORT_REPR))]
        if self._len > _SHORT_REPR:
            head.append(f"... ({self._len} items)")
        open_, close = ("(", ",)" if self._len == 1 else ")") if self.original_type is tuple else ("[", "]")
        return f"SharedSequence({open_}{', '.join(head)}{close})"

    # -- one buffer, whatever the copy --------------------------------------------
    def __reduce__(self):
        # the buffer travels as a descriptor (ForkingPickler) or as its bytes
        return SharedSequence._attach, (self._buffer,)


refusing(SharedSequence, {
    "__setitem__": "item assignment", "__delitem__": "item deletion",
    "__iadd__": "+=", "__imul__": "*=", "append": "append", "extend": "extend",
    "insert": "insert", "pop": "pop", "remove": "remove", "clear": "clear",
    "sort": "sort", "reverse": "reverse",
})
