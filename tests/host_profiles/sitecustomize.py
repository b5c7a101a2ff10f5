"""Installs a simulated host (``torchfeed_host_profile.py``) in every interpreter
started with this folder on ``PYTHONPATH`` and ``TORCHFEED_HOST_PROFILE`` set to
``macos`` or ``windows``: the tests' own, and the DataLoader workers they spawn.
Without the variable it does nothing."""
import os

if os.environ.get("TORCHFEED_HOST_PROFILE"):
    import torchfeed_host_profile

    torchfeed_host_profile.install(os.environ["TORCHFEED_HOST_PROFILE"])
