"""Filesystem rules of output paths: what can be a file name at all, a video's name from its prompt and seed, and
whether the folder it would go to can take it (checked before any work)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import tempfile
import unicodedata
from pathlib import Path

from distvideo.errors import ConfigError, LoraError

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes in a folder
NAME_MAX = 255  # bytes of one path component on Linux file systems
PATH_MAX = 4096


def path_problem(path: str) -> str | None:
    """Why `path` cannot be a file name at all (NUL byte, over-long component or path), or None."""
    if "\x00" in path:
        return "contains a NUL byte"
    if len(os.fsencode(path)) >= PATH_MAX:
        return f"is {len(os.fsencode(path))} bytes long; paths are limited to {PATH_MAX - 1}"
    for part in Path(path).parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return f"has a name of {len(os.fsencode(part))} bytes ({part[:20]}...); names are limited to {NAME_MAX}"
    return None


_MAX_STEM = 60


def sanitize_prompt(prompt: str) -> str:
    """A file-name-safe stem from a prompt: its words transliterated to ASCII (anyascii: 'Кошка' -> 'koshka',
    '日本' -> 'riben') and joined by '_', at most 60 characters. A prompt that is not plain ASCII also gets 8 hex
    digits of its hash, so two prompts that read alike in ASCII keep apart names."""
    from anyascii import anyascii

    normalized = unicodedata.normalize("NFC", prompt)
    words = re.findall(r"[A-Za-z0-9]+", anyascii(normalized).lower())
    stem = "_".join(words)[:_MAX_STEM].strip("_") or "video"
    if not normalized.isascii():
        stem = f"{stem[: _MAX_STEM - 9]}_{hashlib.sha256(normalized.encode()).hexdigest()[:8]}"
    return stem


def resolve_output_path(output: str | None, prompt: str, seed: int, default_dir: str = "outputs") -> Path:
    """`output` ending in .mp4 is a file; otherwise (or None) a folder where the name comes from the
    prompt and seed. Never an existing entry (a dangling symlink counts): `_1`, `_2`, ... are appended until the
    name is free."""
    if output is not None and output.lower().endswith(".mp4"):
        target = Path(output)
    else:
        folder = Path(output) if output else Path(default_dir)
        target = folder / f"{sanitize_prompt(prompt)}_seed{seed}.mp4"
    return first_free(target)


def first_free(target: Path) -> Path:
    if not os.path.lexists(target):
        return target
    n = 1
    while True:
        candidate = target.with_name(f"{target.stem}_{n}{target.suffix}")
        if not os.path.lexists(candidate):
            return candidate
        n += 1


def check_output_target(target: Path, name: str = "output_path", *, keep_folder: bool = False) -> None:
    """Refuse (ConfigError, naming the parameter `name`) an output the writer could not create, before any work: a
    folder that is a file, a folder or the nearest existing ancestor not writable, a name too long for the file
    system. Permission bits do not prove it (root passes `os.access` on a read-only mount or on /sys), so the folder
    is made as the writer would make it and a file created in it, exclusively; both are removed again, unless
    `keep_folder` (a batch, whose ranks all check its folder at once: one's removal would pull it from under
    another's probe)."""
    problem = path_problem(str(target))
    if problem:
        raise ConfigError(f"{name} {str(target)!r}: {problem}")
    folder = target.parent
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name} {str(target)!r}: {existing} is not a folder")
    what = "the folder" if existing == folder else f"{existing}, where its folder would be created,"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{name} {str(target)!r}: {what} is not writable by this user")
    _prove_writable(folder, f"{name} {str(target)!r}: {what} is not writable", keep_folder)


def _prove_writable(folder: Path, refusal: str, keep_folder: bool) -> None:
    """Make `folder` with its parents and an exclusive temporary file in it, and remove the file; remove the folders
    this made too when it fails or unless `keep_folder`. ConfigError(`refusal` and the OS's reason) when either
    cannot be made."""
    for attempt in range(3):
        missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]  # the deepest first
        failure: OSError | None = None
        try:
            os.makedirs(folder, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".distvideo-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:  # FileNotFoundError: another process's check removed the folder it made: again
            failure = exc
        if failure is None and keep_folder:
            return
        for parent in missing:
            with contextlib.suppress(OSError):  # another writer's file in it meanwhile: theirs
                os.rmdir(parent)
        if failure is None:
            return
        if not isinstance(failure, FileNotFoundError) or attempt == 2:
            raise ConfigError(f"{refusal} ({failure.strerror or failure})") from None


def resolve_lora_path(path: str | Path) -> Path:
    """The .safetensors file behind a LoRA path (a file, or a folder holding diffusers'
    pytorch_lora_weights.safetensors or exactly one .safetensors file); a LoraError naming the path when there is
    none. Reads no file, imports no torch: the CLI and the API call it before any rank starts or weight loads."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LoraError(f"LoRA file {str(p)!r} does not exist on host {socket.gethostname()}")
    if p.is_dir():
        if (p / LORA_WEIGHT_NAME).is_file():
            return (p / LORA_WEIGHT_NAME).resolve()
        candidates = sorted(c for c in p.glob("*.safetensors") if c.is_file())
        if len(candidates) == 1:
            return candidates[0].resolve()
        shown = ", ".join(c.name for c in candidates[:5]) or "none"
        raise LoraError(
            f"LoRA path {str(p)!r} is a folder with {len(candidates)} .safetensors files ({shown}); "
            "pass the adapter's .safetensors file itself"
        )
    return p.resolve()


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` atomically: a new temporary file beside it (created exclusively, so a symlink planted
    there is never followed, and named for this call, so two writers never share one), renamed over `path` (which
    replaces a symlink at `path` itself, not its target). The file is readable by all (0644), as a plain write gives
    under the usual umask."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
