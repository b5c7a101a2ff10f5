"""Checking a read state against this loader before ``load_state_dict`` applies it.

``_checkpoint.py`` reads a state dict into a ``Checkpoint`` and checks what
needs no loader; ``fit`` checks the rest against this loader (the same dataset,
batch size and sampler, a generator where the state has one, as many worker
slots or states that map onto them) and returns the checkpoint as this loader
takes it (per-worker states spread over another ``num_workers``; a streaming
library's state in place of per-worker ones).  Each failure raises
``ValueError`` naming the field and both values, so a state that cannot apply
never silently starts the loader from scratch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._checkpoint import Checkpoint, check_rng_text, fail
from ._index_stream import IndexStream
from ._iterable_shards import check_iterable_world_size
from ._sampler_state import ORDER_SETTINGS


def fit(cp: Checkpoint, header: dict, loader, probe: IndexStream) -> Checkpoint:
    """``cp`` as this loader takes it; ValueError if it cannot apply here."""
    for field in ("dataset_kind", "dataset_len", "batch_size", "drop_last"):
        if getattr(cp, field) != header[field]:
            fail(f"field {field!r} is {getattr(cp, field)!r} in the state but "
                 f"{header[field]!r} in this DataLoader; build it with the same dataset, "
                 "batch_size and drop_last as the run that saved the state")
    if cp.sampler is not None and header["sampler"] is not None \
            and cp.sampler != header["sampler"]:
        fail(f"field 'sampler' is {cp.sampler!r} in the state but {header['sampler']!r} "
             "in this DataLoader; the saved positions name other samples in another "
             "sampler's order. Build the DataLoader with the same shuffle=, sampler= and "
             "batch_sampler= as the run that saved the state")
    iterable = header["dataset_kind"] == "iterable"
    if iterable:
        try:
            check_iterable_world_size(cp.world_size, header["world_size"])
        except ValueError as exc:
            fail(f"field 'world_size': {exc}")
    library = _check_dataset_state(cp, loader, probe)
    rereads = library and cp.dataset_state is not None and cp.dataset_state.reread > 0
    if iterable and rereads and cp.num_workers != header["num_workers"]:
        fail(f"field 'num_workers' is {cp.num_workers} in the state but "
             f"{header['num_workers']} in this DataLoader; this {type(loader.dataset).__name__} "
             "state resumes by reading the epoch's first batches again, which needs the same "
             "num_workers")
    if iterable and library:
        # a streaming library resumes its own position, for any num_workers
        cp = dataclasses.replace(cp, worker_states=None, iterator_states=None,
                                 exhausted_workers=(), next_worker=0)
    elif iterable and cp.num_workers != header["num_workers"]:
        fail(f"field 'num_workers' is {cp.num_workers} in the state but "
             f"{header['num_workers']} in this DataLoader; an IterableDataset's stream is "
             "split across workers, so it resumes only with the same num_workers "
             "(map-style datasets resume with any)")
    if cp.epoch_start_rng is not None:
        _check_rng(cp.epoch_start_rng, loader, probe)
    _check_sampler_state(cp, probe)
    _check_out_of_order_world_size(cp, probe)
    slots = max(1, header["num_workers"])
    cp = _fit_worker_states(cp, slots, loader, probe)
    bad = [w for w in cp.exhausted_workers if w >= slots]
    if bad:
        fail(f"field 'exhausted_workers' names worker(s) {bad} but there are {slots} worker(s)")
    if iterable and cp.next_worker >= slots:
        fail(f"field 'next_worker' is {cp.next_worker} but there are {slots} worker(s)")
    return cp


def _check_dataset_state(cp: Checkpoint, loader, probe: IndexStream) -> bool:
    """A streaming library's state (``_streaming_adapters.py``): the same library here."""
    if cp.dataset_state is None:
        return False  # nothing of the library's: the loader re-reads, and warns
    adapter = probe.book.adapter
    mine = adapter.library if adapter is not None else None
    if cp.dataset_state.library != mine:
        fail(f"field 'dataset_state' holds a {cp.dataset_state.library} dataset's state but "
             f"this DataLoader's dataset is {type(loader.dataset).__name__}; use the same "
             "dataset")
    return True


def _fit_worker_states(cp: Checkpoint, slots: int, loader, probe: IndexStream) -> Checkpoint:
    """Per-worker dataset and iterator states: one per worker slot of this loader.

    A map-style dataset resumes with another ``num_workers`` only if its per-worker
    states map onto the new workers: none was saved, or all are the same state.
    """
    name = type(loader.dataset).__name__
    ws, its = cp.worker_states, cp.iterator_states
    if ws is None:
        if probe.dataset_stateful and cp.batches_yielded > 0 and not cp.epoch_finished:
            fail(f"field 'worker_states' is None but {name} has state_dict(); the state "
                 "was saved from a loader over another dataset")
        return cp
    if any(w is not None for w in ws) and not probe.dataset_stateful:
        fail(f"the state has worker_states but {name} has no state_dict()/"
             "load_state_dict() callable with no arguments")
    if len(ws) == slots:
        return cp
    saved = [w for w in ws if w is not None]
    if probe.is_iterable or any(w != saved[0] for w in saved) or len(saved) not in (0, len(ws)):
        fail(f"field 'worker_states' holds the states of {len(ws)} worker(s)' copies of "
             f"{name}, which differ from each other, but this DataLoader has {slots} "
             "worker slot(s); per-worker states cannot map onto another number of workers. "
             f"Resume with num_workers={cp.num_workers}")
    return dataclasses.replace(cp, worker_states=(saved[0] if saved else None,) * slots,
                               iterator_states=None if its is None else (None,) * slots)


def _check_rng(rng: Mapping, loader, probe: IndexStream) -> None:
    """The epoch's RNG states fit this loader's generator and its sampler's generators."""
    has_gen = rng["generator"] is not None
    if has_gen != (loader.generator is not None):
        fail(f"field 'epoch_start_rng' {'has' if has_gen else 'has no'} generator state but "
             f"this DataLoader was built {'without' if has_gen else 'with'} generator=; pass "
             "the same kind of generator as the run that saved the state")
    samplers = rng["samplers"]
    if not isinstance(samplers, (list, tuple)) or len(samplers) != len(probe.generators):
        n = len(samplers) if isinstance(samplers, (list, tuple)) else samplers
        fail(f"field 'epoch_start_rng' has {n} sampler generator state(s) but this "
             f"DataLoader's sampler has {len(probe.generators)} generator(s)")
    expected = []
    if has_gen:
        expected.append(("generator", rng["generator"], loader.generator))
    for i, (text, g) in enumerate(zip(samplers, probe.generators)):
        expected.append((f"samplers[{i}]", text, g))
    for name, text, generator in expected:
        check_rng_text(f"'epoch_start_rng'[{name!r}]", text, generator)


def _check_sampler_state(cp: Checkpoint, probe: IndexStream) -> None:
    if cp.sampler_state is None:
        return  # a sampler captured nothing, or the epoch had not started
    mine, theirs = probe.sampler_protocol, cp.sampler_state.protocol
    if theirs != mine:
        what = type(probe.sampler).__name__ if probe.sampler is not None else \
            type(probe.index_sampler).__name__
        fail(f"field 'sampler_state' was saved from a sampler with protocol {theirs!r} but "
             f"this DataLoader's sampler ({what}) has {mine!r}; use the same sampler")
    if theirs == "set_epoch":
        _check_epoch_state(cp.sampler_state.state, probe.sampler)


def _check_epoch_state(saved: Mapping, sampler) -> None:
    """A ``"set_epoch"`` sampler has no state to say its order; the world size must match."""
    for name in ORDER_SETTINGS:  # recorded since they were added; absent in older states
        theirs, mine = saved.get(name), getattr(sampler, name, None)
        if name in saved and isinstance(mine, (bool, int)) and theirs != mine:
            fail(f"field 'sampler_state' was saved from a {type(sampler).__name__} with "
                 f"{name}={theirs!r} but this one has {name}={mine!r}, which deals another "
                 f"order; build it with the same shuffle, seed and drop_last")
    theirs, mine = saved["num_replicas"], getattr(sampler, "num_replicas", None)
    if theirs is not None and mine is not None and theirs != mine:
        fail(f"field 'sampler_state' was saved at world size {theirs} (num_replicas) but "
             f"this {type(sampler).__name__} runs at world size {mine}. torch's "
             "DistributedSampler deals the epoch differently at each world size, so the "
             "saved position names other samples here. Use torchfeed.DistributedSampler "
             "(same arguments) to resume at another world size, or resume at world size "
             f"{theirs}")


def _check_out_of_order_world_size(cp: Checkpoint, probe: IndexStream) -> None:
    """Out-of-order positions name samples only in the stream they were yielded from."""
    if not cp.out_of_order_yielded or cp.sampler_protocol != "position":
        return
    assert cp.sampler_state is not None
    state = cp.sampler_state.state
    saved = state.get("world_size") if isinstance(state, Mapping) else None
    mine = getattr(probe.sampler, "num_replicas", None)
    if saved is not None and mine is not None and saved != mine:
        fail(f"field 'out_of_order_yielded' lists batches yielded out of order "
             f"(in_order=False) at world size {saved}; at world size {mine} the sampler "
             "re-deals the rest of the epoch, so those positions name other samples. Resume "
             f"at world size {saved}, or checkpoint with in_order=True")


def check_position(cp: Checkpoint, found: int) -> bool:
    """The replayed epoch (``IndexStream.locate``) must reach the positions the state
    names; returns True when every batch of the epoch was yielded."""
    if found < cp.frontier:
        fail(f"field 'batches_yielded' is {cp.batches_yielded} but this DataLoader's "
             f"epoch {cp.epoch} has only {found} batches; the state was saved from a "
             "loader over more data, or another sampler")
    last = max(p for p, _ in cp.out_of_order_yielded) if cp.out_of_order_yielded else None
    if last is not None and found <= last:
        fail(f"field 'out_of_order_yielded' names batch {last} but this DataLoader's epoch "
             f"{cp.epoch} has only {found} batches")
    return last is None and found == cp.frontier


def check_finished(cp: Checkpoint, total) -> None:
    """A finished epoch's state cannot count more batches than the replayed epoch has."""
    if total is not None and cp.batches_yielded > total:
        fail(f"field 'batches_yielded' is {cp.batches_yielded} but this DataLoader's "
             f"epoch {cp.epoch} has only {total} batches; the state was saved from a "
             "loader over more data, or another sampler")
