"""``DataLoader(share_dataset=True)``: find a dataset's large lists, tuples,
dicts and arrays, and replace them in place by their ``torchfeed.share``
equivalents before the loader's workers first start (pytorch issue 13246).

What is searched: the dataset's own attributes (its instance ``__dict__``) and
the attributes of the plain objects it holds, two levels deep: a pycocotools
``COCO`` object held as ``dataset.coco`` has its ``anns``, ``imgs``,
``imgToAnns`` found as ``dataset.coco.anns`` and so on.  A dataset that holds
other datasets (``Subset.dataset``, ``ConcatDataset.datasets``) is followed
into each of them, and the depth starts again there.

What is large: an exact ``list``, ``tuple``, ``dict`` or ``defaultdict``, a
numpy array or a CPU tensor of at least ``LARGE_BYTES``, its size estimated
from ``len`` and a sample of its items (never by walking all of them).  A
``defaultdict`` keeps its lookup: a missing key gives ``default_factory()``,
which is not inserted (the container is read-only).  A container of a few
large entries (``COCO.dataset``, a dict of the JSON file's lists) becomes a
new container of the same type whose large entries are shared one by one.
Other dict subclasses,
object arrays and containers whose items cannot be pickled are left as they
are, and named in a warning.

In place: ``setattr(owner, name, shared)``, so the main process drops its own
copy too (unless the user's code keeps another reference to it), and every
worker, forked or spawned, reads the one shared copy.  Reads then build a
fresh object each time, in the main process as in the workers.

The same search without sharing names, in ``stats()`` and the copy-on-read
warning, the containers that every worker copies (``census``).
"""
from __future__ import annotations

import itertools
import logging
import sys
import time
from collections import defaultdict
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, IterableDataset

from . import _host
from ._processes import start_forkserver_now
from ._share import _buffer as _share_buffer
from ._share import is_shared, share
from ._transport._space import human

logger = logging.getLogger("torchfeed")

LARGE_BYTES = 2**20   # containers and arrays from this size on are shared
_SAMPLES = 32         # items whose size stands for the rest
_SIZE_BUDGET = 4096   # objects looked at to estimate one attribute's size
_HOLDER_MAX = 64      # a large container of this many entries or fewer has its entries shared
_MAX_OBJECTS = 10_000  # attributes looked at in all, whatever the dataset holds


class Found(NamedTuple):
    """A large attribute: ``path`` (``"dataset.coco.anns"``) is ``owner.name``."""

    path: str
    owner: Any
    name: str
    value: Any
    nbytes: int
    why_not: str | None  # why it cannot be shared; None if it can


def find_large(dataset) -> list[Found]:
    """The large lists, tuples, dicts and arrays ``dataset`` holds, two levels deep."""
    found: list[Found] = []
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
            if id(value) in seen:
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
            if size is not None:
                if size >= LARGE_BYTES:
                    seen.add(id(value))
                    found.append(Found(where, obj, name, value, size, _why_not(value)))
                continue
            if level < 2 and _is_plain(value):
                seen.add(id(value))
                stack.append((value, where, level + 1))
    found.sort(key=lambda f: f.path)
    return found


def share_dataset(dataset, originals: list | None = None) -> list[dict]:
    """Replace each large attribute of ``dataset`` by its shared version, in
    place.  Returns those replaced, as ``census`` names them (``"shared": True``,
    and the ``"seconds"`` sharing took); the replaced objects are appended to
    ``originals``, when given, for the caller to drop when it likes.
    Logs what it shared (INFO) and what it left alone, and why (WARNING)."""
    replaced = []
    for found in find_large(dataset):
        what = describe(found.value, found.nbytes)
        if found.why_not is not None:
            logger.warning("share_dataset: left %s (%s) unshared: %s", found.path, what,
                           found.why_not)
            continue
        began = time.perf_counter()
        try:
            shared = _shared(found.value)
        except (TypeError, ValueError, OSError, RuntimeError) as exc:
            logger.warning("share_dataset: left %s (%s) unshared: %s", found.path, what, exc)
            continue
        try:
            setattr(found.owner, found.name, shared)
        except Exception as exc:  # a read-only property, a __setattr__ that refuses
            logger.warning("share_dataset: left %s (%s) unshared: setting %s.%s failed: %r",
                           found.path, what, type(found.owner).__name__, found.name, exc)
            continue
        if originals is not None:
            originals.append(found.value)
        seconds = time.perf_counter() - began
        logger.info("share_dataset: shared %s (%s) in %.2f s", found.path, what, seconds)
        replaced.append({"attribute": found.path, "description": what, "bytes": found.nbytes,
                         "shared": True, "seconds": seconds})
    return replaced


def sharing_pending(loader) -> bool:
    """The loader asks for ``share_dataset`` and has not shared yet (persistent
    workers, a second ``iter()``: once is enough)."""
    return bool(getattr(loader, "share_dataset", False)) and "_shared_attributes" not in loader.__dict__


def share_once(loader, keep_originals: bool = False) -> list:
    """Share ``loader.dataset``'s large attributes if ``sharing_pending``.
    With ``keep_originals``, returns the replaced objects, which then live
    until the caller drops the list (``[]`` otherwise)."""
    if not sharing_pending(loader):
        return []
    if not _host.SHARED_CONTAINERS:
        _host.tell_once("share_dataset", "share_dataset=True shares nothing here: "
                        f"{_share_buffer.supported()}. Each worker holds its own copy of the "
                        "dataset, as with torch's DataLoader; stats() names the large "
                        "attributes copied.", stacklevel=5)
        loader.__dict__["_shared_attributes"] = []
        return []
    originals: list | None = [] if keep_originals else None
    loader.__dict__["_shared_attributes"] = share_dataset(loader.dataset, originals)
    return originals or []


def share_before_workers(loader) -> list:
    """``share_dataset=True``: share the dataset's large attributes before the
    first workers start, once per loader.  Under spawn and forkserver the
    replaced objects are returned, to be freed in a thread once the workers are
    launched (``_worker_costs.in_background``, joined before any fork): freeing
    them then overlaps the workers' start.  A forked worker must not
    inherit them (the main process would write their pages as it frees them,
    and the workers would keep the old ones), so under fork they go at once.
    A fork server is started first, to import torch while the main process shares."""
    if not sharing_pending(loader):
        return []
    ctx = loader.multiprocessing_context or torch.multiprocessing
    method = ctx.get_start_method()
    if method == "forkserver":
        start_forkserver_now(loader.dataset)
    return share_once(loader, keep_originals=method != "fork")


def census(dataset) -> list[dict]:
    """The large attributes still held as Python objects, which every worker
    copies (as it reads them under fork, whole under spawn and forkserver):
    ``[{"attribute", "description", "bytes", "shared": False}]``.  Arrays and
    tensors are left out: reading them writes none of their pages."""
    return [{"attribute": f.path, "description": describe(f.value, f.nbytes), "bytes": f.nbytes,
             "shared": False} for f in find_large(dataset)
            if isinstance(f.value, (list, tuple, dict)) or _is_object_array(f.value)]


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
    return None


def _shared(value):
    if type(value) in (list, tuple, dict) and len(value) <= _HOLDER_MAX:
        # A few large entries (pycocotools' ``COCO.dataset``: {"images": [...],
        # "annotations": [...], ...}) are shared one by one, in a new container of
        # the same type, so that reading one entry does not load them all.
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        large = {key for key, entry in pairs
                 if (estimate_bytes(entry) or 0) >= LARGE_BYTES and _why_not(entry) is None}
        if large:
            if isinstance(value, dict):
                return {key: _shared(entry) if key in large else entry
                        for key, entry in value.items()}
            return type(value)(_shared(entry) if i in large else entry
                               for i, entry in enumerate(value))
    return share(value)
