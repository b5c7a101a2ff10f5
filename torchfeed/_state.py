"""The loader's resumable state: what ``state_dict()`` returns, its validation, and its replay.

A state is a position in a deterministic index stream, never data (the design
of Grain's checkpoints).  For a map-style dataset it says which epoch, how many
of its batches reached the user (plus any yielded out of order), and the RNG
states the epoch's shuffle was drawn from; resuming rebuilds the stream and
skips the consumed positions without loading a sample.  That needs nothing from
the workers, so a state saved with ``num_workers=a`` resumes with any ``b``.
An IterableDataset with ``state_dict``/``load_state_dict`` adds, per worker, the
state its copy reported with its latest batch that was yielded, and which
worker is next in the round-robin; without them the consumed batches are read
again and dropped, with a warning.

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
     "epoch_start_rng": {"generator": str | None, "global": str, "samplers": [str, ...]} | None,
     "sampler_state": {"protocol": "position" | "epoch_start", "state": ...} | None,
     "worker_states": [state | None, ...] | None,           # stateful IterableDataset only
     "exhausted_workers": [int, ...],  # their stream ended with the last batch yielded
     "next_worker": int}

RNG states are base64 strings of the generators' byte states.  ``load_state_dict``
checks everything it can up front and raises ``ValueError`` naming the field and
both values; the state then takes effect at the next ``iter()``.  One exception:
a finished epoch is replayed (indices only) inside ``load_state_dict``, so the
loader's and the sampler's generators, and a stateful sampler, are where the
uninterrupted run had them before the user's loop calls ``set_epoch`` again.

Who else draws from the global RNG is the training loop's business: without a
``generator``, the epoch in progress is replayed from the state alone, and later
epochs draw from the global RNG as torch does, so they match the uninterrupted
run when the checkpoint also restores ``torch.get_rng_state()``.
"""
from __future__ import annotations

import base64
import binascii
import warnings
from collections.abc import Mapping

import torch
from torch.utils.data import IterableDataset

from ._index_stream import IndexStream, StatefulResult

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
}


class Plan:
    """What the next epoch started on a loader is: its number, and what to restore."""

    __slots__ = ("epoch", "state", "base_seed", "worker_states", "exhausted")

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    def __init__(self, epoch: int, state=None, base_seed=None, worker_states=None,
                 exhausted=()) -> None:
        self.epoch = epoch
        self.state = state                  # a state whose epoch this one continues
        self.base_seed = base_seed          # persistent workers keep one base seed
        self.worker_states = worker_states  # IterableDataset states to load first
        self.exhausted = exhausted          # workers with nothing left this epoch


class ResumeBook:
    """Per-loader book-keeping: the live index stream, the epoch count, a loaded state."""

    def __init__(self, loader) -> None:
        self.live = None      # the IndexStream of the latest epoch started
        self.next_epoch = 0
        self.plan = None      # set by load_state_dict, used by the next iter()
        self.loaded = None    # the state loaded, returned by state_dict() until then
        dataset = loader.dataset
        iterable = isinstance(dataset, IterableDataset)
        try:
            length = None if iterable else len(dataset)
        except TypeError:
            length = None
        self.header = {
            "version": VERSION, "kind": KIND,
            "dataset_kind": "iterable" if iterable else "map", "dataset_len": length,
            "batch_size": loader.batch_size, "drop_last": bool(loader.drop_last),
            "num_workers": loader.num_workers,
            "persistent_workers": bool(loader.persistent_workers),
        }

    def __getstate__(self):
        # A copied or pickled loader keeps its epoch count and a pending loaded
        # state, not the live iteration (whose sampler iterator cannot be copied):
        # like torch's loader, the copy's next iter() starts an epoch.
        return {"live": None, "next_epoch": self.next_epoch, "plan": self.plan,
                "loaded": self.loaded, "header": self.header}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)

    @staticmethod
    def of(loader) -> "ResumeBook":
        book = loader.__dict__.get("_resume_book")
        if book is None:
            book = loader.__dict__["_resume_book"] = ResumeBook(loader)
        return book

    def begin(self, stream) -> Plan:
        plan = self.plan if self.plan is not None else Plan(self.next_epoch)
        self.plan = self.loaded = None
        self.live = stream
        self.next_epoch = plan.epoch + 1
        return plan


# -- state_dict ----------------------------------------------------------------
def state_dict(loader) -> dict:
    book = ResumeBook.of(loader)
    if book.loaded is not None:
        return dict(book.loaded)
    state = dict(book.header)
    s = book.live
    if s is None:  # nothing started yet: the start of epoch 0
        state.update(epoch=book.next_epoch, epoch_finished=False, batches_yielded=0,
                     samples_yielded=0, out_of_order_yielded=[], base_seed=None,
                     draws_base_seed=True, epoch_start_rng=None, sampler_state=None,
                     worker_states=None, exhausted_workers=[], next_worker=0)
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
    state["worker_states"] = list(s.worker_states) if s.ships_state else None
    state["exhausted_workers"] = sorted(s.exhausted) if s.exhausted else []
    state["next_worker"] = s.first_worker
    return state


# -- load_state_dict -------------------------------------------------------------
def load_state_dict(loader, state) -> None:
    if isinstance(state, Mapping) and len(state) == 0:
        return  # torchdata's convention: an empty state restores nothing
    book = ResumeBook.of(loader)
    probe = IndexStream(loader)  # what this loader's stream looks like; starts nothing
    state = _validate(state, book.header, loader, probe)
    # A persistent iterator still alive belongs to the old position.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        loader._iterator = None
    epoch = state["epoch"]
    carries = loader.num_workers == 0 or probe.persistent  # the same dataset copies go on
    if state["epoch_start_rng"] is None:  # saved before its epoch started
        plan = Plan(epoch)
    elif state["epoch_finished"]:
        probe.replay_to_end(state)
        plan = Plan(epoch + 1,
                    base_seed=state["base_seed"] if probe.persistent else None,
                    worker_states=state["worker_states"] if carries else None)
    else:
        plan = Plan(epoch, state=state, worker_states=state["worker_states"],
                    exhausted=tuple(state["exhausted_workers"]))
        if probe.is_iterable and not probe.ships_state and state["batches_yielded"] > 0:
            warnings.warn(
                f"{type(loader.dataset).__name__} has no state_dict()/load_state_dict(), so "
                f"resuming reads the {state['batches_yielded']} batches this epoch already "
                "yielded again and drops them. Give the dataset state_dict() and "
                "load_state_dict() to resume without re-reading.", stacklevel=3)
    book.plan, book.loaded, book.live = plan, state, None
    book.next_epoch = plan.epoch


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
    if expected == "list":
        return isinstance(value, (list, tuple))
    if expected == "dict or None":
        return value is None or isinstance(value, Mapping)
    if expected == "list or None":
        return value is None or isinstance(value, (list, tuple))
    return True


def _validate(state, header: dict, loader, probe: IndexStream) -> dict:
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
    for field, expected in _FIELDS.items():
        if not _type_ok(state[field], expected):
            _fail(f"field {field!r} must be {expected}, got {state[field]!r}")
    if state["version"] != VERSION:
        _fail(f"field 'version' is {state['version']} but this torchfeed reads version {VERSION}")
    for field in ("dataset_kind", "dataset_len", "batch_size", "drop_last"):
        if state[field] != header[field]:
            _fail(f"field {field!r} is {state[field]!r} in the state but {header[field]!r} in "
                  "this DataLoader; build it with the same dataset, batch_size and drop_last "
                  "as the run that saved the state")
    iterable = header["dataset_kind"] == "iterable"
    if iterable and state["num_workers"] != header["num_workers"]:
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
    if state["base_seed"] is None and rng is not None:
        _fail("field 'base_seed' is None in a state whose epoch started")
    _check_sampler_state(state["sampler_state"], probe)
    ws = state["worker_states"]
    slots = max(1, header["num_workers"])
    if ws is not None:
        if not probe.ships_state:
            _fail(f"the state has worker_states but {type(loader.dataset).__name__} has no "
                  "state_dict()/load_state_dict()")
        if len(ws) != slots:
            _fail(f"field 'worker_states' has {len(ws)} entries but this DataLoader has {slots} "
                  "worker slot(s)")
    elif probe.ships_state and state["batches_yielded"] > 0 and not state["epoch_finished"]:
        _fail(f"field 'worker_states' is None but {type(loader.dataset).__name__} has "
              "state_dict(); the state was saved from a loader over another dataset")
    bad = [w for w in state["exhausted_workers"]
           if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < slots]
    if bad:
        _fail(f"field 'exhausted_workers' names worker(s) {bad} but there are {slots} worker(s)")
    if iterable and state["next_worker"] >= slots:
        _fail(f"field 'next_worker' is {state['next_worker']} but there are {slots} worker(s)")
    out = dict(state)
    out["out_of_order_yielded"] = [list(p) for p in pairs]
    return out


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
    expected = [("global", rng["global"], torch.get_rng_state())]
    if has_gen:
        expected.append(("generator", rng["generator"], loader.generator.get_state()))
    for i, (text, g) in enumerate(zip(samplers, probe.generators)):
        expected.append((f"samplers[{i}]", text, g.get_state()))
    for name, text, current in expected:
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError, ValueError):
            _fail(f"field 'epoch_start_rng'[{name!r}] is not a base64 RNG state")
        if len(raw) != current.numel():
            _fail(f"field 'epoch_start_rng'[{name!r}] holds {len(raw)} bytes but this "
                  f"generator's state is {current.numel()} bytes")


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


class StatefulUnpacker:
    """The transport's unpacker, which also lets batches carrying a worker's state through."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def unpack(self, payload):
        if type(payload) is StatefulResult:
            return StatefulResult(self._inner.unpack(payload.value), payload.state,
                                   payload.ended)
        return self._inner.unpack(payload)

    def discard(self, payload) -> None:
        if type(payload) is StatefulResult:
            payload = payload.value
        discard = getattr(self._inner, "discard", None)
        if discard is not None:
            discard(payload)

    def __getattr__(self, name):
        return getattr(self._inner, name)
