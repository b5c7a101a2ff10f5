"""The ``num_workers=0`` iterator: fetch, collate and pin in the calling thread.

Errors from the dataset or ``collate_fn`` propagate untouched, as in torch.
With per-batch seeding the RNGs are seeded for each batch as a worker would
seed them (torch's CPU generator only: the accelerators' generators are left
alone), and the caller's RNG state is put back afterwards so the training
loop's own randomness is not disturbed.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from . import _seeding
from ._datapipes import shard_graph
from ._device import resolve_device, to_device_now
from ._fetch import create_fetcher
from ._index_stream import NO_STATE
from ._iterator_base import BaseIterator
from ._pin_memory import pin_memory
from ._stateful import StateTaker, take_state
from ._torch_compat import assertion_message


class SingleProcessIterator(BaseIterator):
    def __init__(self, loader) -> None:
        super().__init__(loader)
        if self._timeout != 0:
            # torch accepts the argument and fails here, with an AssertionError,
            # after drawing the base seed; keep the type and the RNG draw.
            raise AssertionError(assertion_message(
                "_SingleProcessDataLoaderIter requires timeout == 0",
                f"timeout={self._timeout} needs worker processes: a DataLoader with "
                "num_workers=0 loads in the calling thread and cannot time out. Set "
                "timeout=0, or num_workers > 0."))
        self._seed_per_batch = getattr(loader, "seed_per_batch", False)
        self._device = resolve_device(getattr(loader, "device", None))
        shard_graph(self._dataset, 0, 0)  # a DataPipe: this rank's share, as torch does
        self._make_fetcher()

    def _make_fetcher(self) -> None:
        resumes = self._stream.resume_states
        self._stream.resume_states = None  # once: the dataset object keeps it from then on
        resume = resumes[0] if resumes is not None else None  # the one "worker"
        if resume is not None and resume.dataset_state is not None:
            self._dataset.load_state_dict(resume.dataset_state)
        self._fetcher = create_fetcher(self._is_iterable, self._dataset, self._auto_collation,
                                       self._collate_fn, self._drop_last,
                                       iterator_state=resume.iterator_state if resume is not None else None)
        self._taker = (StateTaker(self._dataset, self._is_iterable)
                       if self._stream.ships_state else None)
        if resume is not None and resume.exhausted:
            self._fetcher.exhausted = True  # the last batch yielded exhausted its stream
        elif self._is_iterable:
            # torch calls the dataset's __iter__ when the iterator is made, so
            # an error from it is raised by iter(loader), not the first next().
            self._fetcher.stream()
        if self._taker is not None:
            # The state at the epoch's start (after iter(dataset), as torchdata takes
            # it): a state_dict() before the first next() replays the whole epoch even
            # after this same dataset object has gone further.
            state = take_state(self._taker, self._fetcher)
            self._stream.worker_states[0], self._stream.iterator_states[0] = state

    def _reset(self, loader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._make_fetcher()

    def _fetch_seeded(self, batch_index: int, indices):
        saved = (torch.default_generator.get_state(), random.getstate(), np.random.get_state())
        try:
            _seeding.seed_batch(self._base_seed, self._epoch, batch_index, cpu_only=True)
            return self._fetcher.fetch(indices)
        finally:
            torch.default_generator.set_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _next_data(self):
        batch_index, indices = self._next_index()
        try:
            if self._seed_per_batch:
                data = self._fetch_seeded(batch_index, indices)
            else:
                data = self._fetcher.fetch(indices)  # StopIteration ends an iterable
        except StopIteration:
            if self._taker is not None:  # the state its end left the dataset in
                self._stream.worker_exhausted(0, take_state(self._taker, self._fetcher))
            raise
        except Exception:
            self._stream.record_failure(batch_index, indices)
            raise
        state, exhausted = NO_STATE, False
        if self._taker is not None:  # the dataset's and its iterator's state after this batch
            state = take_state(self._taker, self._fetcher)
            exhausted = getattr(self._fetcher, "exhausted", False)
        if self._pin_memory:
            data = pin_memory(data, self._pin_memory_device)
        if self._device is not None:
            data = to_device_now(data, self._device)
        samples = self._fetcher.last_size if self._is_iterable else None
        self._stream.record_yield(batch_index, indices, 0, state, exhausted, samples)
        return data
