"""A hash of a dict key that is the same in every process, for a shared
dict's key index (``_mapping.py``), and the key equality its lookups use.

Python's ``hash`` of ``str`` and ``bytes`` is salted per process
(``PYTHONHASHSEED``), ``hash(None)`` is an address before Python 3.12, and
``hash`` of a NaN is its address from Python 3.10, so an index built in one
process with ``hash`` would find nothing in a spawned one. Numbers keep
``hash``: it is defined by value (``sys.hash_info``), the same in every
process, and equal numbers of different types (``1``, ``1.0``, ``True``,
``numpy.int64(1)``, ``numpy.True_``) hash alike, as a dict needs. Every NaN
hashes alike. Strings and bytes hash by CRC-32 of their bytes; tuples and
frozensets combine their items'. Any other key type has no such hash, and
``share`` refuses the dict.

A dict finds a NaN key only through the very object it holds (``x != x``);
a shared dict's keys are new objects in every read, so there a NaN key
matches any NaN (``same_key``), and ``d[math.nan]`` works as it did.
"""

from __future__ import annotations

import numbers
import zlib

import numpy as np

_MASK = (1 << 63) - 1
_NONE = 0x5F3759DF
_NAN = 0x7FF8DEAD
_TUPLE_SEED, _TUPLE_MULT = 0x345678, 1000003
_FROZENSET_SEED = 0x1F2E3D4C


class UnstableKey(TypeError):
    """A key whose hash differs between processes."""


def _type_name(kind: type) -> str:
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _is_nan(key) -> bool:
    try:
        return key != key
    except Exception:  # an array-like or a value that cannot compare
        return False


def stable_hash(key) -> int:
    """``key``'s hash, the same in every process (a signed 64-bit int)."""
    kind = type(key)
    if kind is str:
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if kind is int or kind is bool:
        return hash(key)
    if kind is float:
        return _NAN if key != key else hash(key)
    if isinstance(key, str):
        return zlib.crc32(str.encode(key, "utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray, memoryview)):
        hash(key)  # unhashable (bytearray) raises as a dict would
        return zlib.crc32(key)
    if isinstance(key, (numbers.Number, np.bool_)):
        return _NAN if _is_nan(key) else hash(key)
    if key is None:
        return _NONE
    if isinstance(key, tuple):
        h = _TUPLE_SEED
        for item in key:
            h = ((h ^ stable_hash(item)) * _TUPLE_MULT) & _MASK
        return h ^ len(key)
    if isinstance(key, frozenset):
        h = _FROZENSET_SEED
        for item in key:
            h ^= stable_hash(item) & _MASK
        return h
    hash(key)  # an unhashable key raises TypeError as a dict would
    raise UnstableKey(
        f"torchfeed.share: a dict key of type {_type_name(kind)} has no hash that is the same "
        f"in every process; shared dicts take keys that are str, bytes, numbers (numpy's "
        f"included), None, and tuples or frozensets of them. Leave this dict unshared, or "
        f"convert its keys (for example to str).")


def key_hashes(items: dict) -> np.ndarray:
    """``stable_hash`` of every key of ``items``, in order: in C where the keys
    are all ints or all strs (no Python call per key)."""
    n = len(items)
    kinds = set(map(type, items))
    if kinds == {int}:
        return np.fromiter(map(hash, items), np.int64, n)
    if kinds == {str}:
        try:
            return np.fromiter(map(zlib.crc32, map(str.encode, items)), np.int64, n)
        except UnicodeEncodeError:  # a lone surrogate: stable_hash encodes it
            pass
    return np.fromiter(map(stable_hash, items), np.int64, n)


def same_key(stored, key) -> bool:
    """Whether ``stored`` (a key loaded from a shared dict) is the key ``key``
    asks for: equal, or both NaN (also inside tuples)."""
    if stored == key:
        return True
    if isinstance(stored, tuple) and isinstance(key, tuple):
        return len(stored) == len(key) and all(map(same_key, stored, key))
    return isinstance(key, numbers.Number) and _is_nan(key) and _is_nan(stored)
