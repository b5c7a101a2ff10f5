"""``torchfeed.tune``: both the tuner function and ``python -m torchfeed.tune``.

The tuner is :func:`torchfeed._tuner.tune`, re-exported by ``torchfeed`` as
``torchfeed.tune``.  This package holds its command line (``__main__``).  Both
need the name ``tune``, and importing this package (as ``python -m
torchfeed.tune`` or any ``import torchfeed.tune...`` does) rebinds
``torchfeed.tune`` from the function to this module.  So the module is made
callable with the function's signature: ``torchfeed.tune(dataset, ...)`` works
whichever of the two the name holds.
"""
import inspect
import sys
import types

from .._tuner import TuneResult
from .._tuner import tune as _tune

__all__ = ["TuneResult"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs) -> TuneResult:
        return _tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(_tune)
