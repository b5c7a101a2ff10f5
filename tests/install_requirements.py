"""Installs everything the test suite needs into the Python that runs this script,
so that ``python -m pytest`` then runs every test (the README's test command):

1. torchfeed itself, editable, with its ``test`` extra (setup.cfg), which holds
   every test requirement pip can resolve, the streaming libraries' own
   dependencies included;
2. mosaicml-streaming and litdata with ``--no-deps``.  Both declare torchvision,
   and PyPI's torchvision is built against CUDA torch: beside a CPU torch,
   ``import torchvision`` fails (see tests/streaming_shim/README.md).  pip can
   leave dependencies out only for a whole command, hence a second one.

The torch already installed is kept: it is pinned to its exact version, so that
no requirement can make pip replace it (a CPU build, say, by a several-GB CUDA
one).  Where there is none, .ci/constraints.txt's torch is installed.

Without step 2, tests/test_streaming_libraries.py skips itself and names what is
missing; nothing else depends on it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONSTRAINTS = os.path.join(ROOT, ".ci", "constraints.txt")
# The versions tests/test_streaming_libraries.py is written against.
NO_DEPS = ["mosaicml-streaming==0.13.0", "litdata==0.2.76"]


def torch_pin() -> list[str]:
    try:
        return [f"torch=={metadata.version('torch')}"]
    except metadata.PackageNotFoundError:
        return ["-c", CONSTRAINTS]


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "install", "-q", *args]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def main() -> int:
    try:
        pip("-e", ".[test]", *torch_pin())
        pip("--no-deps", *NO_DEPS)
    except subprocess.CalledProcessError as exc:
        print(f"install_requirements: pip failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    print("installed; now: python -m pytest", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
