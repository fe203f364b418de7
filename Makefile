# Quick start: `make demo` (set up .venv, generate a video with the embedded demo model) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
SRC := src/distvideo

.PHONY: setup system-deps demo test test-fast lint typecheck pytest dist clean

setup:
	@bash scripts/setup_venv.sh

system-deps:
	@bash scripts/install_system_deps.sh

demo: setup
	@$(VENV)/bin/distvideo generate --prompt "a red ball moving right on a black background" --output outputs/ --no-progress

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts examples
	$(VENV)/bin/ruff format --check src tests benchmarks scripts examples

typecheck: setup
	$(VENV)/bin/mypy $(SRC)

pytest: setup system-deps
	$(PY) -m pytest -q --durations=40 tests

test: setup system-deps lint typecheck pytest

# The inner loop: no system packages, no root, no launchers, nothing marked slow (docs: CONTRIBUTING.md)
FAST := not slow and not launcher and not slurm and not mpi and not fuse
test-fast: setup
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q -x -p no:randomly -m "$(FAST)" tests

# The wheel for cluster nodes and images (docs/launching.md, "Installing on cluster nodes"): built with .venv's
# setuptools, no download; build/ goes first so that a module deleted since the last build cannot ride along.
dist: setup
	rm -rf build
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) outputs .pytest_cache .mypy_cache .ruff_cache dist build
