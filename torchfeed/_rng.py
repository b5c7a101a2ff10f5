"""The RNG states a checkpoint keeps: plain-string encoding, and replaying draws from them.

An epoch's index stream is rebuilt by setting the RNGs it drew from back to
where they were when it started (``_index_stream.py``).  The loader's and the
sampler's own generators are set and left where the replay leaves them, which
is where the uninterrupted run had them; the global torch RNG belongs to the
training loop, so it is only ever set inside ``torch.random.fork_rng``; that
is also how an epoch after a finished-epoch checkpoint draws its start from the
global RNG state the checkpoint recorded (``drawing_from``).  numpy's and
Python's global RNGs, which a sampler that is not torch's may shuffle with, are
treated the same way: recorded, set for the replay only, then put back.
"""
from __future__ import annotations

import base64
import binascii
import random
import struct
from collections.abc import Mapping
from contextlib import contextmanager

import numpy as np
import torch

# numpy's and Python's global RNGs ("host" RNGs): a sampler that shuffles with
# np.random or random inside __iter__ (a bucketing sampler) draws its order from
# them.  Their states are kept as base64 of fixed-size records:
# numpy: 624 uint32 keys, pos, has_gauss (int32 each), cached_gaussian (float64);
# Python: 624 uint32 words and the index (uint32 each), has_gauss (int32), gauss_next.
_NP_TAIL = struct.Struct("<iid")
_PY_TAIL = struct.Struct("<id")
_MT_WORDS = 624


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def draw_base_seed(generator) -> int:
    """torch's per-iterator base seed, drawn from the loader's generator or the global RNG."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def encode_host_rngs() -> dict:
    """The live numpy and Python global RNG states, as plain strings."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    if name != "MT19937":  # numpy's legacy global RandomState is always MT19937
        raise ValueError(f"numpy's global RNG is {name}, not MT19937")
    version, words, gauss_next = random.getstate()
    py = (np.asarray(words, dtype=np.uint32).tobytes()
          + _PY_TAIL.pack(gauss_next is not None, gauss_next or 0.0))
    np_bytes = np.asarray(keys, dtype=np.uint32).tobytes() + _NP_TAIL.pack(pos, has_gauss, gauss)
    return {"numpy": base64.b64encode(np_bytes).decode("ascii"),
            "python": base64.b64encode(py).decode("ascii")}


def decode_numpy_rng(text: str) -> tuple:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 4 * _MT_WORDS + _NP_TAIL.size:
        raise ValueError(f"holds {len(raw)} bytes, not {4 * _MT_WORDS + _NP_TAIL.size}")
    keys = np.frombuffer(raw[:4 * _MT_WORDS], dtype=np.uint32).copy()
    pos, has_gauss, gauss = _NP_TAIL.unpack(raw[4 * _MT_WORDS:])
    return ("MT19937", keys, pos, has_gauss, gauss)


def decode_python_rng(text: str) -> tuple:
    raw = base64.b64decode(text, validate=True)
    n = 4 * (_MT_WORDS + 1)
    if len(raw) != n + _PY_TAIL.size:
        raise ValueError(f"holds {len(raw)} bytes, not {n + _PY_TAIL.size}")
    words = tuple(int(w) for w in np.frombuffer(raw[:n], dtype=np.uint32))
    has_gauss, gauss = _PY_TAIL.unpack(raw[n:])
    return (3, words, gauss if has_gauss else None)


def check_host_rngs(host: Mapping) -> None:
    """Raise ValueError unless numpy and Python could load these states."""
    for key, decode, load in (("numpy", decode_numpy_rng, np.random.RandomState().set_state),
                              ("python", decode_python_rng, random.Random().setstate)):
        text = host.get(key)
        if text is None:
            continue
        try:
            load(decode(text))
        except (ValueError, TypeError, binascii.Error) as exc:
            raise ValueError(f"[{key!r}] is not a state {key} can load ({exc})") from None


@contextmanager
def host_rngs_at(host: Mapping | None):
    """numpy's and Python's global RNGs at ``host`` for the duration, then as they were."""
    if not host or (host.get("numpy") is None and host.get("python") is None):
        yield
        return
    saved = (np.random.get_state(), random.getstate())
    try:
        if host.get("numpy") is not None:
            np.random.set_state(decode_numpy_rng(host["numpy"]))
        if host.get("python") is not None:
            random.setstate(decode_python_rng(host["python"]))
        yield
    finally:
        np.random.set_state(saved[0])
        random.setstate(saved[1])


@contextmanager
def replaying(generator, generators, rng: Mapping | None):
    """Set the RNGs back to an epoch's start; the global ones only for the duration.

    The loader's generator and the sampler's own generators stay where the
    replay leaves them: that is where the uninterrupted run had them.  The
    global torch RNG, and numpy's and Python's where the epoch recorded them,
    belong to the training loop and are put back afterwards.  ``rng``: a started
    epoch's ``epoch_start_rng`` (never None there).
    """
    if rng is None:
        raise ValueError("cannot load this DataLoader state: field 'epoch_start_rng' is None "
                         "in a state whose epoch started")
    if rng["generator"] is not None and generator is not None:
        generator.set_state(decode_rng(rng["generator"]))
    for g, text in zip(generators, rng["samplers"]):
        g.set_state(decode_rng(text))
    with torch.random.fork_rng(devices=[]), host_rngs_at(rng.get("host")):
        torch.set_rng_state(decode_rng(rng["global"]))
        yield


@contextmanager
def drawing_from(text: str | None, host: Mapping | None = None):
    """Draw an epoch's start from the global RNG states an end-of-epoch checkpoint recorded.

    When the live global RNG is still there (the caller restored it), nothing
    changes and the draws advance it as torch's do.  Otherwise the draws come
    from the recorded state inside ``fork_rng``, so they are the uninterrupted
    run's and the caller's global RNG is left where it is.  ``host``: the same
    for numpy's and Python's global RNGs.
    """
    if host is not None and host == encode_host_rngs():
        host = None  # still there: draw from them as the uninterrupted run did
    recorded = None if text is None else decode_rng(text)
    if recorded is None or torch.equal(torch.get_rng_state(), recorded):
        with host_rngs_at(host):
            yield
        return
    with torch.random.fork_rng(devices=[]), host_rngs_at(host):
        torch.set_rng_state(recorded)
        yield
