"""The README's benchmark table: the same run as ``python -m torchfeed.bench``.

Every option of ``python -m torchfeed.bench`` works here (``--help`` lists
them); the logic lives in ``torchfeed/bench/``.  Run from the repository root:

    python benchmarks/side_by_side.py --workloads image,dict30 --json out.json
"""
import os
import sys

# Runnable from a checkout without installing torchfeed.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from torchfeed.bench.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
