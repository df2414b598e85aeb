#!/usr/bin/env bash
# Installs torch_reccl and runs the failover demo.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q --no-build-isolation -e .
python examples/failover_demo.py
