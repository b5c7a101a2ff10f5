"""A fresh process that resumes from state files: tests/test_streaming_libraries.py.

Usage: python _streaming_resume.py CASES_JSON OUT_JSON

Each case names a library, its data folder, a loader's arguments and a state
file; this process builds the loader anew, loads the state and writes what the
rest of its epochs yield.  A
case with ``"own": true`` does the same with the library's StreamingDataLoader.
"""
import json
import sys

import streaming_data as sd
import torch


def main(cases_path, out_path):
    from torchfeed import DataLoader

    with open(cases_path) as f:
        cases = json.load(f)
    out = []
    for case in cases:
        dataset = sd.make_dataset(case["lib"], case["root"])
        if case.get("own"):
            loader = sd.library_loader(case["lib"], dataset, **case["kwargs"])
            with open(case["state"]) as f:
                loader.load_state_dict(json.load(f))
        else:
            loader = DataLoader(dataset, **case["kwargs"])
            loader.load_state_dict(torch.load(case["state"], weights_only=True))
        out.append([[sd.xs(b) for b in loader] for _ in range(case["epochs"])])
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        del loader, dataset
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
