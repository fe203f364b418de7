"""Generic code names no model family (issue 50): in the layers below the family packages (models/, lora/, parallel/,
pipelines/) and in engine.py, worker.py and executors/, no identifier or string other than a docstring names Wan or
HunyuanVideo. The modules that still do are listed with the reason, and the list may only shrink: a module that no
longer names one must leave it (the test fails until it does), a new one fails the test. The check is also run on a
small tree, so it is seen to find a name."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "distvideo"
GENERIC = ("models/", "lora/", "parallel/", "pipelines/", "executors/", "engine.py", "worker.py")
# "Wan" or "wan" as a word or a prefix of a name (WanTransformer3DModel, wan_qkv, Wan2.1), not "wanted"
FAMILY_NAME = re.compile(r"Wan(?![a-z])|(?<![A-Za-z])wan(?![a-z])|WAN|[Hh]unyuan|HUNYUAN")
STILL_NAMING = {
    "models/compat.py": "the one module of private library names, by rule: diffusers' Wan and HunyuanVideo internals",
    "models/embedded.py": "the shipped demo models' names (demo-wan, tiny-wan)",
    "lora/formats.py": "Wan's original and musubi-tuner LoRA key names: to move into families/wan/",
}


def naming_modules(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Generic modules -> the tokens in them that name a family (docstrings and comments left out)."""
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if not rel.startswith(GENERIC):
            continue
        hits = []
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            docstring = token.type == tokenize.STRING and token.string.lstrip("rbfuRBFU").startswith(('"""', "'''"))
            if token.type in (tokenize.NAME, tokenize.STRING) and not docstring and FAMILY_NAME.search(token.string):
                hits.append(token.string)
        if hits:
            found[rel] = hits
    return found


def test_generic_modules_name_no_family():
    assert sorted(naming_modules()) == sorted(STILL_NAMING), naming_modules()


def test_the_check_finds_a_family_name(tmp_path):
    files = {
        "parallel/plan.py": '"""Wan in a docstring is fine."""\n\nPOINTS = {"WanTransformer3DModel": 1}  # named\n',
        "models/ok.py": "wanted = 1  # not a family\n",
        "families/wan/t2v.py": "class WanT2VPipeline: ...\n",  # a family package may name itself
        "worker.py": "def f():\n    return hunyuan_points()\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert naming_modules(tmp_path) == {
        "parallel/plan.py": ['"WanTransformer3DModel"'],
        "worker.py": ["hunyuan_points"],
    }
