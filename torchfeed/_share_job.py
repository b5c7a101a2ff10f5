"""``DataLoader(share_dataset=True)``, done: which of the large attributes
``_share_dataset.find_large`` names are shared under the loader's start
method, sharing them all in one memfd, replacing them in place, and when.

When: from the loader's construction, in a thread (``start``), so that the
pass over the data overlaps what the training script does next (building
the model, loading a checkpoint), and the first ``iter()`` that starts
workers (``share_before_workers``) only waits for what is left of it.  No
fork happens while that thread runs: torchfeed's own wait for it
(``_worker_costs.in_background``, joined before each worker is forked), and
any other process fork waits for it too (``os.register_at_fork``).  What it
logs is kept and logged by that ``iter()``, in the main thread.

What: under ``fork``, numpy arrays and tensors are left as they are (a
forked worker reads an array's pages without copying them), and so are
containers of large arrays or tensors; under ``spawn`` and ``forkserver``
arrays are shared (copy-on-write in each process, ``_share/_arrays.py``);
tensors never (torch sends a tensor's storage through shared memory itself).
Everything else ``find_large`` finds is shared, in one pack (one descriptor
per loader, an object held by several containers stored once); a container
of a few large entries (``COCO.dataset``) becomes a new container of the
same type whose large entries are shared.  An object reached under several
names (``DatasetFolder.imgs`` is its ``samples``) becomes one shared object
under all of them.  What is left unshared is named in the log: at INFO where
that is the plan, at WARNING where it cannot be shared.

In place: ``setattr(owner, name, shared)``, so the main process drops its own
copy too (unless the user's code keeps another reference to it), and every
worker, forked or spawned, reads the one shared copy.  Reads then build a
fresh object each time, in the main process as in the workers.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections import defaultdict
from typing import Any, NamedTuple

import numpy as np
import torch

from . import _host
from ._processes import start_forkserver_now
from ._share import ShareError, share_all
from ._share import _buffer as _share_buffer
from ._share_dataset import LARGE_BYTES, Found, describe, estimate_bytes, find_large
from ._worker_costs import in_background

logger = logging.getLogger("torchfeed")

_HOLDER_MAX = 64       # a large container of this many entries or fewer has its entries shared
BIG_ITEM_BYTES = 1 << 16  # a container of arrays this large each is read without copying under fork
_FORK_ARRAY = ("under fork, workers read an array's pages without copying them; a write "
               "stays in the worker that makes it")
_FORK_ARRAYS = ("its items are large arrays or tensors, whose pages forked workers read "
                "without copying them")
_TENSOR = ("torch itself sends a tensor's storage to workers through shared memory (and "
           "forked workers read it without copying)")

_lock = threading.Lock()   # one sharing pass at a time (two loaders over one dataset)
_jobs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loader -> its SharingJob
_running: set = set()
_fork_hook = [False]


class Replaced(NamedTuple):
    path: str
    owner: Any
    name: str
    shared: Any
    description: str
    nbytes: int
    seconds: float
    alias_of: str | None

    def stats(self) -> dict:
        entry = {"attribute": self.path, "description": self.description, "bytes": self.nbytes,
                 "shared": True, "seconds": self.seconds}
        if self.alias_of is not None:
            entry["alias_of"] = self.alias_of
        return entry


class Report:
    def __init__(self) -> None:
        self.replaced: list[Replaced] = []
        self.messages: list[tuple[int, str]] = []
        self.originals: list = []

    def log(self, level: int, message: str) -> None:
        self.messages.append((level, message))


def start_method(loader, allow_none: bool = False) -> str:
    ctx = loader.multiprocessing_context
    if ctx is not None:
        return ctx.get_start_method()
    import multiprocessing
    # at construction, never fix the default start method as a side effect
    method = multiprocessing.get_start_method(allow_none=True) if allow_none else None
    return method or (multiprocessing.get_all_start_methods()[0] if allow_none
                      else torch.multiprocessing.get_start_method())


# -- deciding -------------------------------------------------------------------------
def _left_alone(value, method: str) -> str | None:
    """Why ``value``, a container or array ``find_large`` found, is left as it is."""
    if type(value) is torch.Tensor:
        return _TENSOR
    if type(value) is np.ndarray:
        return _FORK_ARRAY if method == "fork" else None
    if isinstance(value, (list, tuple, dict)):
        kind = _large_array_items(value)
        if kind is torch.Tensor or (kind is np.ndarray and method == "fork"):
            return _FORK_ARRAYS if method == "fork" else _TENSOR
    return None


def _large_array_items(value):
    """np.ndarray or torch.Tensor where a sample of ``value``'s items are all
    arrays (tensors) of ``BIG_ITEM_BYTES`` or more on average."""
    step = max(1, len(value) // 16)
    items = list(itertools.islice(value.values(), 0, None, step)) if isinstance(value, dict) \
        else value[::step]
    if not items:
        return None
    for kind in (np.ndarray, torch.Tensor):
        if all(type(item) is kind for item in items):
            sizes = [item.nbytes if kind is np.ndarray else item.element_size() * item.numel()
                     for item in items]
            return kind if sum(sizes) / len(sizes) >= BIG_ITEM_BYTES else None
    return None


def _holder_entries(value, method: str) -> list | None:
    """For a container of a few large entries (``COCO.dataset``): the keys (or
    positions) of those to share, one by one; None for any other container."""
    if type(value) not in (list, tuple, dict) or len(value) > _HOLDER_MAX:
        return None
    pairs = value.items() if isinstance(value, dict) else enumerate(value)
    large = [key for key, entry in pairs if (estimate_bytes(entry) or 0) >= LARGE_BYTES
             and type(entry) in (list, tuple, dict, defaultdict, np.ndarray, torch.Tensor)]
    if not large:
        return None
    return [key for key in large if _left_alone(value[key], method) is None]


# -- sharing ------------------------------------------------------------------------
def share_dataset(dataset, method: str, keep_originals: bool = False) -> Report:
    """Share ``dataset``'s large attributes as ``method`` needs, in place."""
    report = Report()
    found = find_large(dataset)
    targets: dict[int, Found] = {}
    holders: dict[int, list] = {}
    for f in found:
        if f.alias_of is not None:
            continue
        what = describe(f.value, f.nbytes)
        if f.why_not is not None:
            report.log(logging.WARNING, f"share_dataset: left {f.path} ({what}) unshared: {f.why_not}")
            continue
        entries = _holder_entries(f.value, method)
        reason = _left_alone(f.value, method) if entries is None else (
            None if entries else "its large entries are arrays or tensors left as they are")
        if reason is not None:
            report.log(logging.INFO, f"share_dataset: left {f.path} ({what}) unshared: {reason}")
            continue
        targets[id(f.value)] = f
        if entries is not None:
            holders[id(f.value)] = entries
    objects: list = []
    for key, f in targets.items():
        if key in holders:
            objects.extend(f.value[k] for k in holders[key])
        else:
            objects.append(f.value)
    shared, seconds = _share(objects, targets, holders, report)
    made: dict[int, Any] = {}
    for key, f in targets.items():
        if key in holders:
            entries = [k for k in holders[key] if id(f.value[k]) in shared]
            if not entries:
                continue
            made[key] = _rebuilt(f.value, {k: shared[id(f.value[k])] for k in entries})
            seconds[key] = sum(seconds.get(id(f.value[k]), 0.0) for k in entries)
        elif key in shared:
            made[key] = shared[key]
    for f in found:
        new = made.get(id(f.value))
        if new is None:
            continue
        try:
            setattr(f.owner, f.name, new)
        except Exception as exc:  # a read-only property, a __setattr__ that refuses
            report.log(logging.WARNING, f"share_dataset: left {f.path} "
                       f"({describe(f.value, f.nbytes)}) unshared: setting "
                       f"{type(f.owner).__name__}.{f.name} failed: {exc!r}")
            continue
        what = describe(f.value, f.nbytes)
        took = seconds.get(id(f.value), 0.0) if f.alias_of is None else 0.0
        report.replaced.append(Replaced(f.path, f.owner, f.name, new, what, f.nbytes, took,
                                        f.alias_of))
        if f.alias_of is None:
            report.log(logging.INFO, f"share_dataset: shared {f.path} ({what}) in {took:.2f} s")
        else:
            report.log(logging.INFO, f"share_dataset: shared {f.path} ({what}): the same "
                       f"object as {f.alias_of}, shared once")
    if keep_originals:
        report.originals = [targets[key].value for key in made]
    return report


def _share(objects: list, targets: dict, holders: dict, report: Report):
    """Share ``objects`` in one pack: id of each original -> its shared
    version, and the seconds each took; one that cannot be shared is named
    and left out, and the others are shared without it."""
    objects = list({id(o): o for o in objects}.values())
    while objects:
        try:
            done = share_all(objects)
        except ShareError as exc:
            failed = objects.pop(exc.index)
            path = _path_of(failed, targets, holders)
            report.log(logging.WARNING, f"share_dataset: left {path} "
                       f"({describe(failed, estimate_bytes(failed) or 0)}) unshared: {exc}")
            continue
        except (OSError, RuntimeError) as exc:
            report.log(logging.WARNING, f"share_dataset: left the dataset unshared: {exc}")
            return {}, {}
        return ({id(o): s for o, s in zip(objects, done.shared)},
                {id(o): t for o, t in zip(objects, done.seconds)})
    return {}, {}


def _path_of(obj, targets: dict, holders: dict) -> str:
    for key, f in targets.items():
        if key == id(obj):
            return f.path
        for k in holders.get(key, ()):
            if f.value[k] is obj:
                return f"{f.path}[{k!r}]"
    return "an attribute"


def _rebuilt(container, shared_entries: dict):
    if isinstance(container, dict):
        return {key: shared_entries.get(key, entry) for key, entry in container.items()}
    return type(container)(shared_entries.get(i, entry) for i, entry in enumerate(container))


# -- when ---------------------------------------------------------------------------
class SharingJob:
    """``share_dataset`` of one loader's dataset, in a thread from construction."""

    def __init__(self, dataset, method: str):
        self.dataset, self.method = dataset, method
        self.report: Report | None = None
        self.error: BaseException | None = None
        self.ident: int | None = None
        self._done = threading.Event()

    def start(self) -> None:
        _watch_forks()
        _running.add(self)
        in_background(self.run, "torchfeed-share-dataset")

    def run(self) -> None:
        self.ident = threading.get_ident()
        try:
            with _lock:
                self.report = share_dataset(self.dataset, self.method)
        except BaseException as exc:  # never the user's training: the dataset stays as it is
            self.error = exc
        finally:
            self.dataset = None  # nothing of the data kept once done
            self._done.set()
            _running.discard(self)

    def wait(self) -> None:
        self._done.wait()

    def finish(self) -> Report:
        """Wait for the job; its report, with its log lines logged now."""
        self.wait()
        if self.error is not None:
            logger.warning("share_dataset: sharing the dataset failed (%s: %s); it is read as "
                           "it is", type(self.error).__name__, self.error)
            return Report()
        assert self.report is not None
        return self.report


def _wait_for_jobs() -> None:
    """Before any fork of this process: no sharing thread alive (NOTE [ No
    thread of ours at a fork ])."""
    me = threading.get_ident()
    for job in list(_running):
        if job.ident != me:
            job.wait()


def _watch_forks() -> None:
    if not _fork_hook[0] and hasattr(os, "register_at_fork"):
        os.register_at_fork(before=_wait_for_jobs)
        _fork_hook[0] = True


def start(loader) -> None:
    """At construction: start sharing ``loader.dataset`` in a thread, where
    ``share_dataset=True`` and workers will read it."""
    if not getattr(loader, "share_dataset", False) or not loader.num_workers or loader in _jobs:
        return
    if getattr(loader, "worker_method", "multiprocessing") == "thread":
        return  # thread workers read the loader's own dataset: nothing to share
    if not _host.SHARED_CONTAINERS:  # nothing can be shared here: share_before_workers says so
        return
    method = start_method(loader, allow_none=True)
    if method == "forkserver":
        start_forkserver_now(loader.dataset)  # it imports torch while the data is shared
    job = _jobs[loader] = SharingJob(loader.dataset, method)
    job.start()


def sharing_pending(loader) -> bool:
    """The loader asks for ``share_dataset`` and has not shared yet (persistent
    workers, a second ``iter()``: once is enough)."""
    return bool(getattr(loader, "share_dataset", False)) and "_shared_attributes" not in loader.__dict__


def share_before_workers(loader) -> list:
    """``share_dataset=True``: before the workers start, the dataset's large
    attributes are shared, once per loader: what the thread started at
    construction did (waited for), or all of it now.  Under spawn and
    forkserver, the objects replaced now are returned, to be freed in a thread
    once the workers are launched (``_worker_costs.in_background``, joined
    before any fork); a forked worker must not inherit them (the main process
    would write their pages as it frees them, and the workers would keep the
    old ones), so under fork they go at once."""
    if not getattr(loader, "share_dataset", False):
        return []
    if not sharing_pending(loader):
        return []
    if not _host.SHARED_CONTAINERS:
        _host.tell_once("share_dataset", "share_dataset=True shares nothing here: "
                        f"{_share_buffer.supported()}. Each worker holds its own copy of the "
                        "dataset, as with torch's DataLoader; stats() names the large "
                        "attributes copied.", stacklevel=5)
        loader.__dict__["_shared_attributes"] = []
        return []
    method = start_method(loader)
    if method == "forkserver":
        start_forkserver_now(loader.dataset)
    job = _jobs.pop(loader, None)
    report = job.finish() if job is not None else None
    if report is None or job is None or job.method != method:
        with _lock:  # all of it now, or what the job's start method left
            more = share_dataset(loader.dataset, method, keep_originals=method != "fork")
        if report is None:
            report = more
        else:
            logged = {text for _, text in report.messages}
            report.replaced += more.replaced
            report.messages += [m for m in more.messages if m[1] not in logged]
            report.originals = more.originals
    for level, text in report.messages:
        logger.log(level, text)
    loader.__dict__["_shared_attributes"] = [r.stats() for r in report.replaced]
    originals, report.originals = report.originals, []
    return originals
