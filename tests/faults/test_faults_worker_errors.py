"""Items 4 and 5: exceptions raised in worker code, and batches that cannot be sent.

An exception keeps its type and carries the worker's traceback, the worker id
and the batch's sample indices.  A batch that cannot be pickled becomes a
TypeError naming the offending leaf's path and type, and never hangs.
"""
import time

import pytest
from faults_datasets import (
    DatasetBoom,
    FailingCollate,
    FailingInit,
    UnpicklableMeta,
    UnpicklableMetaIterable,
    collate_meta,
    make_dataset,
    read_marker,
)
from faults_helpers import ALL_CONFIGS, SURFACE_WITHIN, epochs_for, iterate_until_failure

from torchfeed import DataLoader

SOURCES = ["__getitem__", "__iter__", "collate_fn", "worker_init_fn"]
# A map-style dataset has no __iter__ of its own: that source runs with iterables only.
CASES = [(source, c) for source in SOURCES for c in ALL_CONFIGS
         if not (source == "__iter__" and c.kind == "map")]


def _loader_for(source, config, marker):
    visit = epochs_for(config)
    kwargs = dict(batch_size=4, num_workers=2, **config.kwargs())
    if source == "__getitem__":
        ds = make_dataset(config.kind, fault="raise", at=21, marker=marker, visit=visit)
    elif source == "__iter__":
        ds = make_dataset(config.kind, fault="raise", at=21, marker=marker, visit=visit,
                          fault_in_iter=True)
    elif source == "collate_fn":
        ds = make_dataset(config.kind)
        kwargs["collate_fn"] = FailingCollate(at=21, marker=marker)
    else:
        ds = make_dataset(config.kind)
        kwargs["worker_init_fn"] = FailingInit(worker_id=1, marker=marker)
    return DataLoader(ds, **kwargs)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("source,loader_config", CASES, indirect=["loader_config"],
                         ids=[f"{source}-{c.id}" for source, c in CASES])
def test_worker_exception_keeps_type_traceback_and_context(source, loader_config, tmp_path,
                                                           no_pin_warning):
    marker = str(tmp_path / "fired")
    loader = _loader_for(source, loader_config, marker)
    failure = iterate_until_failure(loader, epochs=epochs_for(loader_config))
    fired_at, _, worker_id = read_marker(marker)

    assert failure.type is DatasetBoom, failure
    msg = failure.message
    assert f"in DataLoader worker process {worker_id}" in msg, msg
    assert "Original Traceback (most recent call last):" in msg, msg
    assert f"injected failure in {source}" in msg, msg
    assert "faults_datasets.py" in msg, msg  # the worker's own frames
    if source == "worker_init_fn":
        # Worker 1 fails before its first task, batch 1, and answers it with the error.
        assert "in worker_init_fn, so it could not load batch 1" in msg, msg
        if loader_config.kind == "map":
            assert "batch 1 (sample indices [4, 5, 6, 7])" in msg, msg
    elif loader_config.kind == "map":
        # sample 21 sits in batch 5, [20, 21, 22, 23]
        assert "batch 5 (sample indices [20, 21, 22, 23])" in msg, msg
    else:
        assert "batch " in msg, msg
    assert failure.raised_at - fired_at < SURFACE_WITHIN
    del loader


@pytest.mark.timeout(30)
@pytest.mark.parametrize("leaf,type_name", [("lock", "_thread.lock"), ("lambda", "function")])
@pytest.mark.parametrize("loader_config", ALL_CONFIGS, ids=lambda c: c.id, indirect=True)
def test_unpicklable_batch_names_the_leaf(leaf, type_name, loader_config, no_pin_warning):
    dataset = (UnpicklableMeta(leaf) if loader_config.kind == "map"
               else UnpicklableMetaIterable(leaf))
    loader = DataLoader(dataset, batch_size=4, num_workers=2, collate_fn=collate_meta,
                        **loader_config.kwargs())
    started = time.time()  # the very first batch is the bad one: worker start included
    failure = iterate_until_failure(loader, epochs=1)
    assert failure.raised_at - started < SURFACE_WITHIN
    assert failure.type is TypeError, failure
    msg = failure.message
    assert "cannot be sent to the main process" in msg, msg
    assert f"batch['meta'][3] is a {type_name}" in msg, msg
    assert "DataLoader worker process 0" in msg, msg
    if loader_config.kind == "map":
        assert "batch 0 (sample indices [0, 1, 2, 3])" in msg, msg
    assert failure.batches == 0
    del loader
