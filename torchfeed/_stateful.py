"""torchdata's ``Stateful`` protocol: what counts as Stateful, and taking and giving back state.

``StatefulDataLoader`` saves and restores anything that has ``state_dict()`` and
``load_state_dict(state)``: the sampler, the dataset, and the iterator that
``iter(dataset)`` returns.  So does torchfeed, with one difference: torchdata
only checks that both methods exist, so a dataset whose ``state_dict`` needs
arguments (mosaicml-streaming's, litdata's) breaks its iteration.  Here an
object is Stateful only if ``state_dict`` can be called with no arguments and
``load_state_dict`` with one; such libraries are handled through their own
public state API instead (``_streaming_adapters.py``).

What a worker (or the main process, at ``num_workers=0``) reports with each
batch is a ``(dataset state, iterator state)`` pair, taken as torchdata takes
it: for an IterableDataset, the iterator's state, plus the dataset's when the
iterator is another object; for a map-style dataset, the dataset's.  A
``state_dict()`` that raises does not stop the iteration: the error is
recorded as a ``StateFailure`` and raised by ``DataLoader.state_dict()``,
when the state is asked for.

Restoring follows torchdata's order: ``dataset.load_state_dict`` first, then
``iter(dataset)`` (exactly once, as in any epoch), then ``load_state_dict`` on
the iterator it returned.  An IterableDataset resumed with no state at all
(neither Stateful nor a streaming library's) gets one warning naming what a
resume without state risks and how to give it one.
"""
from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import IterableDataset

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint


def _binds(method, *args) -> bool:
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return True  # a builtin without a signature: trust the protocol, as torchdata does
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def is_stateful(obj) -> bool:
    """``state_dict()`` callable with no arguments and ``load_state_dict(state)`` with one."""
    state_dict = getattr(obj, "state_dict", None)
    load_state_dict = getattr(obj, "load_state_dict", None)
    return (callable(state_dict) and callable(load_state_dict)
            and _binds(state_dict) and _binds(load_state_dict, None))


class StateFailure:
    """``state_dict()`` raised while a batch was made; raised again if the state is asked for."""

    __slots__ = ("owner", "error")

    def __init__(self, owner: str, error: str) -> None:
        self.owner = owner  # "dataset FooDataset" or "the iterator of FooDataset"
        self.error = error  # "ValueError: ..." (the exception itself may not pickle)

    def __getstate__(self):
        return self.owner, self.error

    def __setstate__(self, state) -> None:
        self.owner, self.error = state

    def raise_(self):
        raise RuntimeError(
            f"DataLoader.state_dict() cannot include the state of {self.owner}: its "
            f"state_dict() raised {self.error} right after a batch was made. Loading went "
            "on; fix state_dict() (or remove state_dict()/load_state_dict() to resume "
            "without the object's own state).")


def _take(obj, owner: str):
    try:
        return obj.state_dict()
    except Exception as exc:
        return StateFailure(owner, f"{type(exc).__name__}: {exc}")


class TakenState(NamedTuple):
    """One dataset copy's state right after a batch; either part None when not Stateful."""

    dataset_state: Any   # the dataset's (or a StateFailure)
    iterator_state: Any  # the iterator's that iter(dataset) returned (or a StateFailure)


class StateTaker:
    """Takes the ``(dataset state, iterator state)`` pair of one dataset copy after each batch."""

    def __init__(self, dataset, is_iterable: bool) -> None:
        self.dataset = dataset
        self.is_iterable = is_iterable
        self.dataset_stateful = is_stateful(dataset)
        self._iterator = None
        self._iterator_stateful = False

    def take(self, iterator=None) -> TakenState:
        """The pair now; ``iterator``: what ``iter(dataset)`` returned this epoch, if called."""
        name = type(self.dataset).__name__
        if not self.is_iterable:
            return TakenState(
                _take(self.dataset, f"dataset {name}") if self.dataset_stateful else None, None)
        if iterator is not self._iterator:
            self._iterator = iterator
            self._iterator_stateful = iterator is not None and is_stateful(iterator)
        it_state = (_take(iterator, f"the iterator iter({name}) returned")
                    if self._iterator_stateful else None)
        same = iterator is self.dataset
        ds_state = (_take(self.dataset, f"dataset {name}")
                    if self.dataset_stateful and not same else None)
        return TakenState(ds_state, it_state)


def take_state(taker, fetcher):
    """The (dataset, iterator) state of a fetcher's copy now; None when none is shipped."""
    if taker is None:
        return None
    return taker.take(getattr(fetcher, "iterator", None))


def check(state):
    """``state`` itself, or the error its ``state_dict()`` raised."""
    if type(state) is StateFailure:
        state.raise_()
    return state


def warn_stateless(loader, cp: Checkpoint, epoch: int) -> None:
    """One warning for an IterableDataset resumed without any state of its own."""
    if not isinstance(loader.dataset, IterableDataset) or cp.dataset_state is not None \
            or cp.has_worker_state:
        return
    reread = 0 if cp.epoch_finished else cp.batches_yielded
    if reread == 0 and epoch == 0:
        return  # the start of the first epoch: nothing to restore
    name = type(loader.dataset).__name__
    parts = [f"{name} has no state_dict()/load_state_dict() that can be called with no "
             "arguments, nor has the iterator its __iter__ returns, so torchfeed cannot "
             "restore their own state."]
    if reread:
        parts.append(f"Resuming reads the {reread} batches this epoch already yielded again "
                     "and drops them.")
    if epoch > 0:
        parts.append(f"The loader resumes in epoch {epoch}: a dataset that keeps its own "
                     "epoch counter or shuffle state restarts it in the new process, so this "
                     "epoch can come out in another order, repeating some samples and missing "
                     "others.")
    parts.append("Give the dataset (or its iterator) state_dict() and load_state_dict(state) "
                 "with no arguments (torchdata's Stateful protocol) to resume exactly.")
    warnings.warn(" ".join(parts), stacklevel=4)  # the caller of loader.load_state_dict
