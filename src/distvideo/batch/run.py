"""Running a batch: plan what is left (resume), give each replica its share, write each item's video where its
frames are, and the manifest on world rank 0, item by item, so a stopped job resumes where it was."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from distvideo.batch.assign import assign
from distvideo.batch.items import BatchItem, build_items
from distvideo.batch.manifest import Manifest, file_sha256
from distvideo.media import write_video
from distvideo.models.registry import ModelInfo
from distvideo.paths import check_output_target, path_problem, sanitize_prompt
from distvideo.request import GenerationRequest, ResolvedRequest

if TYPE_CHECKING:
    from distvideo.engine import ResolvedEngine
    from distvideo.executors.store import StoreChannel
    from distvideo.outputs import ItemOutcome
    from distvideo.protocols import EngineHandle

logger = logging.getLogger(__name__)

COLLECT_POLL_S = 0.2  # world rank 0 looks for the other replicas' finished items this often
_jobs = itertools.count()  # batches run by this process: every rank runs the same ones, so the numbers agree


@dataclass
class BatchResult:
    index: int
    status: str  # "done" or "failed"
    video_path: str | None
    seed: int | None
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    frames: np.ndarray | None = None
    resumed: bool = False  # finished by an earlier run of the same job


@dataclass
class BatchPlan:
    folder: Path
    items: list[BatchItem]
    finished: dict[int, dict[str, Any]]  # index -> its manifest record, for items no run needs to redo

    @property
    def todo(self) -> list[BatchItem]:
        return [i for i in self.items if i.request is not None and i.index not in self.finished]

    @property
    def invalid(self) -> list[BatchItem]:
        return [i for i in self.items if i.request is None]


def plan_batch(
    raw: Iterable[str | Mapping[str, Any]],
    model: ModelInfo,
    *,
    folder: str | Path,
    defaults: GenerationRequest,
    batch_seed: int = 0,
) -> BatchPlan:
    """Resolve the items and read the manifest: what is already done, what is left. No weights, no process."""
    out = Path(folder)
    check_output_target(out / "manifest.jsonl", keep_folder=True)  # every rank plans at once; the batch writes there
    items = build_items(raw, model, defaults=defaults, batch_seed=batch_seed)
    _refuse_unwritable_names(items, out)
    finished = Manifest(out).finished((i.index, i.fingerprint) for i in items if i.request is not None)
    return BatchPlan(folder=out, items=items, finished=finished)


def _refuse_unwritable_names(items: list[BatchItem], folder: Path) -> None:
    """Refuse, before any work, an item whose video file could not be written (its name too long once `.mp4` is
    added) or would be another item's (two items writing one file would overwrite each other on every run): the
    first valid item keeps a name, the later ones fail. Exact names (no case folding)."""
    holders: dict[str, int] = {}
    for item in items:
        if item.request is None:
            continue  # a refused item holds no name
        name = video_name(item)
        problem = path_problem(str(folder / name))
        if problem is not None:
            what = f"output={item.request.output_path!r}" if item.request.output_path else f"video {name!r}"
            _refuse(item, f"{what}: as a video file (with .mp4) it {problem}")
        elif name in holders:
            _refuse(item, f"output {name!r} is also item {holders[name]}'s")
        else:
            holders[name] = item.index


def _refuse(item: BatchItem, error: str) -> None:
    item.request, item.fingerprint, item.error = None, "", error


def record_refused(plan: BatchPlan) -> None:
    """Record the items refused before any work (a job with nothing else to run records them here)."""
    manifest = Manifest(plan.folder)
    for item in plan.invalid:
        manifest.append(_record(item, replica=-1, error=item.error))


def video_name(item: BatchItem) -> str:
    """The item's video file in the folder: its `output`, else index, prompt and seed (the same on every run)."""
    request = item.resolved
    if request.output_path:
        return request.output_path if request.output_path.endswith(".mp4") else f"{request.output_path}.mp4"
    return f"{item.index:05d}_{sanitize_prompt(request.prompt)[:40]}_seed{request.seed}.mp4"


def run_batch(
    gen: EngineHandle, plan: BatchPlan, *, return_frames: bool = False, progress: bool = True
) -> list[BatchResult]:
    """Generate what is left of `plan` on every replica of `gen`; returns one result per item, in input order
    (on world rank 0; other ranks under a launcher get the results of the items their replica ran)."""
    engine = gen.engine
    layout = engine.layout
    todo = {i.index: i for i in plan.todo}
    world_rank = engine.launch.rank if engine.launch is not None else 0
    manifest = Manifest(plan.folder)
    results: dict[int, BatchResult] = {}
    bar = _Progress(len(todo), layout.replicas, enabled=progress and world_rank == 0)

    def record(entry: dict[str, Any]) -> None:  # on world rank 0: one manifest line, one step of the bar
        manifest.append(entry)
        bar.item_done(int(entry["replica"]))
        results.setdefault(int(entry["index"]), _result_from(entry, plan.folder, resumed=False))

    if world_rank == 0:
        record_refused(plan)  # refused before any work: recorded, the batch goes on
    for item in plan.invalid:
        results[item.index] = BatchResult(item.index, "failed", None, None, error=item.error)
    shares = [
        [(i.index, _for_worker(i.resolved)) for i in share] for share in assign(list(todo.values()), layout.replicas)
    ]
    channel = _Channel.open(engine, plan, shares, record) if engine.launch is not None and layout.replicas > 1 else None

    def on_item(outcome: ItemOutcome) -> None:  # where the item's frames are: write its video, then its manifest line
        item = todo[outcome.index]
        result, entry = _finish(item, outcome, plan.folder, keep_frames=return_frames)
        results[item.index] = result
        if world_rank == 0:
            record(entry)
        else:
            assert channel is not None
            channel.publish(entry)

    try:
        gen.executor.execute_batch(shares, on_item)
    finally:
        if channel is not None:
            channel.close()
        bar.close()
    for index, entry in plan.finished.items():
        results[index] = _result_from(entry, plan.folder, resumed=True)
    return [results[i.index] for i in plan.items if i.index in results]


def _for_worker(request: ResolvedRequest) -> ResolvedRequest:
    return dataclasses.replace(request, save_video=False, return_frames=True, output_path=None)


def _finish(
    item: BatchItem, outcome: ItemOutcome, folder: Path, *, keep_frames: bool
) -> tuple[BatchResult, dict[str, Any]]:
    request = item.resolved
    if outcome.output is None or outcome.output.frames is None:
        error = f"{outcome.error_type}: {outcome.error}" if outcome.error_type else "no frames came back"
        return BatchResult(item.index, "failed", None, request.seed, error=error), _record(item, outcome.replica, error)
    frames = outcome.output.frames
    start = time.perf_counter()
    video = write_video(frames, folder / video_name(item), fps=request.fps, replace=True)
    timings = {**outcome.output.timings, "video_writing": time.perf_counter() - start}
    entry = _record(item, outcome.replica, None, video=video, timings=timings)
    result = BatchResult(
        item.index, "done", str(video), request.seed, timings=timings, frames=frames if keep_frames else None
    )
    return result, entry


def _record(
    item: BatchItem,
    replica: int,
    error: str | None,
    *,
    video: Path | None = None,
    timings: dict[str, float] | None = None,
) -> dict[str, Any]:
    request = item.request
    entry: dict[str, Any] = {
        "index": item.index,
        "status": "failed" if error is not None else "done",
        "replica": replica,
        "fingerprint": item.fingerprint,
        "prompt": request.prompt if request is not None else item.fields.get("prompt"),
        "seed": request.seed if request is not None else None,
        "arguments": {k: v for k, v in item.fields.items() if not k.startswith("_")},
        "error": error,
        "timings": timings or {},
        "finished_at": time.time(),
    }
    if video is not None:
        entry.update(video=video.name, bytes=video.stat().st_size, sha256=file_sha256(video))
    return entry


def _result_from(entry: dict[str, Any], folder: Path, *, resumed: bool) -> BatchResult:
    video = str(folder / entry["video"]) if entry.get("video") else None
    return BatchResult(
        entry["index"],
        entry["status"],
        video,
        entry.get("seed"),
        entry.get("error"),
        entry.get("timings", {}),
        resumed=resumed,
    )


class _Channel:
    """Under a launcher, the other replicas' output ranks hand their manifest lines to world rank 0 through the
    rendezvous store (JSON under a key per item); a thread on rank 0 writes them as they come."""

    def __init__(self, store: StoreChannel, expected: list[int], record: Callable[[dict[str, Any]], None] | None):
        self.store, self.expected = store, expected
        self.record = record
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if record is not None:
            self._thread = threading.Thread(target=self._collect, name="distvideo-batch-manifest", daemon=True)
            self._thread.start()

    @classmethod
    def open(
        cls,
        engine: ResolvedEngine,
        plan: BatchPlan,
        shares: list[list[tuple[int, ResolvedRequest]]],
        record: Callable[[dict[str, Any]], None],
    ) -> _Channel:
        from distvideo.executors.store import connect  # torch.distributed: only under a launcher

        env = engine.launch
        assert env is not None  # opened only under a launcher
        job = json.dumps([str(plan.folder.resolve()), [i.fingerprint for i in plan.items], next(_jobs)])
        store = connect(env, f"batch/{hashlib.sha256(job.encode()).hexdigest()[:16]}")
        expected = [index for share in shares[1:] for index, _ in share]  # replica 0 is world rank 0's own
        return cls(store, expected, record if env.rank == 0 else None)

    def publish(self, entry: dict[str, Any]) -> None:
        self.store.set(str(entry["index"]), json.dumps(entry))

    def _sweep(self) -> None:
        assert self.record is not None
        for index in list(self.expected):
            key = str(index)
            if self.store.has(key):
                self.record(json.loads(self.store.get(key)))
                self.store.delete(key)
                self.expected.remove(index)

    def _collect(self) -> None:
        while self.expected and not self._stop.wait(COLLECT_POLL_S):
            try:
                self._sweep()
            except Exception:  # the store went away with a failed job: the final sweep reports what it can
                logger.debug("collecting batch results failed", exc_info=True)
                return

    def close(self) -> None:
        """After every replica finished (the executor's final exchange): collect what is left, stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            try:
                self._sweep()
            except Exception:
                logger.debug("the last sweep of batch results failed", exc_info=True)


class _Progress:
    """One bar for the batch on world rank 0: items done of the total, per-replica counts, and the rate."""

    def __init__(self, total: int, replicas: int, *, enabled: bool):
        from tqdm.auto import tqdm

        self.per_replica = [0] * replicas
        self.done = 0  # counted here: a disabled tqdm bar (--no-progress) counts nothing
        self.start = time.monotonic()
        self.bar = tqdm(total=total, desc="batch", unit="item", file=sys.stderr, disable=not enabled)
        self.log = not enabled and total > 0

    def item_done(self, replica: int) -> None:
        if 0 <= replica < len(self.per_replica):
            self.per_replica[replica] += 1
        self.done += 1
        self.bar.update()
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rates = ", ".join(f"r{r}: {n / elapsed * 60:.1f}/min" for r, n in enumerate(self.per_replica))
        self.bar.set_postfix_str(rates, refresh=False)
        if self.log:
            logger.info("batch: %d of %d items done (%s)", self.done, self.bar.total, rates)

    def close(self) -> None:
        self.bar.close()
