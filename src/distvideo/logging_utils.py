"""Logging for distvideo: one handler on the `distvideo` logger, with the rank in every record."""

from __future__ import annotations

import logging
from typing import Any

from distvideo import envs

_state: dict[str, Any] = {"rank": None, "configured": False}


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _state["rank"]
        record.rank_prefix = f"[rank {rank}] " if rank is not None else ""
        return True


def set_log_rank(rank: int | None) -> None:
    """Prefix records with this rank (done under launchers and in spawned workers)."""
    _state["rank"] = rank


def configure_logging(level: str | None = None) -> None:
    """Attach a stderr handler to the `distvideo` logger once (the library never touches the root logger)."""
    logger = logging.getLogger("distvideo")
    if level is not None or not _state["configured"]:  # a later call without a level keeps the chosen one
        logger.setLevel((level or envs.get("DISTVIDEO_LOG_LEVEL")).upper())
    if _state["configured"]:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(rank_prefix)s%(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_RankFilter())
    logger.addHandler(handler)
    logger.propagate = False
    _state["configured"] = True
