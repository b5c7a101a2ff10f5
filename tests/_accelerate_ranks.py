"""One process of an Accelerate job: what tests/test_frameworks.py checks across ranks.

tests/_dist_ranks.py runs ``run(OUT_DIR)`` in the two ranks of its world-2 launch
(one torchrun job for several test modules, with no GPU visible); standalone:

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/_accelerate_ranks.py OUT_DIR

Accelerate's ``Accelerator(cpu=True)`` on a gloo group.  Writes
OUT_DIR/rank{RANK}.json: the sample ids of each batch for torch's loader
through ``accelerator.prepare`` (the reference), for a torchfeed loader through
``torchfeed.prepare(accelerator.prepare, loader)``, and for a fresh loader that
``accelerator.load_state`` resumed from a ``save_state`` taken mid-epoch; plus
what the prepared loader iterated with and its ``stats()``; and the warnings
``torchfeed.prepare`` gives under ``dispatch_batches=True``.
"""
import faulthandler
import json
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfeed  # noqa: E402

N, BATCH, SAVE_AT = 38, 4, 2  # 38 = 9.5 batches: Accelerate evens the ranks out
HANG_S = 150


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([i])


def prepared(accelerator, loader_class, seed):
    torch.manual_seed(seed)  # Accelerate seeds the shuffle's generator from the global RNG
    loader = loader_class(Ids(), batch_size=BATCH, shuffle=True, num_workers=1)
    if loader_class is TorchLoader:
        return loader, accelerator.prepare(loader)
    return loader, torchfeed.prepare(accelerator.prepare, loader)


def ids(batch):
    return batch.flatten().tolist()


def run(out: Path) -> None:
    """The job, in a process group torchrun's environment describes (set up or not)."""
    out.mkdir(exist_ok=True)
    reference = Accelerator(cpu=True)  # its own, so ours is loader 0 in save_state's files
    rank = reference.process_index
    result = {"rank": rank, "world": reference.num_processes}
    _, theirs = prepared(reference, TorchLoader, seed=7)
    result["torch"] = [ids(b) for b in theirs]

    accelerator = Accelerator(cpu=True)

    loader, ours = prepared(accelerator, torchfeed.DataLoader, seed=7)
    batches, devices = [], set()
    for step, batch in enumerate(ours):
        batches.append(ids(batch))
        devices.add(str(batch.device))
        if step == SAVE_AT - 1:
            accelerator.save_state(str(out / "ckpt"))
            accelerator.wait_for_everyone()
    result["torchfeed"] = batches
    result["engine"] = type(ours.base_dataloader).__module__
    result["devices"] = [sorted(devices), str(accelerator.device)]  # Accelerate placed them
    stats = ours.stats()  # the running loader's, also through the user's loader
    result["stats"] = [stats["batches_yielded"], stats["transport"],
                       loader.stats()["batches_yielded"]]

    # A new Accelerator and loader, as after a restart; another global seed, so only the
    # saved state can put the shuffle back.
    accelerator2 = Accelerator(cpu=True)
    _, resumed = prepared(accelerator2, torchfeed.DataLoader, seed=99)
    accelerator2.load_state(str(out / "ckpt"))
    result["resumed"] = [ids(b) for b in resumed]

    dispatching = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        dispatch_batches=True))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        prepared(dispatching, torchfeed.DataLoader, seed=7)
    result["dispatch_warnings"] = [str(w.message) for w in record]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    run(Path(sys.argv[1]))
