"""One rank of a real gloo process group: what tests/test_torch_fidelity.py checks of
datapipes across ranks.

tests/_dist_ranks.py runs ``run(OUT_DIR)`` in the two ranks of its world-2 launch
(one torchrun job for several test modules); standalone:

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/_dist_datapipes.py OUT_DIR

Iterates an IterDataPipe with ``shuffle().sharding_filter()`` through torch's
DataLoader and torchfeed's, at 0 and 2 workers, each rank with a generator
seeded differently: torch broadcasts rank 0's shared seed, so every rank
shuffles the same way and each keeps its own share.  Writes
OUT_DIR/rank{RANK}.json: ``{loader: {num_workers: [batch, ...]}}``.
"""
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data.datapipes.iter import IterableWrapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfeed  # noqa: E402

N = 20


def run(out: Path) -> None:
    """The scenario, in a process group already set up (gloo)."""
    out.mkdir(exist_ok=True)
    rank = dist.get_rank()
    result = {}
    for name, cls in (("torch", torch.utils.data.DataLoader), ("torchfeed", torchfeed.DataLoader)):
        result[name] = {}
        for num_workers in (0, 2):
            generator = torch.Generator()
            generator.manual_seed(100 + rank)  # differs per rank; rank 0's seed wins
            pipe = IterableWrapper(range(N)).shuffle().sharding_filter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch's datapipe deprecation notices
                loader = cls(pipe, batch_size=2, num_workers=num_workers, generator=generator)
                result[name][num_workers] = [b.tolist() for b in loader]
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run(Path(sys.argv[1]))
    dist.destroy_process_group()
