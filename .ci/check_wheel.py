"""Run by .ci/run with the Python of a venv the wheel was installed into, from a
folder outside the checkout: the installed torchfeed is the wheel's, whole.

Usage: python check_wheel.py WHEEL

Checks that torchfeed and its subpackages (bench, tune) import from the venv,
not from the checkout; that the installed metadata's version is
``torchfeed.__version__``; that the wheel holds the package and no tests; that
the wheel and the sdist beside it hold the LICENSE (setup.cfg's
``license_files``); and that both command lines start.  Exits non-zero, naming what is wrong.
"""
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import zipfile

import torchfeed
import torchfeed.bench
import torchfeed.tune

wheel = sys.argv[1]
prefix = os.path.realpath(sys.prefix)
for module in (torchfeed, torchfeed.bench, torchfeed.tune):
    where = os.path.realpath(module.__file__)
    assert where.startswith(prefix + os.sep), f"{module.__name__} imported from {where}, not {prefix}"
installed = importlib.metadata.version("torchfeed")
assert installed == torchfeed.__version__, f"metadata says {installed}, __version__ {torchfeed.__version__}"
names = zipfile.ZipFile(wheel).namelist()
top = sorted({n.split("/")[0] for n in names})
assert top == ["torchfeed", f"torchfeed-{installed}.dist-info"], f"the wheel holds {top}"
for package in ("torchfeed/bench/", "torchfeed/tune/", "torchfeed/_transport/", "torchfeed/_share/",
                "torchfeed/_ipc/"):
    assert any(n.startswith(package) for n in names), f"the wheel lacks {package}"
# setuptools puts it in .dist-info/licenses/ (PEP 639), older ones in .dist-info/
assert any(n.startswith(f"torchfeed-{installed}.dist-info/") and n.endswith("/LICENSE")
           for n in names), "the wheel holds no LICENSE"
sdist = os.path.join(os.path.dirname(wheel), f"torchfeed-{installed}.tar.gz")
with tarfile.open(sdist) as archive:
    assert f"torchfeed-{installed}/LICENSE" in archive.getnames(), f"{sdist} holds no LICENSE"
for command in ("torchfeed.tune", "torchfeed.bench"):
    subprocess.run([sys.executable, "-m", command, "--help"], check=True, stdout=subprocess.DEVNULL)
print(f"== {os.path.basename(wheel)}: torchfeed {installed} imports from {os.path.dirname(torchfeed.__file__)}")
