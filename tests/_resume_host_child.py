"""A fresh process that resumes BucketSampler loaders from states on stdin.

    python _resume_host_child.py < cases.json   # [[state, num_workers], ...]

Its global RNGs are seeded differently from the run that saved the states.
Prints, as json, per case: the first epoch after the resume, and whether the
resume left numpy's and Python's global RNGs where they were.
"""
import json
import random
import sys

import numpy as np
import torch
from _resume_helpers import BucketSampler, Ids, ids

from torchfeed import DataLoader

if __name__ == "__main__":
    results = []
    for state, num_workers in json.load(sys.stdin):
        np.random.seed(4242)
        random.seed(4242)
        torch.manual_seed(4242)
        loader = DataLoader(Ids(23), batch_sampler=BucketSampler(23, 4),
                            num_workers=num_workers)
        loader.load_state_dict(state)
        before = (np.random.get_state()[1].tolist(), random.getstate())
        epoch = [ids(b) for b in loader]
        untouched = (np.random.get_state()[1].tolist(), random.getstate()) == before
        results.append({"epoch": epoch, "untouched": untouched})
    print(json.dumps(results))
