"""What a checkpoint keeps of the loader's sampler, besides the RNG states it drew from.

Which protocol a sampler follows (its own position, its own state at the
epoch's start, or only an epoch set by ``set_epoch``), the epoch a state names
for it, what kind of sampler it is (so a resume refuses another), and the
``torch.Generator``s it owns.  ``_index_stream.py`` captures and replays them.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
from torch.utils.data.distributed import DistributedSampler


def stateful_sampler(index_sampler):
    """(sampler, protocol) for the sampler whose state a checkpoint keeps, or (None, None).

    ``"position"``: it has ``state_dict_at(consumed)`` (state after ``consumed`` of
    its items were used) and ``load_state_dict``; ``"epoch_start"``: it has only
    ``state_dict``/``load_state_dict``, captured when the epoch starts;
    ``"set_epoch"``: no state of its own, but ``set_epoch`` and an int ``epoch``
    (torch's ``DistributedSampler``), whose epoch and ``num_replicas`` are
    captured when the epoch starts.  The sampler inside torch's own
    ``BatchSampler`` counts too; other batch samplers may buffer, so only their
    own methods are used.
    """
    candidates = [index_sampler]
    if type(index_sampler) is BatchSampler:
        candidates.append(index_sampler.sampler)
    for candidate in candidates:
        if not callable(getattr(candidate, "load_state_dict", None)):
            continue
        if callable(getattr(candidate, "state_dict_at", None)):
            return candidate, "position"
        if callable(getattr(candidate, "state_dict", None)):
            return candidate, "epoch_start"
    for candidate in candidates:
        epoch = getattr(candidate, "epoch", None)
        if callable(getattr(candidate, "set_epoch", None)) and isinstance(epoch, int) \
                and not isinstance(epoch, bool):
            return candidate, "set_epoch"
    return None, None


ORDER_SETTINGS = ("shuffle", "seed", "drop_last")  # torch's DistributedSampler's


def epoch_state(sampler) -> dict:
    """A ``"set_epoch"`` sampler's state: what its order depends on besides the dataset."""
    replicas = getattr(sampler, "num_replicas", None)
    state = {"epoch": int(sampler.epoch),
             "num_replicas": replicas if isinstance(replicas, int) else None}
    for name in ORDER_SETTINGS:  # so a resume refuses a sampler built another way
        value = getattr(sampler, name, None)
        if isinstance(value, (bool, int)):
            state[name] = value
    return state


def describe_sampler(index_sampler) -> str:
    """The kind of sampler a loader draws its batches from, as a state records it:
    ``"BatchSampler(RandomSampler)"``.  Another kind at resume means another order."""
    def name(sampler) -> str:
        text = type(sampler).__qualname__
        if type(sampler) is RandomSampler and sampler.replacement:
            text += "(replacement=True)"
        return text

    if type(index_sampler) is BatchSampler:
        return f"BatchSampler({name(index_sampler.sampler)})"
    return name(index_sampler)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def saved_sampler_epoch(sampler_state, sampler):
    """The epoch a sampler with ``set_epoch`` was at in a checkpoint's ``sampler_state``
    (a ``_checkpoint.SamplerState``), or None.

    A ``"set_epoch"`` sampler's state is its epoch.  A ``"position"`` sampler
    that also has ``set_epoch`` and an int ``epoch`` (``torchfeed.DistributedSampler``)
    names its epoch in its own state, under ``"epoch"``.
    """
    if sampler_state is None:
        return None
    saved = sampler_state.state
    if sampler_state.protocol == "set_epoch":
        return saved["epoch"]
    if sampler_state.protocol == "position" and isinstance(saved, Mapping) \
            and _int(saved.get("epoch")) and callable(getattr(sampler, "set_epoch", None)) \
            and _int(getattr(sampler, "epoch", None)):
        return saved["epoch"]
    return None


def sampler_generators(index_sampler, loader_generator) -> list:
    """torch.Generators the sampler and the samplers it wraps own, in a fixed order.

    Wrapped: torch's BatchSampler's ``sampler``, and the ``batch_sampler`` inside
    a sharding batch sampler (Accelerate's ``BatchSamplerShard``), whose shuffle
    is drawn from the innermost sampler's generator.
    """
    found: list[torch.Generator] = []
    for obj in _wrapped_samplers(index_sampler):
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator) and g is not loader_generator \
                and all(g is not other for other in found):
            found.append(g)
    return found


def _wrapped_samplers(index_sampler, depth: int = 4) -> list:
    chain: list = []
    obj = index_sampler
    while obj is not None and len(chain) < depth:
        chain.append(obj)
        obj = getattr(obj, "sampler", None) or getattr(obj, "batch_sampler", None)
    return chain


# torch's own samplers (and subclasses that keep their __iter__, like
# torchfeed.DistributedSampler) draw only from torch generators.
_TORCH_ITERS = {cls.__iter__ for cls in (BatchSampler, RandomSampler, SequentialSampler,
                                         SubsetRandomSampler, WeightedRandomSampler,
                                         DistributedSampler)}


def may_draw_host_rngs(index_sampler, protocol) -> bool:
    """Whether the sampler's order may come from numpy's or Python's global RNG.

    A sampler with its own state (``"position"``, ``"epoch_start"``) says its
    order through that state.  Otherwise any sampler in the chain whose
    ``__iter__`` is not one of torch's may shuffle with ``np.random`` or
    ``random`` (a bucketing sampler), so an epoch records their states.
    """
    if protocol in ("position", "epoch_start"):
        return False
    return any(getattr(type(s), "__iter__", None) not in _TORCH_ITERS
               for s in _wrapped_samplers(index_sampler))


def user_sampler(index_sampler):
    """The first sampler in the chain that is not one of torch's (else the index sampler)."""
    for sampler in _wrapped_samplers(index_sampler):
        if getattr(type(sampler), "__iter__", None) not in _TORCH_ITERS:
            return sampler
    return index_sampler


def private_rngs(index_sampler, protocol) -> list:
    """``"Sampler.attr"`` for each numpy or Python RNG object a stateless sampler owns.

    Its state is not in any checkpoint, so after a restart it starts over and
    the resumed epoch's order differs from the uninterrupted run's.
    """
    if protocol in ("position", "epoch_start"):
        return []
    found = []
    for sampler in _wrapped_samplers(index_sampler):
        for name, value in vars(sampler).items() if hasattr(sampler, "__dict__") else ():
            if isinstance(value, (np.random.Generator, np.random.RandomState, random.Random)):
                found.append(f"{type(sampler).__name__}.{name}")
    return found
