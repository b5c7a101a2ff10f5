"""torchfeed: a drop-in replacement for torch.utils.data.DataLoader.

The public surface. (Until the core loader lands, only the distributed sampler.)
"""
from .distributed import DistributedSampler

__all__ = ["DistributedSampler"]
