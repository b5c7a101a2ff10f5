"""``share_dataset=True`` on the shapes real datasets keep their data in
(issue 52's held-out set, ``share_shapes.py``): a torchvision-style
ImageFolder whose ``imgs`` is its ``samples``, a real pycocotools ``COCO``, a
pandas ``DataFrame``, a dict of numpy arrays written in place, a list of
tensors and a list of file paths.  Under fork, spawn and forkserver, the
batches equal torch's DataLoader's over the same dataset left as it is, and
what is not shared is named in the log.
"""
from __future__ import annotations

import logging
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from share_shapes import ImageFolderLike, Shapes

import torchfeed
from torchfeed._share import SharedArray, SharedMapping, SharedSequence

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shapes"))


# Every 10th sample: the attributes stay large (a MiB or more, so they are shared),
# the reading cheap.
EVERY_10TH = range(0, 20_000, 10)


@pytest.fixture(scope="module")
def expected(folder):
    """torch's batches, read in this process from a dataset left as it is."""
    return list(torch.utils.data.DataLoader(Shapes(folder), batch_size=100, sampler=EVERY_10TH))


# The three cases on one pytest worker: torch's batches (``expected``) are read once.
@pytest.mark.timeout(120)
@pytest.mark.xdist_group("share_shapes")
@pytest.mark.parametrize("start_method", [
    "fork", pytest.param("spawn", marks=pytest.mark.long),
    pytest.param("forkserver", marks=pytest.mark.long)])
def test_real_shapes_give_torchs_batches_and_what_is_not_shared_is_named(
        start_method, folder, expected, caplog):
    dataset = Shapes(folder)
    samples = dataset.folder.samples
    # one worker under spawn and forkserver: each is a fresh interpreter importing torch
    workers = 2 if start_method == "fork" else 1
    loader = torchfeed.DataLoader(dataset, batch_size=100, sampler=EVERY_10TH, num_workers=workers,
                                  share_dataset=True, multiprocessing_context=start_method)
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        got = list(loader)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"batch {i} differs"
    logged = {r.getMessage(): r.levelno for r in caplog.records if r.name == "torchfeed"}
    text = "\n".join(logged)

    # the ImageFolder: imgs is samples, and stays so, shared once
    folder_ds = dataset.folder
    assert type(folder_ds.samples) is SharedSequence and folder_ds.imgs is folder_ds.samples
    assert folder_ds.samples == samples
    assert "shared dataset.folder.imgs (a list of 20,000 tuples, " in text
    # the COCO index, three ways to each annotation, in the loader's one memfd
    coco = dataset.coco
    assert type(coco.anns) is SharedMapping and type(coco.imgToAnns) is SharedMapping
    assert coco.anns._buffer is coco.imgToAnns._buffer is folder_ds.samples._buffer
    # the list of paths and the list of tensors
    assert type(dataset.paths) is SharedSequence and type(dataset.tensors) is SharedSequence
    # the DataFrame is not shared, and the log says so and why
    [table] = [m for m in logged if m.startswith("share_dataset: left dataset.table")]
    assert "(a pandas.DataFrame, " in table and "not a pandas.DataFrame" in table
    assert logged[table] == logging.WARNING
    # the dict of arrays: left to fork's own pages, shared copy-on-write otherwise
    if start_method == "fork":
        assert type(dataset.arrays["x"]) is np.ndarray
        assert any(m.startswith("share_dataset: left dataset.arrays") for m in logged), text
    else:
        assert type(dataset.arrays["x"]) is SharedArray and dataset.arrays["x"].flags.writeable
        assert type(dataset.arrays["y"]) is np.ndarray  # small: left as it is


@pytest.mark.timeout(60)
def test_image_folder_aliases_are_one_shared_object_and_spawn_sends_a_handle(tmp_path):
    """Item 11: imgs (= samples) stayed a Python list beside the shared samples:
    the main process held both, and spawn pickled the whole list."""
    dataset = ImageFolderLike(str(tmp_path), 20_000)
    loader = torchfeed.DataLoader(dataset, batch_size=1000, num_workers=1, share_dataset=True,
                                  multiprocessing_context="fork")
    assert len(list(loader)) == 20
    assert type(dataset.samples) is SharedSequence and dataset.imgs is dataset.samples
    shared = {f["attribute"] for f in loader.stats()["large_attributes"] if f["shared"]}
    assert shared >= {"dataset.samples", "dataset.imgs"}
    # what a spawned worker is sent: handles (and the small targets list), not the
    # 20,000 samples (2 MB as a pickle)
    assert len(ForkingPickler.dumps(dataset)) < 200_000
