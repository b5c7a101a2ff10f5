"""torchfeed: a drop-in replacement for ``torch.utils.data.DataLoader``.

    from torchfeed import DataLoader

Everything public is re-exported here; the modules behind it are private.
"""
from torch.utils.data import default_collate, default_convert, get_worker_info
from torch.utils.data._utils.worker import WorkerInfo

from ._host import PlatformFallbackWarning
from ._share import SharedMapping, SharedSequence, share
from ._thread_worker import thread_safe_generator
from ._transport._packer import ShmFallbackWarning
from .dataloader import DataLoader
from .distributed import DistributedSampler
from .frameworks import prepare

__all__ = [
    "DataLoader",
    "DistributedSampler",
    "PlatformFallbackWarning",
    "SharedMapping",
    "SharedSequence",
    "ShmFallbackWarning",
    "WorkerInfo",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "prepare",
    "share",
    "thread_safe_generator",
    "tune",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The tuner times loaders through the bench, so importing it eagerly
    # would load torchfeed.bench into every program and every spawned worker.
    if name == "tune":
        from ._tuner import tune

        return tune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
