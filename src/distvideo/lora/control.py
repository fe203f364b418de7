"""The caller's side of LoRA changes: each one is a transaction over every rank through `collective_rpc`.

``set_lora_adapter`` runs in two phases. Phase 1 (prepare) has every rank load and check the adapter without touching
a weight; only when every rank succeeded, and all of them read the same bytes, does phase 2 (commit) change the
weights. Otherwise every rank drops what it prepared and raises the same error naming the failing ranks. A change
that fails in phase 2 (or a merge/unmerge/clear that fails) on some rank is rolled back on every rank.

`executor` is a :class:`~distvideo.lora.protocols.LoraExecutor` (`collective_rpc`, `ensure_consistent`, `world_size`,
`is_output_rank`): this package sits below the executors and imports nothing from them.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from distvideo.lora import rank as on_rank
from distvideo.lora.formats import LoraError
from distvideo.lora.protocols import LoraExecutor

logger = logging.getLogger(__name__)

_USER_ERRORS = {"LoraError"}  # error types of a rank that are the user's to fix (the CLI exits 2)


def check_arguments(nickname: Any, path: Any, strength: Any, accumulate: Any) -> tuple[str, str | None, float, bool]:
    if not isinstance(nickname, str) or not nickname.strip():
        raise LoraError(f"set_lora_adapter: nickname must be a non-empty text, got {nickname!r}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise LoraError(f"set_lora_adapter({nickname!r}): path must be a file path or None, got {path!r}")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise LoraError(f"set_lora_adapter({nickname!r}): strength must be a finite number, got {strength!r}")
    if not isinstance(accumulate, bool):
        raise LoraError(f"set_lora_adapter({nickname!r}): accumulate must be True or False, got {accumulate!r}")
    resolved = os.path.abspath(Path(os.fspath(path)).expanduser()) if path is not None else None
    return nickname, resolved, float(strength), accumulate


def check_target(nickname: Any, target: Any) -> None:
    if target not in on_rank.TARGETS:
        raise LoraError(
            f"set_lora_adapter({nickname!r}): target must be one of {', '.join(on_rank.TARGETS)} (transformer_2: "
            f"the low-noise expert of a two-expert model), got {target!r}"
        )


def set_lora_adapter(
    executor: LoraExecutor,
    nickname: str,
    path: str | os.PathLike[str] | None,
    strength: float,
    accumulate: bool,
    target: str = "transformer",
) -> None:
    try:
        checked, invalid = check_arguments(nickname, path, strength, accumulate), None
        check_target(nickname, target)
    except LoraError as exc:
        checked, invalid = None, exc
    if checked is not None:
        nickname, resolved, strength, accumulate = checked
    # Paths may differ per rank (node-local copies); what must agree is the call, whether its arguments were valid
    # (so arguments refused on one rank only are refused on every rank, none left waiting in a collective), and
    # (checked below) the bytes read.
    executor.ensure_consistent(
        "set_lora_adapter",
        {
            "call": "set_lora_adapter",
            "nickname": nickname,
            "strength": strength,
            "accumulate": accumulate,
            "target": target,
            "loads_file": path is not None,
            "invalid_arguments": None if invalid is None else str(invalid),
        },
    )
    if invalid is not None:
        raise invalid
    what = f"set_lora_adapter({nickname!r})" if target == "transformer" else f"set_lora_adapter({nickname!r}, {target})"
    try:
        described = executor.collective_rpc(
            on_rank.prepare_adapter, args=(nickname, resolved, strength, accumulate, target)
        )
    except Exception as exc:
        _abort(executor)
        user_error = _user_error(exc, what, executor.world_size)
        if user_error is None:
            raise
        raise user_error from exc
    if len({d["sha256"] for d in described}) > 1:
        _abort(executor)
        lines = [f"{what}: the ranks read different files; no rank changed its weights:"]
        lines += [f"  rank {r}: {d['path']} (sha256 {d['sha256'][:12]})" for r, d in enumerate(described)]
        lines.append("Give every rank the same adapter file (the same bytes; the paths may differ).")
        raise LoraError("\n".join(lines))
    state = _transition(executor, on_rank.commit_adapter, what)
    if target != "transformer":
        state = state[target]
    if executor.is_output_rank:
        d = described[0]
        logger.info(
            "LoRA %r active%s at strength %g (%d layers, rank %d, %s)%s: %s",
            nickname,
            "" if target == "transformer" else f" on {target}",
            strength,
            d["layers"],
            d["rank"],
            d["layout"],
            f", stacked on {len(state['active']) - 1} more" if len(state["active"]) > 1 else "",
            d["path"],
        )


def merge_weights(executor: LoraExecutor) -> None:
    _change(executor, "merge_lora_weights", on_rank.merge_weights)


def unmerge_weights(executor: LoraExecutor) -> None:
    _change(executor, "unmerge_lora_weights", on_rank.unmerge_weights)


def clear_adapters(executor: LoraExecutor) -> None:
    _change(executor, "clear_lora_adapters", on_rank.clear_adapters)


def remove_adapter(executor: LoraExecutor, nickname: str) -> None:
    """Drop a cached, inactive adapter on every rank (no weights change)."""
    if not isinstance(nickname, str):
        raise LoraError(f"remove_lora_adapter: nickname must be a text, got {nickname!r}")
    executor.ensure_consistent("remove_lora_adapter", {"call": "remove_lora_adapter", "nickname": nickname})
    try:
        executor.collective_rpc(on_rank.remove_adapter, args=(nickname,))
    except Exception as exc:
        user_error = _user_error(exc, f"remove_lora_adapter({nickname!r})", executor.world_size)
        if user_error is None:
            raise
        raise user_error from exc


def _change(executor: LoraExecutor, what: str, fn: Callable[..., Any]) -> None:
    executor.ensure_consistent(what, {"call": what})
    _transition(executor, fn, what)


def _transition(executor: LoraExecutor, fn: Callable[..., Any], what: str) -> dict[str, Any]:
    """Run a weight-changing step on every rank; if it fails anywhere, every rank returns to its previous state."""
    try:
        results = executor.collective_rpc(fn)
    except Exception as exc:
        try:
            executor.collective_rpc(on_rank.rollback)
        except Exception as again:
            raise RuntimeError(
                f"{what} failed ({exc}) and rolling the other ranks back failed too ({again}); the ranks' weights may "
                "now differ: create a new VideoGenerator"
            ) from exc
        raise
    return results[0]


def _abort(executor: LoraExecutor) -> None:
    try:
        executor.collective_rpc(on_rank.abort_adapter)
    except Exception:  # a rank that cannot even drop its prepared state is gone; the first error says why
        logger.debug("dropping the prepared LoRA change failed", exc_info=True)


def _user_error(exc: BaseException, what: str, world_size: int) -> LoraError | None:
    """One LoraError (the same words on every rank) when every failing rank failed on a user mistake."""
    failures: dict[int, tuple[str, str]] | None = getattr(exc, "failures", None)
    if not failures or not all(kind in _USER_ERRORS for kind, _ in failures.values()):
        return None
    if world_size == 1:
        message = f"{what} failed; the weights are unchanged: {failures[min(failures)][1]}"
    else:
        ranks = ", ".join(str(r) for r in sorted(failures))
        lines = [f"{what} failed on rank(s) {ranks} of {world_size}; no rank changed its weights:"]
        lines += [f"  rank {r}: {message}" for r, (_, message) in sorted(failures.items())]
        message = "\n".join(lines)
    error = LoraError(message)
    error.failures = failures  # type: ignore[attr-defined]
    return error
