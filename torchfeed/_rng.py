"""The RNG states a checkpoint keeps: plain-string encoding, and replaying draws from them.

An epoch's index stream is rebuilt by setting the RNGs it drew from back to
where they were when it started (``_index_stream.py``).  The loader's and the
sampler's own generators are set and left where the replay leaves them, which
is where the uninterrupted run had them; the global torch RNG belongs to the
training loop, so it is only ever set inside ``torch.random.fork_rng``; that
is also how an epoch after a finished-epoch checkpoint draws its start from the
global RNG state the checkpoint recorded (``drawing_from``).
"""
from __future__ import annotations

import base64
from contextlib import contextmanager

import torch


def encode_rng(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def draw_base_seed(generator) -> int:
    """torch's per-iterator base seed, drawn from the loader's generator or the global RNG."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


@contextmanager
def replaying(generator, generators, rng: dict):
    """Set the RNGs back to an epoch's start; the global one only for the duration.

    The loader's generator and the sampler's own generators stay where the
    replay leaves them: that is where the uninterrupted run had them.
    """
    if rng["generator"] is not None and generator is not None:
        generator.set_state(decode_rng(rng["generator"]))
    for g, text in zip(generators, rng["samplers"]):
        g.set_state(decode_rng(text))
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(decode_rng(rng["global"]))
        yield


@contextmanager
def drawing_from(text: str | None):
    """Draw an epoch's start from the global RNG state a finished-epoch checkpoint recorded.

    When the live global RNG is still there (the caller restored it), nothing
    changes and the draws advance it as torch's do.  Otherwise the draws come
    from the recorded state inside ``fork_rng``, so they are the uninterrupted
    run's and the caller's global RNG is left where it is.
    """
    recorded = None if text is None else decode_rng(text)
    if recorded is None or torch.equal(torch.get_rng_state(), recorded):
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(recorded)
        yield
