"""torch's ``RandomSampler`` order without its list of every index.

``RandomSampler.__iter__`` turns ``torch.randperm(n)`` into a Python list
before it yields the first index: for 2**26 samples that is 2.5 GiB in the main
process and seconds before the first batch.  ``iterate(index_sampler)`` gives
the loader's index stream the same indices, drawn from the same generators in
the same order, but keeps the permutation as an int64 tensor (8 bytes per
sample) and turns it into Python ints a chunk at a time.

Only exactly torch's ``RandomSampler`` without replacement (alone or inside
exactly torch's ``BatchSampler``) is iterated this way: a subclass, or any
other sampler, keeps its own ``__iter__``.  With replacement torch already
draws 32 indices at a time.  The draws happen where torch makes them (lazily,
at the first ``next()``, and one ``randperm`` per pass over the data), so the
generators are left exactly as torch's own iterator leaves them, which is what
resuming replays (``_index_stream.py``).
"""
from __future__ import annotations

import itertools
from typing import Iterator

import torch
from torch.utils.data import BatchSampler, RandomSampler

CHUNK = 1 << 16  # indices turned into Python ints at a time (~2 MiB of ints)


def iterate(index_sampler) -> Iterator:
    """``iter(index_sampler)``, with torch's RandomSampler handed out in chunks."""
    if type(index_sampler) is RandomSampler and not index_sampler.replacement:
        return _random_indices(index_sampler)
    if (type(index_sampler) is BatchSampler and type(index_sampler.sampler) is RandomSampler
            and not index_sampler.sampler.replacement):
        return _batches(index_sampler, _random_indices(index_sampler.sampler))
    return iter(index_sampler)


def _random_indices(sampler: RandomSampler) -> Iterator[int]:
    # Each index comes out of C (chain over a list): no Python frame resumes per
    # index, where yield-from delegation through two generators resumed two.
    return itertools.chain.from_iterable(_random_lists(sampler))


def _random_lists(sampler: RandomSampler) -> Iterator[list]:
    # torch's RandomSampler.__iter__, step for step, with the lists made per chunk:
    # the seed is drawn at the first next(), each randperm when the pass before
    # it is used up, as torch's generator does.
    n = len(sampler.data_source)
    if sampler.generator is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    for _ in range(sampler.num_samples // n):
        yield from _lists(torch.randperm(n, generator=generator))
    yield from _lists(torch.randperm(n, generator=generator)[: sampler.num_samples % n])


def chunks(order: torch.Tensor) -> Iterator[int]:
    """The ints of a 1-D tensor, in order, converted ``CHUNK`` at a time."""
    return itertools.chain.from_iterable(_lists(order))


def _lists(order: torch.Tensor) -> Iterator[list]:
    step = CHUNK
    for start in range(0, len(order), step):
        yield order[start:start + step].tolist()


def _batches(batch_sampler: BatchSampler, indices: Iterator[int]) -> Iterator[list]:
    # torch's BatchSampler.__iter__ over the chunked indices.
    size = batch_sampler.batch_size
    if batch_sampler.drop_last:
        for full in zip(*[indices] * size):
            yield [*full]
    else:
        batch = [*itertools.islice(indices, size)]
        while batch:
            yield batch
            batch = [*itertools.islice(indices, size)]
