"""A script puts its own folder first on sys.path, so a module beside it named like an installed package hides that
package from every library that probes for it. `benchmarks/kernels.py` did: transformers 5.25 installs Hugging
Face's `kernels`, diffusers then found our file under that name and failed to import its Wan transformer (CI, stop
36). Every module of the repo outside the package must keep clear of the names the libraries import or probe."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import diffusers.utils.import_utils
import transformers.utils.import_utils

ROOT = Path(__file__).resolve().parent.parent
# Deliberate: a sitecustomize the fault tests put on PYTHONPATH to patch their child processes.
INTENDED = {"tests/serving_faults/sitecustomize.py"}
PROBE = re.compile(r"""_is_package_available\(\s*["']([A-Za-z0-9_]+)["']""")


def repo_modules() -> dict[str, str]:
    """The repo's Python files outside src/ (scripts, benchmarks, examples, test helpers): stem -> path."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return {
        Path(path).stem: path
        for path in listed.split()
        if (ROOT / path).exists()
        and not path.startswith("src/")
        and not Path(path).stem.startswith("test_")
        and path not in INTENDED
    }


def library_names() -> set[str]:
    """Top-level names of every installed distribution, the ones diffusers and transformers probe for, and the
    standard library's."""
    names = set(importlib.metadata.packages_distributions())
    for module in (diffusers.utils.import_utils, transformers.utils.import_utils):
        names |= set(PROBE.findall(Path(module.__file__).read_text()))
    return names | set(sys.stdlib_module_names)


def test_the_probe_list_is_read():
    # the names this test guards against must come from the libraries' own probes, not from a list kept here
    assert {"kernels", "peft", "accelerate"} <= set(
        PROBE.findall(Path(diffusers.utils.import_utils.__file__).read_text())
    )


def test_no_script_folder_hides_a_library():
    clashes = {stem: path for stem, path in repo_modules().items() if stem in library_names() and stem != "conftest"}
    assert not clashes, f"rename these modules; each hides an installed or probed package of that name: {clashes}"
