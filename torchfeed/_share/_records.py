"""How one record is pickled into a pack, and how the tensors in it come back.

``RecordPickler`` is ``pickle.Pickler`` with two changes, both in
``reducer_override``, which the C pickler calls only for objects of
non-builtin types (a dict, list, str or float never reaches it):

* a plain CPU tensor is stored as its dtype, shape, strides and bytes, and
  rebuilt from them (``tensor_from_bytes``): one copy out of the pack, where
  ``pickle`` of a tensor writes a ``torch.save`` archive per tensor, which
  took some 200 us to load;
* a shared container inside a record is refused: each read of the record
  would build a plain copy of all of it.

``RefPickler`` adds ``persistent_id`` for the records that hold objects the
pack stores once (``_dedup.py``): each such object is written as its
``(part, record)``. It is slower (``persistent_id`` is called for every object
pickled), so only those records use it.
"""

from __future__ import annotations

import pickle

import torch

_REFUSED: list[type] = []  # SharedSequence, SharedMapping (they register themselves)


def refuse_inside_records(cls: type) -> type:
    _REFUSED.append(cls)
    return cls


class RecordPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is torch.Tensor:
            return reduce_tensor(obj)
        if _REFUSED and isinstance(obj, tuple(_REFUSED)):
            raise TypeError("a shared container cannot hold another one (each read would "
                            "copy it whole); share the plain data in one piece")
        return NotImplemented


class RefPickler(RecordPickler):
    """Writes the objects in ``stored`` (id -> (part, record)) as references,
    except ``top``, the record being written."""

    def __init__(self, file, stored: dict):
        super().__init__(file, protocol=5)
        self.stored = stored
        self.top = None

    def persistent_id(self, obj):
        if obj is self.top:
            return None
        return self.stored.get(id(obj))

    def record(self, obj) -> None:
        self.top = obj
        try:
            self.dump(obj)
        finally:
            self.top = None
            self.clear_memo()


def reduce_tensor(tensor: torch.Tensor):
    """A CPU tensor as its bytes; torch's own reduction for anything else
    (sparse, quantized, conjugate or negative views, backward hooks, a
    non-leaf that requires grad: torch refuses that one itself)."""
    if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized
            or tensor.is_conj() or tensor.is_neg() or tensor._backward_hooks
            or any(name is not None for name in getattr(tensor, "names", ()))
            or (tensor.requires_grad and not tensor.is_leaf)):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    dense = tensor.detach()
    stride: tuple | None = tuple(dense.stride())
    if not _dense_non_overlapping(tuple(dense.shape), stride):  # type: ignore[arg-type]
        stride = None  # an expanded or overlapping view: its values, contiguous
    flat = dense.contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return tensor_from_bytes, (flat.dtype, tuple(dense.shape), stride,
                               pickle.PickleBuffer(data) if len(data) else bytearray(),  # type: ignore[arg-type]
                               tensor.requires_grad)


def _dense_non_overlapping(shape: tuple, stride: tuple) -> bool:
    expected = 1
    for size, step in sorted(zip(shape, stride), key=lambda d: d[1]):
        if size == 1:
            continue
        if step != expected:
            return False
        expected *= size
    return True


def tensor_from_bytes(dtype, shape, stride, data: bytearray, requires_grad: bool):
    """A new tensor that owns ``data`` (a fresh bytearray, from the record)."""
    if len(data):
        flat = torch.frombuffer(data, dtype=dtype)
    else:
        flat = torch.empty(0, dtype=dtype)
    tensor = flat.view(shape)
    if stride is not None and tuple(tensor.stride()) != tuple(stride) and tensor.numel() > 1:
        tensor = torch.empty_strided(shape, stride, dtype=dtype).copy_(tensor)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor
