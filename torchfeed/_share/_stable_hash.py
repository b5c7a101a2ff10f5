"""A hash of a dict key that is the same in every process, for a shared
dict's key index (``_mapping.py``).

Python's ``hash`` of ``str`` and ``bytes`` is salted per process
(``PYTHONHASHSEED``), and ``hash(None)`` is an address before Python 3.12, so
an index built in one process with ``hash`` would find nothing in a spawned
one. Numbers keep ``hash``: it is defined by value (``sys.hash_info``), the
same in every process, and equal numbers of different types (``1``, ``1.0``,
``True``, ``numpy.int64(1)``) hash alike, as a dict needs. Strings and bytes
hash by CRC-32 of their bytes; tuples and frozensets combine their items'.
Any other key type has no such hash, and ``share`` refuses the dict.
"""

from __future__ import annotations

import numbers
import zlib

_MASK = (1 << 63) - 1
_NONE = 0x5F3759DF
_TUPLE_SEED, _TUPLE_MULT = 0x345678, 1000003
_FROZENSET_SEED = 0x1F2E3D4C


class UnstableKey(TypeError):
    """A key whose hash differs between processes."""


def stable_hash(key) -> int:
    """``key``'s hash, the same in every process (a signed 64-bit int)."""
    kind = type(key)
    if kind is str:
        return zlib.crc32(key.encode("utf-8", "surrogatepass"))
    if kind is int or kind is float or kind is bool:
        return hash(key)
    if isinstance(key, str):
        return zlib.crc32(str.encode(key, "utf-8", "surrogatepass"))
    if isinstance(key, (bytes, bytearray, memoryview)):
        hash(key)  # unhashable (bytearray) raises as a dict would
        return zlib.crc32(key)
    if isinstance(key, numbers.Number):
        return hash(key)
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
        f"torchfeed.share: a dict key of type {kind.__name__} has no hash that is the same "
        f"in every process; shared dicts take keys of type str, bytes, int, float, bool, "
        f"None, and tuples or frozensets of them. Leave this dict unshared, or convert its "
        f"keys (for example to str).")
