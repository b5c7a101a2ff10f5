"""What ``torchfeed.prepare`` keeps on a loader, and the warnings when a framework drops torchfeed.

``torchfeed.DataLoader`` calls these hooks (``state_dict``, ``load_state_dict``,
``stats``, Accelerate's ``_is_accelerate_prepared`` read); :mod:`torchfeed.frameworks`
writes what they read.  Kept apart from ``frameworks.py`` so that the loader does
not import the module that builds loaders: the data path imports this one,
``frameworks.py`` imports both.
"""
from __future__ import annotations

import sys
import warnings

from torch.utils.data import IterableDataset
from torch.utils.data.distributed import DistributedSampler

from . import _state
from ._iterable_shards import rank_and_world_size
from ._resume_book import ResumeBook

SUPPORTED = ("pass the loader through torchfeed.prepare(framework_prepare, loader), e.g. "
             "torchfeed.prepare(accelerator.prepare, loader) or "
             "torchfeed.prepare(ray.train.torch.prepare_data_loader, loader); see the docs, "
             "'Hugging Face Accelerate and Trainer' and 'Ray Train' (docs/frameworks.md)")

_warned: set = set()
_inside_prepare: set = set()  # ids of the loaders torchfeed.prepare is handing to a framework

# What torchfeed.prepare keeps on a loader, in the loader's __dict__ so that a
# copied or pickled loader keeps it too; frameworks.py writes these keys and only
# this module and frameworks.py read them:
# "_prepared_as", the loader the framework runs in place of this one;
# "_user_state", the state of what the user has consumed while a wrapper holds a
# batch read ahead; "_framework_snapshot", a weak reference to the Accelerate
# adapter whose snapshot reports this loader's state.


def prepared_engine(loader):
    """The loader a framework runs in place of ``loader`` (``torchfeed.prepare``), or None."""
    return loader.__dict__.get("_prepared_as")


def read_ahead_state(loader) -> dict | None:
    """``loader``'s state as the user has seen it while a wrapper (Ray's) holds a
    batch read ahead, or None when no batch is held."""
    return loader.__dict__.get("_user_state")


def _warn_once(key, message: str, stacklevel: int = 3) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def _first_frame_outside(*packages: str) -> int:
    """The ``stacklevel``, for a warning that this function's caller has ``_warn_once``
    raise, of the first frame outside ``packages`` (the user's call into them)."""
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and \
            frame.f_globals.get("__name__", "").partition(".")[0] in packages:
        frame, level = frame.f_back, level + 1
    return level


def accelerate_rebuilds(loader) -> None:
    """Warn once: Accelerate's ``prepare`` is rebuilding ``loader`` on torch's DataLoader.

    Called when Accelerate asks the loader whether it was prepared already, which
    it does right before rebuilding it; not when ``torchfeed.prepare`` is the
    caller, nor for the loader ``torchfeed.prepare`` put inside Accelerate's.
    """
    if id(loader) in _inside_prepare or "_framework_snapshot" in loader.__dict__:
        return
    _warn_once("accelerate", (
        "Accelerator.prepare() rebuilds this torchfeed.DataLoader as torch's DataLoader, so "
        "torchfeed's iterator does not run: no shared-memory transport, no stats(), and "
        f"save_state() does not record the loader's position. To keep torchfeed, {SUPPORTED}."),
        stacklevel=_first_frame_outside("accelerate", "torchfeed"))


def frameworks_warning(loader) -> None:
    """Warn once if ``loader``'s state says nothing ran, likely because a framework replaced it.

    The signature of that loss: a map-style loader never iterated in this
    process, without a distributed sampler, while ``torch.distributed`` runs
    several ranks (Ray Train rebuilds exactly those, Accelerate every loader).
    """
    book = ResumeBook.of(loader)
    if book.live is not None or isinstance(loader.dataset, IterableDataset):
        return
    if rank_and_world_size()[1] <= 1 or _is_distributed(loader):
        return
    _warn_once("state_dict", (
        "DataLoader.state_dict() of a loader that has not been iterated in this process, "
        "while torch.distributed runs several ranks and its sampler is not distributed: if a "
        "framework (Accelerate's prepare, Ray Train's prepare_data_loader) rebuilt it on "
        "torch's DataLoader, torchfeed's iterator did not run and this state restarts the "
        f"epoch on resume. To keep torchfeed and resume exactly, {SUPPORTED}."))


def _is_distributed(loader) -> bool:
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    return any(isinstance(s, DistributedSampler) or hasattr(s, "num_replicas")
               or hasattr(s, "num_processes") for s in (sampler, batch_sampler, inner))


def _accelerate_adapter(engine):
    """The Accelerate adapter ``torchfeed.prepare`` put ``engine`` in, while it lives."""
    snapshot = engine.__dict__.get("_framework_snapshot")
    return snapshot() if snapshot is not None else None


def framework_snapshot(engine) -> dict | None:
    """The state of what the user received from Accelerate's adapter around ``engine``.

    Accelerate's ``DataLoaderShard`` reads one batch ahead of the user and keeps,
    as ``dl_state_dict``, the state it took before that read; ``engine``'s own
    state counts the batch read ahead.  None where no such adapter holds ``engine``.
    """
    holder = _accelerate_adapter(engine)
    if holder is None:
        return None
    # Accelerate tags its copy with "_iterator_finished"; the loader's own state says
    # as much (every batch yielded), so the user gets torchfeed's format alone.
    return {k: v for k, v in holder.dl_state_dict.items() if k != "_iterator_finished"}


def loaded(loader) -> None:
    """After ``load_state_dict``: what a framework's wrapper reports is the loaded state."""
    loader._user_state = None
    holder = _accelerate_adapter(loader)
    if holder is not None:  # Accelerate's adapter would report its stale snapshot until iter()
        holder.dl_state_dict = _state.state_dict(loader)
