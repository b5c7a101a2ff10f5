"""The worker protocol: the messages between the main process and a worker.

CONTRIBUTING's "Worker protocol" section describes the wire; these are the
types on it.  A worker of a resumed epoch starts with a ``WorkerResume``.
Main → worker, on a worker's index queue: ``Task``,
``ResumeIteration``, or ``None`` (exit).  Worker → main, on the shared result
queue, as the payload of ``(send_idx, worker_id, payload, seconds)``: the
transport's packed batch, possibly wrapped in a ``StatefulResult``; a
``WorkerFailure`` (``_errors.py``); or ``IterableExhausted``.  The main process
rebuilds a ``StatefulResult``'s batch with a ``StatefulUnpacker`` around the
transport's unpacker.

Both sides import this module and nothing here imports either side, so the
worker, the receiver, the iterators and the index stream share one definition.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ._pin_memory import pin_memory


class WorkerResume(NamedTuple):
    """What one worker loads when an epoch resumes (``WorkerSpec.resume_states``)."""

    dataset_state: Any   # loaded into its dataset copy before iterating; None: nothing
    exhausted: bool      # the last batch the user got exhausted its stream
    iterator_state: Any  # loaded into what iter(dataset) returns; None: nothing
    # A persistent worker after a finished epoch: the state the ended epoch's iterator
    # had, loaded into an iterator of that epoch before the next one starts, for what
    # it sets in the worker (its global RNG), as the uninterrupted worker kept it.
    ended_iterator_state: Any = None


@dataclass
class Task:
    send_idx: int       # position in this epoch's stream of tasks (reorder key)
    batch_index: int    # position of the batch in the epoch (stable across resume)
    indices: Any        # sample indices, or a list of Nones for iterable datasets


class TaskInfo(NamedTuple):
    """The main process's record of a ``Task`` it sent and has not yet handed to
    the user (the iterator's ``task_info[send_idx]``; restarts re-send from it)."""

    worker_id: int
    batch_index: int
    indices: Any


@dataclass
class ResumeIteration:
    """Start a new epoch with persistent workers."""
    epoch: int
    shared_seed: int | None = None  # an IterDataPipe's, for the new epoch (_datapipes.py)


@dataclass
class IterableExhausted:
    worker_id: int
    state: Any = None  # its (dataset, iterator) state once its stream is exhausted


class StatefulResult:
    """A batch and the (dataset, iterator) state its worker reported right after making it.

    ``exhausted``: making it hit the end of the worker's stream (a short last
    batch), so the worker has nothing more this epoch.  ``samples``: how many
    samples a short last batch holds (None: a full batch).  The worker wraps
    the transport's payload in one (a dataset without state sends one only for
    a short batch, with ``state`` None); the main process's unpacker rebuilds
    the batch inside it; the state is recorded when the batch is yielded to the
    user, not when it arrives.
    """

    __slots__ = ("value", "state", "exhausted", "samples")

    def __init__(self, value, state, exhausted: bool = False, samples=None) -> None:
        self.value = value
        self.state = state
        self.exhausted = exhausted
        self.samples = samples

    def pin_memory(self):  # the pin-memory thread pins what is inside
        return StatefulResult(pin_memory(self.value), self.state, self.exhausted, self.samples)


class StatefulUnpacker:
    """The transport's unpacker, which also lets an IterableDataset's batches through
    when they carry a worker's state or a short batch's sample count."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def unpack(self, payload):
        if type(payload) is StatefulResult:
            return StatefulResult(self._inner.unpack(payload.value), payload.state,
                                  payload.exhausted, payload.samples)
        return self._inner.unpack(payload)

    def __getattr__(self, name):
        return getattr(self._inner, name)
