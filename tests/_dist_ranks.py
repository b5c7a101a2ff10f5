"""One rank of a real gloo process group, launched by tests/test_distributed.py.

    python -m torch.distributed.run --standalone --nproc_per_node=N \
        tests/_dist_ranks.py OUT_DIR [--save] [--resume-from DIR] [--torch-sampler-from DIR]
        [--share TAG] [--datapipes] [--accelerate]

Writes OUT_DIR/rank{RANK}.json (map-style scenarios) and
OUT_DIR/rank{RANK}-iterable.json: the sample ids this rank saw, per scenario.
The test process checks union, disjointness and resume coverage across ranks.

The world-2 launch also runs what other test modules check across two ranks, so
one torchrun job (an agent and two interpreters importing torch) serves them all:
``--share TAG`` runs tests/_share_ranks.py's scenario into OUT_DIR/share and
``--datapipes`` tests/_dist_datapipes.py's into OUT_DIR/datapipes, and
``--accelerate`` tests/_accelerate_ranks.py's (test_frameworks.py) into
OUT_DIR/accelerate: it imports Accelerate and sets the global seed.  Each part
that fails is reported and the next one still runs; the rank exits non-zero.

``--readme-ddp DIR`` (the world-2 and world-1 launches) then runs the docs'
``DIR/train_ddp.py`` (test_readme.py) as torchrun runs it: as ``__main__``, from
DIR, with that argv and this launch's torchrun environment, once every scenario
above has destroyed its process group (the script makes its own).  Its output
goes to ``DIR/output-N.txt`` for a launch of N ranks.
"""
import argparse
import contextlib
import faulthandler
import io
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfeed  # noqa: E402
from torchfeed.distributed import (  # noqa: E402
    DistributedSampler,
    rank_and_world_size,
    shard_info,
    shard_iterable,
)

N = 50  # divisible by neither 2 nor 3: padding and drop_last both matter
ITERABLE_N = 37
BATCH = 4
SEED = 1234
SAVE_STEP = 3  # batches taken before the checkpoint
CHAIN_STEP = 1  # batches taken into a resumed pass before checkpointing again
WORKERS = (0, 2)
HANG_S = 150  # a launch takes ~10 s, ~40 s on a loaded 2-core machine


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


class IterIds(IterableDataset):
    def __iter__(self):
        return shard_iterable(range(ITERABLE_N))


def shard_of_worker(_):
    return [shard_info(), rank_and_world_size()]


LOADER = torchfeed.DataLoader


def make_loader(dataset, sampler, num_workers, **kw):
    return LOADER(dataset, batch_size=BATCH, sampler=sampler, num_workers=num_workers, **kw)


def ids_of(batches):
    return [int(i) for b in batches for i in b]


# Recorded so the tests can tell a loader without state_dict() from a bug.
LOADER_STATE = hasattr(LOADER, "state_dict") and hasattr(LOADER, "load_state_dict")


def take_and_save(loader, steps):
    """The ids of the first ``steps`` batches of an epoch, and the loader's state after
    them, through json as a checkpoint file would carry it."""
    it = iter(loader)
    taken = [next(it) for _ in range(steps)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    return {"ids": ids_of(taken), "state": state}


def loader_level(res, args, saved, chained, nw):
    """k batches at one world size, loader.state_dict(), a fresh loader at another.

    ``--save-chain`` also saves again a few batches into the resumed pass, and
    ``--chain-from`` resumes from that second state (2 -> 3 -> 1 ranks).
    """
    key = f"loader/nw{nw}"
    if args.save:
        sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED)
        sampler.set_epoch(1)
        loader = make_loader(Ids(), sampler, nw)
        res[f"{key}/save"] = take_and_save(loader, SAVE_STEP)
    if saved is not None:
        sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED)
        loader = make_loader(Ids(), sampler, nw)
        loader.load_state_dict(saved[f"{key}/save"]["state"])
        sampler.set_epoch(1)  # the usual loop, with the checkpoint's epoch
        res[f"{key}/rest"] = ids_of(loader)
        sampler.set_epoch(2)
        res[f"{key}/next"] = ids_of(loader)
    if saved is not None and args.save_chain:
        sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED)
        loader = make_loader(Ids(), sampler, nw)
        loader.load_state_dict(saved[f"{key}/save"]["state"])
        sampler.set_epoch(1)
        res[f"{key}/chain-save"] = take_and_save(loader, CHAIN_STEP)
    if chained is not None:
        sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED)
        loader = make_loader(Ids(), sampler, nw)
        loader.load_state_dict(chained[f"{key}/chain-save"]["state"])
        sampler.set_epoch(1)
        res[f"{key}/chain-rest"] = ids_of(loader)


def torch_sampler_level(res, args, nw):
    """torch's own DistributedSampler (no state_dict) under the loader: its epoch is in
    loader.state_dict(); rank 0's state resumes every rank at the saved world size (a
    fresh sampler and loader in the saving launch, given rank 0's state through json),
    and any other world size is refused at load_state_dict (``--torch-sampler-from``)."""
    key = f"torch-sampler/nw{nw}"
    saved = None
    if args.save:
        sampler = torch.utils.data.distributed.DistributedSampler(Ids(), shuffle=True, seed=SEED)
        sampler.set_epoch(1)
        loader = make_loader(Ids(), sampler, nw)
        res[f"{key}/save"] = take_and_save(loader, SAVE_STEP)
        rank0 = [json.dumps(res[f"{key}/save"]["state"])]
        dist.broadcast_object_list(rank0, src=0)
        saved = json.loads(rank0[0])
    if args.torch_sampler_from:
        saved = json.loads((Path(args.torch_sampler_from) / "rank0.json").read_text())
        saved = saved[f"{key}/save"]["state"]
    if saved is None:
        return
    sampler = torch.utils.data.distributed.DistributedSampler(Ids(), shuffle=True, seed=SEED)
    loader = make_loader(Ids(), sampler, nw)
    try:
        loader.load_state_dict(saved)
    except ValueError as e:
        res[f"{key}/error"] = str(e)
        return
    res[f"{key}/rest"] = ids_of(loader)  # no set_epoch: the state brings epoch 1 back


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--save", action="store_true")
    p.add_argument("--resume-from")
    p.add_argument("--save-chain", action="store_true")
    p.add_argument("--chain-from")
    p.add_argument("--torch-sampler-from")
    p.add_argument("--share", metavar="TAG")
    p.add_argument("--datapipes", action="store_true")
    p.add_argument("--accelerate", action="store_true")
    p.add_argument("--readme-ddp", metavar="DIR")
    args = p.parse_args()

    # A hang fails the launch with every thread's stack instead of blocking the test.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    if args.readme_ddp:
        init_under_a_prefix("scenarios")
    else:
        dist.init_process_group("gloo")
    out = Path(args.out)
    parts = [lambda: samplers_and_loaders(args)]
    if args.share:
        import _share_ranks
        parts.append(lambda: _share_ranks.run(out / "share", args.share))
    if args.datapipes:
        import _dist_datapipes
        parts.append(lambda: _dist_datapipes.run(out / "datapipes"))
    if args.accelerate:
        import _accelerate_ranks
        parts.append(lambda: _accelerate_ranks.run(out / "accelerate"))
    failed = False
    for part in parts:
        try:
            part()
        except Exception:
            traceback.print_exc()
            failed = True
    dist.destroy_process_group()
    if args.readme_ddp and not run_readme_ddp(Path(args.readme_ddp)):
        failed = True
    sys.exit(1 if failed else 0)


def init_under_a_prefix(prefix: str) -> None:
    """The default process group, on torchrun's store as ``env://`` makes it, with
    its keys under ``prefix/``.  The docs' example (``--readme-ddp``) makes the
    default group again after this one is destroyed, as a fresh launch would: the
    default group's keys are named by a count that ``destroy_process_group`` resets,
    so on the same keys a rank of the second group could read the first one's
    addresses and wait for ever (seen: one hang in a full run)."""
    # torchrun --standalone's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE):
    # every rank is a client of it, as under env://.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def run_readme_ddp(folder: Path) -> bool:
    """docs/distributed.md's train_ddp.py, as ``torchrun ... train_ddp.py`` would run it
    here.  Rank 0 writes what it printed, and its traceback if it failed, to
    ``folder/output-WORLD_SIZE.txt``; any rank's traceback also goes to stderr."""
    out = io.StringIO()
    cwd, argv = os.getcwd(), sys.argv
    ok = True
    try:
        assert not dist.is_initialized(), "a scenario left its process group behind"
        os.chdir(folder)
        sys.argv = ["train_ddp.py"]
        with contextlib.redirect_stdout(out):
            runpy.run_path("train_ddp.py", run_name="__main__")
    except BaseException:
        traceback.print_exc()
        out.write(traceback.format_exc())
        ok = False
    finally:
        os.chdir(cwd)
        sys.argv = argv
    if os.environ["RANK"] == "0":  # the only rank the script prints on
        (folder / f"output-{os.environ['WORLD_SIZE']}.txt").write_text(out.getvalue())
    return ok


def samplers_and_loaders(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"world": world, "rank": rank, "loader": f"{LOADER.__module__}.{LOADER.__name__}",
           "loader_state": LOADER_STATE}
    saved = None
    if args.resume_from:
        saved = json.loads((Path(args.resume_from) / "rank0.json").read_text())
    chained = None
    if args.chain_from:
        chained = json.loads((Path(args.chain_from) / "rank0.json").read_text())

    for nw in WORKERS:
        for drop_last in (False, True):
            key = f"nw{nw}/dl{int(drop_last)}"
            sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED, drop_last=drop_last)
            assert (sampler.rank, sampler.num_replicas) == (rank, world)
            loader = make_loader(Ids(), sampler, nw)
            for epoch in (0, 1):
                sampler.set_epoch(epoch)
                res[f"full/{key}/e{epoch}"] = ids_of(loader)

            if args.save:
                sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED, drop_last=drop_last)
                sampler.set_epoch(1)
                loader = make_loader(Ids(), sampler, nw)
                it = iter(loader)
                taken = [next(it) for _ in range(SAVE_STEP)]
                state = sampler.state_dict_at(SAVE_STEP * BATCH)
                gathered = [None] * world
                dist.all_gather_object(gathered, state)
                res[f"save/{key}"] = {
                    "ids": ids_of(taken),
                    "state": state,
                    "gathered": gathered,
                    "ahead": sampler.state_dict(),  # counts what prefetching handed out
                }
                del it

            if saved is not None:
                state = saved[f"save/{key}"]["state"]
                sampler = DistributedSampler(Ids(), shuffle=True, seed=SEED, drop_last=drop_last)
                sampler.load_state_dict(state)
                sampler.set_epoch(state["epoch"])  # the usual loop; keeps the position
                loader = make_loader(Ids(), sampler, nw)
                res[f"resume/{key}/len"] = len(loader)
                res[f"resume/{key}/rest"] = ids_of(loader)
                sampler.set_epoch(state["epoch"] + 1)
                res[f"resume/{key}/next"] = ids_of(loader)

        if LOADER_STATE:
            loader_level(res, args, saved, chained, nw)

        # torch's own DistributedSampler, unchanged, under torchfeed's loader
        sampler = torch.utils.data.distributed.DistributedSampler(Ids(), shuffle=True, seed=SEED)
        loader = make_loader(Ids(), sampler, nw)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            res[f"torch-sampler/nw{nw}/e{epoch}"] = ids_of(loader)
        if LOADER_STATE:
            torch_sampler_level(res, args, nw)

    Path(args.out, f"rank{rank}.json").write_text(json.dumps(res))

    # IterableDatasets last, in their own file: a failure here fails only their test.
    res = {}
    for nw in WORKERS:
        loader = make_loader(IterIds(), None, nw)
        res[f"iterable/nw{nw}"] = ids_of(loader)
        if nw:
            probe = LOADER(range(nw), batch_size=1, num_workers=nw, collate_fn=shard_of_worker)
            res[f"iterable/nw{nw}/shards"] = list(probe)
    Path(args.out, f"rank{rank}-iterable.json").write_text(json.dumps(res))
    dist.barrier()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
