"""The index stream: one epoch of the sampler, numbered, and how much of it the user consumed.

Every batch of an epoch has a stable position, its ``batch_index``: the n-th
item the (batch) sampler produced this epoch.  Positions do not depend on
``num_workers``, on prefetching or on a resume, so they key the per-batch seeds
and identify what was yielded.  The stream counts what reached the user (not
what was sent to workers: prefetched batches are not consumed), which is the
whole of a checkpoint for a map-style dataset (see ``_state.py``):

* ``frontier``: every position below it was yielded;
* ``out_of_order``: positions at or above it yielded early (``in_order=False``),
  at most the prefetch window;
* per worker, the state its dataset copy (and the iterator ``iter(dataset)``
  returned) reported with the latest batch of it that was yielded, and which
  worker is next in the round-robin (``_stateful.py``: an IterableDataset, or
  a map-style dataset with ``state_dict()``/``load_state_dict()``).

At the start of each epoch the stream records what is needed to rebuild it:
the states of the RNGs the sampler and the base seed draw from (the loader's
``generator``, the global torch RNG, and generators the sampler owns), the
state of a sampler that has ``state_dict`` but no ``state_dict_at``, and the
epoch of one that has only ``set_epoch`` (torch's ``DistributedSampler``); what
a checkpoint keeps of the sampler is worked out in ``_sampler_state.py``.  A
resume sets those RNGs back, remakes the sampler's iterator and skips the consumed
positions without loading any data (``load_state_dict`` does it once first,
``locate``, to check the state fits this loader's epoch).  The global RNG is only ever touched inside
``torch.random.fork_rng``, so the training loop's own randomness is left alone.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ._checkpoint import Checkpoint
from ._chunked_sampler import iterate
from ._datapipes import SharedSeed, is_iter_datapipe
from ._protocol import StatefulResult, WorkerResume
from ._replay import Replay
from ._rng import draw_base_seed, drawing_from, encode_host_rngs, encode_rng, replaying
from ._sampler_state import epoch_state, may_draw_host_rngs, private_rngs, sampler_generators, stateful_sampler
from ._stateful import is_stateful

WATCH_BATCHES = 32  # batches of an epoch checked for global-RNG draws by the sampler

NO_STATE = object()  # a batch that came without a dataset state
_NOTHING = object()


class IndexStream(Replay):
    """One iterator's index stream, epoch after epoch (persistent workers reuse it).

    ``book``: the loader's ``ResumeBook`` (``_state.py``), which says what epoch
    starts next and holds a loaded state until an epoch takes it.
    """

    def __init__(self, loader, book) -> None:
        self.generator = loader.generator  # not the loader: no reference cycle through it
        self.index_sampler = loader._index_sampler
        self.is_iterable = isinstance(loader.dataset, IterableDataset)
        self.auto_collation = loader._auto_collation
        self.num_workers = loader.num_workers
        self.persistent = bool(loader.persistent_workers and loader.num_workers > 0)
        # Whether the iterator iter(dataset) returns is Stateful is known only in the
        # worker, so an IterableDataset's workers always report a state (None parts
        # cost nothing); a map-style dataset's only when the dataset is Stateful.
        self.dataset_stateful = is_stateful(loader.dataset)
        self.ships_state = self.is_iterable or self.dataset_stateful
        self.sampler: Any
        self.sampler_protocol: str | None
        self.sampler, self.sampler_protocol = (None, None) if self.is_iterable \
            else stateful_sampler(self.index_sampler)
        self.generators = sampler_generators(self.index_sampler, loader.generator)
        # A sampler that may shuffle with numpy's or Python's global RNG: each
        # epoch records them too (and checks its first batches for later draws).
        self.host = not self.is_iterable and may_draw_host_rngs(self.index_sampler,
                                                                self.sampler_protocol)
        self.private = [] if self.is_iterable else private_rngs(self.index_sampler,
                                                                self.sampler_protocol)
        self.lazy_draws = False  # the sampler drew from a global RNG after its first batch
        self.book = book
        self.base_seed: int | None = None
        # An IterDataPipe's shared seed (``_datapipes.py``): drawn with the
        # epoch's other draws, in torch's order, so a resume replays it.
        self.shared = SharedSeed() if is_iter_datapipe(loader.dataset) else None
        self.shared_seed: int | None = None
        self.worker_states = [None] * max(1, self.num_workers)    # the datasets' states
        self.iterator_states = [None] * max(1, self.num_workers)  # their iterators' states

    # -- starting an epoch --------------------------------------------------
    def start(self, fresh: bool) -> None:
        """Start the next epoch, or the one a loaded state continues.

        ``fresh``: a new iterator (it draws a base seed, as torch's does);
        otherwise persistent workers starting another epoch.
        """
        previous = self.book.live
        pending = self.book.plan
        if pending is not None and pending.checkpoint is not None:
            if pending.next is not None and self.sampler.epoch != self.saved_sampler_epoch(
                    pending.checkpoint):
                pending = pending.next  # the loop went on to the next epoch
            else:
                self._check_sampler_epoch(pending.checkpoint)  # before the plan is used up
        undo = self.book.undo_point()
        plan = self.book.begin(self, pending)
        try:
            self._open(plan, fresh, previous)
        except BaseException:
            undo()  # a loaded state that failed to apply stays pending: no silent new epoch
            raise
        self.book.undo_start = undo  # the iterator may still fail to start (_state.starting)

    def _open(self, plan, fresh: bool, previous) -> None:
        self.epoch = plan.epoch
        adapter = self.book.adapter
        if adapter is not None:  # a streaming library's dataset: its epoch, recorded now
            adapter.started(carries=self.num_workers == 0 or (self.persistent and not fresh),
                            previous_finished=previous is not None and previous.finished)
        self.finished = False
        self.batches_yielded = self.samples_yielded = 0
        self.frontier = self.prefix_samples = 0
        self.out_of_order: dict[int, int] = {}  # position -> samples, yielded before the frontier got there
        self._skip: set[int] = set()  # positions a resume must not hand out again
        self._next_pos = 0
        self._peeked = _NOTHING
        self._watch = WATCH_BATCHES if self.host else 0
        self.consumed_offset = 0     # items of a "position" sampler used before its iter()
        self.next_worker = 0
        self.reread = 0              # batches to read and drop (stateless IterableDataset)
        self.exhausted_workers = set()  # workers whose last yielded batch exhausted their stream
        self.states_at_exhaustion: dict = {}  # worker -> its (dataset, iterator) state then
        self.resume_states: list[WorkerResume] | None = None  # per worker, when resuming
        slots = max(1, self.num_workers)
        self.iterator_states = [None] * slots  # every epoch calls iter(dataset) anew
        if plan.worker_states is not None:
            its = plan.iterator_states or [None] * slots
            ended = plan.ended_iterator_states or [None] * slots
            self.resume_states = [WorkerResume(ws, w in plan.exhausted_workers, its[w], ended[w])
                                  for w, ws in enumerate(plan.worker_states)]
            self.exhausted_workers = set(plan.exhausted_workers)
            self.worker_states = list(plan.worker_states)
            self.iterator_states = list(its)
        elif fresh and self.num_workers > 0:
            self.worker_states = [None] * self.num_workers  # fresh copies of the dataset
        elif previous is not None and previous is not self and self.num_workers == 0:
            self.worker_states = list(previous.worker_states)  # the same dataset object
        if plan.checkpoint is not None:
            self._resume(plan.checkpoint, fresh)
            return
        with drawing_from(plan.global_rng, plan.host_rng):  # also what _capture records
            self._capture()
            if fresh:
                self._draw_shared_seed()  # torch's _BaseDataLoaderIter.__init__
            self._sampler_iter = iterate(self.index_sampler)
            if fresh:
                if plan.base_seed is not None:  # persistent workers: one base seed for all
                    self.base_seed, self.draws_base_seed = plan.base_seed, False
                else:
                    self.base_seed, self.draws_base_seed = draw_base_seed(self.generator), True
            else:
                self.draws_base_seed = False
            if not fresh or self.num_workers > 0:
                self._draw_shared_seed(keep=not fresh)  # torch's _reset
            self._peek()

    def _draw_shared_seed(self, keep: bool = True) -> None:
        """An IterDataPipe's shared seed, where torch draws one; torch's
        multi-process iterator draws a second at once and keeps the first."""
        if self.shared is not None:
            seed = self.shared.draw(self.generator)
            if keep:
                self.shared_seed = seed

    def _peek(self) -> None:
        """Take the first batch of indices now, at iter().

        The sampler's first draw (RandomSampler seeds itself from the global
        RNG then) thus happens with the epoch's other draws, right after the
        base seed, as torch's multi-process iterator does it; for
        ``num_workers=0`` torch would wait for the first ``next()``.  A state
        saved between ``iter()`` and ``next()`` is then exact too.
        """
        self._peeked = next(self._sampler_iter, _NOTHING)
        if self._peeked is _NOTHING:
            self._sampler_iter = iter(())

    def _capture(self) -> None:
        """Record what rebuilding this epoch's stream needs (before the sampler draws)."""
        generator = self.generator
        rng: dict[str, Any] = {
            "generator": None if generator is None else encode_rng(generator.get_state()),
            "global": encode_rng(torch.get_rng_state()),
            "samplers": [encode_rng(g.get_state()) for g in self.generators],
        }
        if self.host:
            rng["host"] = encode_host_rngs()
        self.rng: Mapping[str, Any] | None = rng
        protocol = self.sampler_protocol
        self.sampler_start_state = (self.sampler.state_dict() if protocol == "epoch_start"
                                    else epoch_state(self.sampler) if protocol == "set_epoch"
                                    else None)

    def _resume(self, cp: Checkpoint, fresh: bool) -> None:
        self.rng = cp.epoch_start_rng
        self.base_seed = cp.base_seed
        self.draws_base_seed = cp.draws_base_seed
        sampler_state = cp.sampler_state
        self.sampler_start_state = None
        self.batches_yielded = cp.batches_yielded
        self.samples_yielded = cp.samples_yielded
        self.out_of_order = dict(cp.out_of_order_yielded)
        self.frontier = cp.frontier
        self.prefix_samples = self.samples_yielded - sum(self.out_of_order.values())
        self._skip = set(self.out_of_order)
        start = 0
        with replaying(self.generator, self.generators, self.rng):
            self._draw_shared_seed()  # the epoch's: its first draw, fresh or not
            if sampler_state is not None and sampler_state.protocol == "position":
                self.sampler.load_state_dict(sampler_state.state)
                start = self.frontier
                self.consumed_offset = self._consumed_units()
            elif sampler_state is not None:
                self.sampler_start_state = sampler_state.state
                if sampler_state.protocol == "epoch_start":
                    self.sampler.load_state_dict(sampler_state.state)
            self._sampler_iter = iterate(self.index_sampler)
            if self.draws_base_seed and fresh:
                draw_base_seed(self.generator)  # keeps the generator in step
            if self.draws_base_seed and self.num_workers > 0:
                self._draw_shared_seed(keep=False)  # so does torch's second draw
            if self.ships_state:  # the workers go on round-robin where they were
                self.next_worker = cp.next_worker % max(1, self.num_workers)
            if self.is_iterable:
                if cp.dataset_state is not None:  # the library skips what was read
                    self.next_worker = 0
                    self.reread = cp.dataset_state.reread
                    self._next_pos = self.batches_yielded - self.reread
                elif cp.has_worker_state:
                    self._next_pos = self.batches_yielded
                else:  # no state to restore: read the consumed batches again, and drop them
                    self.next_worker = 0
                    self.reread = self.batches_yielded
                return
            self._next_pos = start
            for _ in range(self.frontier - start):
                next(self._sampler_iter, None)
            self._next_pos = self.frontier
            self._peek()  # inside the replay, as the sampler may draw from the global RNG

    # -- handing out positions ------------------------------------------------
    def next(self):
        """(batch_index, indices) of the next batch to fetch; StopIteration at the end."""
        while True:
            if self._peeked is not _NOTHING:
                indices, self._peeked = self._peeked, _NOTHING
            elif self._watch:
                indices = self._watched_next()
            else:
                indices = next(self._sampler_iter)
            pos = self._next_pos
            self._next_pos += 1
            if self._skip and pos in self._skip:
                self._skip.discard(pos)  # yielded before the checkpoint, out of order
                continue
            return pos, indices

    def _watched_next(self):
        """The sampler's next batch, noting a draw from a global RNG while making it.

        Such a draw, after the first batch, comes from the global RNG as the
        training loop has left it by then, which a resume cannot replay.
        """
        self._watch -= 1
        before = (encode_rng(torch.get_rng_state()), encode_host_rngs())
        indices = next(self._sampler_iter)
        if (encode_rng(torch.get_rng_state()), encode_host_rngs()) != before:
            self.lazy_draws, self._watch = True, 0
        return indices

    # -- what reached the user --------------------------------------------------
    def yielded(self, data, pos: int, indices, worker_id: int):
        """Record that the batch at ``pos`` goes to the user now; return the batch itself."""
        if type(data) is StatefulResult:
            self.record_yield(pos, indices, worker_id,
                              data.state if self.ships_state else NO_STATE, data.exhausted,
                              data.samples)
            return data.value
        self.record_yield(pos, indices, worker_id)
        return data

    def record_yield(self, pos: int, indices, worker_id: int = 0, worker_state=NO_STATE,
                     exhausted: bool = False, samples=None) -> None:
        if self.reread:  # a batch the checkpoint had already counted
            self.reread -= 1
            return
        n = samples if samples is not None else len(indices) if self.auto_collation else 1
        self.batches_yielded += 1
        self.samples_yielded += n
        if worker_state is not NO_STATE and worker_state is not None:
            self.worker_states[worker_id], self.iterator_states[worker_id] = worker_state
        if self.ships_state:
            self.next_worker = (worker_id + 1) % len(self.worker_states)
        if self.is_iterable:
            if exhausted:
                self.exhausted_workers.add(worker_id)
            return
        if pos == self.frontier:
            self.frontier += 1
            self.prefix_samples += n
            while self.out_of_order and self.frontier in self.out_of_order:
                self.prefix_samples += self.out_of_order.pop(self.frontier)
                self.frontier += 1
        else:
            self.out_of_order[pos] = n

    def record_failure(self, pos: int, indices, worker_id: int = 0) -> None:
        """The batch at ``pos`` raised instead of reaching the user: it counts as consumed.

        A loop that catches the error and goes on has moved past that batch,
        as with torch, so a resume must not fetch it again; and the frontier
        must move past it, or every later batch would be kept as yielded out of
        order and the state would grow with the epoch.  An IterableDataset has
        no positions to skip: its copy's stream has already moved on.
        """
        if not self.is_iterable:
            self.record_yield(pos, indices, worker_id)

    def worker_exhausted(self, worker_id: int, state) -> None:
        """A worker's stream is exhausted; ``state``: its (dataset, iterator) state then."""
        if self.ships_state and state is not None:
            self.states_at_exhaustion[worker_id] = state

    def finish(self) -> None:
        """StopIteration: every worker's stream is exhausted, and the user has seen all of it."""
        self.finished = True
        for worker_id, (state, it_state) in self.states_at_exhaustion.items():
            self.worker_states[worker_id] = state
            self.iterator_states[worker_id] = it_state
        self.states_at_exhaustion.clear()

    def at_end(self) -> bool:
        """Whether the epoch is over for the user: it finished, or (map-style, in
        order) it yielded as many batches as ``len()`` of its sampler says it has.
        Decides only whether a state records the global RNG for the next epoch;
        ``load_state_dict`` replays the stream to know for sure."""
        if self.finished:
            return True
        if self.is_iterable or self.out_of_order or self.sampler_protocol == "position":
            return False  # a "position" sampler's len() is what is left of its pass
        try:
            return self.batches_yielded == len(self.index_sampler)
        except Exception:  # a sampler without __len__: then only the replay can tell
            return False

    def _consumed_units(self) -> int:
        """Items of the stateful sampler consumed up to the frontier."""
        return self.frontier if self.sampler is self.index_sampler else self.prefix_samples

    def sampler_state(self):
        if self.sampler_protocol == "position":
            consumed = self._consumed_units() - self.consumed_offset
            return {"protocol": "position", "state": self.sampler.state_dict_at(consumed)}
        if self.sampler_start_state is not None:  # "epoch_start" or "set_epoch"
            return {"protocol": self.sampler_protocol, "state": self.sampler_start_state}
        return None
