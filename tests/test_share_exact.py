"""torchfeed.share gives back exactly what it was given (issue 52): values,
types, shapes and layouts, NaN and numpy keys, the size of what it stores,
what pickling writes, and the descriptors and mappings it holds.

In-process and cheap: the processes and loaders are in test_share.py and
test_share_dataset.py. An array write that crashed the process before runs
in a forked child, so that the test, not the pytest worker, fails.
"""
from __future__ import annotations

import io
import json
import math
import multiprocessing as mp
import os
import pickle
import warnings
from collections import defaultdict
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from share_datasets import COCOLike, coco_json, share_descriptors

import torchfeed
from torchfeed._share import SharedArray, is_shared, shared_nbytes

MiB = 2**20


def in_a_forked_child(work) -> tuple[int, object]:
    """``work()`` in a forked child: (its exit code, what it returned)."""
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def run():
        writer.send(work())

    child = ctx.Process(target=run)
    child.start()
    writer.close()
    got = reader.recv() if reader.poll(60) else None
    child.join(60)
    return child.exitcode, got


# -- arrays ---------------------------------------------------------------------------
def test_an_in_place_write_to_a_shared_array_is_private_and_never_crashes():
    """Item 1: the array was mapped read-only, and torch.from_numpy(row).sub_()
    through it was a SIGSEGV, in a worker or the training process."""
    feats = torchfeed.share(np.arange(4096 * 64, dtype=np.float32).reshape(4096, 64))

    def write():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "NumPy array is not writable" included
            row = torch.from_numpy(feats[3])
            row.sub_(0.5)
        return float(feats[3, 0]), bool(feats.flags.writeable)

    code, got = in_a_forked_child(write)
    assert code == 0, f"the child died (exit code {code}) writing to a shared array"
    assert got == (3 * 64 - 0.5, True)
    assert feats[3, 0] == 3 * 64  # the child's write was its own
    # and here: a write costs this process its page, and no other process sees it
    feats[5] += 1
    assert feats[5, 0] == 5 * 64 + 1
    code, seen = in_a_forked_child(lambda: float(torchfeed.share(np.asarray(feats))[5, 0]))
    assert code == 0 and seen == 5 * 64 + 1  # sharing it again takes what it holds now


def test_a_zero_d_array_keeps_its_shape_and_fortran_order_its_strides():
    """Items 4 and 18: np.ascontiguousarray made a 0-d array 1-d, and every array C-ordered."""
    scalar = torchfeed.share(np.array(3.5))
    assert scalar.shape == () and scalar.ndim == 0 and scalar[()] == 3.5
    fortran = np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4))
    shared = torchfeed.share(fortran)
    assert shared.flags.f_contiguous and not shared.flags.c_contiguous
    assert shared.strides == fortran.strides and (shared == fortran).all()
    strided = np.arange(60.0).reshape(3, 4, 5).transpose(2, 0, 1)[::2]  # neither
    again = torchfeed.share(strided)
    assert (again == strided).all() and again.shape == strided.shape


@pytest.mark.parametrize("make,name", [
    (lambda: np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False]), "MaskedArray"),
    (lambda: np.rec.fromrecords([(1, 2.0)], names="a,b"), "recarray"),
    pytest.param(lambda: np.asmatrix(np.eye(2)), "matrix",
                 marks=pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")),
])
def test_an_array_subclass_is_refused_not_made_plain(make, name):
    """Item 5: a masked array lost its mask (mean 2.0 became -331.67), a
    recarray its fields, a matrix row its shape."""
    with pytest.raises(TypeError, match=f"{name} is a numpy array subclass.*np.asarray"):
        torchfeed.share(make())


def test_string_dtype_is_named_as_such():
    """Item 18: StringDType arrays were refused as "dtype object"."""
    if not hasattr(np.dtypes, "StringDType"):
        pytest.skip("numpy < 2 has no StringDType (an optional numpy feature)")
    with pytest.raises(TypeError, match="StringDType array keeps its strings outside"):
        torchfeed.share(np.array(["a", "bc"], dtype=np.dtypes.StringDType()))


def test_reductions_give_numpy_scalars_and_computations_plain_arrays():
    """Item 13: sa.max() was a 0-d SharedArray: unhashable, and not a float."""
    ints = torchfeed.share(np.arange(10))
    floats = torchfeed.share(np.linspace(0, 1, 11))
    assert {ints.max(): 1} == {9: 1} and type(ints.max()) is np.int64
    assert isinstance(floats.mean(), float) and floats.mean() == pytest.approx(0.5)
    assert type(floats.sum(axis=0)) is np.float64 and type(floats * 2) is np.ndarray
    assert type(np.sqrt(floats)) is np.ndarray and type(floats[2:5]) is SharedArray


def test_pickling_a_row_writes_the_row():
    """Item 12: pickle.dumps of one 8 KB row wrote the whole 16 MB buffer."""
    big = torchfeed.share(np.ones((2000, 1000), np.float64))
    row = big[5]
    assert len(pickle.dumps(row)) < row.nbytes + 500
    saved = io.BytesIO()
    torch.save({"row": big[7]}, saved)
    assert len(saved.getvalue()) < 2 * row.nbytes
    assert type(pickle.loads(pickle.dumps(row))) is np.ndarray


def test_a_view_travels_by_value_and_a_handle_reuses_the_descriptor():
    """Item 2: a shared array's view in a batch travelled as a duplicated
    descriptor and a whole mapping, one per kept batch."""
    feats = torchfeed.share(np.zeros((4096, 64), np.float32))
    assert len(ForkingPickler.dumps(feats[3])) < feats[3].nbytes + 500
    assert b"DupFd" not in ForkingPickler.dumps(feats[3])
    before = share_descriptors()
    queue = mp.get_context("fork").SimpleQueue()
    kept = []
    for _ in range(50):  # the whole array, as a handle, sent to this very process
        queue.put(feats)
        kept.append(queue.get())
    assert len(share_descriptors()) == len(before)  # each handle reused this process's descriptor
    assert all(type(k) is SharedArray and k.shared_buffer is feats.shared_buffer for k in kept)


def test_a_written_array_travels_as_what_it_holds():
    """Copy-on-write: after a write here, the memory's pages are no longer what
    this process reads, so the array goes to another process as its values."""
    feats = torchfeed.share(np.zeros(10_000, np.float32))
    clean = ForkingPickler.dumps(feats)
    feats[0] = 7
    written = ForkingPickler.dumps(feats)
    assert len(clean) < 1000 < feats.nbytes < len(written)
    assert pickle.loads(written)[0] == 7


# -- containers -------------------------------------------------------------------------
def test_nan_items_and_keys_compare_as_in_the_original():
    """Item 6: each read builds a new NaN, so Python's identity shortcut never applied."""
    items = [1.0, math.nan, {"x": [math.nan]}, (2, math.nan)]
    shared = torchfeed.share(items)
    assert shared == items and items == shared and not shared != items
    assert shared.index(math.nan) == 1 and math.nan in shared and shared.count(math.nan) == 1
    assert {"x": [math.nan]} in shared and shared.index((2, math.nan)) == 3
    table = torchfeed.share({math.nan: "a", (1, math.nan): "b", 2.0: "c"})
    assert table[math.nan] == "a" and table[float("nan")] == "a" and table[np.float32("nan")] == "a"
    assert table[(1, math.nan)] == "b" and math.nan in table and table[2] == "c"
    assert table == {math.nan: "a", (1, math.nan): "b", 2.0: "c"}


def test_numpy_bool_keys_are_found():
    """Item 7: np.bool_ keys raised KeyError, and share({np.True_: 1}) was
    refused as "bool has no hash ...; shared dicts take ... bool"."""
    table = torchfeed.share({np.True_: 1, np.False_: 0, np.int64(5): "five"})
    assert table[True] == 1 and table[np.True_] == 1 and table[np.False_] == 0
    assert table[5] == "five" and table[np.int16(5)] == "five"
    with pytest.raises(TypeError, match="key of type numpy.datetime64 has no hash") as caught:
        torchfeed.share({np.datetime64("2026-01-01"): 1})
    assert "bool" not in str(caught.value).split(";")[0]


def test_an_object_many_records_hold_is_stored_once():
    """Item 10: the pickle memo was cleared per record, so 1,000 records
    pointing at one 25 KB dict took 24.9 MB against pickle.dumps's 37 KB."""
    common = {f"k{i}": float(i) for i in range(1000)}  # about 25 KB pickled
    records = [{"id": i, "meta": common} for i in range(1000)]
    shared = torchfeed.share(records)
    assert shared.nbytes < 4 * len(pickle.dumps(records)), shared.nbytes
    assert shared == records and shared[3]["meta"] == common
    assert shared[3]["meta"] is not shared[4]["meta"]  # fresh objects at every read
    twice = torchfeed.share([{"a": common, "b": common}] * 3)
    first = twice[0]
    assert first["a"] is first["b"]  # held twice by one record: one object, as before


def test_a_coco_index_reachable_three_ways_is_stored_about_once():
    """Item 10: pycocotools holds each annotation in dataset["annotations"],
    anns and imgToAnns; shared one by one, that was 26 MiB against one pickle's 7.2."""
    from torchfeed._share import share_all

    coco = COCOLike(coco_json(2000))
    parts = [coco.dataset["annotations"], coco.anns, coco.imgToAnns, coco.imgs]
    done = share_all(parts)
    one_pickle = len(pickle.dumps(parts))
    # each record loads alone, so it cannot share the pickle memo's key strings
    # with the others: within twice one pickle (3.6 times before, 26 MiB against 7.2)
    assert done.nbytes < 2 * one_pickle, (done.nbytes, one_pickle)
    annotations, anns, by_image, imgs = done.shared
    assert annotations == coco.dataset["annotations"] and anns == coco.anns
    assert by_image == coco.imgToAnns and imgs == coco.imgs
    some = list(coco.anns)[17]
    assert by_image[3] == coco.imgToAnns[3] and anns[some] == coco.anns[some]
    assert len(share_descriptors()) >= 1 and done.shared[0]._buffer is done.shared[2]._buffer


def test_many_containers_hold_one_descriptor():
    """Item 2: each shared container held a descriptor in every process, for life."""
    from torchfeed._share import share_all

    name = f"clips-{os.getpid()}-{id(object())}"
    done = share_all([[{"clip": c, "frame": i} for i in range(2000)] for c in range(60)], name)
    assert len([fd for fd in share_descriptors() if name in os.readlink(f"/proc/self/fd/{fd}")]) == 1
    assert [s[5]["clip"] for s in done.shared] == list(range(60))


def test_tensors_in_a_list_are_stored_as_their_bytes():
    """Item 14: a list of 2,000 small tensors read at 227 us an item: each was
    a torch.save archive (some 700 bytes of zip around 16 floats)."""
    tensors = [torch.arange(16, dtype=torch.float32) + i for i in range(2000)]
    shared = torchfeed.share(tensors)
    assert shared.nbytes < 2000 * 200, shared.nbytes
    assert all(torch.equal(a, b) for a, b in zip(shared, tensors))
    odd = [torch.ones(3, 4).t(), torch.zeros(2, dtype=torch.bfloat16), torch.tensor(5),
           torch.ones(2, 2, requires_grad=True), torch.empty(0, 3), torch.ones(1).expand(4),
           torch.arange(6).reshape(2, 3)[:, 1]]
    back = torchfeed.share(odd)
    for got, want in zip(back, odd):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.requires_grad == want.requires_grad and torch.equal(got.detach(), want.detach())
    assert back[0].stride() == odd[0].stride()  # a transposed view keeps its layout
    fresh = back[1]
    fresh += 1  # writable, and its own
    assert torch.equal(back[1], odd[1])


def test_share_of_a_tensor_keeps_requires_grad():
    """Item 18: requires_grad was dropped silently."""
    weights = torch.ones(3, requires_grad=True)
    shared = torchfeed.share(weights)
    assert shared.requires_grad and shared.is_shared() and torch.equal(shared, weights)


# -- the memory itself --------------------------------------------------------------------
def test_unsealed_memory_is_refused():
    """Item 16: open_path accepted an unsealed memfd carrying the header, and
    later writes to it showed through."""
    from torchfeed._share._buffer import SharedBuffer

    shared = torchfeed.share([1, 2, 3])
    data = bytes(shared._buffer.view)
    fd = os.memfd_create("torchfeed-share-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.write(fd, data)
        with pytest.raises(ValueError, match="not sealed against writes"):
            SharedBuffer.open_path(f"/proc/self/fd/{fd}")
        import fcntl
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        with pytest.raises(ValueError, match="not sealed against writes"):
            SharedBuffer.open_path(f"/proc/self/fd/{fd}")  # F_SEAL_WRITE still missing
    finally:
        os.close(fd)
    again = SharedBuffer.open_path(f"/proc/self/fd/{shared._buffer.fd}")  # sealed: accepted
    assert again is shared._buffer


def test_the_host_key_leaves_no_file_open():
    """Item 17: _ranks.host_key left a file open, a ResourceWarning per call."""
    from torchfeed._share._ranks import host_key

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        host_key()
        import gc
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], caught


def test_shared_values_pickle_as_plain_values():
    """Item 9: json and weights_only loading need plain lists and dicts: any
    pickler but multiprocessing's writes them so."""
    table = torchfeed.share(defaultdict(list, {"a": [1]}))
    back = pickle.loads(pickle.dumps({"t": table, "l": torchfeed.share([1, (2, 3)])}))
    assert type(back["t"]) is defaultdict and back["t"]["zz"] == [] and back["l"] == [1, (2, 3)]
    assert json.dumps(back["l"]) == "[1, [2, 3]]"
    assert is_shared(table) and shared_nbytes(table) > 0


def test_the_cost_benchmark_reports_each_size(monkeypatch, capsys):
    """Item 15: the cost claims held at 1M records only, and share_cost.py
    measured one size; it reports each (100,000 and 1,000,000 by default)."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import share_cost

    monkeypatch.setattr(sys, "argv", ["share_cost.py", "--records", "300", "700", "--runs", "1",
                                      "--reads", "50"])
    share_cost.main()
    out = capsys.readouterr().out
    assert "300 COCO-like dicts" in out and "700 COCO-like dicts" in out
    assert out.count("share/dumps (list)") == 2 and out.count("share/dumps (dict)") == 2
