"""Seeds for workers: processes seed their process's global RNGs, threads
seed generators of their own.

Three schemes live here:

* torch's own (the default): worker ``k`` seeds ``torch`` and ``random`` with
  ``base_seed + k`` and numpy's global RNG with a state derived from
  ``(base_seed, k)``.  The numpy derivation is numpy's own ``SeedSequence`` over
  the words ``[k, low32(base_seed), high32(base_seed), 0]``, which is exactly the
  state torch's DataLoader feeds to ``np.random.seed``.
* per-batch seeding (opt-in, ``DataLoader(seed_per_batch=True)``): before each
  batch is fetched, the worker reseeds all three RNGs from
  ``(base_seed, epoch, batch_index)``.  Random augmentations then depend only on
  which batch is being built, never on which worker builds it, so they are the
  same for any ``num_workers`` and are restored exactly on resume.
* thread workers' own generators (``worker_method="thread"``, pytorch PR
  161044): a thread must not reseed the process's global RNGs, which the
  training loop and the other workers share.  Worker ``k`` gets a
  ``random.Random(base_seed + k)``, a ``torch.Generator`` seeded with
  ``base_seed + k`` and a numpy ``Generator`` (``default_rng``) over the same
  four words as the process worker's numpy seed; ``get_worker_info().rng``
  holds them and ``torch.thread_safe_generator()`` returns the torch one.
  With per-batch seeding they, not the global RNGs, are reseeded per batch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from ._torch_compat import WORKER_INFO_RNG

_MASK32 = 0xFFFFFFFF


def numpy_worker_state(base_seed: int, worker_id: int) -> list[int]:
    """The 4-word numpy seed torch's DataLoader gives worker ``worker_id``."""
    words = [worker_id, base_seed & _MASK32, base_seed >> 32, 0]
    return np.random.SeedSequence(words).generate_state(4).tolist()


def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed this process's RNGs as torch seeds a DataLoader worker; return the seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(numpy_worker_state(base_seed, worker_id))
    return seed


def batch_seed(base_seed: int, epoch: int, batch_index: int) -> int:
    """A 63-bit seed that depends only on (base_seed, epoch, batch_index)."""
    words = [base_seed & _MASK32, base_seed >> 32, epoch & _MASK32, batch_index & _MASK32,
             batch_index >> 32]
    lo, hi = np.random.SeedSequence(words).generate_state(2).tolist()
    return ((hi << 32) | lo) & 0x7FFFFFFFFFFFFFFF


def seed_batch(base_seed: int, epoch: int, batch_index: int, *, cpu_only: bool = False) -> None:
    """Reseed torch, ``random`` and numpy for one batch (per-batch seeding).

    ``cpu_only``: seed torch's CPU generator alone, for the main process
    (``num_workers=0``).  ``torch.manual_seed`` also reseeds every CUDA (and
    other accelerator) generator, and in the main process those belong to the
    training loop; only the CPU generator is put back after the batch.  The CPU
    draws are the same either way, so batches equal the workers' ones.
    """
    seed = batch_seed(base_seed, epoch, batch_index)
    random.seed(seed)
    if cpu_only:
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    np.random.seed(numpy_worker_state(seed, 0))


@dataclass(frozen=True)
class _WorkerRNG:
    """torch's ``_RNG`` (2.13 on), for the releases before it."""

    random_generator: random.Random
    torch_generator: torch.Generator
    numpy_generator: object | None = None


def thread_worker_rng(base_seed: int, worker_id: int):
    """Thread worker ``worker_id``'s own generators, seeded as torch's thread
    worker seeds them (``WorkerInfo.rng``)."""
    seed = base_seed + worker_id
    torch_generator = torch.Generator()
    torch_generator.manual_seed(seed)
    container = WORKER_INFO_RNG or _WorkerRNG
    return container(random_generator=random.Random(seed), torch_generator=torch_generator,
                     numpy_generator=np.random.default_rng(numpy_worker_state(base_seed, worker_id)))


def seed_thread_batch(rng, base_seed: int, epoch: int, batch_index: int) -> None:
    """Per-batch seeding for a thread worker: its own generators, from the same
    seed a process worker puts into the global RNGs for this batch."""
    seed = batch_seed(base_seed, epoch, batch_index)
    rng.random_generator.seed(seed)
    rng.torch_generator.manual_seed(seed)
    numpy_generator = rng.numpy_generator
    numpy_generator.bit_generator.state = np.random.PCG64(numpy_worker_state(seed, 0)).state
