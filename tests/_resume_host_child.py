"""A fresh process that resumes a BucketSampler loader from a state on stdin.

    python _resume_host_child.py NUM_WORKERS EPOCHS < state.json

Its global RNGs are seeded differently from the run that saved the state.
Prints, as json, the batches of EPOCHS epochs and whether the resume left
numpy's and Python's global RNGs where they were.
"""
import json
import random
import sys

import numpy as np
import torch

from torchfeed import DataLoader

from _resume_helpers import BucketSampler, Ids, ids

if __name__ == "__main__":
    num_workers, epochs = int(sys.argv[1]), int(sys.argv[2])
    state = json.load(sys.stdin)
    np.random.seed(4242)
    random.seed(4242)
    torch.manual_seed(4242)
    loader = DataLoader(Ids(23), batch_sampler=BucketSampler(23, 4), num_workers=num_workers)
    loader.load_state_dict(state)
    before = (np.random.get_state()[1].tolist(), random.getstate())
    first = [ids(b) for b in loader]
    untouched = (np.random.get_state()[1].tolist(), random.getstate()) == before
    rest = [[ids(b) for b in loader] for _ in range(epochs - 1)]
    print(json.dumps({"epochs": [first, *rest], "untouched": untouched}))
