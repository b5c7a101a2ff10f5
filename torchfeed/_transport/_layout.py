"""Flatten a nested batch into one slot, and rebuild it as zero-copy views.

The batch is pickled, in the worker, by a pickler with a persistent-id hook.
Every plain CPU tensor and every numpy array without Python objects in it is
not pickled: it becomes a *leaf*, given an aligned offset in the slot, and only
a short id ``(kind, offset, shape, dtype)`` goes into the pickle. Everything
else (dict, list, tuple, namedtuple, dataclass, custom Mapping/Sequence types,
str, int, arbitrary objects, even tensors held inside objects' attributes) is
pickled as usual, so the batch comes back with exactly the types, nesting and
object identities it had, by pickle's own rules. Tensors that cannot live in a
slot (sparse, quantized, nested, requiring grad, not on the CPU, tensor
subclasses) are pickled with torch's own multiprocessing reductions, as torch's
DataLoader would.

In the main process the pickle is loaded with a persistent-load hook that turns
each leaf id into a view of the slot: a numpy array for a numpy leaf, a tensor
for a tensor leaf (via ``torch.from_numpy`` where numpy has the dtype, else
``torch.frombuffer``; either way the tensor has a storage of its own, exactly
its bytes, as a collated tensor would). Every view references one per-batch
:class:`SlotOwner`, a view of the whole slot; when the owner dies, no view of
the batch is left and the slot can be reused.

Leaves are written contiguous and C-ordered whatever their input strides, so a
non-contiguous input comes back contiguous with the same values; a tensor that
appears twice in a batch comes back as one object, as with pickle. Two
different views of one storage come back as two separate copies.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

ALIGN = 64

# Leaf kinds in a persistent id.
K_TORCH_NP = 0   # (0, start, end, shape, numpy dtype str): torch.from_numpy(view)
K_TORCH_BUF = 1  # (1, start, shape, torch dtype code, numel): torch.frombuffer
K_NUMPY = 2      # (2, start, end, shape, numpy dtype str or dtype): view
K_SAME = 3       # (3, ordinal): the same object as an earlier leaf


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


class LeafPickler(ForkingPickler):
    """Pickles a batch, collecting its array leaves instead of pickling them.

    After ``dump``: ``leaves`` lists ``(array, offset)`` to copy into the slot,
    and ``end`` is the bytes the slot needs. ``direct`` maps ``id(tensor)`` to
    ``(tensor, offset)`` for tensors already written in the slot (by the
    direct collate), which are referenced, not copied.
    """

    def __init__(self, file, start: int = 0, direct=None):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.leaves: list = []
        self.end = start
        self.direct = direct
        self._seen: dict = {}
        self._n = 0

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
            return (K_SAME, seen[1])
        self._seen[id(obj)] = (obj, self._n)
        self._n += 1
        shape = tuple(obj.shape)
        if tp is np.ndarray:
            off = self._alloc(obj.nbytes)
            self.leaves.append((obj, off))
            dt = obj.dtype
            return (K_NUMPY, off, self.end, shape,
                    dt if dt.fields is not None or dt.subdtype else dt.str)
        d = self.direct.get(id(obj)) if self.direct else None
        if d is not None and d[0] is obj:
            off = d[1]
        else:
            off = self._alloc(obj.nbytes)
            self.leaves.append((obj, off))
        npdt = _NUMPY_OF_TORCH.get(obj.dtype)
        if npdt is not None:
            return (K_TORCH_NP, off, off + obj.nbytes, shape, npdt)
        return (K_TORCH_BUF, off, shape, _TORCH_CODE[obj.dtype], obj.numel())


def dump(batch, start: int = 0, direct=None) -> LeafPickler:
    """Pickle ``batch``; the returned pickler carries ``data``, ``leaves``, ``end``."""
    buf = io.BytesIO()
    p = LeafPickler(buf, start, direct)
    p.dump(batch)
    p.data = buf.getvalue()
    return p


def copy_leaves(leaves, u8: torch.Tensor, arr: np.ndarray) -> None:
    """Write every ``(array, offset)`` leaf into the slot whose bytes are ``u8``/``arr``."""
    for src, off in leaves:
        n = src.nbytes
        if n == 0:
            continue
        if type(src) is np.ndarray:
            dst = arr[off:off + n].view(src.dtype).reshape(src.shape)
            np.copyto(dst, src, casting="no")
        else:
            u8[off:off + n].view(src.dtype).view(src.shape).copy_(src)


class LeafUnpickler(pickle.Unpickler):
    """Loads a batch pickled by :class:`LeafPickler`, leaves as views of ``owner``."""

    def __init__(self, data: bytes, owner: SlotOwner):
        super().__init__(io.BytesIO(data))
        self.owner = owner
        self.built: list = []

    def persistent_load(self, pid):
        kind = pid[0]
        if kind == K_TORCH_NP:
            x = torch.from_numpy(self.owner[pid[1]:pid[2]].view(_np_dtype(pid[4]), np.ndarray)
                                 .reshape(pid[3]))
        elif kind == K_NUMPY:
            dt = pid[4]
            x = self.owner[pid[1]:pid[2]].view(_np_dtype(dt) if type(dt) is str else dt,
                                               np.ndarray).reshape(pid[3])
        elif kind == K_TORCH_BUF:
            dtype = TORCH_DTYPES[pid[3]]
            if pid[4] == 0:
                x = torch.empty(pid[2], dtype=dtype)
            else:
                x = torch.frombuffer(self.owner, dtype=dtype, count=pid[4],
                                     offset=pid[1]).view(pid[2])
        elif kind == K_SAME:
            return self.built[pid[1]]
        else:
            raise pickle.UnpicklingError(f"torchfeed transport: unknown leaf kind {kind!r}")
        self.built.append(x)
        return x


def load(data: bytes, owner: SlotOwner):
    """Rebuild the batch pickled in ``data``; its leaves view ``owner``."""
    return LeafUnpickler(data, owner).load()
