"""The ``num_workers=0`` iterator: fetch, collate and pin in the calling thread.

Errors from the dataset or ``collate_fn`` propagate untouched, as in torch.
With per-batch seeding the RNGs are seeded for each batch as a worker would
seed them, and the caller's RNG state is put back afterwards so the training
loop's own randomness is not disturbed.
"""
from __future__ import annotations

import random

import numpy as np
import torch

from . import _seeding
from ._fetch import create_fetcher
from ._iterator_base import BaseIterator
from ._pin_memory import pin_memory


class SingleProcessIterator(BaseIterator):
    def __init__(self, loader) -> None:
        super().__init__(loader)
        self._seed_per_batch = getattr(loader, "seed_per_batch", False)
        self._make_fetcher()

    def _make_fetcher(self) -> None:
        self._fetcher = create_fetcher(self._is_iterable, self._dataset, self._auto_collation,
                                       self._collate_fn, self._drop_last)

    def _reset(self, loader, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        self._make_fetcher()

    def _fetch_seeded(self, batch_index: int, indices):
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        try:
            _seeding.seed_batch(self._base_seed, self._epoch, batch_index)
            return self._fetcher.fetch(indices)
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _next_data(self):
        batch_index, indices = self._next_index()
        if self._seed_per_batch:
            data = self._fetch_seeded(batch_index, indices)
        else:
            data = self._fetcher.fetch(indices)  # StopIteration ends an iterable
        if self._pin_memory:
            data = pin_memory(data, self._pin_memory_device)
        return data
