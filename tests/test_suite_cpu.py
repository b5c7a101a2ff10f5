"""``.ci/suite_cpu.py``, the suite's CPU census, on a job of known shape.

The job: a script that runs a fresh interpreter and forks a child that outlives
it.  The census must count those three processes, the orphan included (the tool
is the job's subreaper), and nothing else that ends on the machine meanwhile
(the other pytest workers' processes).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from loader_helpers import ROOT

TOOL = os.path.join(ROOT, ".ci", "suite_cpu.py")
ACTIVE_ENV = "TORCHFEED_SUITE_CPU_ACTIVE"
JOB = """
import os, subprocess, sys, time
subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0)"], check=True)
if os.fork() == 0:  # outlives the script: reparented to the tool, and still counted
    time.sleep(1.0)
    os._exit(0)
sys.exit(3)
"""
ROW = re.compile(r"^ +[\d.]+ +[\d.]+% +(\d+)  (.+)$", re.M)


@pytest.mark.timeout(60)
def test_census_counts_every_process_of_the_job_and_only_those():
    if os.environ.get(ACTIVE_ENV):
        pytest.skip("this run is being counted by .ci/suite_cpu.py, and the machine has one "
                    "accounting file: a nested count would end the outer one")
    run = subprocess.run([sys.executable, TOOL, "--list", "the tests' fresh scripts",
                          sys.executable, "-c", JOB], capture_output=True, text=True, timeout=50)
    if "acct(2) failed" in run.stderr:
        pytest.skip(f"process accounting is not available here: {run.stderr.strip()}")
    assert run.returncode == 3, run.stdout + run.stderr  # the job's own exit status
    assert re.search(r": exit 3, \d+ s wall, \d+ CPU-seconds in 3 processes$", run.stdout,
                     re.M), run.stdout
    assert dict((kind, int(n)) for n, kind in ROW.findall(run.stdout)) == {
        "the tests' fresh scripts": 2, "forked by the tests' fresh scripts": 1}, run.stdout
    listed = [line for line in run.stdout.splitlines() if line.startswith("  ") and " -c " in line]
    assert len(listed) == 2 and any("time.sleep(1.0)" in line for line in listed), run.stdout


@pytest.mark.timeout(30)
def test_a_nested_census_is_refused():
    run = subprocess.run([sys.executable, TOOL, sys.executable, "-c", "pass"],
                         env={**os.environ, ACTIVE_ENV: "1"}, capture_output=True, text=True,
                         timeout=20)
    assert run.returncode != 0
    assert f"{ACTIVE_ENV} is set: a suite_cpu.py run is counting already" in run.stderr
