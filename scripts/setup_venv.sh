#!/usr/bin/env bash
# Create .venv at the repo root when missing and install distvideo with its test dependencies.
# On a machine without an NVIDIA GPU torch is pinned to the CPU build (constraints-cpu.txt); on a GPU
# machine an already installed torch is kept and otherwise pip's default (CUDA) build is used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.distvideo-installed"
want=$(cat pyproject.toml constraints-cpu.txt constraints-test.txt scripts/setup_venv.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
constraint=()
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    constraint=(-c constraints-cpu.txt)
    if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
        "$VENV/bin/python" -m pip install -q "${constraint[@]}" torch
    fi
fi
"$VENV/bin/python" -m pip install -q "${constraint[@]}" -c constraints-test.txt -e ".[test,ray]"
echo "$want" > "$stamp"
