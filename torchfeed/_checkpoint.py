"""The checkpoint format as one typed value: ``Checkpoint``, read once from a state dict.

``Checkpoint.read`` is the only place a state dict given to ``load_state_dict``
is read.  It checks everything that needs no loader (the kind and version,
every field's type, values that cannot be, RNG states torch and numpy cannot
load, parts that contradict each other) and raises ``ValueError`` naming the
field; it returns a frozen ``Checkpoint`` whose fields are the format's keys
(described in ``_state.py``).  Every later step (``_state_validation.fit``,
the plan, the replay, the resume at ``iter()``) takes that value, never the
dict.  ``as_dict`` gives the format back, as ``state_dict()`` writes it, so a
state loaded and asked for again is the same dict, in today's format.

Fields added within version 1 (``next_epoch_global_rng``, ``next_epoch_host_rng``,
``sampler``, ``iterator_states``, ``dataset_state``) read as None when absent:
checkpoints written before them still load, and are given back with those
fields None (which reads as the same ``Checkpoint``).

The value owns what it holds: ``read`` deep-copies the nested values it keeps
(RNG states, the sampler's, the datasets' and the iterators' states) and
``as_dict`` returns a fresh copy, so a caller that changes the dict it loaded,
or the one it was given back, changes nothing in the loader.
"""
from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, NoReturn

import torch

from ._rng import check_host_rngs

VERSION = 1
KIND = "torchfeed.DataLoader"
# torch's base seed is a random int64 drawn with random_(): it lies in [0, 2**63).
BASE_SEED_RANGE = 2 ** 63

_INT, _BOOL, _OPT_INT = "int", "bool", "int or None"
_REQUIRED = {
    "version": _INT, "dataset_kind": "str", "dataset_len": _OPT_INT, "batch_size": _OPT_INT,
    "drop_last": _BOOL, "num_workers": _INT, "persistent_workers": _BOOL, "epoch": _INT,
    "epoch_finished": _BOOL, "batches_yielded": _INT, "samples_yielded": _INT,
    "out_of_order_yielded": "list", "base_seed": _OPT_INT, "draws_base_seed": _BOOL,
    "epoch_start_rng": "dict or None", "sampler_state": "dict or None",
    "worker_states": "list or None", "exhausted_workers": "list", "next_worker": _INT,
    "world_size": _OPT_INT,
}
# Added within version 1: a state saved before they existed lacks them and still loads.
_OPTIONAL = {"next_epoch_global_rng": "str or None", "sampler": "str or None",
             "next_epoch_host_rng": "dict or None",
             "iterator_states": "list or None", "dataset_state": "dict or None"}


def fail(message: str) -> NoReturn:
    raise ValueError(f"cannot load this DataLoader state: {message}")


@dataclasses.dataclass(frozen=True)
class SamplerState:
    """``sampler_state``: ``"position"``, ``"epoch_start"`` or ``"set_epoch"``, and its state."""

    protocol: str
    state: Any  # set_epoch: {"epoch", "num_replicas", and shuffle/seed/drop_last}


@dataclasses.dataclass(frozen=True)
class DatasetState:
    """``dataset_state``: a streaming library's own state (``_streaming_adapters.py``)."""

    library: Any
    state: Mapping
    reread: int  # batches the library's state does not count: read again, dropped


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """One loader state, read and checked; its fields are the format's keys."""

    kind: str
    version: int
    dataset_kind: str
    dataset_len: int | None
    batch_size: int | None
    drop_last: bool
    num_workers: int
    persistent_workers: bool
    world_size: int | None
    sampler: str | None
    epoch: int
    epoch_finished: bool
    batches_yielded: int
    samples_yielded: int
    out_of_order_yielded: tuple[tuple[int, int], ...]
    base_seed: int | None
    draws_base_seed: bool
    epoch_start_rng: Mapping | None
    sampler_state: SamplerState | None
    worker_states: tuple | None
    iterator_states: tuple | None
    dataset_state: DatasetState | None
    exhausted_workers: tuple[int, ...]
    next_worker: int
    next_epoch_global_rng: str | None
    next_epoch_host_rng: Mapping | None

    # -- what the fields say ------------------------------------------------------
    @property
    def started(self) -> bool:
        """The epoch had started when the state was taken (its RNG states are kept)."""
        return self.epoch_start_rng is not None

    @property
    def frontier(self) -> int:
        """Batches consumed in order: every position below it was yielded."""
        return self.batches_yielded - len(self.out_of_order_yielded)

    @property
    def sampler_protocol(self) -> str | None:
        return None if self.sampler_state is None else self.sampler_state.protocol

    @property
    def has_worker_state(self) -> bool:
        """Some worker's dataset or iterator state is kept."""
        return any(ws is not None for ws in self.worker_states or ()) or any(
            its is not None for its in self.iterator_states or ())

    # -- the format -----------------------------------------------------------------
    @classmethod
    def read(cls, state) -> Checkpoint:
        """The one reading of a state dict; ValueError names what is wrong."""
        if not isinstance(state, Mapping):
            fail(f"expected a dict from DataLoader.state_dict(), got {type(state).__name__}")
        kind = state.get("kind")
        if kind != KIND:
            hint = ""
            if any(str(k).startswith("_") for k in state):
                hint = " (it looks like torchdata's StatefulDataLoader state)"
            fail(f"field 'kind' is {kind!r} but this loader is {KIND!r}{hint}; pass the dict "
                 "that torchfeed's DataLoader.state_dict() returned")
        missing = [f for f in _REQUIRED if f not in state]
        if missing:
            fail(f"the state is missing field(s) {', '.join(map(repr, missing))}; it is "
                 "corrupted or from another version")
        fields = {**{f: None for f in _OPTIONAL}, **state}
        for field, expected in {**_REQUIRED, **_OPTIONAL}.items():
            if not _type_ok(fields[field], expected):
                fail(f"field {field!r} must be {expected}, got {fields[field]!r}")
        if fields["version"] != VERSION:
            fail(f"field 'version' is {fields['version']} but this torchfeed reads version "
                 f"{VERSION}")
        for field in ("epoch", "batches_yielded", "samples_yielded", "next_worker"):
            if fields[field] < 0:
                fail(f"field {field!r} must be >= 0, got {fields[field]}")
        pairs = _out_of_order(fields["out_of_order_yielded"], fields["batches_yielded"])
        rng = fields["epoch_start_rng"]
        if rng is not None:
            _check_rng_keys(rng)
        if fields["next_epoch_global_rng"] is not None:  # used only at an epoch's end
            check_rng_text("'next_epoch_global_rng'", fields["next_epoch_global_rng"],
                           torch.default_generator)
        if rng is None and (fields["batches_yielded"] or fields["epoch_finished"]):
            fail(f"field 'epoch_start_rng' is None (the epoch never started) but "
                 f"batches_yielded={fields['batches_yielded']} and "
                 f"epoch_finished={fields['epoch_finished']}; the state is corrupted")
        if fields["next_epoch_host_rng"] is not None:
            check_host("'next_epoch_host_rng'", fields["next_epoch_host_rng"])
        base_seed = fields["base_seed"]
        if base_seed is None and rng is not None:
            fail("field 'base_seed' is None in a state whose epoch started")
        if base_seed is not None and not 0 <= base_seed < BASE_SEED_RANGE:
            fail(f"field 'base_seed' is {base_seed}, outside the range torch draws a "
                 f"DataLoader's base seed from, [0, 2**63); the state is corrupted")
        ws, its = fields["worker_states"], fields["iterator_states"]
        if ws is None and its is not None:
            fail("field 'iterator_states' is set but 'worker_states' is None")
        if ws is not None and its is not None and len(its) != len(ws):
            fail(f"field 'iterator_states' has {len(its)} entries but 'worker_states' has "
                 f"{len(ws)}")
        bad = [w for w in fields["exhausted_workers"]
               if not isinstance(w, int) or isinstance(w, bool) or w < 0]
        if bad:
            fail(f"field 'exhausted_workers' names worker(s) {bad}, which are not worker ids")
        values = {f.name: fields[f.name] for f in dataclasses.fields(cls)}
        values.update(
            out_of_order_yielded=tuple(pairs),
            sampler_state=_sampler_state(fields["sampler_state"]),
            dataset_state=_dataset_state(fields["dataset_state"]),
            worker_states=None if ws is None else tuple(ws),
            iterator_states=None if its is None else tuple(its),
            exhausted_workers=tuple(fields["exhausted_workers"]))
        return cls(**_owned(values))

    def as_dict(self) -> dict:
        """The state dict of this checkpoint, as ``state_dict()`` writes it."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["out_of_order_yielded"] = [list(p) for p in self.out_of_order_yielded]
        if self.sampler_state is not None:
            out["sampler_state"] = {"protocol": self.sampler_state.protocol,
                                    "state": self.sampler_state.state}
        if self.dataset_state is not None:
            out["dataset_state"] = {"library": self.dataset_state.library,
                                    "state": self.dataset_state.state,
                                    "reread": self.dataset_state.reread}
        for name in ("worker_states", "iterator_states"):
            if out[name] is not None:
                out[name] = list(out[name])
        out["exhausted_workers"] = list(self.exhausted_workers)
        return copy.deepcopy(out)  # the caller's to change


FIELDS = tuple(f.name for f in dataclasses.fields(Checkpoint))  # the format's keys


def _owned(values: dict) -> dict:
    """``values`` deep-copied: the checkpoint shares nothing with the caller's dict."""
    try:
        return copy.deepcopy(values)
    except Exception as exc:  # whatever a user's state holds may refuse
        fail(f"it holds a value that cannot be copied ({type(exc).__name__}: {exc}); a "
             "state holds plain values (what state_dict() returns, or its json or "
             "torch.save round trip)")


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


def _out_of_order(ooo, batches_yielded: int) -> list[tuple[int, int]]:
    try:
        pairs = [(int(p), int(n)) for p, n in ooo]
    except (TypeError, ValueError):
        fail(f"field 'out_of_order_yielded' must be a list of [batch_index, samples] pairs, "
             f"got {ooo!r}")
    frontier = batches_yielded - len(pairs)
    positions = [p for p, _ in pairs]
    if frontier < 0 or any(p <= frontier for p in positions) \
            or len(set(positions)) != len(positions) or any(n < 1 for _, n in pairs):
        fail(f"field 'out_of_order_yielded' ({ooo!r}) does not fit batches_yielded="
             f"{batches_yielded}")
    return pairs


def _check_rng_keys(rng: Mapping) -> None:
    for key in ("generator", "global", "samplers"):
        if key not in rng:
            fail(f"field 'epoch_start_rng' lacks {key!r}")
    check_rng_text("'epoch_start_rng'['global']", rng["global"], torch.default_generator)
    if rng.get("host") is not None:
        check_host("'epoch_start_rng'['host']", rng["host"])


def check_rng_text(field: str, text, generator: torch.Generator) -> None:
    """The text must be a state that ``generator`` can load: torch checks more than the
    length (an mt19937 state that fails its check is refused at ``set_state``)."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError):
        fail(f"field {field} is not a base64 RNG state")
    size = generator.get_state().numel()
    if len(raw) != size:
        fail(f"field {field} holds {len(raw)} bytes but this generator's state is "
             f"{size} bytes")
    try:
        torch.Generator(device=generator.device).set_state(
            torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        fail(f"field {field} is not a state torch can load ({exc}); the state is corrupted")


def check_host(field: str, host) -> None:
    """numpy's and Python's global RNG states, as ``_rng.encode_host_rngs`` writes them."""
    if not isinstance(host, Mapping) or not all(isinstance(host.get(k), (str, type(None)))
                                                for k in ("numpy", "python")):
        fail(f"field {field} must be {{'numpy': str, 'python': str}}, got {host!r}")
    try:
        check_host_rngs(host)
    except ValueError as exc:
        fail(f"field {field}{exc}; the state is corrupted")


def _sampler_state(saved) -> SamplerState | None:
    if saved is None:
        return None  # a sampler captured nothing, or the epoch had not started
    if "protocol" not in saved or "state" not in saved:
        fail(f"field 'sampler_state' must be {{'protocol': ..., 'state': ...}}, got {saved!r}")
    if saved["protocol"] == "set_epoch":
        epoch_state = saved["state"]
        if not isinstance(epoch_state, Mapping) or not _type_ok(epoch_state.get("epoch"), _INT) \
                or not _type_ok(epoch_state.get("num_replicas"), _OPT_INT):
            fail("field 'sampler_state' of protocol 'set_epoch' must hold {'epoch': int, "
                 f"'num_replicas': int or None}}, got {epoch_state!r}")
    return SamplerState(saved["protocol"], saved["state"])


def _dataset_state(saved) -> DatasetState | None:
    if saved is None:
        return None  # nothing of a streaming library's: the loader re-reads, and warns
    if not isinstance(saved.get("state"), Mapping):
        fail(f"field 'dataset_state' must be {{'library': str, 'state': dict}}, got {saved!r}")
    reread = saved.get("reread", 0)
    if isinstance(reread, bool) or not isinstance(reread, int) or reread < 0:
        fail(f"field 'dataset_state' has 'reread' {reread!r}; it must be an int >= 0")
    return DatasetState(saved.get("library"), saved["state"], reread)
