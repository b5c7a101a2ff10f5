"""Which objects a pack stores once though several records hold them.

``pickle.dumps`` of a whole dataset stores an object once however many
places hold it (its memo). A pack's records load alone, so each is pickled
with a memo of its own, and an object that many records hold would be stored
once per record: pycocotools' ``COCO`` holds each annotation dict three ways
(``dataset["annotations"]``, ``anns``, ``imgToAnns``), and a thousand records
may point at one large dict. ``plan`` finds such objects, so the writer
(``_writer.py``) stores each once, as a record of its own, and the other
records refer to it (``_buffer.REF``, ``WITH_REFS``).

What is looked at, without walking every object in Python:

* each container's items (a dict's values): level 1;
* level 2, where a sample of the items says it pays: the elements of items
  that are lists or tuples (``imgToAnns``: lists of annotation dicts), or the
  values of dict items whose sample holds an object that is held elsewhere
  too (records that all point at one dict).

An object can be held twice only if its reference count says another holder
exists: reference counts are read in C (``map(sys.getrefcount, ...)``), and
only those above what one holder gives (measured the same way, ``_baseline``)
are looked at further. Atoms (numbers, strings, bytes, ``None``) are never
stored apart: a record's own copy costs less than a reference.
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import NamedTuple

import numpy as np

_ATOMS = (int, float, bool, type(None), str, bytes, complex)
_ATOM_IDS = np.array([id(kind) for kind in _ATOMS], np.int64)
_SAMPLE = 32
_NONE = np.zeros(0, np.int64)


class Plan(NamedTuple):
    shared: frozenset           # ids of the objects stored once
    flagged: list               # per container: sorted item positions that need care
    nested: list                # per container: "elements", "fields" or None
    index_like: list            # per container: its items are lists of other objects


@functools.lru_cache(maxsize=1)
def _baseline() -> int:
    """What ``_counts`` reads for an object held by one container (and the list
    the count is taken from): the same calls, on objects held exactly so."""
    holders = [[object()] for _ in range(4)]
    return int(min(_counts(list(itertools.chain.from_iterable(holders)))))


def _counts(objects: list) -> np.ndarray:
    return np.fromiter(map(sys.getrefcount, objects), np.int64, len(objects))


def _held_elsewhere(objects: list) -> tuple[np.ndarray, np.ndarray]:
    """Positions and ids of ``objects`` (a list built for this) that are not
    atoms and that something besides their container and this list holds;
    in C, but for the reference counts' first pass over all of them."""
    if not objects:
        return _NONE, _NONE
    above = np.flatnonzero(_counts(objects) > _baseline())
    if not above.size:
        return _NONE, _NONE
    n = len(objects)
    kinds = np.fromiter(map(id, map(type, objects)), np.int64, n)[above]
    keep = above[~np.isin(kinds, _ATOM_IDS)]
    return keep, np.fromiter(map(id, objects), np.int64, n)[keep]


def _sample(values: list) -> list:
    step = max(1, len(values) // _SAMPLE)
    return values[::step][:_SAMPLE]


def _nested_mode(values: list) -> str | None:
    """Whether level 2 of these items is looked at, and how."""
    sample = _sample(values)
    if not sample:
        return None
    if all(type(v) in (list, tuple) for v in sample):
        inner = [e for v in sample for e in itertools.islice(v, 8)]
        if any(not isinstance(e, _ATOMS) for e in inner) and set(map(type, values)) <= {list, tuple}:
            return "elements"
        return None
    if all(type(v) is dict for v in sample):
        fields = list(itertools.chain.from_iterable(map(dict.values, sample)))
        if _held_elsewhere(fields)[0].size and set(map(type, values)) <= {dict}:
            return "fields"
    return None


def children(item, mode: str | None):
    """The level-2 objects of ``item`` that ``plan`` looked at."""
    if mode == "elements":
        return item
    if mode == "fields":
        return item.values()
    return ()


def plan(containers: list) -> Plan:
    """``containers``: each a list of its items (a dict's values), or None for
    a part that is not a container (an array)."""
    found = []  # per container: (level-1 positions, ids, level-2 item of each, ids)
    modes: list = []
    for values in containers:
        if values is None:
            found.append((_NONE, _NONE, _NONE, _NONE))
            modes.append(None)
            continue
        positions, ids = _held_elsewhere(values)
        mode = _nested_mode(values)
        owners, inner_ids = _NONE, _NONE
        if mode is not None:
            inner = list(itertools.chain.from_iterable(children(v, mode) for v in values))
            inner_positions, inner_ids = _held_elsewhere(inner)
            if inner_positions.size:
                ends = np.cumsum(np.fromiter(map(len, values), np.int64, len(values)))
                owners = np.searchsorted(ends, inner_positions, side="right")
        found.append((positions, ids, owners, inner_ids))
        modes.append(mode)
    every = np.concatenate([np.concatenate([f[1], f[3]]) for f in found]) if found else _NONE
    ids, counts = np.unique(every, return_counts=True)
    shared = ids[counts > 1]
    flagged = []
    for positions, level1, owners, level2 in found:
        mine = np.concatenate([positions[np.isin(level1, shared)], owners[np.isin(level2, shared)]])
        flagged.append(np.unique(mine).tolist())
    return Plan(frozenset(shared.tolist()), flagged, modes, [m == "elements" for m in modes])
