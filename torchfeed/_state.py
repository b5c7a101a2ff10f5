"""The loader's resumable state: its format, what ``state_dict()`` returns and what
``load_state_dict`` applies.

``load_state_dict`` reads the dict once, at this boundary, into a frozen
``Checkpoint`` (``_checkpoint.py``, which also checks what needs no loader),
fits it to this loader (``_state_validation.py``), and plans the next
``iter()`` (a ``Plan`` in the loader's ``ResumeBook``, ``_resume_book.py``);
every step after the reading takes the ``Checkpoint``, and nothing below this
module imports it.  The replay of a state's epoch lives in ``_replay.py`` (a
mixin of ``_index_stream.py``'s ``IndexStream``), the sampler's part in
``_sampler_state.py``.

A state is a position in a deterministic index stream, never data (the design
of Grain's checkpoints).  For a map-style dataset it says which epoch, how many
of its batches reached the user (plus any yielded out of order), and the RNG
states the epoch's shuffle was drawn from; resuming rebuilds the stream and
skips the consumed positions without loading a sample.  That needs nothing from
the workers, so a state saved with ``num_workers=a`` resumes with any ``b``.
A Stateful dataset, or the Stateful iterator an IterableDataset's ``iter()``
returns (torchdata's protocol, ``_stateful.py``), adds, per worker, the state its
copy reported with its latest batch that was yielded, and which worker is next
in the round-robin.  An IterableDataset with neither has its consumed batches
read again and dropped, with a warning.  Per-worker states resume with the same
``num_workers``; a map-style dataset's also with another, when every worker's
saved state is the same (else ``ValueError``).  A mosaicml-streaming or litdata
``StreamingDataset`` is resumed through the library's own state API instead
(``_streaming_adapters.py``).

The format (version 1), plain values only, so it survives ``json`` and
``torch.load(weights_only=True)``; its size is O(num_workers)::

    {"version": 1, "kind": "torchfeed.DataLoader",
     "dataset_kind": "map" | "iterable", "dataset_len": int | None,
     "batch_size": int | None, "drop_last": bool,
     "num_workers": int, "persistent_workers": bool,
     "epoch": int,                   # the loader's epoch (its iter() count, from 0)
     "epoch_finished": bool,         # StopIteration was raised: the next iter() starts epoch + 1
     "batches_yielded": int,         # this epoch, including those yielded out of order
     "samples_yielded": int,
     "out_of_order_yielded": [[batch_index, samples], ...],  # in_order=False only
     "base_seed": int | None, "draws_base_seed": bool,      # the epoch drew its base seed
     "epoch_start_rng": {"generator": str | None, "global": str, "samplers": [str, ...],
                         "host": {"numpy": str, "python": str}  # samplers not torch's own
                         } | None,
     "sampler_state": {"protocol": "position" | "epoch_start" | "set_epoch",
                       "state": ...} | None,  # set_epoch: {"epoch", "num_replicas"}
     "worker_states": [state | None, ...] | None,   # per worker: its dataset copy's state
     "iterator_states": [state | None, ...] | None, # per worker: its iter(dataset)'s state
     "dataset_state": {"library": str, "state": dict, "reread": int} | None,
                                    # a streaming library's state: _streaming_adapters.py
     "exhausted_workers": [int, ...],  # the last batch yielded exhausted their stream
     "next_worker": int,
     "next_epoch_global_rng": str | None,  # at an epoch's end (or before the first
                                           # iter()): the global RNG at state_dict()
     "next_epoch_host_rng": {"numpy": str, "python": str} | None,  # and numpy's, Python's
     "sampler": str | None}  # map-style: the kind of sampler, "BatchSampler(RandomSampler)"

An epoch is at its end when it finished, or when every batch was yielded but
nothing called ``next()`` again (a framework that knows ``len(loader)``, as
Lightning does): ``load_state_dict`` counts the latter as finished too.  What a
dataset copy carries into the next epoch is restored as the uninterrupted run
carried it: with ``num_workers=0``, ``load_state_dict`` loads the dataset
object's state itself, before the next epoch's draws (its state may hold the
global RNG); persistent workers, started again, load their copy's state and,
into an iterator of the ended epoch, the state that iterator ended with
(torchdata's order), so what it sets in the worker (its global RNG) is there
when the next epoch calls ``iter(dataset)``.  Workers that are not persistent
start the next epoch fresh, as torch's do.

``next_epoch_global_rng``, ``next_epoch_host_rng``, ``sampler``,
``epoch_start_rng["host"]``, ``iterator_states`` and ``dataset_state`` were added
within version 1; a state without them loads as if they were None.

A sampler that is not one of torch's and has no state of its own may shuffle
with numpy's or Python's global RNG inside ``__iter__`` (a bucketing sampler):
its epoch also records those two states when it starts, and a resume sets them
for the replay only, as it does torch's.  ``state_dict()`` warns, once, when an
epoch cannot be resumed exactly: the sampler owns a numpy or Python RNG object
of its own (not in any checkpoint), or it drew from a global RNG while yielding
batches after its first (checked on the first ``WATCH_BATCHES`` of an epoch).

RNG states are base64 strings of the generators' byte states.  ``load_state_dict``
checks everything it can up front (``_state_validation.py``) and raises
``ValueError`` naming the field and both values; the state then takes effect
at the next ``iter()``.  To check what only the sampler can tell (a position
past the end of the epoch, an epoch with every batch yielded), a map-style
state's epoch is replayed (indices only, ``_replay.py``) up to its checkpoint inside
``load_state_dict``, and again at ``iter()``; a refused state leaves the
generators and the sampler's epoch as they were.  A finished epoch is replayed
to its end there, so the loader's and the sampler's generators, and a stateful
sampler, are where the uninterrupted run had them before the user's loop calls
``set_epoch`` again.  A sampler that has ``set_epoch`` but no
state (torch's ``DistributedSampler``) is set to the saved epoch there; a
mid-epoch state then refuses, at ``iter()``, a sampler the user has since set to
another epoch, and ``load_state_dict`` refuses one at another ``num_replicas``.

The global RNG belongs to the training loop; what is guaranteed without a
``generator`` (the shuffle and base seed then come from it, as in torch):

* the epoch in progress is replayed from the state alone;
* a state taken before the loader's first ``iter()`` records the global RNG as
  one at an epoch's end does (below), so the epoch it starts draws what the
  saving loader's first epoch drew (torchdata draws the base seed at that
  ``state_dict()``);
* a state taken at the end of an epoch records the global RNG as it was at that
  ``state_dict()``.  At the next ``iter()``, if the live global RNG is still
  there (the checkpoint restored it), the epoch draws from it as torch does.
  Otherwise the epoch's draws at its start (the base seed, and what the sampler
  draws up to its first batch: ``RandomSampler``'s seed) come from the recorded
  state inside ``fork_rng``, leaving the live global RNG alone, and become the
  epoch's ``epoch_start_rng``.  Either way the epoch is the uninterrupted run's
  if that run drew nothing from the global RNG between the ``state_dict()`` and
  its next ``iter()``;
* every epoch after the first resumed one (after a state taken inside an
  epoch, every epoch after it) draws from the live global RNG, which the
  training loop also consumes, so it matches the uninterrupted run only when
  the checkpoint also restores ``torch.get_rng_state()`` (or with a
  ``generator``).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import contextmanager

import torch

from ._checkpoint import Checkpoint
from ._index_stream import IndexStream
from ._resume_book import Plan, ResumeBook
from ._rng import encode_host_rngs, encode_rng
from ._sampler_state import may_draw_host_rngs, stateful_sampler
from ._state_validation import check_finished, check_position, fit
from ._stateful import check, warn_stateless


@contextmanager
def starting(loader):
    """Around ``iter(loader)``: an iterator that fails to start after its epoch began
    (a worker that cannot be started, a dataset's ``__iter__`` raising) did not start
    the epoch, so a loaded state stays pending and the next ``iter()`` tries it again."""
    book = ResumeBook.of(loader)
    book.undo_start = None
    try:
        yield
    except BaseException:
        if book.undo_start is not None:
            book.undo_start()
        raise
    finally:
        book.undo_start = None


# -- state_dict ----------------------------------------------------------------
def state_dict(loader) -> dict:
    book = ResumeBook.of(loader)
    if book.loaded is not None:
        return book.loaded.as_dict()
    state = dict(book.header)
    s = book.live
    if s is None:  # nothing started yet: the start of epoch 0
        # The epoch will draw its start (base seed, shuffle) from the global RNGs as they
        # are now, so they are recorded as at an epoch's end (torchdata draws the
        # base seed here).
        host = state["dataset_kind"] == "map" and may_draw_host_rngs(
            loader._index_sampler, stateful_sampler(loader._index_sampler)[1])
        state.update(epoch=book.next_epoch, epoch_finished=False, batches_yielded=0,
                     samples_yielded=0, out_of_order_yielded=[], base_seed=None,
                     draws_base_seed=True, epoch_start_rng=None, sampler_state=None,
                     worker_states=None, iterator_states=None, dataset_state=None,
                     exhausted_workers=[], next_worker=0,
                     next_epoch_global_rng=encode_rng(torch.get_rng_state()),
                     next_epoch_host_rng=encode_host_rngs() if host else None)
        return state
    state["epoch"] = s.epoch
    state["epoch_finished"] = s.finished
    state["batches_yielded"] = s.batches_yielded
    state["samples_yielded"] = s.samples_yielded
    state["out_of_order_yielded"] = ([[p, n] for p, n in sorted(s.out_of_order.items())]
                                     if s.out_of_order else [])
    state["base_seed"] = s.base_seed
    state["draws_base_seed"] = s.draws_base_seed
    state["epoch_start_rng"] = s.rng
    state["sampler_state"] = s.sampler_state()
    state["worker_states"] = [check(w) for w in s.worker_states] if s.ships_state else None
    state["iterator_states"] = ([check(w) for w in s.iterator_states] if s.ships_state
                                else None)
    state["exhausted_workers"] = sorted(s.exhausted_workers) if s.exhausted_workers else []
    state["next_worker"] = s.next_worker
    # Only a state at the end of an epoch pays for the encoding; a state inside an
    # epoch replays that epoch from epoch_start_rng instead.
    at_end = s.at_end()
    state["next_epoch_global_rng"] = encode_rng(torch.get_rng_state()) if at_end else None
    state["next_epoch_host_rng"] = encode_host_rngs() if at_end and s.host else None
    reason = s.inexact()
    if reason is not None and not book.warned:
        book.warned = True
        warnings.warn(f"this DataLoader state cannot resume the epoch exactly: {reason}.",
                      stacklevel=3)
    state["dataset_state"] = None
    adapter = book.adapter
    if adapter is not None:  # asked for now, never per batch
        library_state, reread = adapter.state(
            s, loader.num_workers == 0 or bool(loader.persistent_workers), loader)
        state["dataset_state"] = {"library": adapter.library, "state": library_state,
                                  "reread": reread}
    return state


# -- load_state_dict -------------------------------------------------------------
def load_state_dict(loader, state) -> None:
    if isinstance(state, Mapping) and len(state) == 0:
        return  # torchdata's convention: an empty state restores nothing
    checkpoint = Checkpoint.read(state)  # the one reading of the dict
    book = ResumeBook.of(loader)
    probe = IndexStream(loader, book)  # what this loader's stream looks like; starts nothing
    checkpoint = fit(checkpoint, book.header, loader, probe)
    undo = _undo_point(loader, probe)
    try:
        plan = _plan(loader, probe, checkpoint)
    except BaseException:
        undo()  # a refused state leaves the loader as it was
        raise
    # A persistent iterator still alive belongs to the old position.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator.shutdown()
        loader._iterator = None
    if checkpoint.dataset_state is not None:  # fit: this loader has the same library
        book.adapter.load(checkpoint.dataset_state.state)
    if loader.num_workers == 0:
        _load_finished_dataset_state(loader.dataset, plan)
    warn_stateless(loader, checkpoint, plan.epoch)
    book.plan, book.loaded, book.live = plan, checkpoint, None
    book.next_epoch = plan.epoch


def _plan(loader, probe: IndexStream, cp: Checkpoint) -> Plan:
    """What the next iter() does with ``cp``; raises ValueError if it cannot apply.

    A map-style state inside an epoch is replayed up to its checkpoint here
    (indices only), so one that points past the end of this loader's epoch is
    refused now, and one with every batch yielded (a framework that knows
    ``len(loader)`` never calls ``next()`` after the last) counts as finished.
    """
    epoch = cp.epoch
    carries = loader.num_workers == 0 or probe.persistent  # the same dataset copies go on
    probe.restore_sampler_epoch(cp)
    if not cp.started:  # saved before its epoch started
        return Plan(epoch, global_rng=cp.next_epoch_global_rng, host_rng=cp.next_epoch_host_rng)
    finished = cp.epoch_finished
    if finished:
        check_finished(cp, probe.replay_to_end(cp))
    elif not probe.is_iterable:
        # every batch yielded: locate left the RNGs and the sampler at the end
        finished = check_position(cp, probe.locate(cp))
    if finished:
        after = Plan(epoch + 1,
                     base_seed=cp.base_seed if probe.persistent else None,
                     worker_states=cp.worker_states if carries else None,
                     ended_iterator_states=cp.iterator_states if probe.persistent else None,
                     global_rng=cp.next_epoch_global_rng,
                     host_rng=cp.next_epoch_host_rng)
        if cp.epoch_finished or probe.saved_sampler_epoch(cp) is None:
            return after
        # Every batch yielded, and the sampler has set_epoch: the loop tells which
        # epoch it wants.  set_epoch(epoch + 1) before iter() (Lightning) starts it;
        # left at the saved epoch (a loop that resumes its own epoch count), the
        # saved epoch goes on, with nothing left in it, so no epoch is dealt twice.
        return Plan(epoch, checkpoint=cp, next=after)
    if probe.is_iterable and (cp.dataset_state is not None or not cp.has_worker_state):
        return Plan(epoch, checkpoint=cp)  # the library skips, or the loader re-reads
    return Plan(epoch, checkpoint=cp, worker_states=cp.worker_states,
                exhausted_workers=cp.exhausted_workers, iterator_states=cp.iterator_states)


def _load_finished_dataset_state(dataset, plan: Plan) -> None:
    """A state at an epoch's end, in the main process: the dataset object's state, now.

    In the uninterrupted run the same object goes on into the next epoch with that
    state, before the epoch's draws; a dataset whose state holds the global RNG
    (torchdata's examples do) must have set it by then, not after them.
    """
    for p in (plan, plan.next):
        if p is None or p.checkpoint is not None or p.worker_states is None:
            continue
        saved, p.worker_states = p.worker_states[0], None
        if saved is not None:
            dataset.load_state_dict(saved)
            return


def _undo_point(loader, probe: IndexStream):
    """Put back what checking a state may move: the generators and the sampler's epoch."""
    generators = [g for g in (loader.generator, *probe.generators) if g is not None]
    states = [g.get_state() for g in generators]
    sampler = probe.sampler
    epoch = getattr(sampler, "epoch", None)

    def undo() -> None:
        for g, s in zip(generators, states):
            g.set_state(s)
        if epoch is not None and getattr(sampler, "epoch", None) != epoch \
                and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
    return undo

