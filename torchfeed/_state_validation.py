"""Checking a state before ``load_state_dict`` applies it.

Owns the format's version, its field table and every check a state must pass
before it touches the loader (the format itself is described in ``_state.py``).
Each failure raises ``ValueError`` naming the field and both values, so a
state that cannot apply never silently starts the loader from scratch.
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

import torch

from ._index_stream import IndexStream
from ._rng import check_host_rngs
from ._sampler_state import ORDER_SETTINGS
from .distributed import check_iterable_world_size

VERSION = 1
KIND = "torchfeed.DataLoader"

_INT, _BOOL, _OPT_INT = "int", "bool", "int or None"
_FIELDS = {
    "version": _INT, "dataset_kind": "str", "dataset_len": _OPT_INT, "batch_size": _OPT_INT,
    "drop_last": _BOOL, "num_workers": _INT, "persistent_workers": _BOOL, "epoch": _INT,
    "epoch_finished": _BOOL, "batches_yielded": _INT, "samples_yielded": _INT,
    "out_of_order_yielded": "list", "base_seed": _OPT_INT, "draws_base_seed": _BOOL,
    "epoch_start_rng": "dict or None", "sampler_state": "dict or None",
    "worker_states": "list or None", "exhausted_workers": "list", "next_worker": _INT,
    "world_size": _OPT_INT,
}
# Added within version 1: a state saved before they existed lacks them and still loads.
_OPTIONAL_FIELDS = {"next_epoch_global_rng": "str or None", "sampler": "str or None",
                    "next_epoch_host_rng": "dict or None",
                    "iterator_states": "list or None", "dataset_state": "dict or None"}
# torch's base seed is a random int64 drawn with random_(): it lies in [0, 2**63).
BASE_SEED_RANGE = 2 ** 63


def _fail(message: str):
    raise ValueError(f"cannot load this DataLoader state: {message}")


def _type_ok(value, expected: str) -> bool:
    if expected == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == _OPT_INT:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))
    if expected == _BOOL:
        return isinstance(value, bool)
    if expected == "str":
        return isinstance(value, str)
    if expected == "str or None":
        return value is None or isinstance(value, str)
    if expected == "list":
        return isinstance(value, (list, tuple))
    if expected == "dict or None":
        return value is None or isinstance(value, Mapping)
    if expected == "list or None":
        return value is None or isinstance(value, (list, tuple))
    return True


def validate(state, header: dict, loader, probe: IndexStream) -> dict:
    if not isinstance(state, Mapping):
        _fail(f"expected a dict from DataLoader.state_dict(), got {type(state).__name__}")
    kind = state.get("kind")
    if kind != KIND:
        hint = ""
        if any(str(k).startswith("_") for k in state):
            hint = " (it looks like torchdata's StatefulDataLoader state)"
        _fail(f"field 'kind' is {kind!r} but this loader is {KIND!r}{hint}; pass the dict "
              "that torchfeed's DataLoader.state_dict() returned")
    missing = [f for f in _FIELDS if f not in state]
    if missing:
        _fail(f"the state is missing field(s) {', '.join(map(repr, missing))}; it is "
              "corrupted or from another version")
    state = {**{f: None for f in _OPTIONAL_FIELDS}, **state}
    for field, expected in {**_FIELDS, **_OPTIONAL_FIELDS}.items():
        if not _type_ok(state[field], expected):
            _fail(f"field {field!r} must be {expected}, got {state[field]!r}")
    if state["version"] != VERSION:
        _fail(f"field 'version' is {state['version']} but this torchfeed reads version {VERSION}")
    for field in ("dataset_kind", "dataset_len", "batch_size", "drop_last"):
        if state[field] != header[field]:
            _fail(f"field {field!r} is {state[field]!r} in the state but {header[field]!r} in "
                  "this DataLoader; build it with the same dataset, batch_size and drop_last "
                  "as the run that saved the state")
    if state["sampler"] is not None and header["sampler"] is not None \
            and state["sampler"] != header["sampler"]:
        _fail(f"field 'sampler' is {state['sampler']!r} in the state but {header['sampler']!r} "
              "in this DataLoader; the saved positions name other samples in another "
              "sampler's order. Build the DataLoader with the same shuffle=, sampler= and "
              "batch_sampler= as the run that saved the state")
    iterable = header["dataset_kind"] == "iterable"
    if iterable:
        try:
            check_iterable_world_size(state["world_size"], header["world_size"])
        except ValueError as exc:
            _fail(f"field 'world_size': {exc}")
    library = _check_dataset_state(state["dataset_state"], loader, probe)
    rereads = library and state["dataset_state"].get("reread", 0) > 0
    if iterable and rereads and state["num_workers"] != header["num_workers"]:
        _fail(f"field 'num_workers' is {state['num_workers']} in the state but "
              f"{header['num_workers']} in this DataLoader; this {type(loader.dataset).__name__} "
              "state resumes by reading the epoch's first batches again, which needs the same "
              "num_workers")
    if iterable and library:
        # a streaming library resumes its own position, for any num_workers
        state["worker_states"] = state["iterator_states"] = None
        state["exhausted_workers"], state["next_worker"] = [], 0
    elif iterable and state["num_workers"] != header["num_workers"]:
        _fail(f"field 'num_workers' is {state['num_workers']} in the state but "
              f"{header['num_workers']} in this DataLoader; an IterableDataset's stream is "
              "split across workers, so it resumes only with the same num_workers "
              "(map-style datasets resume with any)")
    for field in ("epoch", "batches_yielded", "samples_yielded", "next_worker"):
        if state[field] < 0:
            _fail(f"field {field!r} must be >= 0, got {state[field]}")
    ooo = state["out_of_order_yielded"]
    try:
        pairs = [(int(p), int(n)) for p, n in ooo]
    except (TypeError, ValueError):
        _fail(f"field 'out_of_order_yielded' must be a list of [batch_index, samples] pairs, "
              f"got {ooo!r}")
    frontier = state["batches_yielded"] - len(pairs)
    positions = [p for p, _ in pairs]
    if frontier < 0 or any(p <= frontier for p in positions) \
            or len(set(positions)) != len(positions) or any(n < 1 for _, n in pairs):
        _fail(f"field 'out_of_order_yielded' ({ooo!r}) does not fit batches_yielded="
              f"{state['batches_yielded']}")
    rng = state["epoch_start_rng"]
    if rng is not None:
        _check_rng(rng, loader, probe)
    next_rng = state["next_epoch_global_rng"]
    if next_rng is not None:  # used only if the state turns out to be at its epoch's end
        _check_rng_text("'next_epoch_global_rng'", next_rng, torch.default_generator)
    if rng is None and (state["batches_yielded"] or state["epoch_finished"]):
        _fail(f"field 'epoch_start_rng' is None (the epoch never started) but "
              f"batches_yielded={state['batches_yielded']} and "
              f"epoch_finished={state['epoch_finished']}; the state is corrupted")
    if state["next_epoch_host_rng"] is not None:
        _check_host("'next_epoch_host_rng'", state["next_epoch_host_rng"])
    if state["base_seed"] is None and rng is not None:
        _fail("field 'base_seed' is None in a state whose epoch started")
    if state["base_seed"] is not None and not 0 <= state["base_seed"] < BASE_SEED_RANGE:
        _fail(f"field 'base_seed' is {state['base_seed']}, outside the range torch draws a "
              f"DataLoader's base seed from, [0, 2**63); the state is corrupted")
    _check_sampler_state(state["sampler_state"], probe)
    _check_out_of_order_world_size(state["sampler_state"], pairs, probe)
    slots = max(1, header["num_workers"])
    _check_worker_states(state, slots, loader, probe)
    bad = [w for w in state["exhausted_workers"]
           if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < slots]
    if bad:
        _fail(f"field 'exhausted_workers' names worker(s) {bad} but there are {slots} worker(s)")
    if iterable and state["next_worker"] >= slots:
        _fail(f"field 'next_worker' is {state['next_worker']} but there are {slots} worker(s)")
    out = dict(state)
    out["out_of_order_yielded"] = [list(p) for p in pairs]
    return out


def _check_dataset_state(saved, loader, probe: IndexStream) -> bool:
    """A streaming library's state (``_streaming_adapters.py``): the same library here."""
    adapter = probe.book.adapter
    mine = adapter.library if adapter is not None else None
    if saved is None:
        return False  # nothing of the library's: the loader re-reads, and warns
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        _fail(f"field 'dataset_state' must be {{'library': str, 'state': dict}}, got {saved!r}")
    reread = saved.get("reread", 0)
    if isinstance(reread, bool) or not isinstance(reread, int) or reread < 0:
        _fail(f"field 'dataset_state' has 'reread' {reread!r}; it must be an int >= 0")
    if saved.get("library") != mine:
        _fail(f"field 'dataset_state' holds a {saved.get('library')} dataset's state but this "
              f"DataLoader's dataset is {type(loader.dataset).__name__}; use the same dataset")
    return True


def _check_worker_states(state: dict, slots: int, loader, probe: IndexStream) -> None:
    """Per-worker dataset and iterator states: one per worker slot of this loader.

    A map-style dataset resumes with another ``num_workers`` only if its per-worker
    states map onto the new workers: none was saved, or all are the same state.
    """
    name = type(loader.dataset).__name__
    ws, its = state["worker_states"], state["iterator_states"]
    if ws is None:
        if probe.dataset_stateful and state["batches_yielded"] > 0 \
                and not state["epoch_finished"]:
            _fail(f"field 'worker_states' is None but {name} has state_dict(); the state "
                  "was saved from a loader over another dataset")
        if its is not None:
            _fail("field 'iterator_states' is set but 'worker_states' is None")
        return
    if any(w is not None for w in ws) and not probe.dataset_stateful:
        _fail(f"the state has worker_states but {name} has no state_dict()/"
              "load_state_dict() callable with no arguments")
    if its is not None and len(its) != len(ws):
        _fail(f"field 'iterator_states' has {len(its)} entries but 'worker_states' has "
              f"{len(ws)}")
    if len(ws) == slots:
        return
    saved = [w for w in ws if w is not None]
    if probe.is_iterable or any(w != saved[0] for w in saved) or len(saved) not in (0, len(ws)):
        _fail(f"field 'worker_states' holds the states of {len(ws)} worker(s)' copies of "
              f"{name}, which differ from each other, but this DataLoader has {slots} "
              "worker slot(s); per-worker states cannot map onto another number of workers. "
              f"Resume with num_workers={state['num_workers']}")
    state["worker_states"] = [saved[0] if saved else None] * slots
    state["iterator_states"] = None if its is None else [None] * slots


def _check_rng(rng: Mapping, loader, probe: IndexStream) -> None:
    for key in ("generator", "global", "samplers"):
        if key not in rng:
            _fail(f"field 'epoch_start_rng' lacks {key!r}")
    has_gen = rng["generator"] is not None
    if has_gen != (loader.generator is not None):
        _fail(f"field 'epoch_start_rng' {'has' if has_gen else 'has no'} generator state but "
              f"this DataLoader was built {'without' if has_gen else 'with'} generator=; pass "
              "the same kind of generator as the run that saved the state")
    samplers = rng["samplers"]
    if not isinstance(samplers, (list, tuple)) or len(samplers) != len(probe.generators):
        n = len(samplers) if isinstance(samplers, (list, tuple)) else samplers
        _fail(f"field 'epoch_start_rng' has {n} sampler generator state(s) but this "
              f"DataLoader's sampler has {len(probe.generators)} generator(s)")
    expected = [("global", rng["global"], torch.default_generator)]
    if has_gen:
        expected.append(("generator", rng["generator"], loader.generator))
    for i, (text, g) in enumerate(zip(samplers, probe.generators)):
        expected.append((f"samplers[{i}]", text, g))
    for name, text, generator in expected:
        _check_rng_text(f"'epoch_start_rng'[{name!r}]", text, generator)
    if rng.get("host") is not None:
        _check_host("'epoch_start_rng'['host']", rng["host"])


def _check_host(field: str, host) -> None:
    """numpy's and Python's global RNG states, as ``_rng.encode_host_rngs`` writes them."""
    if not isinstance(host, Mapping) or not all(isinstance(host.get(k), (str, type(None)))
                                                for k in ("numpy", "python")):
        _fail(f"field {field} must be {{'numpy': str, 'python': str}}, got {host!r}")
    try:
        check_host_rngs(host)
    except ValueError as exc:
        _fail(f"field {field}{exc}; the state is corrupted")


def _check_rng_text(field: str, text, generator: torch.Generator) -> None:
    """The text must be a state that ``generator`` can load: torch checks more than the
    length (an mt19937 state that fails its check is refused at ``set_state``)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError):
        _fail(f"field {field} is not a base64 RNG state")
    size = generator.get_state().numel()
    if len(raw) != size:
        _fail(f"field {field} holds {len(raw)} bytes but this generator's state is "
              f"{size} bytes")
    try:
        torch.Generator(device=generator.device).set_state(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        _fail(f"field {field} is not a state torch can load ({exc}); the state is corrupted")


def _check_sampler_state(sampler_state, probe: IndexStream) -> None:
    mine = probe.sampler_protocol
    if sampler_state is None:
        return  # a sampler captured nothing, or the epoch had not started
    if not isinstance(sampler_state, Mapping) or "protocol" not in sampler_state \
            or "state" not in sampler_state:
        _fail(f"field 'sampler_state' must be {{'protocol': ..., 'state': ...}}, got "
              f"{sampler_state!r}")
    theirs = sampler_state["protocol"]
    if theirs != mine:
        what = type(probe.sampler).__name__ if probe.sampler is not None else \
            type(probe.index_sampler).__name__
        _fail(f"field 'sampler_state' was saved from a sampler with protocol {theirs!r} but "
              f"this DataLoader's sampler ({what}) has {mine!r}; use the same sampler")
    if theirs == "set_epoch":
        _check_epoch_state(sampler_state["state"], probe.sampler)


def _check_epoch_state(saved, sampler) -> None:
    """A ``"set_epoch"`` sampler has no state to say its order; the world size must match."""
    if not isinstance(saved, Mapping) or not _type_ok(saved.get("epoch"), _INT) \
            or not _type_ok(saved.get("num_replicas"), _OPT_INT):
        _fail("field 'sampler_state' of protocol 'set_epoch' must hold {'epoch': int, "
              f"'num_replicas': int or None}}, got {saved!r}")
    for name in ORDER_SETTINGS:  # recorded since they were added; absent in older states
        theirs, mine = saved.get(name), getattr(sampler, name, None)
        if name in saved and isinstance(mine, (bool, int)) and theirs != mine:
            _fail(f"field 'sampler_state' was saved from a {type(sampler).__name__} with "
                  f"{name}={theirs!r} but this one has {name}={mine!r}, which deals another "
                  f"order; build it with the same shuffle, seed and drop_last")
    theirs, mine = saved["num_replicas"], getattr(sampler, "num_replicas", None)
    if theirs is not None and mine is not None and theirs != mine:
        _fail(f"field 'sampler_state' was saved at world size {theirs} (num_replicas) but "
              f"this {type(sampler).__name__} runs at world size {mine}. torch's "
              "DistributedSampler deals the epoch differently at each world size, so the "
              "saved position names other samples here. Use torchfeed.DistributedSampler "
              "(same arguments) to resume at another world size, or resume at world size "
              f"{theirs}")


def _check_out_of_order_world_size(sampler_state, pairs, probe: IndexStream) -> None:
    """Out-of-order positions name samples only in the stream they were yielded from."""
    if not pairs or sampler_state is None or sampler_state["protocol"] != "position":
        return
    saved = sampler_state["state"].get("world_size") if isinstance(
        sampler_state["state"], Mapping) else None
    mine = getattr(probe.sampler, "num_replicas", None)
    if saved is not None and mine is not None and saved != mine:
        _fail(f"field 'out_of_order_yielded' lists batches yielded out of order "
              f"(in_order=False) at world size {saved}; at world size {mine} the sampler "
              "re-deals the rest of the epoch, so those positions name other samples. Resume "
              f"at world size {saved}, or checkpoint with in_order=True")


def check_position(state: Mapping, frontier: int, found: int) -> bool:
    """The replayed epoch (``IndexStream.locate``) must reach the positions the state
    names; returns True when every batch of the epoch was yielded."""
    pairs = state["out_of_order_yielded"]
    if found < frontier:
        _fail(f"field 'batches_yielded' is {state['batches_yielded']} but this DataLoader's "
              f"epoch {state['epoch']} has only {found} batches; the state was saved from a "
              "loader over more data, or another sampler")
    last = max(p for p, _ in pairs) if pairs else None
    if last is not None and found <= last:
        _fail(f"field 'out_of_order_yielded' names batch {last} but this DataLoader's epoch "
              f"{state['epoch']} has only {found} batches")
    return last is None and found == frontier


def check_finished(state: Mapping, total) -> None:
    """A finished epoch's state cannot count more batches than the replayed epoch has."""
    if total is not None and state["batches_yielded"] > total:
        _fail(f"field 'batches_yielded' is {state['batches_yielded']} but this DataLoader's "
              f"epoch {state['epoch']} has only {total} batches; the state was saved from a "
              "loader over more data, or another sampler")
