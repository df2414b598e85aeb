#!/usr/bin/env bash
# Installs torch_reccl with its test dependencies and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch only where there is none: a torch the user already has stays (a GPU build, say).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q --no-build-isolation -e '.[test]'
python -m pytest -q -p no:cacheprovider tests "$@"
