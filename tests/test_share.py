"""torchfeed.share (issue 34): read-only shared containers stored once per
machine, across start methods, DataLoader workers, pickles, a SIGKILLed main
process and torch.distributed ranks (tests/_share_ranks.py under torchrun).

Processes are real; "the same memory" is checked as the same memfd (device
and inode of the descriptor each process holds), never assumed. Names carry a
uuid, so the fd and /proc scans count only this test's memory under xdist.
"""
import copy
import gc
import json
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from dist_launches import LAUNCHES, ranks_of
from loader_helpers import env_with_path
from share_helpers import (
    DiesMidRead,
    SharedRecords,
    identity,
    memory_of,
    private_growth_reading,
    records,
    report,
    report_then_read,
)

import torchfeed
from torchfeed._share import SharedArray, is_shared, shared_nbytes

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
START_METHODS = ["fork", "spawn", "forkserver"]


def unique(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def holders(name: str) -> list[str]:
    """Every descriptor and mapping of ``torchfeed-share-<name>`` on the machine
    (of the processes this user can read)."""
    needle = f"torchfeed-share-{name}"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if needle in os.readlink(f"/proc/{pid}/fd/{fd}"):
                        found.append(f"pid {pid} fd {fd}")
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as maps:
                found.extend(f"pid {pid} maps it" for line in maps if needle in line)
        except OSError:
            continue
    return found


# -- behaves as the original ------------------------------------------------------------


def test_list_behaves_as_the_list():
    original = records(50)
    shared = torchfeed.share(original)
    assert isinstance(shared, torchfeed.SharedSequence) and isinstance(shared, Sequence)
    assert shared == original and original == shared and not shared != original
    assert shared != tuple(original)
    assert len(shared) == 50 and list(shared) == original
    assert shared[0] == original[0] and shared[-1] == original[-1]
    for s in (slice(3, 9), slice(None, None, -3), slice(-5, None), slice(40, 10, -7), slice(0, 0)):
        assert shared[s] == original[s] and type(shared[s]) is list
    assert original[17] in shared and {"id": -1} not in shared
    assert shared.index(original[17]) == 17 and shared.count(original[17]) == 1
    assert list(reversed(shared)) == original[::-1]
    assert shared + [1] == original + [1] and [1] + shared == [1] + original
    assert shared * 2 == original * 2
    assert shared.copy() == original and type(shared.copy()) is list
    assert (shared < original + [{}]) is True
    with pytest.raises(IndexError):
        shared[50]
    with pytest.raises(TypeError, match="indices must be integers"):
        shared["a"]
    with pytest.raises(TypeError, match="unhashable"):
        hash(shared)
    assert repr(shared).startswith("SharedSequence([{'id': 0,") and "(50 items)" in repr(shared)
    assert repr(torchfeed.share([1, 2])) == "SharedSequence([1, 2])"
    assert torchfeed.share([]) == [] and len(torchfeed.share([])) == 0


def test_items_are_fresh_objects_each_read():
    shared = torchfeed.share([{"a": [1, 2]}])
    first = shared[0]
    first["a"].append(3)
    assert shared[0] == {"a": [1, 2]} and shared[0] is not shared[0]


def test_tuple_behaves_as_the_tuple():
    original = (1, "two", (3.0, None), b"four")
    shared = torchfeed.share(original)
    assert shared == original and original == shared and shared != list(original)
    assert hash(shared) == hash(original)
    assert shared[1:3] == original[1:3] and type(shared[1:3]) is tuple
    assert shared + (5,) == original + (5,)
    assert repr(torchfeed.share((1,))) == "SharedSequence((1,))"
    assert shared.original_type is tuple


def test_dict_behaves_as_the_dict():
    original = {i: records(1)[0] | {"id": i} for i in range(30)}
    original.update({"name": "x", (1, "a"): [1], None: 0, 2.5: "f", b"raw": 1,
                     frozenset({1, 2}): "fs"})
    shared = torchfeed.share(original)
    assert isinstance(shared, torchfeed.SharedMapping) and isinstance(shared, Mapping)
    assert shared == original and original == shared and len(shared) == len(original)
    assert list(shared) == list(original) and list(shared.keys()) == list(original.keys())
    assert list(shared.values()) == list(original.values())
    assert list(shared.items()) == list(original.items())
    assert shared.keys() == original.keys() and shared.items() == original.items()
    for key in original:
        assert key in shared and shared[key] == original[key] and shared.get(key) == original[key]
    # equal keys of other types find the entry, as in a dict
    assert shared[1.0] == original[1] and shared[True] == original[1]
    assert shared[np.int64(3)] == original[3] and shared[(1.0, "a")] == [1]
    assert "missing" not in shared and shared.get("missing", 7) == 7 and 99 not in shared
    assert object() not in shared  # a key type a shared dict cannot hold
    with pytest.raises(KeyError):
        shared["missing"]
    with pytest.raises(TypeError, match="unhashable"):
        shared[[1]]
    assert shared | {"new": 1} == original | {"new": 1} and {"new": 1} | shared == {"new": 1} | original
    assert shared.copy() == original and type(shared.copy()) is dict
    assert list(reversed(shared)) == list(reversed(original))
    assert shared != {**original, "name": "y"}
    assert repr(torchfeed.share({"a": 1})) == "SharedMapping({'a': 1})"


# One fresh interpreter (its str hashes seeded at random) reads what these tests made:
# a shared dict of str keys, opened through /proc/<pid>/fd as another rank opens it,
# and shared containers torch.save'd to a file, loaded with weights_only=True.
in_a_fresh_process = pytest.mark.xdist_group("share_fresh_process")
FRESH_PROCESS_CODE = """
import json, sys
from torchfeed._share._buffer import SharedBuffer
from torchfeed._share._mapping import SharedMapping
table = SharedMapping._attach(SharedBuffer.open_path(sys.argv[1]), 0)
result = {"table": [type(table).__name__, all(table[f"key{i}"] == i for i in range(200)),
                    "key7" in table]}
import collections, numpy as np, torch
from share_helpers import records
# weights_only=True takes plain lists and dicts once allowed (torch refuses every global
# it does not know, builtins.list included); numpy arrays need more, so they load apart
with torch.serialization.safe_globals([list, dict, collections.defaultdict]):
    d = torch.load(sys.argv[2], weights_only=True)
d["array"] = torch.load(sys.argv[3], weights_only=False)
result["saved"] = [d["records"] == records(300), d["table"] == {f"k{i}": i for i in range(300)},
                   d["array"].tolist() == [0, 1, 2, 3, 4], type(d["records"]).__name__,
                   type(d["table"]).__name__, type(d["array"]).__name__]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def loaded_in_a_fresh_process(tmp_path_factory):
    folder = tmp_path_factory.mktemp("share-fresh")
    table = torchfeed.share({f"key{i}": i for i in range(200)})
    torch.save({"records": torchfeed.share(records(300)),
                "table": torchfeed.share({f"k{i}": i for i in range(300)})}, folder / "data.pt")
    torch.save(torchfeed.share(np.arange(5)), folder / "array.pt")
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS_CODE,
                          f"/proc/{os.getpid()}/fd/{table._buffer.fd}", str(folder / "data.pt"),
                          str(folder / "array.pt")],
                         capture_output=True, text=True, timeout=100,
                         env={**env_with_path(ROOT, HERE), "PYTHONHASHSEED": "random"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.timeout(120)
@in_a_fresh_process
def test_dict_keys_hash_alike_in_another_process(loaded_in_a_fresh_process):
    """str keys hash per process in Python: the index must not depend on it."""
    assert loaded_in_a_fresh_process["table"] == ["SharedMapping", True, True]


def test_memory_written_by_another_python_or_platform_is_refused():
    """Records may be marshal data and a dict's index holds numbers' hashes: a
    pack is read by the Python, and the hash modulus, that wrote it."""
    from torchfeed._share._buffer import HEADER, SharedBuffer, seal

    shared = torchfeed.share(defaultdict(list, {10**12: [1], "a": [2]}))
    for field, value in ((4, 2**31 - 1), (5, 0x0207)):
        raw = bytearray(shared._buffer.view)
        fields = list(HEADER.unpack_from(raw, 0))
        fields[field] = value
        HEADER.pack_into(raw, 0, *fields)
        fd = os.memfd_create("torchfeed-share-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, raw)
        seal(fd)
        with pytest.raises(ValueError, match="written by another Python"):
            SharedBuffer(fd)


def test_defaultdict_keeps_its_default():
    shared = torchfeed.share(defaultdict(list, {1: [2]}))
    assert shared[1] == [2] and shared[5] == [] and 5 not in shared and len(shared) == 1
    assert type(shared.copy()) is defaultdict and shared.copy().default_factory is list
    assert pickle.loads(pickle.dumps(shared))[6] == []


WRITES = {
    "list": [("__setitem__", (0, 1)), ("__delitem__", (0,)), ("append", (1,)), ("extend", ([1],)),
             ("insert", (0, 1)), ("pop", ()), ("remove", (1,)), ("clear", ()), ("sort", ()),
             ("reverse", ()), ("__iadd__", ([1],)), ("__imul__", (2,))],
    "dict": [("__setitem__", ("a", 1)), ("__delitem__", ("a",)), ("update", ({"b": 1},)),
             ("pop", ("a",)), ("popitem", ()), ("setdefault", ("a",)), ("clear", ()),
             ("__ior__", ({"b": 1},))],
}


@pytest.mark.parametrize("kind,method,args", [(k, m, a) for k, ws in WRITES.items() for m, a in ws])
def test_writes_raise_type_error(kind, method, args):
    original = [1, 2] if kind == "list" else {"a": 1}
    shared = torchfeed.share(original)
    with pytest.raises(TypeError, match=f"shared read-only between processes.*use {kind}\\(x\\)"):
        getattr(shared, method)(*args)
    assert shared == original


def test_augmented_assignment_and_item_assignment_syntax():
    shared = torchfeed.share([1])
    with pytest.raises(TypeError, match="does not support item assignment"):
        shared[0] = 2
    with pytest.raises(TypeError, match="does not support \\+="):
        shared += [2]
    table = torchfeed.share({"a": 1})
    with pytest.raises(TypeError, match="does not support item deletion"):
        del table["a"]


def test_numpy_array():
    original = np.arange(600_000, dtype=np.float64).reshape(1000, 600)
    shared = torchfeed.share(original)
    assert isinstance(shared, SharedArray) and isinstance(shared, np.ndarray)
    assert (shared == original).all() and shared.dtype == original.dtype
    # the whole array travels as a handle to the one copy; a view as its own values
    assert len(ForkingPickler.dumps(shared)) < 1000 < shared.nbytes
    view = shared[1:, ::2].T
    assert is_shared(view) and memory_of(view) == memory_of(shared)
    sent = ForkingPickler.dumps(view)
    assert view.nbytes < len(sent) < view.nbytes + 1000
    back = pickle.loads(sent)
    assert type(back) is np.ndarray and (back == original[1:, ::2].T).all()
    back = pickle.loads(pickle.dumps(view))  # any other pickler: the values, a plain array
    assert type(back) is np.ndarray and (back == original[1:, ::2].T).all()
    computed = shared + 1
    assert type(computed) is np.ndarray and not is_shared(computed)
    assert shared_nbytes(shared) == original.nbytes
    with pytest.raises(TypeError, match="dtype object"):
        torchfeed.share(np.array([{}, []], dtype=object))


def test_tensor():
    original = torch.arange(10.0)
    shared = torchfeed.share(original)
    assert shared.is_shared() and not original.is_shared() and torch.equal(shared, original)
    assert torchfeed.share(shared) is shared and is_shared(shared)
    assert shared_nbytes(shared) == 40


def test_already_shared_comes_back_as_is():
    for original in ([1], (1,), {"a": 1}, np.arange(3)):
        shared = torchfeed.share(original)
        assert torchfeed.share(shared) is shared and is_shared(shared)
        assert not is_shared(original) and shared_nbytes(original) == 0
        assert 0 < shared_nbytes(shared) <= os.fstat(memory_of_fd(shared)).st_size
        if isinstance(original, np.ndarray):  # writable: a copy is a copy
            copied = copy.deepcopy(shared)
            copied[0] = 7
            assert shared[0] == 0 and not is_shared(copied)
        else:
            assert copy.copy(shared) is shared and copy.deepcopy(shared) is shared


def memory_of_fd(shared):
    return (getattr(shared, "shared_buffer", None) or shared._buffer).fd


def my_share_fds() -> list[str]:
    return [link for fd in os.listdir("/proc/self/fd")
            if "torchfeed-share" in (link := _readlink(f"/proc/self/fd/{fd}"))]


def _readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return ""


@pytest.mark.parametrize("bad,message", [
    ([1, lambda: 0], "item 1 of the list cannot be pickled"),
    ({"a": 1, "b": lambda: 0}, "the value of the dict's item 1 cannot be pickled"),
    ({object(): 1}, "a dict key of type object has no hash that is the same in every process"),
    (OrderedDict(a=1), "OrderedDict is a dict subclass"),
    (namedtuple("P", "x")(1), "P is a tuple subclass"),
    ({1, 2}, "torchfeed.share takes a list, tuple, dict, numpy array or CPU tensor"),
    (lambda: "text", "or a callable returning one\\), not a str"),
    ([1, torchfeed.share([2])], "item 1 of the list cannot be pickled: a shared container cannot hold another"),
])
def test_bad_input_is_named_and_leaves_nothing(bad, message):
    # Only this call's memory is looked at (its unique name): a container an
    # earlier test in this process dropped may be freed by the collection below.
    name = unique("bad")
    with pytest.raises(TypeError, match=message):
        torchfeed.share(bad, name=name)
    gc.collect()
    assert [link for link in my_share_fds() if name in link] == []


def test_group_needs_a_name_and_an_initialized_process_group():
    with pytest.raises(TypeError, match="group= shares across ranks under a name; pass name="):
        torchfeed.share([1], group=object())
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        torchfeed.share([1], name="x", group=object())
    with pytest.raises(TypeError, match="name must be a str or None, not int"):
        torchfeed.share([1], name=3)


def test_memory_is_freed_with_the_last_reference():
    name = unique("freed")
    shared = torchfeed.share(records(1000), name=name)
    view = shared[:3]
    assert len(holders(name)) == 2  # its descriptor and its mapping
    del shared
    gc.collect()
    assert holders(name) == [] and view == records(3)


# -- handles, not copies ----------------------------------------------------------------


def test_a_handle_crosses_processes_and_pickle_writes_values():
    shared = torchfeed.share(records(20_000))
    assert shared.nbytes > 1_000_000
    handle = ForkingPickler.dumps(shared)
    assert len(handle) < 1000
    assert len(ForkingPickler.dumps(torchfeed.share({i: i for i in range(50_000)}))) < 1000
    stored = pickle.dumps(shared)  # any other pickler: the plain list, values and all
    back = pickle.loads(stored)
    assert type(back) is list and back == records(20_000)


@pytest.mark.timeout(120)
@in_a_fresh_process
def test_saved_with_torch_save_loads_as_plain_values_even_weights_only(loaded_in_a_fresh_process):
    assert loaded_in_a_fresh_process["saved"] == [True, True, True, "list", "dict", "ndarray"]


def small_shared():
    return {"list": torchfeed.share(records(2000)),
            "dict": torchfeed.share({i: str(i) for i in range(50)}),
            "array": torchfeed.share(np.arange(100.0)),
            "tensor": torchfeed.share(torch.arange(100))}


def run_child(ctx, target, args, answers=1):
    """Start ``target(*args, queue)`` in a child of ``ctx``; return what it put."""
    queue = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, queue))
    child.start()
    try:
        return [queue.get(timeout=90) for _ in range(answers)]
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
        queue.close()


READ_N = 100_000  # records the reading child reads


@pytest.fixture(scope="module")
def spawned_child():
    """One spawned child (a fresh interpreter importing torch) does what both spawn cases
    below check: it reports what it was given and the memory behind it, then reads
    every record of a large shared list and reports how much its private memory grew."""
    shared = small_shared()
    shared["large"] = torchfeed.share(records(READ_N))
    seen, read = run_child(mp.get_context("spawn"), report_then_read,
                           (shared["list"], shared["dict"], shared["array"], shared["tensor"],
                            shared["large"]), answers=2)
    return shared, seen, read


# the spawn cases of the next two tests share one spawned child (spawned_child)
ONE_SPAWNED_CHILD = pytest.mark.xdist_group("share_spawned_child")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=ONE_SPAWNED_CHILD),
                                    "forkserver"])
def test_child_processes_map_the_same_memory(method, request):
    if method == "spawn":
        shared, seen, _ = request.getfixturevalue("spawned_child")
    else:
        shared = small_shared()
        [seen] = run_child(mp.get_context(method), report,
                           (shared["list"], shared["dict"], shared["array"], shared["tensor"]))
    shared_list = shared["list"]
    tensor_fd, _ = shared["tensor"].untyped_storage()._share_fd_cpu_()
    assert seen["pid"] != os.getpid()
    assert seen["list"] == ["SharedSequence", True, memory_of(shared_list)]
    assert seen["dict"] == ["SharedMapping", True, "7", memory_of(shared["dict"])]
    assert seen["array"] == [True, memory_of(shared["array"])]
    assert seen["tensor"] == [True, identity(tensor_fd)]
    # and through a queue, from this process to itself
    queue = mp.get_context(method).Queue()
    queue.put(shared_list)
    back = queue.get(timeout=30)
    assert back == shared_list and memory_of(back) == memory_of(shared_list)
    queue.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", pytest.param("spawn", marks=ONE_SPAWNED_CHILD)])
def test_reading_copies_nothing_into_the_reader(method, request):
    """Copy-on-read: a forked child reading every dict of a plain list copies
    the pages it touches (reference counts); reading a shared one writes no
    shared page, so the child's private memory (USS) stays flat, even though
    it is the only reader: the process that built the buffer maps all of it,
    so the pages the child maps count as shared."""
    growth = {}
    if method == "spawn":  # spawn pickles a plain list whole before the child starts reading
        _, _, (growth["shared"], total) = request.getfixturevalue("spawned_child")
        assert total == 2 * sum(range(READ_N))
    else:
        plain = records(READ_N)
        shared = torchfeed.share(plain)
        for label, data in (("shared", shared), ("plain", plain)):
            [(growth[label], total)] = run_child(mp.get_context(method), private_growth_reading,
                                                 (data,))
            assert total == 2 * sum(range(READ_N))
    assert growth["shared"] < 4 * 2**20, growth
    if method == "fork":  # the premise: the same reads of the plain list do copy
        assert growth["plain"] > 20 * 2**20, growth


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", START_METHODS)
def test_dataloader_workers_read_the_shared_list(method):
    shared = torchfeed.share(records(64))
    # Each worker gets the dataset the same way; under spawn and forkserver each is a
    # fresh interpreter importing torch, so one shows it there (two forked ones here).
    loader = torchfeed.DataLoader(SharedRecords(shared), batch_size=8,
                                  num_workers=2 if method == "fork" else 1,
                                  multiprocessing_context=method)
    batches = list(loader)
    ids = torch.cat([b[:, 0] for b in batches]).tolist()
    assert ids == list(range(64))
    assert {b[:, 1].unique().item() for b in batches} == {memory_of(shared)[1]}


@pytest.mark.timeout(120)
def test_sigkilled_main_process_leaves_nothing():
    name = unique("killed")
    before = set(os.listdir("/dev/shm"))
    main = subprocess.Popen([sys.executable, str(HERE / "share_helpers.py"), name, "5000"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env=env_with_path(ROOT, HERE))
    try:
        line = main.stdout.readline()
        assert line, "the main process died before it was ready"
        ready = json.loads(line)
        pids = ready["pids"]
        assert len(pids) >= 5, pids  # main + 2 forked + 2 spawned workers
        assert any("maps it" in h for h in holders(name)) and len(holders(name)) >= 5
        os.kill(main.pid, signal.SIGKILL)
        main.wait(10)
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                  for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert left == [], f"processes left after the main process was killed: {left}"
        assert holders(name) == []
        assert not [e for e in set(os.listdir("/dev/shm")) - before if name in e]
    finally:
        try:
            os.killpg(main.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        main.stdout.close()


# -- one copy per machine across ranks ---------------------------------------------------


@pytest.mark.timeout(420)  # the shared world-2 torchrun job runs other modules' scenarios too
@LAUNCHES
def test_two_ranks_on_one_host_map_one_copy(tmp_path_factory):
    # tests/_share_ranks.py, run by both ranks of tests/dist_launches.py's world-2 job
    r0, r1 = ranks_of(tmp_path_factory, "share")
    assert r0["pid"] != r1["pid"]
    for kind in ("list", "dict", "array", "tensor"):
        assert r0[kind]["memory"] == r1[kind]["memory"], kind
        assert all(v for k, v in r0[kind].items() if k in ("equal", "shared")), (kind, r0[kind])
        assert all(v for k, v in r1[kind].items() if k in ("equal", "shared")), (kind, r1[kind])
    assert r0["unnamed"]["memory"] != r1["unnamed"]["memory"]  # no name: each its own
    # the callable ran on the building rank only
    assert (r0["list"]["built"], r1["list"]["built"]) == (True, False)
    # an error on the building rank reaches every rank, so none is left in a collective
    assert r0["errors"]["builder-fails"].startswith("TypeError: torchfeed.share: the value of")
    assert r1["errors"]["builder-fails"].startswith(
        "RuntimeError: torchfeed.share(name=") and "rank 0 of the group" in r1["errors"]["builder-fails"]
    for r in (r0, r1):
        assert r["errors"]["names-differ"].startswith("ValueError: torchfeed.share: the ranks "
                                                      "called share with different names")
        # issue 52: rank 1 passed 4 items and silently got rank 0's 3
        assert r["errors"]["data-differs"].startswith("ValueError: torchfeed.share(name=")
        assert ("the ranks passed different data (rank 0: a list of 3 items"
                in r["errors"]["data-differs"]), r["errors"]["data-differs"]
    # issue 52: rank 0 failed pickling the handle outside the try, and rank 1 waited
    # out the collective's timeout
    assert r0["errors"]["factory-unsendable"].startswith("TypeError: torchfeed.share(name="), r0
    assert "default_factory" in r0["errors"]["factory-unsendable"]
    assert r1["errors"]["factory-unsendable"].startswith("RuntimeError: torchfeed.share(name=")
    # one copy between them: each maps every page, and each page counts half to each
    nbytes = r0["list"]["nbytes"]
    for r in (r0, r1):
        assert r["list"]["rss"] >= nbytes * 0.99
        assert abs(r["list"]["pss"] - r["list"]["rss"] / 2) <= 8192, r["list"]


@pytest.mark.timeout(120)
def test_a_worker_killed_mid_read_holds_nothing_back(tmp_path):
    """NOTE [ Cross-process primitives ]: a worker that dies while it reads a
    shared container leaves the others reading it, and nothing of it behind."""
    name = unique("midread")
    shared = torchfeed.share(records(64), name=name)
    before = len(holders(name))
    loader = torchfeed.DataLoader(DiesMidRead(shared, str(tmp_path / "died"), die_at=21),
                                  batch_size=8, num_workers=2, max_worker_restarts=1)
    with pytest.warns(RuntimeWarning, match="killed by signal SIGKILL.*restarted it"):
        batches = list(loader)
    assert (tmp_path / "died").exists()
    assert torch.cat([b[:, 0] for b in batches]).tolist() == list(range(64))
    assert shared == records(64)
    del loader, batches
    gc.collect()
    assert len(holders(name)) == before  # this process's descriptor and mapping only
