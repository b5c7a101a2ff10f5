"""``DataLoader(share_dataset=True)``: which of a dataset's attributes are
large (``find_large``), how they are named (``describe``), and which of them
every worker copies (``census``, for ``stats()`` and the copy-on-read
warning).  Sharing them is ``_share_job.py``'s (pytorch issue 13246).

What is searched: the dataset's own attributes (its instance ``__dict__``) and
the attributes of the plain objects it holds, two levels deep: a pycocotools
``COCO`` object held as ``dataset.coco`` has its ``anns``, ``imgs``,
``imgToAnns`` found as ``dataset.coco.anns`` and so on.  A dataset that holds
other datasets (``Subset.dataset``, ``ConcatDataset.datasets``) is followed
into each of them, and the depth starts again there.

What is large: an exact ``list``, ``tuple``, ``dict`` or ``defaultdict``, a
numpy array or a CPU tensor of at least ``LARGE_BYTES``, its size estimated
from ``len`` and a sample of its items (never by walking all of them); and
any other object that says, through ``sys.getsizeof`` (its own
``__sizeof__``: a pandas ``DataFrame``), that it holds that much, found so
that the log can name it though it is not shared.  One object reached under
several names (torchvision's ``DatasetFolder.imgs``, which is its
``samples``) is found under each: the ``alias_of`` the first.
"""
from __future__ import annotations

import itertools
import logging
import sys
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ._share import is_shared
from ._transport._space import human

logger = logging.getLogger("torchfeed")

LARGE_BYTES = 2**20   # containers and arrays from this size on are shared
_SAMPLES = 32         # items whose size stands for the rest
_SIZE_BUDGET = 4096   # objects looked at to estimate one attribute's size
_MAX_OBJECTS = 10_000  # attributes looked at in all, whatever the dataset holds


class Found(NamedTuple):
    """A large attribute: ``path`` (``"dataset.coco.anns"``) is ``owner.name``."""

    path: str
    owner: Any
    name: str
    value: Any
    nbytes: int
    why_not: str | None  # why it cannot be shared; None if it can
    alias_of: str | None = None  # the path it was first found under, if not this one


def find_large(dataset) -> list[Found]:
    """The large lists, tuples, dicts and arrays ``dataset`` holds, two levels
    deep, and the other large objects (``why_not`` says why they are not shared)."""
    found: list[Found] = []
    first: dict[int, Found] = {}  # id of a large value -> where it was first found
    seen: set[int] = {id(dataset)}
    # (object, its path, its level): level 1 is a dataset's, 2 a plain object's it holds.
    # A stack, not a recursive closure: a closure's reference cycle would keep the
    # replaced objects alive until the garbage collector ran.
    stack: list[tuple[Any, str, int]] = [(dataset, "dataset", 1)]
    budget = _MAX_OBJECTS
    while stack:
        obj, path, level = stack.pop()
        for name, value in _attributes(obj):
            budget -= 1
            if budget < 0:
                return found
            where = f"{path}.{name}"
            earlier = first.get(id(value))
            if earlier is not None:
                found.append(Found(where, obj, name, value, earlier.nbytes, earlier.why_not,
                                   earlier.path))
                continue
            if id(value) in seen or is_shared(value):
                continue
            if _is_dataset(value):
                seen.add(id(value))
                stack.append((value, where, 1))
                continue
            if type(value) in (list, tuple) and 0 < len(value) <= 1024 and _is_dataset(value[0]):
                for i, item in enumerate(value):  # ConcatDataset.datasets
                    if _is_dataset(item) and id(item) not in seen:
                        seen.add(id(item))
                        stack.append((item, f"{where}[{i}]", 1))
                continue
            size = estimate_bytes(value)
            why = _why_not(value)
            if size is None:
                size, why = _other_large(value)
            if size is not None:
                if size >= LARGE_BYTES:
                    seen.add(id(value))
                    first[id(value)] = entry = Found(where, obj, name, value, size, why)
                    found.append(entry)
                continue
            if level < 2 and _is_plain(value):
                seen.add(id(value))
                stack.append((value, where, level + 1))
    found.sort(key=lambda f: (f.alias_of is not None, f.path))
    return found


def census(dataset) -> list[dict]:
    """The large attributes still held as Python objects, which every worker
    copies (as it reads them under fork, whole under spawn and forkserver):
    ``[{"attribute", "description", "bytes", "shared": False}]``.  Arrays and
    tensors are left out: reading them writes none of their pages."""
    return [{"attribute": f.path, "description": describe(f.value, f.nbytes), "bytes": f.nbytes,
             "shared": False} for f in find_large(dataset)
            if f.alias_of is None and (isinstance(f.value, (list, tuple, dict))
                                       or _is_object_array(f.value))]


def naming(found: list[dict]) -> str:
    """``found`` (``census``) in one sentence for the copy-on-read warning."""
    return "; ".join(f"`{f['attribute']}`: {f['description']}" for f in found)


# -- sizes and words ---------------------------------------------------------------
def estimate_bytes(value) -> int | None:
    """About how much memory ``value`` holds, or None if it is not a container
    or array that sharing is about."""
    if is_shared(value):
        return None  # shared already
    kind = type(value)
    if kind in (list, tuple) or isinstance(value, dict):
        return _container_bytes(value)
    if kind is torch.Tensor:
        return None if value.device.type != "cpu" else value.element_size() * value.numel()
    numpy = sys.modules.get("numpy")
    if numpy is not None and kind is numpy.ndarray:
        return value.nbytes if value.dtype != object else _container_bytes(value)
    return None


def _container_bytes(value) -> int:
    return _size(value, [_SIZE_BUDGET])


def _size(obj, budget: list) -> int:
    """``obj``'s size with what it holds: containers by a sample of their
    items, all in at most ``budget[0]`` objects looked at."""
    budget[0] -= 1
    outer = sys.getsizeof(obj)
    if type(obj) is torch.Tensor and obj.device.type == "cpu":
        outer += obj.element_size() * obj.numel()  # its __sizeof__ leaves the storage out
    if budget[0] <= 0:
        return outer
    if isinstance(obj, (dict, list, tuple, set, frozenset)) or _is_object_array(obj):
        n = len(obj)
        if not n:
            return outer
        if isinstance(obj, dict):
            sample = [_size(k, budget) + _size(v, budget)
                      for k, v in itertools.islice(obj.items(), _SAMPLES)]
        elif isinstance(obj, (set, frozenset)):
            sample = [_size(item, budget) for item in itertools.islice(obj, _SAMPLES)]
        else:
            step = max(1, n // _SAMPLES)
            sample = [_size(obj[i], budget) for i in range(0, n, step)][:_SAMPLES]
        return outer + n * sum(sample) // len(sample)
    if _is_plain(obj):
        return outer + _size(vars(obj), budget)
    return outer


def _is_object_array(obj) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and type(obj) is numpy.ndarray and obj.dtype == object


def describe(value, nbytes: int) -> str:
    """"a list of 1,000,000 dicts, 1.0 GiB"."""
    kind = type(value)
    if not isinstance(value, (list, tuple, dict)) and not hasattr(value, "dtype"):
        return f"a {_type_name(kind)}, {human(nbytes)}"
    if kind is torch.Tensor or not isinstance(value, (list, tuple, dict)):
        shape = "x".join(str(d) for d in value.shape)
        noun = "tensor" if kind is torch.Tensor else f"{kind.__module__.split('.')[0]} array"
        return f"a {value.dtype} {noun} of shape {shape}, {human(nbytes)}"
    items = list(itertools.islice(value.values() if isinstance(value, dict) else value, _SAMPLES))
    names = {type(item).__name__ for item in items}
    plural = f"{names.pop()}s" if len(names) == 1 else "objects"
    name = kind.__name__
    if isinstance(value, defaultdict):
        factory = getattr(value.default_factory, "__name__", repr(value.default_factory))
        name = f"defaultdict({factory})"
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name} of {len(value):,} {plural}, {human(nbytes)}"


# -- what is searched, and how it is shared ----------------------------------------
def _attributes(obj) -> list:
    attributes = getattr(obj, "__dict__", None)
    return list(attributes.items()) if isinstance(attributes, dict) else []


def _is_dataset(value) -> bool:
    return isinstance(value, (Dataset, IterableDataset))


def _is_plain(value) -> bool:
    """An instance of a user's class whose attributes are data: not a class,
    module, function, torch module or tensor."""
    kind = type(value)
    if kind.__module__ == "builtins" or isinstance(value, (type, torch.nn.Module, torch.Tensor)):
        return False
    return isinstance(getattr(value, "__dict__", None), dict) and not callable(value)


def _why_not(value) -> str | None:
    kind = type(value)
    if kind in (list, tuple, dict, defaultdict, torch.Tensor):
        return None
    if isinstance(value, dict):
        return (f"it is a {kind.__name__}, a dict subclass whose behaviour a shared mapping "
                "would not keep; convert it to a dict to share it")
    if _is_object_array(value):
        return ("it is an array of Python objects, which sharing would copy out item by item; "
                "convert it to a list to share it")
    if getattr(getattr(value, "dtype", None), "kind", None) == "T":
        return ("its numpy StringDType keeps the strings outside the array's memory; "
                "convert it to a fixed-width array (x.astype(str)) or a list to share it")
    return None


def _other_large(value) -> tuple[int | None, str | None]:
    """The size of an object that is not a container or array sharing takes,
    where its type reports what it holds (its own ``__sizeof__``), and why it
    is not shared; (None, None) for the rest."""
    kind = type(value)
    if isinstance(value, (type, torch.nn.Module)) or callable(value):
        return None, None
    if kind.__sizeof__ is object.__sizeof__ and not isinstance(value, (str, bytes)):
        return None, None
    try:
        size = sys.getsizeof(value)
    except Exception:
        return None, None
    if size < LARGE_BYTES:
        return None, None
    name = _type_name(kind)
    if isinstance(value, np.ndarray):
        why = (f"it is a {name}, an array subclass whose own behaviour a shared array would "
               f"lose; share np.asarray(x) if that behaviour is not needed")
    else:
        why = (f"torchfeed.share takes lists, tuples, dicts and numpy arrays, not a {name}; "
               f"hold its data as those (a DataFrame's columns as numpy arrays, "
               f"df[c].to_numpy(), or lists) to share it")
    return size, why


def _type_name(kind: type) -> str:
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"
