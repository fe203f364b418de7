"""Environment variables are read only through distvideo.envs, and docs/env_vars.md lists each one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distvideo import envs

SRC = Path(__file__).resolve().parent.parent / "src" / "distvideo"
DOC = Path(__file__).resolve().parent.parent / "docs" / "env_vars.md"


def test_no_module_but_envs_touches_os_environ():
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "envs.py":
            continue
        text = path.read_text()
        if re.search(r"os\.environ|os\.getenv|os\.putenv|from os import .*environ", text):
            offenders.append(str(path.relative_to(SRC)))
    assert offenders == [], f"read environment variables through distvideo.envs, not directly: {offenders}"


def test_docs_list_every_declared_variable():
    text = DOC.read_text()
    missing = [name for name in envs.REGISTRY if f"`{name}`" not in text]
    assert missing == [], f"docs/env_vars.md lacks {missing}"


def test_undeclared_variable_is_an_error():
    with pytest.raises(KeyError, match="not declared"):
        envs.get("SOME_UNDECLARED_VARIABLE")


def test_parse_and_default(monkeypatch):
    monkeypatch.delenv("DISTVIDEO_NUM_THREADS", raising=False)
    assert envs.get("DISTVIDEO_NUM_THREADS") is None
    monkeypatch.setenv("DISTVIDEO_NUM_THREADS", "3")
    assert envs.get("DISTVIDEO_NUM_THREADS") == 3
    monkeypatch.setenv("DISTVIDEO_NUM_THREADS", "three")
    with pytest.raises(ValueError, match="DISTVIDEO_NUM_THREADS"):
        envs.get("DISTVIDEO_NUM_THREADS")
