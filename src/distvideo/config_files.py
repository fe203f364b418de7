"""Config files (YAML or JSON) parsed strictly into checked engine and request values: a key is an option's name or
one of its aliases (config.ALIASES: `steps` for num_inference_steps); an unknown key names its dotted path and the
nearest known one, a value of the wrong type names the key, the value and the expected type."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from distvideo.config import (
    LORA_TARGETS,
    EngineConfig,
    LoraSpec,
    did_you_mean,
    keys_of,
    option_fields,
    option_for_key,
)
from distvideo.errors import ConfigError
from distvideo.request import GenerationRequest

_SECTIONS: dict[str, type] = {"engine": EngineConfig, "request": GenerationRequest}


@dataclass(frozen=True)
class ConfigFile:
    """A config file's checked values by option name, {"engine": {...}, "request": {...}}, and the key each option
    was given by in the file (an alias or the name itself), so that errors name it as written."""

    path: str
    values: dict[str, dict[str, Any]]
    keys: dict[str, dict[str, str]]

    def labels(self, section: str) -> dict[str, str]:
        """The section's options as messages name them: `--config c.yaml: request.steps`."""
        return {name: f"--config {self.path}: {section}.{key}" for name, key in self.keys[section].items()}


def load_config_file(path: str | Path) -> dict[str, dict[str, Any]]:
    """Parse a YAML or JSON config file into {"engine": {...}, "request": {...}} of checked values by option name.

    Strict: an unknown key is an error naming its dotted path; a value of the wrong type names the
    key, the value and the expected type.
    """
    return read_config_file(path).values


def read_config_file(path: str | Path) -> ConfigFile:
    """The checked values of a YAML or JSON config file, with the key each option was given by (load_config_file)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        text = p.read_text()
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot parse: {exc}") from None
    except RecursionError:
        raise ConfigError(f"--config {path}: cannot parse: nested too deeply") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping with sections 'engine' and 'request'")
    out: dict[str, dict[str, Any]] = {"engine": {}, "request": {}}
    keys: dict[str, dict[str, str]] = {"engine": {}, "request": {}}
    for section, values in data.items():
        if section not in _SECTIONS:
            hint = did_you_mean(section, _SECTIONS)
            raise ConfigError(
                f"--config {path}: unknown key '{section}'{hint}; top-level keys are {', '.join(sorted(_SECTIONS))}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"--config {path}: '{section}' must be a mapping, got {type(values).__name__}")
        out[section], keys[section] = _check_section(path, section, _SECTIONS[section], values)
    return ConfigFile(str(path), out, keys)


def _check_section(
    path: str | Path, section: str, cls: type, values: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """(the section's checked values by option name, the key each was given by)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in option_fields(cls)]
    checked: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for key, value in values.items():
        dotted = f"{section}.{key}"
        name = option_for_key(str(key), names)
        if name is None:
            raise ConfigError(
                f"--config {path}: unknown key '{dotted}'{did_you_mean(key, names, section + '.')}; known keys: "
                f"{', '.join(sorted(' or '.join(keys_of(name)) for name in names))}"
            )
        if name in keys:
            raise ConfigError(
                f"--config {path}: '{section}.{keys[name]}' and '{dotted}' are the same option ({name}); give one"
            )
        keys[name] = str(key)
        if section == "engine" and name == "lora":
            checked[name] = _parse_lora_list(path, dotted, value)
            continue
        if section == "request" and name == "image":  # a file path in a config file (the API also takes arrays)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"--config {path}: '{dotted}' must be a file path, got {value!r}")
            checked[name] = value
            continue
        checked[name] = _coerce(path, dotted, hints[name], value)
    return checked, keys


def _parse_lora_list(path: str | Path, dotted: str, value: Any) -> list[LoraSpec]:
    items = value if isinstance(value, list) else [value]
    specs = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            specs.append(LoraSpec.parse(item, given=f"--config {path}: '{dotted}[{i}]'"))
        elif (
            isinstance(item, dict) and set(item) <= {"path", "strength", "target"} and isinstance(item.get("path"), str)
        ):
            strength = item.get("strength", 1.0)
            if isinstance(strength, bool) or not isinstance(strength, (int, float)):
                raise ConfigError(f"--config {path}: '{dotted}[{i}].strength' must be a number, got {strength!r}")
            target = item.get("target", "transformer")
            if target not in LORA_TARGETS:
                raise ConfigError(
                    f"--config {path}: '{dotted}[{i}].target' must be one of {LORA_TARGETS}, got {target!r}"
                )
            specs.append(LoraSpec(path=item["path"], strength=float(strength), target=target))
        else:
            raise ConfigError(
                f"--config {path}: '{dotted}[{i}]' must be 'PATH[:STRENGTH]' or {{path: ..., strength: ..., target: ...}}, "
                f"got {item!r}"
            )
    return specs


def _coerce(path: str | Path, dotted: str, hint: Any, value: Any) -> Any:
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"--config {path}: '{dotted}' must not be null")
    for kind in allowed:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed if k is not type(None))
    raise ConfigError(f"--config {path}: '{dotted}' must be {names}, got {value!r}")
