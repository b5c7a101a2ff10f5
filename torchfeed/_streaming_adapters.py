"""Exact resume for streaming-dataset libraries, through each library's public state API.

mosaicml-streaming's and litdata's ``StreamingDataset`` keep their epoch and
position in the dataset, and their ``state_dict`` needs arguments (so they are
not Stateful in torchdata's sense, ``_stateful.py``).  Their own
``StreamingDataLoader`` saves ``dataset.state_dict(<samples yielded>, ...)``,
taken in the main process, and hands it back to ``dataset.load_state_dict``
before the next epoch starts; the library's workers then skip what was
consumed, for any ``num_workers``.  An adapter does the same for
``torchfeed.DataLoader``, with two differences that make it exact at every
step: the state is taken only when ``DataLoader.state_dict()`` is called
(nothing is computed per batch), and its epoch is the one this loader's epoch
runs, recorded when the epoch started (the dataset's own counter may lag behind
its workers, or be another copy's).

An adapter is chosen only when the library is already imported
(``sys.modules``): torchfeed does not depend on either.  Its state is saved in
the loader state's ``dataset_state`` field as ``{"library": ..., "state": ...,
"reread": n}``: where the library's state cannot say the position, it says the
start of the epoch and the loader reads the ``n`` batches yielded since then
again, and drops them (litdata with several workers, below).
"""
from __future__ import annotations

import sys

from ._iterable_shards import rank_and_world_size


class _Adapter:
    library = ""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self.epoch: int | None = None  # the library's epoch this loader's epoch runs
        self.loaded: dict | None = None  # a state loaded into the dataset, in effect from the next epoch
        self.resumed = False  # the epoch now running continues a loaded state

    def started(self, carries: bool, previous_finished: bool) -> None:
        """This loader starts an epoch; ``carries``: the same dataset copies go on."""
        if self.loaded is not None:
            self.epoch, self.loaded, self.resumed = self._epoch_of(self.loaded), None, True
            return
        if self.resumed:
            self._forget_resume()
            self.resumed = False
        self.epoch = self._next_loader_epoch(carries, previous_finished)

    def _next_loader_epoch(self, carries: bool, previous_finished: bool) -> int:
        if self.epoch is not None and carries:  # the same copies: each ended epoch counted
            return self.epoch + (1 if previous_finished else 0)
        return self._dataset_epoch()  # fresh copies of the main process's dataset

    def next_epoch(self, carries: bool) -> int:
        return self.epoch + 1 if carries else self._dataset_epoch()

    def load(self, saved: dict) -> None:
        self.dataset.load_state_dict(saved)
        self.loaded = saved

    # per library
    def _dataset_epoch(self) -> int:
        raise NotImplementedError

    def _epoch_of(self, state: dict) -> int:
        raise NotImplementedError

    def _forget_resume(self) -> None:
        pass


class MosaicStreaming(_Adapter):
    """mosaicml-streaming: the epoch counter lives in shared memory, seen by every copy."""

    library = "mosaicml-streaming"

    def _dataset_epoch(self) -> int:
        return int(self.dataset.next_epoch)

    def _epoch_of(self, state: dict) -> int:
        return int(state["epoch"])

    def next_epoch(self, carries: bool) -> int:
        return self.epoch + 1  # every copy's __iter__ advances the shared counter

    def _next_loader_epoch(self, carries: bool, previous_finished: bool) -> int:
        return self._dataset_epoch()  # shared: read before this epoch's workers iterate

    def state(self, stream, carries: bool, loader) -> tuple:
        """(the library's state, batches to read again) for ``DataLoader.state_dict()``."""
        world = rank_and_world_size()[1]
        replication = getattr(self.dataset, "replication", None) or 1
        samples = 0 if stream.finished else stream.samples_yielded
        state = dict(self.dataset.state_dict(samples * world // replication, True))
        if stream.finished:
            state.update(epoch=self.next_epoch(carries), sample_in_epoch=0)
        else:
            state["epoch"] = self.epoch
        return state, 0


class Litdata(_Adapter):
    """litdata: each copy of the dataset counts its own epoch (``current_epoch``)."""

    library = "litdata"

    def _dataset_epoch(self) -> int:
        return int(self.dataset.current_epoch)

    def _epoch_of(self, state: dict) -> int:
        return int(state["current_epoch"])

    def _forget_resume(self) -> None:
        # litdata's own loader clears it at each new epoch; fresh worker copies would
        # otherwise resume the same position again.
        self.dataset.reset_state_dict()

    def state(self, stream, carries: bool, loader) -> tuple:
        """(the library's state, batches to read again) for ``DataLoader.state_dict()``.

        litdata replays a position as samples dealt round-robin in its own
        ``batch_size`` (1 unless its StreamingDataLoader set it; it partitions with
        it, so it must stay), which is the loader's order only with one worker.
        With several, the state says where the epoch started, and the batches
        yielded since are read again.
        """
        samples, reread = stream.samples_yielded, 0
        if stream.finished:
            samples = 0
        elif loader.num_workers > 1:
            samples, reread = 0, stream.batches_yielded
        state = dict(self.dataset.state_dict(samples, loader.num_workers,
                                             self.dataset.batch_size))
        state["current_epoch"] = self.next_epoch(carries) if stream.finished else self.epoch
        return state, reread


def adapter_for(dataset):
    """The adapter for ``dataset``'s library, or None (a library not imported has no datasets)."""
    for module, name, cls in (("streaming", "StreamingDataset", MosaicStreaming),
                              ("litdata", "StreamingDataset", Litdata)):
        lib = sys.modules.get(module)
        base = getattr(lib, name, None) if lib is not None else None
        if isinstance(base, type) and isinstance(dataset, base):
            return cls(dataset)
    return None
