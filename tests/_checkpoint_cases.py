"""Checkpoints that an earlier torchfeed wrote, kept so that later versions must still load them.

Each case builds a loader, runs it uninterrupted for a few epochs, then runs it
again from the same seed, takes ``k`` batches (``finished``: up to an epoch's
StopIteration) and saves ``state_dict()``.  ``tests/checkpoints/<name>.json``
holds that state, the global torch RNG at the moment it was taken (a training
loop's checkpoint restores it, as Lightning does) and the batches the
uninterrupted run went on to yield.  ``test_resume_old_checkpoints.py`` loads
each into a fresh loader and checks it yields those batches.

The files were written by torchfeed at commit 9d57888 (before ``load_state_dict``
read a state into one typed value), with::

    git worktree add /tmp/base 9d57888
    cd /tmp/base && PYTHONPATH=$PWD python <this checkout>/tests/_checkpoint_cases.py <out dir>

Module-level datasets and samplers only, so workers can unpickle them.
"""
from __future__ import annotations

import base64
import json
import os
import sys

import torch
from torch.utils.data import DistributedSampler as TorchDistributedSampler

from torchfeed import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _resume_helpers import Ids, StatefulStream, close, run_epochs  # noqa: E402
from stateful_datasets import Counting  # noqa: E402

SEED = 2024


def _generator():
    return torch.Generator().manual_seed(7)


def _set_epoch(loader, epoch: int) -> None:
    loader.sampler.set_epoch(epoch)


# name -> (make, k batches taken before the state, finished, epochs, before_epoch)
CASES = {
    "map_shuffle_generator_nw0": (
        lambda: DataLoader(Ids(11), batch_size=3, shuffle=True, generator=_generator()),
        2, False, 2, None),
    "map_shuffle_global_nw2": (
        lambda: DataLoader(Ids(11), batch_size=3, shuffle=True, num_workers=2),
        5, False, 3, None),
    "map_stateful_dataset_nw2_persistent": (
        lambda: DataLoader(Counting(12), batch_size=2, shuffle=True, num_workers=2,
                           persistent_workers=True, generator=_generator()),
        3, False, 2, None),
    "iterable_stateful_nw2": (
        lambda: DataLoader(StatefulStream(10), batch_size=2, num_workers=2),
        3, False, 2, None),
    "torch_distributed_sampler_nw0": (
        lambda: DataLoader(Ids(12), batch_size=2, sampler=TorchDistributedSampler(
            Ids(12), num_replicas=2, rank=1, shuffle=True, seed=3)),
        4, False, 3, _set_epoch),
    "torchfeed_distributed_sampler_nw2": (
        lambda: DataLoader(Ids(13), batch_size=2, num_workers=2, sampler=DistributedSampler(
            Ids(13), num_replicas=2, rank=0, shuffle=True, seed=5)),
        2, False, 2, _set_epoch),
    "end_of_epoch_shuffle_global_nw2": (
        lambda: DataLoader(Ids(11), batch_size=3, shuffle=True, num_workers=2),
        4, True, 3, None),
    "before_first_iter_shuffle_global_nw0": (
        lambda: DataLoader(Ids(7), batch_size=2, shuffle=True),
        0, False, 2, None),
}


def write(name: str) -> dict:
    """Run case ``name`` and return what its fixture holds."""
    make, k, finished, epochs, before_epoch = CASES[name]
    torch.manual_seed(SEED)
    reference = make()
    full = run_epochs(reference, epochs, before_epoch)
    close(reference)

    torch.manual_seed(SEED)
    loader = make()
    epoch = j = 0
    if k or finished:
        if before_epoch is not None:
            before_epoch(loader, 0)
        it = iter(loader)
        for _ in range(k):
            if j == len(full[epoch]):
                epoch, j = epoch + 1, 0
                if before_epoch is not None:
                    before_epoch(loader, epoch)
                it = iter(loader)
            next(it)
            j += 1
        if finished:
            assert j == len(full[epoch]) and next(it, None) is None
    state = loader.state_dict()
    global_rng = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")
    close(loader)
    if finished:
        epoch, j = epoch + 1, 0
    return {"case": name, "state": state, "global_rng": global_rng, "epoch": epoch,
            "rest": [full[epoch][j:]] + full[epoch + 1:]}


if __name__ == "__main__":
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "checkpoints")
    os.makedirs(out_dir, exist_ok=True)
    for case in CASES:
        with open(os.path.join(out_dir, f"{case}.json"), "w") as f:
            json.dump(write(case), f, indent=1)
            f.write("\n")
        print("wrote", case)
