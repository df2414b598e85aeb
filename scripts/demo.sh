#!/usr/bin/env bash
# Installs torch_reccl and runs the drill: a training job in an emulated
# cluster loses a rail and keeps going, bit-identical to a fault-free run.
# Extra arguments go to `reccl drill` (e.g. --fault, --duration, --plot).
set -euo pipefail
cd "$(dirname "$0")/.."
# torch only where there is none: a torch the user already has stays (a GPU build, say).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q --no-build-isolation -e '.[fabric,plot]'
python -m torch_reccl drill --verify "$@"
