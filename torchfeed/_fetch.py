"""Turning the indices of one task into one batch.

A fetcher is built once per worker (and once per epoch for iterable datasets)
and called once per task.  The semantics are torch's, case by case:

* map-style with automatic batching: ``dataset.__getitems__(indices)`` when the
  dataset defines it, else ``[dataset[i] for i in indices]``, then ``collate_fn``.
  A collate that declares ``takes_sample_stream`` (the shared-memory
  transport's ``default_collate``) gets the samples lazily instead, as a
  ``SampleStream`` it fetches one by one, in the same order;
* map-style without batching (``batch_size=None``): ``dataset[index]`` then
  ``collate_fn`` (``default_convert`` by default);
* iterable with batching: up to ``len(indices)`` items from the dataset's
  iterator; an empty batch, or a short one under ``drop_last``, ends the stream.
  A collate that takes a ``SampleStream`` gets them lazily here too;
* iterable without batching: one item per task.

As in torch, ``iter(dataset)`` is called once per fetcher and only ``next()``
afterwards: an ``__iter__`` that returns ``self`` and restarts the epoch
(litdata's ``StreamingDataset``) must not be called again per batch.  A resume
gives the fetcher the state of that iterator, loaded right after ``iter()``
(torchdata's order; see ``_stateful.py``).

``StopIteration`` from an iterable fetcher means "this worker's stream is done".

``fetch_task`` runs one task through a fetcher for a worker, process or
thread alike: the batch and the (dataset, iterator) state right after it
(``Fetched``, whose ``wrap`` puts the state around what is sent), or the
``WorkerFailure`` / ``IterableExhausted`` to send instead.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ._errors import WorkerFailure, explain_lookup_error
from ._protocol import IterableExhausted, StatefulResult, Task
from ._stateful import take_state
from ._transport import SampleStream


def takes_sample_stream(collate_fn) -> bool:
    """Whether ``collate_fn`` fetches the samples itself from a ``SampleStream``."""
    return bool(getattr(collate_fn, "takes_sample_stream", False))


class MapFetcher:
    def __init__(self, dataset, auto_collation: bool, collate_fn: Callable):
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        getitems = getattr(dataset, "__getitems__", None)
        self._getitems = getitems if callable(getitems) else None
        self._lazy = takes_sample_stream(collate_fn)

    def fetch(self, indices) -> Any:
        if not self.auto_collation:
            return self.collate_fn(self._get(indices))
        if self._getitems is not None:
            try:
                samples = self._getitems(indices)
            except LookupError as exc:
                explain_lookup_error(exc, self.dataset, indices, batched=True)
                raise
        elif self._lazy:
            samples = SampleStream(map(self._get, indices), len(indices))
        else:
            samples = [self._get(i) for i in indices]
        return self.collate_fn(samples)

    def _get(self, index):
        try:
            return self.dataset[index]
        except LookupError as exc:  # IndexError, KeyError: name the index and len(dataset)
            explain_lookup_error(exc, self.dataset, index)
            raise
        except StopIteration as exc:
            # Left alone, it would end whatever iteration is running: torch's
            # num_workers=0 epoch stops early without a word, and the lazy
            # stream of samples (SampleStream) would yield a short batch.
            raise RuntimeError(
                f"dataset[{index!r}] raised StopIteration. A map-style dataset's "
                f"__getitem__ must return a sample; past its end it should raise "
                f"IndexError.") from exc


class IterableFetcher:
    def __init__(self, dataset, auto_collation: bool, collate_fn: Callable, drop_last: bool,
                 iterator_state=None):
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self._iterator: Any = None  # iter(dataset), once the first task asks
        self._iterator_state = iterator_state  # a resume's, loaded right after iter()
        self.exhausted = False
        self.last_size: int | None = None  # samples in the latest batch when it came up short, else None
        self._lazy = takes_sample_stream(collate_fn)

    @property
    def iterator(self):
        """What ``iter(dataset)`` returned this epoch, or None before it was called."""
        return self._iterator

    def stream(self):
        """``iter(dataset)``, made on first use (a resume's iterator state loaded
        into it).  The dataset's __iter__ runs lazily, on the first task, as in
        torch: errors raised by it are then reported against that task."""
        if self._iterator is None:
            self._iterator = iter(self.dataset)
            state, self._iterator_state = self._iterator_state, None
            if state is not None:
                self._iterator.load_state_dict(state)
        return self._iterator

    def fetch(self, indices) -> Any:
        if self.exhausted:
            raise StopIteration
        stream = self.stream()
        if not self.auto_collation:
            try:
                return self.collate_fn(next(stream))
            except StopIteration:
                self.exhausted = True
                raise
        n = len(indices)
        try:
            first = next(stream)  # an empty batch must never reach the collate
        except StopIteration:
            self.exhausted = True
            raise
        short = False
        self.last_size = None

        def items(first):
            nonlocal short
            yield first
            del first  # a streaming collate may free each sample once it has copied it
            taken = 1
            while taken < n:
                try:
                    sample = next(stream)  # never iter(stream) again: see the module doc
                except StopIteration:
                    short = True
                    self.last_size = taken  # the batch is padded to n in no count
                    return
                taken += 1
                yield sample
                del sample

        samples: SampleStream | list = SampleStream(items(first), n)
        del first
        if not self._lazy:
            samples = list(samples)  # torch's order: every sample, then the collate
        # torch drops a short last batch under drop_last without collating it.
        # A streaming collate finds it short only after the fact, so its error
        # must not surface either.
        try:
            batch = None if short and self.drop_last else self.collate_fn(samples)
        except Exception:
            if not (short and self.drop_last):
                raise
            batch = None
        if short:
            self.exhausted = True
            if self.drop_last:
                raise StopIteration
        return batch


def create_fetcher(is_iterable: bool, dataset, auto_collation: bool, collate_fn, drop_last: bool,
                   iterator_state=None):
    if is_iterable:
        return IterableFetcher(dataset, auto_collation, collate_fn, drop_last, iterator_state)
    return MapFetcher(dataset, auto_collation, collate_fn)


class Fetched(NamedTuple):
    """A task's batch, the state its worker's dataset reported right after it,
    and what a short last batch of an iterable holds."""

    batch: Any
    state: Any       # a TakenState, or None
    exhausted: bool  # the batch hit the end of the worker's stream
    short: int | None  # samples in a short batch of an iterable; None: a full batch

    def wrap(self, payload, ships_state: bool):
        """``payload`` (the batch as it is sent) with the state around it when
        there is one to send, or the sample count of a short batch."""
        state = self.state
        if state is not None and state.dataset_state is None and state.iterator_state is None:
            state = None  # nothing Stateful here: the batch goes unwrapped, as without state
        if (ships_state and state is not None) or self.short is not None:
            return StatefulResult(payload, state, self.exhausted, self.short)
        return payload


def fetch_task(task: Task, fetcher, taker, is_iterable: bool, worker_id: int,
               kind: str = "process"):
    """``task``'s batch as a ``Fetched``; or the ``IterableExhausted`` that ends
    an iterable worker's stream, or the ``WorkerFailure`` (its worker ``kind``:
    "process" or "thread") that answers the task instead."""
    try:
        batch = fetcher.fetch(task.indices)
        state = take_state(taker, fetcher)
    except StopIteration:
        if is_iterable:
            return IterableExhausted(worker_id, take_state(taker, fetcher))
        return WorkerFailure(RuntimeError("StopIteration raised while fetching a batch"),
                             worker_id, "fetching", task.indices, task.batch_index, kind)
    except Exception as exc:
        return WorkerFailure(exc, worker_id, "fetching", task.indices, task.batch_index, kind)
    short = fetcher.last_size if is_iterable else None  # the samples a short batch holds
    return Fetched(batch, state, getattr(fetcher, "exhausted", False), short)
