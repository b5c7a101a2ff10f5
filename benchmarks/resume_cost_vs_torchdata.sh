#!/usr/bin/env bash
# resume_cost.py with torchdata's StatefulDataLoader beside torchfeed, in the same run.
#
# torchdata is installed for this run only, into a temporary folder that is put
# on PYTHONPATH and removed afterwards; --no-deps keeps pip from pulling a torch
# other than the one installed (StatefulDataLoader needs nothing else).
#
#   bash benchmarks/resume_cost_vs_torchdata.sh [resume_cost.py options]
set -euo pipefail
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python -m pip install -q --no-deps --target "$site" "torchdata==${TORCHDATA_VERSION:-0.11.0}"
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" python "$(dirname "$0")/resume_cost.py" "$@"
