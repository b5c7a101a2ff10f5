"""``torchfeed.prepare``: keep torchfeed inside the loaders that frameworks rebuild.

Accelerate's ``Accelerator.prepare`` and Ray Train's ``prepare_data_loader``
shard a loader per rank by rebuilding it as ``torch.utils.data.DataLoader(...)``
with their own (batch) sampler, then wrap that in their own object (Accelerate's
``DataLoaderShard``, which places batches on the device and tracks the end of the
epoch; Ray's ``_WrappedDataLoader``, which moves batches to the device).  Both
name torch's class, not ``type(loader)``, and neither has a hook for another
class, so the import swap alone cannot survive them without patching them.

One mechanism for all of them: let the framework prepare the loader as it
always does, then put a ``torchfeed.DataLoader`` back where it put torch's,
rebuilt from the framework's own (batch) sampler (so every rank deals exactly
the framework's shard) and from the user's loader's other options (including
the ones Ray drops: ``persistent_workers``, ``prefetch_factor`` and torchfeed's
own).  The user's loader then answers ``state_dict()``, ``load_state_dict()``
and ``stats()`` for the loader that actually runs.  Both wrappers read one batch
ahead of the user; the state is the one the user has seen, not the look-ahead:
Accelerate's ``DataLoaderShard`` snapshots it itself, and Ray's wrapper is fed
through :class:`_Lookahead`, which snapshots it the same way (also when Ray kept
a loader that already had a ``DistributedSampler``).  Accelerate's
``use_stateful_dataloader`` builds torchdata's loader and takes its state first,
drawing from the RNG; that loader is replaced too, with a warning.  Under
``dispatch_batches=True`` (Accelerate's ``DataLoaderDispatcher``) the same swap
holds, exact in one process; with several processes only process 0 iterates,
and a warning says that the saved position is not exact there.

Where the framework's product is not recognised, the framework's loader runs
and a warning names the supported way; so it does when ``accelerator.prepare``
is given a ``torchfeed.DataLoader`` directly (``_prepared.accelerate_rebuilds``, on
the attribute Accelerate reads right before it rebuilds a loader).
``_prepared.frameworks_warning`` covers the other silent loss: a ``state_dict()``
of a loader that a framework replaced without ``torchfeed.prepare`` would say
that nothing ran.
"""
from __future__ import annotations

import sys
import weakref

import torch.utils.data
from torch.utils.data import IterableDataset

from . import _state
from ._prepared import _inside_prepare, _warn_once
from ._torch_compat import TAKES_IN_ORDER
from .dataloader import DataLoader

# dataset, sampler, batch_sampler, batch_size and drop_last decide which indices a
# rank gets: always the framework's (``_rebuild``).  Ray may wrap these for
# reproducibility (``enable_reproducibility``): the framework's.
_FROM_FRAMEWORK = ("worker_init_fn", "generator")
# The rest of torch's arguments, and torchfeed's: the user's loader's.
_FROM_USER = ("num_workers", "collate_fn", "pin_memory", "timeout", "multiprocessing_context",
              "prefetch_factor", "persistent_workers", "pin_memory_device",
              *(("in_order",) if TAKES_IN_ORDER else ()),  # torch 2.6 on
              "transport", "seed_per_batch", "snapshot_every_n_steps", "log_every",
              "max_worker_restarts", "device", "share_dataset")


def prepare(framework_prepare, loader, *args, **kwargs):
    """``framework_prepare(loader, *args, **kwargs)``, with torchfeed still iterating.

    Accelerate's ``accelerator.prepare`` and Ray Train's
    ``prepare_data_loader`` rebuild any loader as torch's own DataLoader.  This
    lets the framework prepare the loader as it always does, then puts a
    ``torchfeed.DataLoader`` back where the framework put torch's, built from
    the framework's (batch) sampler, so that every rank deals exactly the
    framework's shard, and from ``loader``'s other options.  Afterwards
    ``loader.state_dict()``, ``loader.load_state_dict()`` and
    ``loader.stats()`` refer to the loader that runs, and count the batches
    the training loop received, not the framework's look-ahead.

    Warns, and leaves the framework's loader running, when the framework's
    result holds no DataLoader torchfeed knows how to replace; warns too
    under Accelerate's ``use_stateful_dataloader=True`` and under
    ``dispatch_batches=True`` with several processes (the saved position is
    then not exact).

    Args:
        framework_prepare: the framework's own call, e.g.
            ``accelerator.prepare`` or ``ray.train.torch.prepare_data_loader``.
        loader (DataLoader): the ``torchfeed.DataLoader`` to prepare.
        *args: passed on to ``framework_prepare`` after ``loader``.
        **kwargs: passed on to ``framework_prepare``.

    Returns:
        What ``framework_prepare`` returned, holding the torchfeed loader.

    Raises:
        TypeError: ``loader`` is not a ``torchfeed.DataLoader``.
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"torchfeed.prepare() takes a torchfeed.DataLoader, got "
                        f"{type(loader).__module__}.{type(loader).__qualname__}")
    _inside_prepare.add(id(loader))
    try:
        prepared = framework_prepare(loader, *args, **kwargs)
    finally:
        _inside_prepare.discard(id(loader))
    holder, slot, inner = _engine_slot(prepared)
    if inner is loader or isinstance(inner, DataLoader):
        engine = inner  # the framework kept the loader (it was already per-rank)
        if slot == "_dataloader":  # but its wrapper still reads one batch ahead (Ray's)
            setattr(holder, slot, _Lookahead(engine))
    elif isinstance(inner, torch.utils.data.DataLoader):  # torch's, or torchdata's Stateful one
        if type(inner) is not torch.utils.data.DataLoader:
            _warn_once("stateful", (
                f"torchfeed.prepare(): the framework built a {type(inner).__qualname__} and "
                "took its state_dict() before torchfeed replaced it (Accelerate's "
                "use_stateful_dataloader=True), which drew from the global RNG, so this "
                "epoch's shuffle is not the one torch's loader would deal. Leave "
                "use_stateful_dataloader off: with torchfeed.prepare, save_state and "
                "load_state include the loader's exact state without it."))
        engine = _rebuild(inner, loader)
        if holder is None:
            prepared = engine
        else:
            _install(holder, slot, engine)
    else:
        _warn_once(type(prepared), (
            f"torchfeed.prepare(): {type(prepared).__module__}.{type(prepared).__qualname__} "
            "holds no torch.utils.data.DataLoader that torchfeed knows how to replace, so "
            "torchfeed's iterator is not used; this framework or version is not supported."))
        return prepared
    if engine is not loader:
        loader._prepared_as = engine
    return prepared


def _engine_slot(prepared):
    """``(holder, attribute, loader)``: where the framework keeps the loader that runs."""
    own = getattr(prepared, "__dict__", {})
    for slot in ("base_dataloader", "_dataloader"):  # Accelerate's adapters; Ray's wrapper
        inner = own.get(slot)
        if isinstance(inner, torch.utils.data.DataLoader):
            return prepared, slot, inner
    return None, None, prepared


def _rebuild(inner, loader):
    """A torchfeed loader dealing ``inner``'s indices with ``loader``'s options."""
    kwargs = {name: getattr(loader, name) for name in _FROM_USER}
    kwargs.update({name: getattr(inner, name) for name in _FROM_FRAMEWORK})
    if kwargs["num_workers"] == 0:
        kwargs["prefetch_factor"] = None  # torch refuses one without workers
    if not isinstance(inner.dataset, IterableDataset):
        if inner.batch_size is None and inner.batch_sampler is not None:
            kwargs["batch_sampler"] = inner.batch_sampler  # the framework's own
        else:
            kwargs["sampler"] = inner.sampler
    if "batch_sampler" not in kwargs:
        kwargs.update(batch_size=inner.batch_size, drop_last=inner.drop_last)
    return DataLoader(inner.dataset, **kwargs)


def _install(holder, slot, engine) -> None:
    if slot == "base_dataloader":
        # Accelerate's adapter: its state_dict() is the snapshot it takes before each
        # look-ahead (exact), and save_state/load_state include loaders that say
        # use_stateful_dataloader.  Its snapshot starts as the fresh loader's state.
        holder.dl_state_dict = _state.state_dict(engine)  # not iterated yet, and not to warn so
        holder.use_stateful_dataloader = True
        engine._framework_snapshot = weakref.ref(holder)
        setattr(holder, slot, engine)
        _dispatched_to_several(holder)
    else:
        setattr(holder, slot, _Lookahead(engine))


def _dispatched_to_several(holder) -> None:
    """Warn when Accelerate's ``DataLoaderDispatcher`` serves several processes.

    With ``dispatch_batches=True`` process 0 alone iterates the loader and
    broadcasts slices of its batches; the loaders of the other processes never
    move.  ``save_state`` has every process write the same loader file, so the
    position saved may be another process's (the start of the epoch), and process
    0's own snapshot counts the batches it read ahead for the next step.  In one
    process the dispatcher reads one batch ahead and snapshots before it, so the
    state is exact there.
    """
    dispatcher = getattr(sys.modules.get("accelerate.data_loader"), "DataLoaderDispatcher", None)
    if dispatcher is None or not isinstance(holder, dispatcher):
        return
    if holder.state.num_processes > 1:
        _warn_once("dispatch", (
            "torchfeed.prepare(): Accelerate's dispatch_batches=True runs the loader on "
            "process 0 only and broadcasts its batches, so accelerator.save_state() cannot "
            "record where the loader is (every process writes the loader file; the others' "
            "loaders never move) and load_state() does not resume this epoch exactly. To "
            "resume exactly, use Accelerator(dataloader_config=DataLoaderConfiguration("
            "dispatch_batches=False)): each process then runs its own torchfeed loader on "
            "its shard."))


class _Lookahead:
    """Feeds a loader to a wrapper that reads one batch ahead of the user (Ray's).

    Before each batch is taken from the loader, the loader's state is noted: it is
    what the user has consumed while that batch waits in the wrapper.  When the
    loader is exhausted, the user has everything it yielded.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def __len__(self) -> int:
        return len(self.engine)

    def __iter__(self):
        engine = self.engine
        iterator = iter(engine)
        try:
            while True:
                engine._user_state = _state.state_dict(engine)
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                yield batch
        finally:
            engine._user_state = None

