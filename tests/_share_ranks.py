"""One rank of a real gloo process group: what tests/test_share.py checks across ranks.

tests/_dist_ranks.py runs ``run(OUT_DIR, TAG)`` in the two ranks of its world-2
launch (one torchrun job for several test modules); standalone:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/_share_ranks.py OUT_DIR TAG

Shares a list (through a callable), a dict, a numpy array and a tensor with
``torchfeed.share(..., name=...)``, and a list without a name, and writes
OUT_DIR/rank{RANK}.json: for each, the identity of the memory this rank maps
(device and inode of its descriptor), whether this rank built it, whether the
values are right, and for the list the Rss and Pss of its mapping after every
rank read every item (two ranks mapping one copy each have Pss = Rss / 2),
and the errors every rank gets when the building rank fails (its data, or its
copy's handle, cannot be sent), the ranks give different names, or different
data under one name.
"""
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfeed  # noqa: E402

N = 20_000


def records():
    return [{"id": i, "bbox": [i * 0.5, 1.0, 2.0, 3.0], "name": f"r{i}"} for i in range(N)]


def identity(fd):
    st = os.fstat(fd)
    return [st.st_dev, st.st_ino]


def mapping_memory(label):
    """Rss and Pss, in bytes, of this process's mappings of memfd ``label``."""
    rss = pss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = f"memfd:{label}" in line
            elif inside and first == "Rss:":
                rss += int(line.split()[1]) * 1024
            elif inside and first == "Pss:":
                pss += int(line.split()[1]) * 1024
    return rss, pss


def run(out: Path, tag: str) -> None:
    """The scenario, in a process group already set up (gloo, two ranks)."""
    out.mkdir(exist_ok=True)
    rank = dist.get_rank()
    res = {"rank": rank, "pid": os.getpid()}
    built = []

    def build():
        built.append(rank)
        return records()

    name = f"{tag}-list"
    shared = torchfeed.share(build, name=name)
    res["list"] = {"type": type(shared).__name__, "memory": identity(shared._buffer.fd),
                   "built": bool(built), "nbytes": shared.nbytes,
                   "equal": shared == records()}
    total = sum(len(item["name"]) for item in shared)  # every record read, every page touched
    res["list"]["read"] = total
    dist.barrier()
    res["list"]["rss"], res["list"]["pss"] = mapping_memory(f"torchfeed-share-{name}")
    dist.barrier()

    table = torchfeed.share({i: f"v{i}" for i in range(100)} | {"key": (1, 2)}, name=f"{tag}-dict")
    res["dict"] = {"memory": identity(table._buffer.fd),
                   "equal": table == ({i: f"v{i}" for i in range(100)} | {"key": (1, 2)}),
                   "lookups": [table[7], list(table["key"])]}

    array = torchfeed.share(np.arange(1000, dtype=np.float32), name=f"{tag}-array")
    res["array"] = {"memory": identity(array.shared_buffer.fd),
                    "equal": bool((array == np.arange(1000, dtype=np.float32)).all())}

    tensor = torchfeed.share(lambda: torch.arange(1000, dtype=torch.int64), name=f"{tag}-tensor")
    fd, _ = tensor.untyped_storage()._share_fd_cpu_()
    res["tensor"] = {"memory": identity(fd), "equal": torch.equal(tensor, torch.arange(1000)),
                     "shared": tensor.is_shared()}

    alone = torchfeed.share(records())  # no name: this rank's own copy, no collective
    res["unnamed"] = {"memory": identity(alone._buffer.fd)}

    errors = {}
    cases = {
        "builder-fails": (lambda: {"key": lambda: 0}, f"{tag}-fails"),
        "names-differ": (records, f"{tag}-name{rank}"),
        # the copy is built, but its handle (with the lambda) cannot be sent
        "factory-unsendable": (lambda: defaultdict(lambda: 0, {"a": 1}), f"{tag}-factory"),
        "data-differs": (records()[:3 + rank], f"{tag}-differs"),
    }
    for case, args in cases.items():
        try:
            torchfeed.share(args[0], name=args[1])
            errors[case] = None
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[case] = f"{type(exc).__name__}: {exc}"
    res["errors"] = errors

    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()


def main():
    dist.init_process_group("gloo")
    run(Path(sys.argv[1]), sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
