"""Datasets for ``test_scale.py`` that workers started by spawn or a fork
server import by name: a module of its own, that records which process
imported it."""
from __future__ import annotations

import os

import psutil
import torch.utils.data

IMPORTED_IN = os.getpid()  # the process that ran this module's code


class ImportProbe(torch.utils.data.Dataset):
    """Says which process imported this module and whether the worker's parent
    (the fork server, under forkserver) has torch's library mapped."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        parent = psutil.Process(os.getppid())
        return {"imported_in": IMPORTED_IN, "pid": os.getpid(), "ppid": parent.pid,
                "parent_has_torch": any("libtorch" in m.path for m in parent.memory_maps())}
