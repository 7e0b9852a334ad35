#!/usr/bin/env bash
# The test command (README): installs xpu-serve with its test tools into .venv, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e '.[dev]'
exec .venv/bin/python -m pytest -q "$@"
