"""``DataLoader(share_dataset=True)``: the dataset's large attributes are
replaced by shared ones before the workers first start, with real workers
under fork, spawn and forkserver.

Batches are compared with torch's DataLoader over an identical dataset left
as it is; the memory tests read each worker's own private pages from
``/proc/<pid>/smaps`` (``share_datasets.own_private_bytes``).
"""
from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import pickle
import threading
import warnings
import weakref
from collections import defaultdict

import numpy as np
import pytest
import torch
from share_datasets import (
    Clip,
    CocoDetectionLike,
    Records,
    Rows,
    WeakDict,
    WritesInPlace,
    annotation,
    annotation_records,
    own_private_bytes,
    share_descriptors,
)

import torchfeed
import torchfeed._worker_costs as costs
from torchfeed._share import SharedMapping, SharedSequence, is_shared

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

START_METHODS = ["fork", "spawn", "forkserver"]
MiB = 2**20


def torchs_batches(dataset, **kwargs) -> list:
    return list(torch.utils.data.DataLoader(dataset, **kwargs))


def assert_same_batches(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"batch {i} differs"


def shuffled(seed: int = 0) -> dict:
    return {"shuffle": True, "generator": torch.Generator().manual_seed(seed)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", START_METHODS)
def test_coco_like_attributes_are_shared_and_batches_equal_torchs(start_method, caplog):
    dataset = CocoDetectionLike(3000)
    expected = torchs_batches(CocoDetectionLike(3000), batch_size=16, **shuffled())
    coco = dataset.coco
    cats, note = coco.cats, dataset.note
    missing = next(i for i in dataset.ids if i not in coco.imgToAnns)  # an image without annotations
    # One spawned worker reads the shared index as two would (each unpickles it
    # alone); two interleave under fork and forkserver, and two spawned ones map
    # the shared records in test_workers_reading_every_record_hold_no_copy_of_them.
    workers = 1 if start_method == "spawn" else 2
    loader = torchfeed.DataLoader(dataset, batch_size=16, num_workers=workers, share_dataset=True,
                                  multiprocessing_context=start_method, **shuffled())
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        got = list(loader)
    assert_same_batches(got, expected)

    # Two levels deep: the COCO object's indexes, as pycocotools lays them out.
    assert type(coco.anns) is SharedMapping and type(coco.imgs) is SharedMapping
    assert type(coco.imgToAnns) is SharedMapping and coco.imgToAnns.original_type is defaultdict
    # COCO.dataset (the annotation file: a few large lists) keeps its keys; its large
    # lists are shared one by one, so reading one does not load the others.
    assert type(coco.dataset) is dict
    assert type(coco.dataset["annotations"]) is SharedSequence
    assert type(coco.dataset["images"]) is SharedSequence
    # Small attributes are left as they are, the same objects.
    assert coco.cats is cats and dataset.note is note and type(dataset.ids) is list
    # defaultdict's lookup, read-only: the default comes back, nothing is inserted.
    assert coco.imgToAnns[missing] == [] and missing not in coco.imgToAnns
    with pytest.raises(TypeError, match="read-only"):
        coco.anns[0] = {}
    shared = [f["attribute"] for f in loader.stats()["large_attributes"] if f["shared"]]
    assert set(shared) >= {"dataset.coco.anns", "dataset.coco.imgs", "dataset.coco.imgToAnns",
                           "dataset.coco.dataset"}, shared
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "torchfeed")
    assert "share_dataset: shared dataset.coco.anns (a dict of" in logged, logged


@pytest.mark.timeout(60)
def test_subset_and_concat_are_followed_to_the_datasets_they_wrap():
    first, second = Records(annotation_records(3000)), Records(annotation_records(4000))
    wrapped = torch.utils.data.ConcatDataset([first, torch.utils.data.Subset(second, range(0, 4000, 2))])
    expected = torchs_batches(torch.utils.data.ConcatDataset(
        [Records(annotation_records(3000)),
         torch.utils.data.Subset(Records(annotation_records(4000)), range(0, 4000, 2))]),
        batch_size=50, **shuffled(1))
    loader = torchfeed.DataLoader(wrapped, batch_size=50, num_workers=1, share_dataset=True,
                                  multiprocessing_context="fork", **shuffled(1))
    assert_same_batches(list(loader), expected)
    assert type(first.records) is SharedSequence and type(second.records) is SharedSequence
    assert first.labels == [0, 1, 2] and type(first.labels) is list
    shared = {f["attribute"] for f in loader.stats()["large_attributes"]}
    assert shared == {"dataset.datasets[0].records", "dataset.datasets[1].dataset.records"}


@pytest.mark.timeout(60)
def test_shared_once_across_epochs_and_iterators():
    dataset = Records(annotation_records(3000))
    loader = torchfeed.DataLoader(dataset, batch_size=100, num_workers=1, share_dataset=True,
                                  persistent_workers=True, multiprocessing_context="fork")
    first = [b.clone() for b in loader]
    shared = dataset.records
    assert type(shared) is SharedSequence
    second = list(loader)  # the same persistent workers
    assert dataset.records is shared
    other = torchfeed.DataLoader(dataset, batch_size=100, num_workers=1, share_dataset=True,
                                 multiprocessing_context="fork")
    assert_same_batches(list(other), first)
    assert_same_batches(list(other), second)  # a second iter() starts new workers
    assert dataset.records is shared


@pytest.mark.timeout(30)
def test_num_workers_0_shares_nothing():
    """No worker, no copy: the main process reads its own objects, as torch's loader does."""
    dataset = Records(annotation_records(3000))
    records = dataset.records
    loader = torchfeed.DataLoader(dataset, batch_size=100, share_dataset=True)
    assert_same_batches(list(loader), torchs_batches(Records(annotation_records(3000)),
                                                     batch_size=100))
    assert dataset.records is records


@pytest.mark.timeout(30)
def test_share_dataset_must_be_a_bool():
    with pytest.raises(TypeError, match="share_dataset must be True or False, but got 'yes'"):
        torchfeed.DataLoader(Records([]), share_dataset="yes")


@pytest.mark.timeout(60)
def test_a_dict_subclass_is_left_alone_and_named(caplog):
    class Counts(dict):
        pass

    dataset = Records(annotation_records(2000))
    dataset.by_id = Counts((i, [float(i)] * 16) for i in range(20_000))
    loader = torchfeed.DataLoader(dataset, batch_size=100, num_workers=1, share_dataset=True,
                                  multiprocessing_context="fork")
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        list(loader)
    assert type(dataset.by_id) is Counts and type(dataset.records) is SharedSequence
    left = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(left) == 1 and left[0].startswith(
        "share_dataset: left dataset.by_id (a Counts of 20,000 lists"), left
    assert "convert it to a dict to share it" in left[0]


@pytest.mark.timeout(60)
def test_resume_with_shared_attributes_equals_torchs_epoch():
    expected = torchs_batches(Records(annotation_records(4000)), batch_size=100, **shuffled(2))
    loader = torchfeed.DataLoader(Records(annotation_records(4000)), batch_size=100,
                                  num_workers=2, share_dataset=True,
                                  multiprocessing_context="fork", **shuffled(2))
    it = iter(loader)
    head = [next(it) for _ in range(7)]
    state = loader.state_dict()
    del it
    resumed = torchfeed.DataLoader(Records(annotation_records(4000)), batch_size=100,
                                   num_workers=2, share_dataset=True,
                                   multiprocessing_context="fork", **shuffled(2))
    resumed.load_state_dict(state)
    assert_same_batches(head + list(resumed), expected)
    assert type(resumed.dataset.records) is SharedSequence


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_restarted_worker_reads_the_shared_attributes(start_method, tmp_path):
    expected = torchs_batches(Records(annotation_records(3000)), batch_size=50, **shuffled(3))
    marker = str(tmp_path / "died")
    dataset = Records(annotation_records(3000), die_at=1234, marker=marker)
    # Under spawn the restart is a fresh interpreter that unpickles the shared
    # dataset again, with or without a second worker beside it (that one runs
    # under fork).
    workers = 1 if start_method == "spawn" else 2
    loader = torchfeed.DataLoader(dataset, batch_size=50, num_workers=workers, share_dataset=True,
                                  max_worker_restarts=1, multiprocessing_context=start_method,
                                  **shuffled(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = list(loader)
    assert os.path.exists(marker), "the worker never died"
    assert any("restarted it as pid" in str(w.message) for w in caught), caught
    assert_same_batches(got, expected)
    assert type(dataset.records) is SharedSequence


# -- no crash, no descriptor per container or batch (issue 52) --------------------------
@pytest.mark.timeout(60)
def test_under_fork_arrays_and_tensors_are_left_alone_and_written_in_place(caplog):
    """Item 1: the shared array was a read-only mapping, and the worker that
    wrote a sample in place died of SIGSEGV; under fork, arrays and tensors
    need no sharing at all (reading them writes none of their pages)."""
    dataset = WritesInPlace()
    expected = torchs_batches(WritesInPlace(), batch_size=64)
    loader = torchfeed.DataLoader(dataset, batch_size=64, num_workers=2, share_dataset=True,
                                  multiprocessing_context="fork")
    with caplog.at_level(logging.INFO, logger="torchfeed"):
        got = list(loader)
    assert_same_batches(got, expected)
    assert type(dataset.feats) is np.ndarray and dataset.feats.flags.writeable
    assert type(dataset.weights) is torch.Tensor and not dataset.weights.is_shared()
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "torchfeed")
    assert ("share_dataset: left dataset.feats (a float32 numpy array of shape 4096x64, "
            "1.0 MiB) unshared: under fork, workers read an array's pages") in logged, logged
    assert "share_dataset: left dataset.weights (a torch.float32 tensor" in logged, logged


@pytest.mark.timeout(60)
def test_kept_batches_of_shared_array_rows_hold_no_descriptor():
    """Item 2: a shared array's view in a batch travelled as a duplicated
    descriptor; 64 kept batches held 65 descriptors and 65 whole mappings."""
    feats = torchfeed.share(np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64))
    loader = torchfeed.DataLoader(Rows(feats), batch_size=8, num_workers=2, collate_fn=list,
                                  multiprocessing_context="fork")
    before = len(share_descriptors())
    kept = list(loader)
    # (fewer, where an earlier test's garbage was collected meanwhile)
    assert len(kept) == 512 and len(share_descriptors()) <= before
    assert all(type(row) is np.ndarray for batch in kept for row in batch)
    assert (np.stack([row for batch in kept for row in batch]) == feats).all()


@pytest.mark.timeout(60)
def test_one_loaders_containers_live_in_one_descriptor():
    """Item 2: every shared container kept a descriptor open in every process
    for its whole life: a ConcatDataset of 60 clips ran out of descriptors
    at ulimit -n 64, where the unshared dataset ran."""
    clips = [Clip(c, frames=6000) for c in range(60)]
    dataset = torch.utils.data.ConcatDataset(clips)
    before = len(share_descriptors())
    loader = torchfeed.DataLoader(dataset, batch_size=50, sampler=range(0, len(dataset), 600),
                                  num_workers=2, share_dataset=True, multiprocessing_context="fork")
    batches = list(loader)
    assert all(type(clip.frames) is SharedSequence for clip in clips)
    assert len(share_descriptors()) <= before + 1  # the loader's one memfd
    in_workers = {int(n) for batch in batches for n in batch[:, 2]}
    assert max(in_workers) <= before + 1, in_workers
    assert torch.cat(batches)[:, 0].tolist() == [i // 6000 for i in range(0, len(dataset), 600)]


# -- when: from construction, in a thread ---------------------------------------------
def _forked_child_sees(dataset) -> str:
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=lambda: writer.send(type(dataset.records).__name__))
    child.start()
    writer.close()
    seen = reader.recv() if reader.poll(60) else "nothing"
    child.join(30)
    return seen


@pytest.mark.timeout(60)
def test_sharing_starts_at_construction_and_a_fork_waits_for_it():
    """Goal of issue 52: the first batch no longer pays for the sharing pass,
    done in a thread from the loader's construction; no fork happens while
    that thread runs (here multiprocessing's own, at once)."""
    dataset = Records(annotation_records(20_000))
    loader = torchfeed.DataLoader(dataset, batch_size=500, num_workers=1, share_dataset=True,
                                  multiprocessing_context="fork")
    assert _forked_child_sees(dataset) == "SharedSequence"  # the fork waited for the pass
    assert type(dataset.records) is SharedSequence  # shared before any iter()
    assert not [t for t in threading.enumerate() if t.name == "torchfeed-share-dataset"]
    assert_same_batches(list(loader), torchs_batches(Records(annotation_records(20_000)),
                                                     batch_size=500))
    [shared] = loader.stats()["large_attributes"]
    assert shared["attribute"] == "dataset.records" and shared["shared"]


# -- telling the user ---------------------------------------------------------------
@pytest.mark.timeout(90)
def test_warning_and_stats_name_the_attribute_that_is_copied(monkeypatch, caplog):
    # Each worker reading half of these records ends its epoch about 14 MiB larger
    # (the dicts' and lists' pages, whose reference counts it writes); with
    # share_dataset=True, under 1 MiB.  At 4 MiB the growth passes the bound a
    # third of the way through the epoch, so some periodic reading sees it even
    # when readings are slow (at 12 MiB only the epoch's last ones did, and a
    # busy machine missed them).
    monkeypatch.setattr(costs, "USS_GROWTH_WARN", 4 * MiB)
    monkeypatch.setattr(costs, "MEMORY_CHECK_EVERY", 0.0)  # a check at every batch
    monkeypatch.setattr(costs, "_warned", False)
    # About 60 MiB of dicts and lists.  Two workers: a page that the main process
    # writes after the fork (its garbage collector) stays shared between them.
    dataset = Records(annotation_records(40_000))
    loader = torchfeed.DataLoader(dataset, batch_size=500, num_workers=2,
                                  persistent_workers=True, multiprocessing_context="fork")
    with caplog.at_level(logging.WARNING, logger="torchfeed"):
        list(loader)
        s = loader.stats()
    warned = [r.getMessage() for r in caplog.records if r.name == "torchfeed"]
    assert len(warned) == 1, warned
    assert "`dataset.records`: a list of 40,000 dicts, " in warned[0], warned[0]
    assert "pass `share_dataset=True`" in warned[0], warned[0]
    named = [f for f in s["large_attributes"] if f["attribute"] == "dataset.records"]
    assert len(named) == 1 and not named[0]["shared"] and named[0]["bytes"] > 20 * MiB, named
    assert s["large_attributes"] == [named[0]]  # labels (3 ints) is small
    assert ("  copied per worker   `dataset.records`: a list of 40,000 dicts, "
            in str(s)), str(s)

    # With the argument: no warning, and stats() says what was shared.  (The first
    # loader's garbage is collected first: a collection in the main process during
    # the epoch writes pages that the workers then hold without it.)
    del loader, s
    gc.collect()
    caplog.clear()
    monkeypatch.setattr(costs, "_warned", False)
    loader = torchfeed.DataLoader(Records(annotation_records(40_000)), batch_size=500,
                                  num_workers=2, persistent_workers=True, share_dataset=True,
                                  multiprocessing_context="fork")
    with caplog.at_level(logging.WARNING, logger="torchfeed"):
        list(loader)
        s = loader.stats()
    assert not [r for r in caplog.records if r.name == "torchfeed"], caplog.records
    assert [f["shared"] for f in s["large_attributes"]] == [True]
    assert "  shared dataset      `dataset.records`: a list of 40,000 dicts, " in str(s), str(s)


# -- the memory effect ----------------------------------------------------------------
def _workers_memory(start_method: str, share: bool, records: int, workers: int = 2) -> list:
    """Each worker's own private bytes after the workers read every record once.

    Two workers under fork: a page the main process writes after the fork (its
    garbage collector runs when it likes) stays shared between them, not private."""
    gc.collect()  # no garbage of an earlier loader collected in the main process mid-epoch
    loader = torchfeed.DataLoader(Records(annotation_records(records)), batch_size=500,
                                  num_workers=workers, persistent_workers=True, share_dataset=share,
                                  multiprocessing_context=start_method)
    assert len(list(loader)) == -(-records // 500)
    return [own_private_bytes(w["pid"]) for w in loader.stats()["workers"]]


def _share_and_iterate(start_method: str, records: int, **kwargs):
    """A loader with ``share_dataset=True`` over ``records`` annotation records,
    record 7 followed by a weak reference, read once.  Whether the main process
    had let go of its own records once ``iter()`` had started the workers, the
    dataset, and the loader."""
    gc.collect()  # no garbage of an earlier loader collected in the main process mid-epoch
    originals = annotation_records(records)
    originals[7] = WeakDict(originals[7])
    probe = weakref.ref(originals[7])
    dataset = Records(originals)
    del originals
    loader = torchfeed.DataLoader(dataset, share_dataset=True,
                                  multiprocessing_context=start_method, **kwargs)
    it = iter(loader)
    let_go = probe() is None
    assert len(list(it)) == len(loader)
    return let_go, dataset, loader


@pytest.fixture(scope="module")
def spawned_share():
    """Two persistent spawned workers read 60,000 shared records once: whether
    the main process let go of its own copy, the dataset, and each worker's own
    private bytes.  Read by two tests: each spawned worker costs seconds of CPU."""
    let_go, dataset, loader = _share_and_iterate("spawn", 60_000, batch_size=500, num_workers=2,
                                                 persistent_workers=True)
    private = [own_private_bytes(w["pid"]) for w in loader.stats()["workers"]]
    del loader  # its workers with it
    gc.collect()
    return let_go, dataset, private


spawned_share_once = pytest.mark.xdist_group("spawned_share")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=spawned_share_once)])
def test_workers_reading_every_record_hold_no_copy_of_them(start_method, request):
    records = 60_000  # about 90 MiB of dicts and lists in the main process
    # The premise needs one worker under spawn: each spawned worker unpickles a
    # whole copy of the records, whatever it reads. Both workers that share are checked.
    unshared = _workers_memory(start_method, False, records,
                               workers=1 if start_method == "spawn" else 2)
    if start_method == "spawn":
        shared = request.getfixturevalue("spawned_share")[2]
    else:
        shared = _workers_memory(start_method, True, records)
    assert len(shared) == 2
    mib = {"unshared": [u / MiB for u in unshared], "shared": [s / MiB for s in shared]}
    # The premise: without sharing, each worker copied the records it read
    # (half of them, page by page, under fork; all of them under spawn).
    least_copied = 25 * MiB if start_method == "fork" else 50 * MiB
    assert min(unshared) - max(shared) > least_copied, mib
    if start_method == "fork":
        assert max(shared) < 16 * MiB, mib  # the interpreter's own pages, not the data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=spawned_share_once)])
def test_the_main_process_lets_go_of_its_own_copy(start_method, request):
    """In place: the dataset's attribute is replaced, so the original objects are
    freed in the main process too (nothing else refers to them here): under
    fork before the workers are forked, under spawn once they are launched
    (there, on the memory test's loader)."""
    if start_method == "spawn":
        let_go, dataset, _ = request.getfixturevalue("spawned_share")
    else:
        let_go, dataset, _ = _share_and_iterate(start_method, 20_000, batch_size=1000,
                                                num_workers=1)
    assert let_go, "the main process still held the original records"
    assert is_shared(dataset.records)
    assert dataset.records[7] == annotation(7) and type(dataset.records[7]) is WeakDict


# -- what changes in the main process (issue 52, item 9) ---------------------------------
def _share_section() -> str:
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "sharing-data.md")) as f:
        text = f.read()
    start = text.index("## Workers' memory grows: copy-on-read")
    return " ".join(text[start:text.index("**Finding the attribute that grows.**")].split())


@pytest.mark.timeout(60)
def test_what_sharing_changes_in_the_main_process_is_what_the_docs_say():
    """Item 9: after share_dataset=True, some writes in the main process are
    silent no-ops; each is documented with its reason, and behaves so."""
    section = _share_section()
    for documented in (
            'dataset.records[0]["label"] = 99` leaves record 0 as it was',
            "an append to a list read from a shared `defaultdict` (a missing key's default "
            "included) is lost",
            "appending to it changes neither `len(dataset)` nor what the workers read",
            "`json.dumps` of one raises `TypeError` (`json.dumps(list(dataset.records))` works)",
            "`torch.load(..., weights_only=True)` takes them once `list` and `dict` are allowed",
            "Why not keep the user's own objects in the main process"):
        assert documented in section, documented
    records = annotation_records(3000)
    dataset = Records(records)
    dataset.by_image = defaultdict(list, {i: [i] for i in range(20_000)})
    loader = torchfeed.DataLoader(dataset, batch_size=500, num_workers=1, share_dataset=True,
                                  multiprocessing_context="fork")
    assert len(list(loader)) == 6
    dataset.records[0]["label"] = 99
    assert "label" not in dataset.records[0]
    dataset.by_image[5].append(6)
    dataset.by_image[-1].append(1)
    assert dataset.by_image[5] == [5] and dataset.by_image[-1] == [] and -1 not in dataset.by_image
    records.append(annotation(3000))
    assert len(dataset) == 3000
    with pytest.raises(TypeError, match="SharedSequence is not JSON serializable"):
        json.dumps(dataset.records)
    assert json.loads(json.dumps(list(dataset.records)))[7] == annotation(7)
    again = pickle.loads(pickle.dumps(dataset))
    assert type(again.records) is list and type(again.by_image) is defaultdict
    assert again.records == annotation_records(3000)
