"""``python -m torchfeed.tune MODULE:FACTORY``: the tuner's command line (see ``__main__``).

The tuner itself is :func:`torchfeed.tune`, in :mod:`torchfeed._tuner`.
"""
