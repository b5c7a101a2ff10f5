"""Finding the part of a batch that cannot cross a process boundary.

When a worker's batch fails to pickle, the exception from ``pickle`` names a
type but not where it sits.  ``describe_unpicklable`` walks the batch the way
``default_collate`` builds it (mappings, sequences, namedtuples, dataclasses)
and names the first leaf that will not pickle, as a Python expression:
``batch['meta'][3] is a _thread.lock``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler


def _picklable(obj) -> bool:
    try:
        ForkingPickler.dumps(obj)
        return True
    except Exception:
        return False


def _children(obj):
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [(f".{name}", getattr(obj, name)) for name in obj._fields]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return []


def find_unpicklable(obj, path: str = "batch", depth: int = 0):
    """(path, leaf) of the first part of ``obj`` that cannot be pickled, or None."""
    if depth < 32:
        for suffix, child in _children(obj):
            found = find_unpicklable(child, path + suffix, depth + 1)
            if found is not None:
                return found
    if not _picklable(obj):
        return path, obj
    return None


def describe_unpicklable(obj) -> str:
    found = find_unpicklable(obj)
    if found is None:
        return "the batch failed to pickle, but every part of it pickles on its own"
    path, leaf = found
    kind = type(leaf)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{path} is a {name} ({leaf!r:.80}), which cannot be pickled"
