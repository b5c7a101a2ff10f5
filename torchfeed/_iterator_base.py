"""What the single- and multi-process iterators share.

The base iterator drives the index stream (``_index_stream.py``: the loader's
sampler or batch sampler, turned into numbered tasks, and the count of what
reached the user, which is what ``state_dict()`` reports), and applies torch's
per-iterator rules: the base seed is drawn once per iterator from the loader's
generator (or the global RNG), after the sampler's iterator is made, exactly
as torch does, so iterating advances the global RNG no further than torch's
DataLoader would; whether to pin, for which device, and the warnings about it
are the installed torch's; an IterableDataset that yields more batches than
its ``len()`` promised gets torch's warning.
"""
from __future__ import annotations

import warnings
from time import perf_counter

from torch.utils.data import IterableDataset

from . import _dropped_ctrl_c
from ._datapipes import seed_graph
from ._index_stream import IndexStream
from ._resume_book import ResumeBook
from ._stats import IteratorStats
from ._torch_compat import (
    HONOURS_PIN_MEMORY_DEVICE,
    PINS_FOR_CURRENT_ACCELERATOR,
    accelerator_available,
    current_accelerator_type,
)


def pin_memory_plan(loader) -> tuple[bool, str | None]:
    """(pin?, the device to pin for), by the installed torch's rules
    (``_torch_compat.py``), with its warnings for what cannot be honoured.
    The device is None where torch pins for the default device."""
    if HONOURS_PIN_MEMORY_DEVICE and loader.pin_memory_device:
        # before torch 2.9 a named device is pinned for as asked, present or not
        if not loader.pin_memory:
            warnings.warn(
                "'pin_memory_device' is set but 'pin_memory' argument is not set, then device "
                "pinned memory won't be used.please set 'pin_memory' to true, if you need to use "
                "the device pin memory" if PINS_FOR_CURRENT_ACCELERATOR else
                "pin memory device is set and pin_memory flag is not used then device pinned "
                "memory won't be usedplease set pin_memory to true, if you need to use the "
                "device pin memory", stacklevel=4)
        return loader.pin_memory, loader.pin_memory_device
    if loader.pin_memory and loader.pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device,ignore pin_memory_device='{loader.pin_memory_device}'.", stacklevel=4)
    available = accelerator_available()
    if loader.pin_memory and not available and PINS_FOR_CURRENT_ACCELERATOR:
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used.", stacklevel=4)
    pin = bool(loader.pin_memory and available)
    device = current_accelerator_type() if pin else None
    if device == "mps":
        warnings.warn(
            "'pin_memory' argument is set as true but not supported on MPS now, "
            f"{'then ' if HONOURS_PIN_MEMORY_DEVICE else ''}device pinned memory won't be used.",
            stacklevel=4)
        pin, device = False, None
    # from torch 2.9 the accelerator's device type; before, None (the default)
    return pin, None if HONOURS_PIN_MEMORY_DEVICE else device


def warn_empty_iterable(dataset, num_workers: int) -> None:
    """torch silently yields nothing; an empty epoch is far more often a bug
    (every worker skipped its share, a filter dropped everything) than intended,
    but it is legal, so it warns rather than raises."""
    where = (f"from any of its {num_workers} workers" if num_workers > 0
             else "in the main process (num_workers=0)")
    warnings.warn(
        f"IterableDataset {type(dataset).__name__} yielded no batches this epoch {where}. "
        "If each worker should read a share of the data, check how __iter__ splits it with "
        "torch.utils.data.get_worker_info(); with drop_last=True, an epoch shorter than "
        "batch_size yields nothing too. If the dataset is meant to be empty, ignore this "
        "warning.", stacklevel=3)


class BaseIterator:
    def __init__(self, loader) -> None:
        # No reference to the loader is kept: with persistent workers the
        # loader holds its iterator, and a cycle would keep the workers alive
        # after `del loader` until the garbage collector ran.
        self._dataset = loader.dataset
        self._is_iterable = isinstance(loader.dataset, IterableDataset)
        self._auto_collation = loader._auto_collation
        self._drop_last = loader.drop_last
        self._index_sampler = loader._index_sampler
        self._num_workers = loader.num_workers
        self._collate_fn = loader.collate_fn
        self._timeout = loader.timeout
        self._persistent_workers = loader.persistent_workers
        self._pin_memory, self._pin_memory_device = pin_memory_plan(loader)
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        self._epoch = 0
        self._stream = IndexStream(loader, ResumeBook.of(loader))
        self._start_stream(fresh=True)  # also draws the base seed, or restores a resumed one
        self._stats = IteratorStats(self, loader, self._epoch)
        self._base_seed = self._stream.base_seed

    # -- the index stream ---------------------------------------------------
    def _start_stream(self, fresh: bool = False) -> None:
        self._stream.start(fresh)
        self._epoch = self._stream.epoch  # the loader's epoch: keys per-batch seeds
        # An IterDataPipe is seeded in the main process too, as torch does.
        self._dataset = seed_graph(self._dataset, self._stream.shared_seed)
        self._num_yielded = self._stream.batches_yielded

    def _next_index(self):
        """(batch_index, indices) of the next task; StopIteration at the end."""
        return self._stream.next()

    def _reset(self, loader, first_iter: bool = False) -> None:
        """Start another epoch over the same iterator (persistent workers)."""
        self._IterableDataset_len_called = loader._IterableDataset_len_called
        self._start_stream()

    # -- what the loader and the stats ask ----------------------------------
    def hand_over(self) -> IteratorStats:
        """``iter(loader)`` gives this iterator to the user now: wall time starts
        here.  Returns the stats, which the loader keeps instead of the iterator,
        so that asking for stats keeps no worker alive."""
        self._stats.start_clock()  # counts began before any task
        return self._stats

    @property
    def shut_down(self) -> bool:
        """Whether the workers were stopped (an error, the end of an epoch
        without persistent workers, or the iterator dropped); never here."""
        return False

    def shutdown(self) -> None:
        """Stop the workers, if any: a loaded state replaces this iterator."""

    # -- the iterator protocol ---------------------------------------------
    def __iter__(self):
        return self

    def _next_data(self):
        raise NotImplementedError

    def __next__(self):
        _dropped_ctrl_c.raise_if_kept()  # NOTE [ Ctrl-C in a release ]
        t0 = perf_counter()
        try:
            while self._stream.reread:  # a resumed IterableDataset without state
                self._next_data()
            data = self._next_data()
        except StopIteration:
            if self._is_iterable and self._num_yielded == 0:
                warn_empty_iterable(self._dataset, self._num_workers)
            self._stream.finish()
            self._stats.finish(t0)
            raise
        self._stats.on_yield(t0)
        self._num_yielded += 1
        if (self._is_iterable and self._IterableDataset_len_called is not None
                and self._num_yielded > self._IterableDataset_len_called):
            msg = (f"Length of IterableDataset {self._dataset} was reported to be "
                   f"{self._IterableDataset_len_called}(when accessing len(dataloader)), but "
                   f"{self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                msg += ("For multiprocessing data-loading, this could be caused by not properly "
                        "configuring the IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                        "for examples.")
            warnings.warn(msg, stacklevel=2)
        return data

    def __len__(self) -> int:
        return len(self._index_sampler)

    def __getstate__(self):
        raise NotImplementedError(f"{type(self).__name__} cannot be pickled")
