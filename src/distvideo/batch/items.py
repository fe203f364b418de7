"""The items of a batch job: read from a prompt file (plain text, one prompt per line; or JSONL, one object per line)
or given to `generate_batch`, each resolved against the model into a request, with a seed of its own and a
fingerprint of everything that decides its video."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distvideo.config import did_you_mean, keys_of, option_for_key
from distvideo.errors import ConfigError
from distvideo.images import image_fingerprint
from distvideo.models.registry import ModelInfo
from distvideo.models.schedules import SCHEDULE_KEYS
from distvideo.request import GenerationRequest, ResolvedRequest

#: the fields an item may set (JSONL keys, generate_batch mappings); `output` names its video file in the folder
ITEM_FIELDS = (
    "prompt",
    "negative_prompt",
    "seed",
    "num_frames",
    "height",
    "width",
    "num_inference_steps",
    "guidance_scale",
    "guidance_scale_2",
    "image",
    "fps",
    "scheduler",
    "flow_shift",
    "timesteps",
    "sigmas",
    "output",
)
#: the request fields that decide an item's video: a change in any of them redoes the item on resume
DECIDING_FIELDS = (*(f for f in ITEM_FIELDS if f != "output"), "max_sequence_length")
MAX_ITEMS = 1_000_000


@dataclass
class BatchItem:
    """One item: its position in the input, the request it became, or why it could not become one."""

    index: int
    fields: dict[str, Any]
    request: ResolvedRequest | None = None
    error: str | None = None  # a validation failure: the item is recorded as failed, the batch goes on
    fingerprint: str = ""

    @property
    def cost(self) -> int:
        """What the item costs to generate, for balancing replicas: frames x pixels x steps."""
        r = self.request
        return 0 if r is None else r.num_frames * r.height * r.width * r.num_inference_steps

    @property
    def resolved(self) -> ResolvedRequest:
        """The request of an item that became one (every item the batch runs)."""
        if self.request is None:
            raise ValueError(f"batch item {self.index} was refused ({self.error}); it has no request to run")
        return self.request


def derive_seed(batch_seed: int, index: int) -> int:
    """An item's seed when it has none: from the batch seed and its index only, so it is the same whatever the
    layout, the replica or the order."""
    digest = hashlib.sha256(f"distvideo-batch:{batch_seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def read_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """The items of a prompt file: `.jsonl` (or a file whose first non-blank character is `{`) holds one JSON object
    per line; anything else one prompt per line. Blank lines are skipped. A line that is not a JSON object becomes
    an item with `_error`, recorded as failed. Unreadable files are a ConfigError."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--prompts {path}: cannot read it ({exc})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts {path}: holds no prompt")
    if len(lines) > MAX_ITEMS:
        raise ConfigError(f"--prompts {path}: {len(lines)} items; at most {MAX_ITEMS} per job")
    jsonl = p.suffix == ".jsonl" or lines[0][1].lstrip().startswith("{")
    if not jsonl:
        return [{"prompt": line.strip()} for _, line in lines]
    items: list[dict[str, Any]] = []
    for number, line in lines:
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            items.append({"_error": f"line {number}: not JSON ({exc.msg})", "_line": line[:200]})
            continue
        if not isinstance(value, dict):
            items.append({"_error": f"line {number}: expected a JSON object, got {type(value).__name__}"})
            continue
        items.append(value)
    return items


def build_items(
    raw: Iterable[str | Mapping[str, Any]],
    model: ModelInfo,
    *,
    defaults: GenerationRequest,
    batch_seed: int = 0,
) -> list[BatchItem]:
    """Resolve every raw item (a prompt, or a mapping of ITEM_FIELDS) into a request on top of `defaults`, with a
    derived seed where it has none; an item that fails validation keeps its error."""
    items = []
    for index, value in enumerate(raw):
        fields = {"prompt": value} if isinstance(value, str) else dict(value)
        item = BatchItem(index=index, fields=fields)
        try:
            item.request = _request_for(fields, model, defaults, batch_seed, index)
            item.fingerprint = fingerprint(item.request)
        except ConfigError as exc:
            item.error = str(exc)
        items.append(item)
    return items


def _request_for(
    fields: dict[str, Any], model: ModelInfo, defaults: GenerationRequest, batch_seed: int, index: int
) -> ResolvedRequest:
    if "_error" in fields:
        raise ConfigError(str(fields["_error"]))
    named = item_fields(fields)
    given = {k: v for k, v in named.items() if k != "output" and v is not None}
    if "seed" not in given:
        given["seed"] = derive_seed(batch_seed, index)
    output = named.get("output")
    if output is not None and (not isinstance(output, str) or "/" in output or output in ("", ".", "..")):
        raise ConfigError(f"output={output!r}: a file name inside the output folder, without '/'", param="output")
    keys = {option_for_key(key, ITEM_FIELDS) or key: key for key in fields}  # the item's own keys name its fields
    naming = defaults.naming.with_given({name: keys[name] for name in given if name in keys})
    request = dataclasses.replace(defaults, **given, output_path=output, naming=naming)
    return model.resolve_request(request)


def item_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """An item's fields by ITEM_FIELDS name: a key is a field or one of its aliases (`steps`: config.ALIASES); an
    unknown key, or two keys for one field, is a ConfigError naming it."""
    named: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in fields.items():
        name = option_for_key(str(key), ITEM_FIELDS)
        if name is None:
            aliases = ", ".join(f"{alias} for {name}" for name in ITEM_FIELDS for alias in keys_of(name)[1:])
            raise ConfigError(
                f"unknown key {key!r}{did_you_mean(key, ITEM_FIELDS)}; an item may set {', '.join(ITEM_FIELDS)} "
                f"({aliases})"
            )
        if name in named:
            raise ConfigError(f"{keys[name]!r} and {key!r} are the same field ({name}); give one", param=name)
        named[name], keys[name] = value, str(key)
    return named


def fingerprint(request: ResolvedRequest) -> str:
    """sha256 of what decides the item's video (an image by the sha256 of its pixels or file)."""
    decided = {name: getattr(request, name) for name in DECIDING_FIELDS}
    for name in SCHEDULE_KEYS:  # in the fingerprint when set: manifests written before they were options still match
        if decided[name] is None:
            del decided[name]
    decided["image"] = image_fingerprint(request.image)
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()
