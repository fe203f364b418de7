"""Executors: how ranks exist (in process, spawned, or started by a launcher) and how one call reaches all."""

from distvideo.errors import RankFailure
from distvideo.executors.base import CallOptions, Executor, RankStatus, StopToken, collective_error
from distvideo.executors.select import choose_executor, create_executor, resolve_engine

__all__ = [
    "CallOptions",
    "Executor",
    "RankFailure",
    "RankStatus",
    "StopToken",
    "choose_executor",
    "collective_error",
    "create_executor",
    "resolve_engine",
]
