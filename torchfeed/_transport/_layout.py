"""Flatten a nested batch into one slot, and rebuild it as zero-copy views.

The batch is pickled, in the worker, by a pickler with a persistent-id hook.
Every plain CPU tensor and every numpy array without Python objects in it is
not pickled: it becomes a *leaf*, given an aligned offset in the slot, and only
its index goes into the pickle; its descriptor ``(kind, offset, ..., shape,
dtype)`` travels beside the pickle. Everything
else (dict, list, tuple, namedtuple, dataclass, custom Mapping/Sequence types,
str, int, arbitrary objects, even tensors held inside objects' attributes) is
pickled as usual, so the batch comes back with exactly the types, nesting and
object identities it had, by pickle's own rules. Tensors that cannot live in a
slot (sparse, quantized, nested, requiring grad, not on the CPU, tensor
subclasses) are pickled with torch's own multiprocessing reductions, as torch's
DataLoader would.

In the main process the pickle is loaded with a persistent-load hook that turns
each leaf id into a view of the slot: a numpy array for a numpy leaf, a tensor
for a tensor leaf. Every view references one per-batch :class:`SlotOwner`, a
view of the whole slot; when the owner dies, no view of the batch is left and
the slot can be reused.

Layout and aliasing are kept as torch's DataLoader keeps them:

* A tensor crosses as its storage plus its size, stride and storage offset,
  as torch's reductions send it. All the batch's tensors on one storage share
  one storage again in the main process, so ``tokens`` and ``tokens[:, :-1]``
  stay views of each other, ``channels_last`` and transposed strides survive,
  and an ``expand()``ed tensor stays as small as its storage. The storage is
  sent whole, unless it is much bigger than what the batch's views of it reach
  (a row of a big dataset tensor, say): then only that span goes, and
  ``storage_offset()`` counts from its start. A tensor that owns its storage
  exactly (what collate produces) takes a quicker path with the same result.
  Tensors with a lazy conjugate or negative bit are written resolved.
* A numpy array crosses as pickle would send it, which is what torch does for
  arrays: its own copy, C-ordered, or Fortran-ordered if it was F-contiguous.
* A tensor or array that appears twice in a batch comes back as one object,
  as with pickle.
"""

from __future__ import annotations

import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

ALIGN = 64

# Leaf descriptors. The pickle holds only each leaf's index into the list of
# descriptors (an int pid, which the pickler saves without further calls to
# persistent_id); the descriptors travel beside it as plain tuples.
K_TORCH_NP = 0   # (0, start, end, shape, numpy dtype str): torch.from_numpy(view)
K_TORCH_BUF = 1  # (1, start, shape, torch dtype code, numel): torch.frombuffer
K_NUMPY = 2      # (2, start, end, shape, numpy dtype str or dtype, fortran): view
K_VIEW = 3       # (3, start, nbytes, torch dtype code, shape, stride, storage_offset):
                 #   a view of the storage in [start, start + nbytes), shared per start
K_EMPTY = 4      # (4, shape, stride, torch dtype code): no elements

# A storage is sent whole unless the part its views do not reach is bigger than
# both this and the part they do.
TRIM_MIN = 1 << 20


class SlotOwner(np.ndarray):
    """The owner of one batch: a uint8 view of its whole slot.

    A subclass on purpose: numpy collapses a view's ``base`` chain through
    plain ndarrays (and through memoryviews) down to the memory's exporter, so
    a plain array or memoryview owner would be skipped and could die while
    views of the batch are still alive. The chain stops at a different type,
    so every leaf keeps this object, and only this object, alive.
    """

TORCH_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)},
                            key=str))
_TORCH_CODE = {d: i for i, d in enumerate(TORCH_DTYPES)}

_NUMPY_OF_TORCH = {}
for _t, _n in ((torch.bool, np.bool_), (torch.uint8, np.uint8), (torch.int8, np.int8),
               (torch.int16, np.int16), (torch.int32, np.int32), (torch.int64, np.int64),
               (torch.uint16, np.uint16), (torch.uint32, np.uint32),
               (torch.uint64, np.uint64), (torch.float16, np.float16),
               (torch.float32, np.float32), (torch.float64, np.float64),
               (torch.complex64, np.complex64), (torch.complex128, np.complex128)):
    _NUMPY_OF_TORCH[_t] = np.dtype(_n).str
del _t, _n

_NP_DTYPES: dict = {}


def _np_dtype(code):
    dt = _NP_DTYPES.get(code)
    if dt is None:
        dt = _NP_DTYPES[code] = np.dtype(code)
    return dt


def _slot_tensor(t) -> bool:
    """Whether tensor ``t`` (exact type torch.Tensor) can be a leaf in a slot."""
    return (t.layout is torch.strided and t.is_cpu and not t.requires_grad
            and not t.is_quantized and not t.is_nested)


_dispatch: dict = {}
_dispatch_sizes = [(-1, -1)]


def _dispatch_table():
    """copyreg's reductions plus multiprocessing's (torch registers its own
    there); what ``ForkingPickler`` uses, without copying it per batch."""
    # _extra_reducers: multiprocessing's private registry of reducers, absent from its stubs
    sizes = (len(copyreg.dispatch_table), len(ForkingPickler._extra_reducers))  # type: ignore[attr-defined]
    if sizes != _dispatch_sizes[0]:
        _dispatch.clear()
        _dispatch.update(copyreg.dispatch_table)
        _dispatch.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
        _dispatch_sizes[0] = sizes
    return _dispatch


class LeafPickler(pickle.Pickler):
    """Pickles a batch, collecting its array leaves instead of pickling them.

    After ``dump`` and ``finish``: ``leaves`` lists ``(array, offset)`` to copy
    into the slot, and ``end`` is the bytes the slot needs. ``direct`` maps
    ``id(tensor)`` to ``(tensor, offset)`` for tensors already written in the
    slot (by the direct collate), which are referenced, not copied (unless
    ``copy_direct``). Everything else is pickled as ``ForkingPickler`` would.
    """

    data: bytes          # set by dump(): the pickle
    descs: Any           # a list while pickling, a tuple once dump() is done

    def __init__(self, file, start: int = 0, direct=None, copy_direct=False):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.copy_direct = copy_direct
        self.dispatch_table = _dispatch_table()
        self.leaves: list = []
        self.end = start
        self.direct = direct
        self.descs: list = []
        self._seen: dict = {}
        # (desc index, tensor) of tensors that do not own their storage exactly;
        # laid out by ``finish`` once every tensor of the batch has been seen.
        self._views: list = []

    def _alloc(self, nbytes: int) -> int:
        off = (self.end + ALIGN - 1) & ~(ALIGN - 1)
        self.end = off + nbytes
        return off

    def persistent_id(self, obj):
        tp = type(obj)
        if tp is torch.Tensor:
            if not _slot_tensor(obj):
                return None
        elif tp is np.ndarray:
            if obj.dtype.hasobject:
                return None
        else:
            return None
        seen = self._seen.get(id(obj))
        if seen is not None and seen[0] is obj:
            return seen[1]  # the same object again: pickle's identity semantics
        i = len(self.descs)
        self._seen[id(obj)] = (obj, i)
        shape = tuple(obj.shape)
        if tp is np.ndarray:
            off = self._alloc(obj.nbytes)
            self.leaves.append((obj, off))
            dt = obj.dtype
            fortran = not obj.flags.c_contiguous and obj.flags.f_contiguous
            self.descs.append((K_NUMPY, off, self.end, shape,
                               dt if dt.fields is not None or dt.subdtype else dt.str,
                               fortran))
            return i
        d = self.direct.get(id(obj)) if self.direct else None
        if d is not None and d[0] is obj:  # stacked into a slot by the collate
            if self.copy_direct:  # not this slot: it owns its storage, as collated
                off = self._alloc(obj.nbytes)
                self.leaves.append((obj, off))
            else:
                off = d[1]
            self.descs.append(_whole_desc(obj, off, shape))
            return i
        if obj._is_view() or obj.storage_offset() or not obj.is_contiguous():
            self._views.append((i, obj))  # laid out by finish(), with its storage
            self.descs.append(None)
            return i
        # Owns its storage, as a collated tensor does: the quick path (finish()
        # revisits it if a view of the same storage turns up).
        off = self._alloc(obj.nbytes)
        self.leaves.append((obj, off))
        npdt = _NUMPY_OF_TORCH.get(obj.dtype)
        if npdt is not None:
            self.descs.append((K_TORCH_NP, off, off + obj.nbytes, shape, npdt))
        else:
            self.descs.append((K_TORCH_BUF, off, shape, _TORCH_CODE[obj.dtype], obj.numel()))
        return i

    def finish(self) -> None:
        """Lay out the storages of the batch's views, with any tensor that owns
        one of those storages, and write their descriptors."""
        if not self._views:
            return
        by_storage: dict = {}
        for i, t in self._views:
            if t.numel() == 0:
                self.descs[i] = (K_EMPTY, tuple(t.shape), t.stride(), _TORCH_CODE[t.dtype])
            elif t.is_conj() or t.is_neg():  # written resolved, in a storage of its own
                off = self._alloc(t.nbytes)
                self.leaves.append((t, off))
                self.descs[i] = _whole_desc(t, off, t.shape)
            else:
                storage = t.untyped_storage()
                by_storage.setdefault(storage._cdata, (storage, []))[1].append((i, t))
        self._views = []
        if not by_storage:
            return
        # A tensor that took the quick path but whose storage a view shares.
        starts = {storage.data_ptr(): key for key, (storage, _) in by_storage.items()}
        moved = set()
        for obj, i in self._seen.values():
            if (type(obj) is torch.Tensor and self.descs[i] is not None
                    and self.descs[i][0] in (K_TORCH_NP, K_TORCH_BUF)
                    and obj.data_ptr() in starts):
                key = obj.untyped_storage()._cdata
                if key in by_storage and (self.direct is None or id(obj) not in self.direct):
                    by_storage[key][1].append((i, obj))
                    moved.add(id(obj))
        if moved:  # their bytes go with their storage; the room they had stays unused
            self.leaves = [leaf for leaf in self.leaves if id(leaf[0]) not in moved]
        for storage, views in by_storage.values():
            self._lay_out_storage(storage, views)

    def _lay_out_storage(self, storage, views) -> None:
        """One storage and the batch's ``views`` of it: the storage (or the span
        they reach, if it is much bigger) goes to the slot once."""
        lo, hi = None, 0
        for _, t in views:
            itemsize = t.itemsize
            a = t.storage_offset() * itemsize
            b = a + itemsize
            for n, st in zip(t.shape, t.stride()):
                b += (n - 1) * st * itemsize
            lo = a if lo is None else min(lo, a)
            hi = max(hi, b)
        size = storage.nbytes()
        lo &= ~(ALIGN - 1)
        if size - (hi - lo) <= max(hi - lo, TRIM_MIN):
            lo, hi = 0, size
        off = self._alloc(hi - lo)
        self.leaves.append((_Span(storage, lo, hi), off))
        for i, t in views:
            self.descs[i] = (K_VIEW, off, hi - lo, _TORCH_CODE[t.dtype], tuple(t.shape),
                             t.stride(), t.storage_offset() - lo // t.itemsize)


class _Span:
    """Bytes ``[lo, hi)`` of a tensor storage, to copy into a slot."""

    __slots__ = ("storage", "lo", "hi")

    def __init__(self, storage, lo, hi):
        self.storage, self.lo, self.hi = storage, lo, hi

    def bytes(self):
        u8 = torch.empty(0, dtype=torch.uint8).set_(self.storage)
        return u8[self.lo:self.hi]


def _whole_desc(t, off, shape):
    """The descriptor of contiguous tensor ``t`` written at ``off``."""
    npdt = _NUMPY_OF_TORCH.get(t.dtype)
    if npdt is not None:
        return (K_TORCH_NP, off, off + t.nbytes, tuple(shape), npdt)
    return (K_TORCH_BUF, off, tuple(shape), _TORCH_CODE[t.dtype], t.numel())


def dump(batch, start: int = 0, direct=None, copy_direct=False) -> LeafPickler:
    """Pickle ``batch``; the pickler returned carries ``data``, ``descs``,
    ``leaves`` and ``end``. ``copy_direct``: the ``direct`` tensors are to be
    copied to another slot, each as a tensor owning its storage."""
    buf = io.BytesIO()
    p = LeafPickler(buf, start, direct, copy_direct)
    p.dump(batch)
    p.finish()
    p.data = buf.getvalue()
    p.descs = tuple(p.descs)
    return p


def copy_leaves(leaves, slot) -> None:
    """Write every ``(array, offset)`` leaf into ``slot`` (a ``_slots.WorkerSlot``)."""
    arr, write = slot.arr, slot.write
    for src, off in leaves:
        if type(src) is _Span:
            src = src.bytes().numpy()
        n = src.nbytes
        if n == 0:
            continue
        if type(src) is torch.Tensor:
            npdt = _NUMPY_OF_TORCH.get(src.dtype)
            if npdt is None or src.is_conj() or src.is_neg():
                typed = slot.typed(src.dtype)
                typed.as_strided(src.shape, contiguous_strides(src.shape),
                                 off // src.itemsize).copy_(src)
                continue
            src = src.numpy()  # numpy's calls cost a fraction of torch's for small leaves
        if src.flags.c_contiguous:
            write(off, src.reshape(-1).view(np.uint8))
        elif src.flags.f_contiguous:  # written in Fortran order, as its descriptor says
            write(off, src.T.reshape(-1).view(np.uint8))
        else:
            np.copyto(arr[off:off + n].view(src.dtype).reshape(src.shape), src, casting="no")


def contiguous_strides(shape):
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


class LeafUnpickler(pickle.Unpickler):
    """Loads a batch pickled by :class:`LeafPickler`, leaves as views of ``owner``."""

    def __init__(self, data: bytes, descs: tuple, owner: SlotOwner):
        super().__init__(io.BytesIO(data))
        self.descs = descs
        self.owner = owner
        self.built = [None] * len(descs)
        self.storages: dict = {}  # start in the slot -> the storage its views share

    def persistent_load(self, i):
        x = self.built[i]
        if x is not None:
            return x
        d = self.descs[i]
        kind = d[0]
        if kind == K_TORCH_NP:
            x = torch.from_numpy(self.owner[d[1]:d[2]].view(_np_dtype(d[4]), np.ndarray)
                                 .reshape(d[3]))
        elif kind == K_NUMPY:
            dt = d[4]
            x = self.owner[d[1]:d[2]].view(_np_dtype(dt) if type(dt) is str else dt, np.ndarray)
            x = x.reshape(d[3], order="F") if d[5] else x.reshape(d[3])
        elif kind == K_VIEW:
            storage = self.storages.get(d[1])
            if storage is None:
                storage = torch.from_numpy(self.owner[d[1]:d[1] + d[2]].view(np.ndarray))
                storage = self.storages[d[1]] = storage.untyped_storage()
            x = torch.empty(0, dtype=TORCH_DTYPES[d[3]]).set_(storage, d[6], d[4], d[5])
        elif kind == K_EMPTY:
            x = torch.empty_strided(d[1], d[2], dtype=TORCH_DTYPES[d[3]])
        elif kind == K_TORCH_BUF:
            dtype = TORCH_DTYPES[d[3]]
            if d[4] == 0:
                x = torch.empty(d[2], dtype=dtype)
            else:
                x = torch.frombuffer(self.owner, dtype=dtype, count=d[4],
                                     offset=d[1]).view(d[2])
        else:
            raise pickle.UnpicklingError(f"torchfeed transport: unknown leaf kind {kind!r}")
        self.built[i] = x
        return x


def load(data: bytes, descs: tuple, owner: SlotOwner):
    """Rebuild the batch pickled in ``data``; its leaves view ``owner``."""
    return LeafUnpickler(data, descs, owner).load()
