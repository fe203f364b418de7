"""Executors: how ranks exist (in process, spawned, or started by a launcher) and how one call reaches all."""

from distvideo.executors.base import Executor, RankFailure, RankStatus, collective_error

__all__ = ["Executor", "RankFailure", "RankStatus", "collective_error"]
