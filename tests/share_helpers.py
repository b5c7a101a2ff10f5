"""What tests/test_share.py runs in other processes: module-level, so it
pickles by reference under spawn and forkserver without importing the test.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np
import torch
from torch.utils.data import Dataset


def records(n: int) -> list:
    return [{"id": i, "bbox": [i * 0.5, 1.0, 2.0, 3.0], "name": f"r{i}"} for i in range(n)]


def identity(fd: int) -> tuple[int, int]:
    """The memory behind descriptor ``fd``: (device, inode)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def memory_of(shared) -> tuple[int, int]:
    """The identity of the memfd behind a torchfeed.share container or array."""
    buffer = getattr(shared, "shared_buffer", None) or shared._buffer
    return identity(buffer.fd)


def report(shared_list, shared_dict, shared_array, shared_tensor, queue):
    """A child's view of what it was given: values and the memory behind them."""
    tensor_fd, _ = shared_tensor.untyped_storage()._share_fd_cpu_()
    queue.put({
        "pid": os.getpid(),
        "list": [type(shared_list).__name__, shared_list == records(len(shared_list)),
                 memory_of(shared_list)],
        "dict": [type(shared_dict).__name__, shared_dict == {i: str(i) for i in range(50)},
                 shared_dict[7], memory_of(shared_dict)],
        "array": [bool((shared_array == np.arange(100.0)).all()), memory_of(shared_array)],
        "tensor": [torch.equal(shared_tensor, torch.arange(100)), identity(tensor_fd)],
    })


def private_growth_reading(recs, queue):
    """Read every record twice; put how much this process's private memory
    (USS, what stats() and the copy-on-read warning read) grew."""
    import psutil

    me = psutil.Process()
    before = me.memory_full_info().uss
    total = 0
    for _ in range(2):
        for item in recs:
            total += item["id"]
    queue.put((me.memory_full_info().uss - before, total))


def report_then_read(shared_list, shared_dict, shared_array, shared_tensor, large, queue):
    """``report`` on the first four, then ``private_growth_reading`` of ``large``: one
    spawned child for both (a fresh interpreter costs seconds of CPU importing torch)."""
    report(shared_list, shared_dict, shared_array, shared_tensor, queue)
    private_growth_reading(large, queue)


class SharedRecords(Dataset):
    """Sample i is ``[records[i]['id'], inode of the memory records live in]``."""

    def __init__(self, recs):
        self.records = recs

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return torch.tensor([self.records[i]["id"], memory_of(self.records)[1]])


class DiesMidRead(SharedRecords):
    """``SharedRecords`` whose worker SIGKILLs itself once, between reading
    record ``die_at`` out of the shared memory and returning it (``marker``: a
    file that says it already died)."""

    def __init__(self, recs, marker: str, die_at: int):
        super().__init__(recs)
        self.marker, self.die_at = marker, die_at

    def __getitem__(self, i):
        record = self.records[i]
        if i == self.die_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.tensor([record["id"], memory_of(self.records)[1]])


def main_that_gets_killed(name: str, n: int) -> None:
    """Run as a script: share a list under ``name``, put it in two persistent
    workers of each start method, then print what the test needs and sleep
    until SIGKILLed."""
    import psutil

    import torchfeed

    shared = torchfeed.share(records(n), name=name)
    loaders = []
    for method in ("fork", "spawn"):
        loader = torchfeed.DataLoader(SharedRecords(shared), batch_size=4, num_workers=2,
                                      persistent_workers=True, multiprocessing_context=method)
        iterator = iter(loader)
        next(iterator)
        loaders.append((loader, iterator))
    pids = [os.getpid()] + [p.pid for p in psutil.Process().children(recursive=True)]
    print(json.dumps({"pids": pids, "memory": memory_of(shared)}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main_that_gets_killed(sys.argv[1], int(sys.argv[2]))
