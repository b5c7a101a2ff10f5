"""webdataset, the real library: its pipelines under our loader, and its WebLoader.

A WebDataset is an IterableDataset that splits its shards between a loader's
workers through torch's ``get_worker_info()``; with ``batch_size=None`` the
pipeline batches for itself.  ``wds.WebLoader`` builds torch's DataLoader
(``webdataset/compat.py``), so changing the import to torchfeed leaves it on
torch's loader; ``wds.FluidWrapper`` gives the same fluid methods over ours
(docs/frameworks.md, "webdataset", says so).  The shards are written with
the library's own ``TarWriter`` into a temporary folder.
"""
from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from _resume_helpers import disturb_rngs

import torchfeed

if importlib.util.find_spec("webdataset") is None:
    pytest.skip("webdataset is not installed (the [test] extra has it)", allow_module_level=True)
import webdataset as wds  # noqa: E402

SHARDS, PER_SHARD = 4, 10


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    root = tmp_path_factory.mktemp("webdataset")
    for shard in range(SHARDS):
        with wds.TarWriter(str(root / f"shard-{shard:02d}.tar")) as sink:
            for i in range(PER_SHARD):
                key = shard * PER_SHARD + i
                sink.write({"__key__": f"{key:04d}", "id.pyd": key,
                            "v.npy": np.full(3, key, np.float32)})
    return str(root / f"shard-{{00..{SHARDS - 1:02d}}}.tar")


def pipeline(urls):
    """A user's pipeline: decode, a seeded shuffle buffer, batches of 4, in each worker."""
    return (wds.WebDataset(urls, shardshuffle=False, empty_check=False)
            .decode().to_tuple("id.pyd", "v.npy").shuffle(8, seed=3).batched(4))


def ids(batch) -> list[int]:
    return [int(i) for i in batch[0]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_pipeline_batches_are_torchs_and_each_worker_reads_its_own_shards(urls, num_workers):
    kwargs = dict(batch_size=None, num_workers=num_workers)
    theirs = torch.utils.data.DataLoader(pipeline(urls), **kwargs)
    ours = torchfeed.DataLoader(pipeline(urls), **kwargs)
    for _ in range(2):  # each epoch starts the pipeline (and, here, its workers) afresh
        expected = [(ids(b), b[1].tolist()) for b in theirs]
        got = [(ids(b), b[1].tolist()) for b in ours]
        assert got == expected
        samples = sorted(i for batch, _ in got for i in batch)
        assert samples == list(range(SHARDS * PER_SHARD))  # every sample once: shards split
    assert ours.stats()["batches_yielded"] == len(expected)


@pytest.mark.timeout(60)
def test_webloader_keeps_torchs_loader_and_fluid_wrapper_runs_ours(urls):
    theirs = wds.WebLoader(pipeline(urls), batch_size=None, num_workers=2).unbatched().batched(6)
    loader = torchfeed.DataLoader(pipeline(urls), batch_size=None, num_workers=2)
    ours = wds.FluidWrapper(loader).unbatched().batched(6)
    # What the docs warn of: WebLoader builds torch's DataLoader whatever was imported.
    assert type(theirs.pipeline[0]) is torch.utils.data.DataLoader
    assert ours.pipeline[0] is loader
    assert [ids(b) for b in ours] == [ids(b) for b in theirs]
    assert loader.stats()["batches_yielded"] == SHARDS * PER_SHARD // 4


@pytest.mark.timeout(60)
def test_mid_epoch_resume_reads_again_and_drops_what_was_yielded(urls):
    """A WebDataset keeps no state of its own: resuming replays the epoch's start
    and drops the batches already yielded, and says so."""
    uninterrupted = [ids(b) for b in torchfeed.DataLoader(pipeline(urls), batch_size=None,
                                                          num_workers=2)]
    loader = torchfeed.DataLoader(pipeline(urls), batch_size=None, num_workers=2)
    it = iter(loader)
    head = [ids(next(it)) for _ in range(3)]
    state = loader.state_dict()
    del it
    disturb_rngs()  # whatever ran in between, the state alone says where to go on
    resumed = torchfeed.DataLoader(pipeline(urls), batch_size=None, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    said = [str(w.message) for w in caught]
    assert any(m.startswith("WebDataset has no state_dict()") and "3 batches" in m
               for m in said), said
    assert head + [ids(b) for b in resumed] == uninterrupted
