"""Equality of what a shared container gives back with what it was built from.

Python compares a list with itself item by item, identity first: ``[nan] ==
the same list`` is true because the NaN is the very same object, and a list
of numpy arrays equals itself though ``array == array`` has no single truth
value. A shared container's items are new objects at every read, so no
identity shortcut ever applies: ``same_value`` stands in for it, treating
NaN as equal to NaN, and arrays and tensors as equal when their dtype,
shape and values are (NaN included), inside lists, tuples and dicts too.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch


def same_value(a, b) -> bool:
    """``a == b`` as ``b`` compares with itself (``a`` a fresh copy of it)."""
    try:
        if a == b:
            return True
    except (ValueError, RuntimeError, TypeError):
        pass  # an array's or a tensor's comparison has no single truth value
    return _same(a, b)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return (isinstance(b, list) if isinstance(a, list) else isinstance(b, tuple)) and \
            len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict):
        if not isinstance(b, dict) or len(a) != len(b):
            return False
        missing = object()
        for key, value in a.items():
            other = b.get(key, missing)
            if other is missing:
                other = _nan_key_value(b, key, missing)
            if other is missing or not same_value(value, other):
                return False
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same_array(np.asarray(a), np.asarray(b)) if type(a) is type(b) else False
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                and bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point()
                          or a.is_complex() else (a == b)).all()))
    return isinstance(a, numbers.Number) and isinstance(b, numbers.Number) and _nan(a) and _nan(b)


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    try:
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    except TypeError:
        return bool(np.array_equal(a, b))


def _nan(x) -> bool:
    try:
        return bool(x != x)
    except Exception:
        return False


def _nan_key_value(mapping: dict, key, missing):
    if not (isinstance(key, numbers.Number) and _nan(key)):
        return missing
    return next((v for k, v in mapping.items() if isinstance(k, numbers.Number) and _nan(k)),
                missing)
