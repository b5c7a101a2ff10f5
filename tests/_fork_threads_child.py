"""Run by tests/test_fork_threads.py in a fresh interpreter:

    python tests/_fork_threads_child.py

Records the Python threads alive in this process at every ``os.fork()``
(``os.register_at_fork``), while torch's DataLoader and then torchfeed's run
the same scenarios, and prints ``{scenario: {"torch": [...], "torchfeed":
[...]}}`` as JSON: per fork, the sorted thread names.  Python 3.12+ warns at a
fork of a multi-threaded process; torchfeed must never fork with more threads
than torch's loader has at its forks.
"""
import gc
import json
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader as TorchLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # cuda_stubs
import torchfeed  # noqa: E402

_forks: list = []


def _record() -> None:
    _forks.append(sorted(t.name for t in threading.enumerate()))


def _settle() -> None:
    """Let the last run's threads end (a closed queue's feeder thread ends a
    moment after the loader is gone), so each run's forks see its own."""
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)


class Samples(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([i])


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        return iter(range(info.id, 16, info.num_workers))


class KillsOnce(Samples):
    """Worker 1 SIGKILLs itself at sample 5, once (the file says it did)."""

    def __init__(self, marker):
        self.marker = marker

    def __getitem__(self, i):
        if i == 5 and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


def fresh(cls):
    """Fresh workers each epoch; the last epoch's pin thread (with an accelerator)
    must be gone before the next epoch forks, and so must a broken-off epoch's."""
    loader = cls(Samples(), batch_size=2, num_workers=2, pin_memory=True)
    for _ in range(2):
        list(loader)
    for batch in loader:
        break
    list(loader)


def persistent_pin(cls):
    loader = cls(Samples(), batch_size=2, num_workers=2, persistent_workers=True, pin_memory=True)
    for _ in range(2):
        list(loader)


def iterable(cls):
    list(cls(Stream(), batch_size=2, num_workers=2))


def two_loaders(cls):
    """A second loader starts while the first's iterator (pin thread and all) lives."""
    first = iter(cls(Samples(), batch_size=2, num_workers=2, pin_memory=True))
    next(first)
    list(cls(Samples(), batch_size=2, num_workers=2, pin_memory=True))
    del first


def big_tasks(cls):
    """Index lists too big for a direct write: torchfeed's feeder threads."""
    loader = cls(torch.utils.data.TensorDataset(torch.arange(20_000.0)), batch_size=5_000,
                 num_workers=2, persistent_workers=True)
    for _ in range(2):
        list(loader)


SCENARIOS = {"fresh": fresh, "persistent_pin": persistent_pin, "iterable": iterable,
             "two_loaders": two_loaders, "big_tasks": big_tasks}


def restart(marker):
    """torchfeed only: a worker killed, and a replacement forked mid-epoch.
    Batches are dropped as they arrive, so slots are released all along; with
    page-locked slots (stubbed here without CUDA, see ``cuda_stubs.py``), the
    renewal of the dead worker's arena hands its slots to the releaser's
    thread just before the replacement is forked."""
    loader = torchfeed.DataLoader(KillsOnce(marker), batch_size=2, num_workers=2,
                                  pin_memory=True, max_worker_restarts=1)
    for batch in loader:
        del batch


def reading_then_fork():
    """torchfeed only: a reading of the workers' memory (a thread of its own,
    made slow here) runs when a second loader forks its workers."""
    import torchfeed._worker_costs as costs

    read, every = costs.private_bytes, costs.MEMORY_CHECK_EVERY

    def slow_read(pids):
        time.sleep(0.3)
        return read(pids)

    costs.private_bytes, costs.MEMORY_CHECK_EVERY = slow_read, 0.0
    try:
        training = torchfeed.DataLoader(Samples(), batch_size=2, num_workers=1,
                                        persistent_workers=True)
        it = iter(training)
        next(it)
        next(it)  # a reading starts here
        list(torchfeed.DataLoader(Samples(), batch_size=2, num_workers=2))
        list(it)
    finally:
        costs.private_bytes, costs.MEMORY_CHECK_EVERY = read, every


def main(out_dir: str) -> None:
    warnings.simplefilter("ignore")
    # What the imports made lives to the end: each _settle's collection need
    # not walk it again (about 0.1 s apiece with torch imported).
    gc.freeze()
    os.register_at_fork(before=_record)
    result = {}
    for name, scenario in SCENARIOS.items():
        result[name] = {}
        for label, cls in (("torch", TorchLoader), ("torchfeed", torchfeed.DataLoader)):
            _settle()
            _forks.clear()
            scenario(cls)
            result[name][label] = list(_forks)
    _settle()
    _forks.clear()
    restart(os.path.join(out_dir, "killed"))
    result["restart"] = {"torchfeed": list(_forks)}
    _settle()
    _forks.clear()
    reading_then_fork()
    result["reading"] = {"torchfeed": list(_forks)}
    if not torch.cuda.is_available():  # the same with page-locked slots, CUDA stubbed
        import cuda_stubs

        runtime = cuda_stubs.FakeRuntime()
        cuda_stubs.page_lock_slots(setattr, runtime)
        cuda_stubs.pin_thread_on_cpu(setattr)
        _settle()
        _forks.clear()
        restart(os.path.join(out_dir, "killed-locked"))
        result["restart_page_locked"] = {"torchfeed": list(_forks),
                                         "registered": runtime.calls.count(
                                             ("cudaHostRegister", "torchfeed-pin-memory")),
                                         "released_by": sorted({t for c, t in runtime.calls
                                                                if c == "cudaHostUnregister"})}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
