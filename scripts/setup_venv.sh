#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 and install mtp_jax (editable) with the given extras.
# Usage: scripts/setup_venv.sh [EXTRAS]   e.g. scripts/setup_venv.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "$(scripts/find_python.sh)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${1:+[$1]}"
