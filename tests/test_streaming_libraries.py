"""mosaicml-streaming and litdata, the real libraries (issue 21): plain iteration is torch's,
the libraries' own errors come out as under torch, and mid-epoch resume is exact in a
fresh process, through each library's public state API (``_streaming_adapters.py``).

The data is written with each library's own writer into a temporary folder.
tests/install_requirements.py installs both libraries without torchvision; see
tests/streaming_shim/README.md.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import streaming_data as sd
import torch
from loader_helpers import warning_messages

from torchfeed import DataLoader

# Installed or not, without importing: mosaicml-streaming imports torchvision, which
# only streaming_data's stand-in provides here (see tests/streaming_shim/README.md).
for _library, _name in (("streaming", "mosaicml-streaming"), ("litdata", "litdata")):
    if importlib.util.find_spec(_library) is None:
        pytest.skip(f"{_name} is not installed (python tests/install_requirements.py "
                    "installs it)", allow_module_level=True)
HERE = os.path.dirname(os.path.abspath(__file__))
LIBS = ["streaming", "litdata"]
BATCHES = 38  # 300 samples in batches of 8

# Every test here on one pytest-xdist worker, one after another: mosaicml-streaming
# names its shared memory by the first prefix free on the machine, and two processes
# making a StreamingDataset at once can pick the same one (a FileExistsError on
# /dev/shm/000997_locals, seen in a full run).  The data is written once, too.
pytestmark = pytest.mark.xdist_group("streaming_libraries")


@pytest.fixture(scope="module", autouse=True)
def _torchvision_shim_only_here():
    """The stand-in goes on sys.path when a test here first needs it; it must not
    outlive this module's tests in the process (pytest-xdist runs others after)."""
    yield
    sd.drop_torchvision_shim()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming_data")
    return {lib: write(str(root / lib)) for lib, write in sd.WRITERS.items()}


def _run(loader_cls, dataset, epochs=2, **kwargs):
    """len(loader), every batch (content, dtype, shape) and the warnings, over ``epochs``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = loader_cls(dataset, batch_size=8, **kwargs)
        out = [len(loader)]
        for _ in range(epochs):
            out.append([(sd.xs(b), b["x"].dtype, tuple(b["v"].shape), b["v"].dtype,
                         b["v"][:, 0].tolist()) for b in loader])
        del loader
    # torch's C++ "NumPy array is not writable" warning fires once per process, in
    # whichever loader collates first: not a difference between the loaders
    # (nor is Python 3.12's fork-with-threads warning: warning_messages drops it).
    said = [(category, message) for category, message in warning_messages(caught)
            if "NumPy array is not writable" not in message]
    return out, said


@pytest.mark.long
@pytest.mark.timeout(300)
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_plain_iteration_is_torchs(data, lib, num_workers):
    """Ours under spawn, the start method of issue 21, against torch's batches.

    torch's loader gives the same batches and warnings under fork and spawn
    (its workers run the same code either way; checked for both libraries when
    this was written), so its reference runs under fork: two spawned workers
    importing torch and the library cost it 5 to 8 s of CPU on 2 cores."""
    theirs, ours = {"num_workers": num_workers}, {"num_workers": num_workers}
    if num_workers:
        both = dict(persistent_workers=True, prefetch_factor=4)
        theirs.update(both, multiprocessing_context="fork")
        ours.update(both, multiprocessing_context="spawn")
    expected, expected_warnings = _run(torch.utils.data.DataLoader,
                                       sd.make_dataset(lib, data[lib]), **theirs)
    got, got_warnings = _run(DataLoader, sd.make_dataset(lib, data[lib]), **ours)
    assert expected[0] == BATCHES and len(expected[1]) == BATCHES
    assert got == expected
    assert got_warnings == expected_warnings


def _until_error(loader):
    """The batches before the error, and the error without its traceback.

    torch re-raises a worker's error from a frame that holds it, so the
    traceback keeps torch's iterator in a reference cycle; freed by the
    collector (in some later test, whenever it runs), the iterator finds its
    index queues already finalized and waits 5 s per worker for workers that
    never hear ``None``."""
    seen = []
    try:
        for batch in loader:
            seen.append(sd.xs(batch))
    except Exception as exc:
        exc.__traceback__ = None
        return seen, exc
    pytest.fail(f"{type(loader).__module__} ran its epoch without an error")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_library_errors_come_out_as_under_torch(data, lib, num_workers):
    ours = _until_error(DataLoader(sd.make_dataset(lib, data[lib], fail_at=50), batch_size=8,
                                   num_workers=num_workers))
    theirs = _until_error(torch.utils.data.DataLoader(
        sd.make_dataset(lib, data[lib], fail_at=50), batch_size=8, num_workers=num_workers))
    assert type(ours[1]) is type(theirs[1]) is ValueError
    assert "transform failed on sample 50" in str(ours[1])
    if num_workers:  # torch's sentence first; which worker hit sample 50 first is a race
        for text in (str(ours[1]), str(theirs[1])):
            assert text.startswith("Caught ValueError in DataLoader worker process ")
    if num_workers == 0:  # with workers, how far the other worker got is a race
        assert ours[0] == theirs[0]
    assert all(50 not in b for b in ours[0])


# -- resume in a fresh process -----------------------------------------------------------
def _save_run(lib, root, kwargs, k, path, epochs=2):
    """Run ``epochs`` epochs uninterrupted, saving the state after the k-th batch to ``path``."""
    loader = DataLoader(sd.make_dataset(lib, root), **kwargs)
    batches = []
    for _ in range(epochs):
        for batch in loader:
            batches.append(sd.xs(batch))
            if len(batches) == k:
                torch.save(loader.state_dict(), path)
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    return batches


def _own_state(lib, root, k, path, num_workers):
    """The library's own StreamingDataLoader: its state after k batches."""
    loader = sd.library_loader(lib, sd.make_dataset(lib, root), batch_size=8,
                               num_workers=num_workers)
    taken = []
    for batch in loader:
        taken.append(sd.xs(batch))
        if len(taken) == k:
            with open(path, "w") as f:
                json.dump(loader.state_dict(), f)
            break
    del loader
    return taken


def _fresh_process(cases, tmp_path):
    cases_path, out_path = tmp_path / "cases.json", tmp_path / "out.json"
    cases_path.write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, os.path.join(HERE, "_streaming_resume.py"),
                           str(cases_path), str(out_path)],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out_path.read_text())


def _resume_plan(lib, root, tmp_path):
    """Run uninterrupted, saving states along the way: the cases a fresh process
    resumes, what each must yield, and what the 2 -> 1 checks need."""
    cases, expected = [], []
    # (num_workers, persistent, k): inside epoch 0 and inside epoch 1, at 0 and 2 workers
    for nw, persistent, k in [(0, False, 5), (0, False, BATCHES + 9),
                              (2, True, 6), (2, True, BATCHES + 7), (2, False, BATCHES + 4)]:
        kwargs = {"batch_size": 8, "num_workers": nw, "persistent_workers": persistent}
        path = str(tmp_path / f"state{len(cases)}.pt")
        full = _save_run(lib, root, kwargs, k, path)
        epochs = 2 if k < BATCHES else 1
        cases.append({"lib": lib, "root": root, "kwargs": kwargs, "state": path,
                      "epochs": epochs})
        rest = full[k:]
        expected.append([rest[:BATCHES - k], rest[BATCHES - k:]] if k < BATCHES else [rest])
    # 2 -> 1 workers
    plan = {"cases": cases, "expected": expected, "two_to_one": str(tmp_path / "two_to_one.pt")}
    plan["taken"] = _save_run(lib, root, {"batch_size": 8, "num_workers": 2}, 7,
                              plan["two_to_one"], epochs=1)[:7]
    if lib == "streaming":  # its state is a global sample count: any num_workers
        cases.append({"lib": lib, "root": root, "kwargs": {"batch_size": 8, "num_workers": 1},
                      "state": plan["two_to_one"], "epochs": 1})
        own_path = str(tmp_path / "own.json")
        plan["own_taken"] = _own_state(lib, root, 7, own_path, num_workers=2)
        cases.append({"lib": lib, "root": root, "kwargs": {"batch_size": 8, "num_workers": 1},
                      "state": own_path, "epochs": 1, "own": True})
    return plan


@pytest.fixture(scope="module")
def resumed(data, tmp_path_factory):
    """Both libraries' plans, and what one fresh process resumed from their
    states: one interpreter for both (each costs seconds of CPU importing torch)."""
    plans = {lib: _resume_plan(lib, data[lib], tmp_path_factory.mktemp(f"resume_{lib}"))
             for lib in LIBS}
    got = _fresh_process([case for lib in LIBS for case in plans[lib]["cases"]],
                         tmp_path_factory.mktemp("resume_fresh_process"))
    for lib in LIBS:
        plans[lib]["got"], got = got[:len(plans[lib]["cases"])], got[len(plans[lib]["cases"]):]
    assert not got
    return plans


@pytest.mark.long
@pytest.mark.timeout(500)
@pytest.mark.parametrize("lib", LIBS)
def test_mid_epoch_resume_in_a_fresh_process(data, lib, resumed):
    plan = resumed[lib]
    cases, got = plan["cases"], plan["got"]
    for i, want in enumerate(plan["expected"]):
        assert got[i] == want, f"case {cases[i]['kwargs']}: resumed != uninterrupted"
    if lib == "streaming":
        ours, theirs = got[-2][0], got[-1][0]
        assert plan["taken"] == plan["own_taken"]
        assert ours == theirs  # the library's own loader resumes 2 -> 1 the same way
        assert sorted(x for b in plan["taken"] + ours for x in b) == list(range(sd.N))
    else:
        # litdata's state deals a position out in its own batch_size (1 under any loader
        # but its own), which is the loader's order only at one worker: at two, torchfeed
        # saves the epoch's start and reads the yielded batches again, at the same
        # num_workers only.
        one = DataLoader(sd.make_dataset(lib, data[lib]), batch_size=8, num_workers=1)
        with pytest.raises(ValueError, match="needs the same num_workers"):
            one.load_state_dict(torch.load(plan["two_to_one"], weights_only=True))
