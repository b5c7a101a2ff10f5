"""The documentation holds together: no test here starts a process.

- Every ```python block of README.md and docs/ compiles, and every runnable
  example (a block whose first line names a file) is run by a test, the same
  text wherever it stands (tests/doc_examples.py).
- The API reference (docs/reference/) has an entry for every public name, and
  the public names' docstrings say what each takes and raises.
- The version has one source: ``torchfeed.__version__``, which setup.cfg reads
  and CHANGELOG.md's latest release names.

The site's strict build (broken links, missing anchors) is CI's
``mkdocs build --strict`` (.ci/run); its packages are the ``docs`` extra, not
the tests'.
"""
from __future__ import annotations

import ast
import configparser
import inspect
import os
import re
import shutil

import pytest
import test_readme
from doc_examples import DOCS, ROOT, doc_python_block, python_blocks

import torchfeed
import torchfeed.distributed

# The examples and the test that runs each as written.
RUN_BY = {**{name: "tests/test_readme.py (one interpreter)" for name in test_readme.EXAMPLES},
          "train_ddp.py": "tests/test_readme.py (torchrun, world 2 then 1)",
          "feed_gpu.py": "tests/test_gpu_feed.py (on a CUDA machine)"}


def test_every_python_block_compiles():
    blocks = python_blocks()
    # the premise: the collector reads both the README and the site's pages
    assert any(b.path == "README.md" for b in blocks)
    assert sum(b.path.startswith("docs") for b in blocks) > 10
    for block in blocks:
        try:
            ast.parse(block.code, filename=block.path)
        except SyntaxError as exc:
            pytest.fail(f"{block.path}:{block.line + (exc.lineno or 0)}: {exc.msg}")


def test_every_runnable_example_is_run_by_a_test_and_reads_the_same_everywhere():
    named = {b.name for b in python_blocks() if b.name is not None}
    assert named == set(RUN_BY), (
        f"examples no test runs: {sorted(named - set(RUN_BY))}; "
        f"tests of examples that are gone: {sorted(set(RUN_BY) - named)}")
    for name in named:
        doc_python_block(f"# {name}")  # asserts one text for the name


def test_a_named_example_that_differs_between_two_pages_is_caught(tmp_path, monkeypatch):
    import doc_examples

    shutil.copytree(DOCS, tmp_path / "docs")
    quickstart = doc_python_block("# quickstart.py")
    (tmp_path / "docs" / "page.md").write_text(
        "```python\n" + quickstart.replace("num_workers=1", "num_workers=3") + "```\n")
    monkeypatch.setattr(doc_examples, "DOCS", str(tmp_path / "docs"))
    with pytest.raises(AssertionError, match="differ"):
        doc_python_block("# quickstart.py")


def _reference_text() -> str:
    folder = os.path.join(DOCS, "reference")
    return "\n".join(open(os.path.join(folder, f), encoding="utf-8").read()
                     for f in sorted(os.listdir(folder)) if f.endswith(".md"))


def test_the_api_reference_has_an_entry_for_every_public_name():
    reference = _reference_text()
    entries = set(re.findall(r"^::: ([\w.]+)$", reference, re.M))
    entries |= set(re.findall(r"^\s+heading: ([\w.]+)$", reference, re.M))
    entries |= set(re.findall(r"^## (torchfeed\.\w+)$", reference, re.M))
    public = {f"torchfeed.{name}" for name in torchfeed.__all__}
    public |= {f"torchfeed.distributed.{name}" for name in torchfeed.distributed.__all__
               if name != "DistributedSampler"}
    assert public <= entries, f"no API reference entry for {sorted(public - entries)}"
    for cli in ("torchfeed.tune.__main__:build_parser", "torchfeed.bench.__main__:build_parser"):
        assert f"<!-- argparse: {cli} -->" in reference


def _ours() -> dict:
    """torchfeed's own public callables (torch's re-exports have torch's docstrings)."""
    names = {f"torchfeed.{n}": getattr(torchfeed, n) for n in torchfeed.__all__}
    names.update({f"torchfeed.distributed.{n}": getattr(torchfeed.distributed, n)
                  for n in torchfeed.distributed.__all__})
    names["torchfeed.tune"] = torchfeed._tuner.tune  # the module, where torchfeed.tune is imported
    return {k: v for k, v in names.items()
            if getattr(v, "__module__", "").startswith("torchfeed")}


@pytest.mark.parametrize("name", sorted(_ours()))
def test_a_public_name_says_what_it_takes_and_raises(name):
    obj = _ours()[name]
    doc = inspect.getdoc(obj) or ""
    assert len(doc.split("\n\n")[0]) > 20, f"{name}: no summary"
    if isinstance(obj, type) and issubclass(obj, Warning):
        return  # a category: it takes a message and raises nothing
    takes = [p for p in inspect.signature(obj).parameters if p not in ("self", "args", "kwargs")]
    if takes and name not in ("torchfeed.SharedSequence", "torchfeed.SharedMapping"):
        assert "\nArgs:\n" in doc, f"{name} takes {takes}; its docstring has no Args: section"
    if name != "torchfeed.distributed.rank_and_world_size":  # raises nothing of its own
        assert "\nRaises:\n" in doc, f"{name}: its docstring has no Raises: section"


def test_the_version_has_one_source():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    assert config["metadata"]["version"] == "attr: torchfeed.__version__"
    assert re.fullmatch(r"\d+\.\d+\.\d+", torchfeed.__version__)
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        released = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d\d-\d\d$", f.read(), re.M)
    assert released and released[0] == torchfeed.__version__, (
        f"CHANGELOG.md's latest release is {released[:1]}, torchfeed.__version__ is "
        f"{torchfeed.__version__}: move the Unreleased entries under the new version")
