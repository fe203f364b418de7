"""VideoGenerator: the public facade. It validates requests, owns one executor, and writes the video on the output rank."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from distvideo.batch.run import BatchResult
from distvideo.config import EngineConfig, LoraSpec, did_you_mean, option_fields
from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError, RankFailure
from distvideo.executors import Executor, create_executor, resolve_engine
from distvideo.executors.base import SHUT_DOWN
from distvideo.logging_utils import configure_logging
from distvideo.media import check_video_output, write_video_or_keep_frames
from distvideo.models.cache_ratios import check_cache_servable
from distvideo.models.embedded import prompt_warning
from distvideo.models.registry import ModelInfo
from distvideo.outputs import GenerationResult, run_summary
from distvideo.paths import resolve_output_path
from distvideo.request import GenerationRequest, ResolvedRequest
from distvideo.rpc import RpcCall

logger = logging.getLogger(__name__)


class VideoGenerator:
    """Generate videos with a diffusers-format checkpoint on one or many ranks."""

    def __init__(self, engine: ResolvedEngine, executor: Executor):
        self.engine = engine
        self._executor: Executor | None = executor
        self._finalizer = weakref.finalize(self, executor.shutdown)  # also runs at interpreter exit

    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | None = None,
        *,
        num_gpus: int | None = None,
        executor: str = "auto",
        sp_size: int | None = None,
        cfg_parallel: bool | None = None,
        replicas: int | None = None,
        ulysses_size: int | None = None,
        ring_size: int | None = None,
        dist_timeout: float | None = None,
        device: str | None = None,
        dtype: str | None = None,
        lora: list[LoraSpec | str | Path] | None = None,  # a path may end in ":STRENGTH"
        **options: Any,
    ) -> VideoGenerator:
        """`options`: any other EngineConfig field by name (offload="model", compile=True, ...)."""
        known = {f.name for f in option_fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"{', '.join(unknown)}: not an engine option{did_you_mean(unknown[0], known)}; the options are "
                f"{', '.join(sorted(known))}"
            )
        config = EngineConfig(
            model=str(model) if model is not None else None,
            num_gpus=num_gpus,
            executor=executor,
            sp_size=sp_size,
            cfg_parallel=cfg_parallel,
            replicas=replicas,
            ulysses_size=ulysses_size,
            ring_size=ring_size,
            dist_timeout=dist_timeout,
            device=device,
            dtype=dtype,
            lora=[LoraSpec.parse(str(x), "lora") if isinstance(x, (str, Path)) else x for x in lora or []],
            **options,
        )
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> VideoGenerator:
        """Resolve the engine (bad paths and impossible layouts fail here, before any process or weight), then
        start its ranks and load the model."""
        configure_logging(config.log_level)
        return cls.from_engine(resolve_engine(config))

    @classmethod
    def from_engine(cls, engine: ResolvedEngine) -> VideoGenerator:
        """Start the ranks of an engine resolved with `distvideo.executors.resolve_engine` and load the model."""
        configure_logging(engine.config.log_level)
        start = time.perf_counter()
        gen = cls(engine, create_executor(engine))
        logger.debug(
            "loaded %s with executor %s in %.2f s", engine.model.path, engine.executor, time.perf_counter() - start
        )
        if engine.config.lora:
            try:
                gen._apply_lora_specs(engine.config.lora)
            except BaseException:
                gen.shutdown()
                raise
        return gen

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def model_info(self) -> ModelInfo:
        return self.engine.model

    # -- properties ------------------------------------------------------------------------------
    @property
    def executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError(SHUT_DOWN)
        return self._executor

    @property
    def is_output_rank(self) -> bool:
        return self.executor.is_output_rank

    @property
    def world_size(self) -> int:
        return self.executor.world_size

    # -- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        *,
        negative_prompt: str | None = None,
        image: Any = None,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        boundary_ratio: float | None = None,
        seed: int = 0,
        fps: int | None = None,
        output_path: str | None = None,
        save_video: bool = True,
        return_frames: bool = True,
        max_sequence_length: int = 512,
        request_timeout: float | None = None,
        cache: str | None = None,
        cache_threshold: float | None = None,
        cache_warmup_steps: int | None = None,
        cache_max_skip: int | None = None,
        scheduler: str | None = None,
        flow_shift: float | None = None,
        timesteps: list[float] | None = None,
        sigmas: list[float] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> GenerationResult:
        """Generate one video. `image` (image-to-video models): a file path, a PIL image or a uint8 array (H, W, 3).
        Fields left None take the model's defaults (`fps`: the family's frame rate, 16 for Wan2.1, 24 for Wan2.2
        TI2V-5B). `request_timeout` (seconds): the request stops at the next denoising step after it on every rank
        and raises GenerationTimeout; `on_progress(done, total)` is called in this process after every denoising
        step (under a launcher: on every rank). `cancel()` from another thread stops it. `scheduler`, `flow_shift`,
        `timesteps`, `sigmas`: the noise schedule (default: the checkpoint's; docs/performance.md, "Few-step models")."""
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            image=image,
            num_frames=num_frames,
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            guidance_scale_2=guidance_scale_2,
            boundary_ratio=boundary_ratio,
            seed=seed,
            fps=fps,
            output_path=output_path,
            save_video=save_video,
            return_frames=return_frames,
            max_sequence_length=max_sequence_length,
            request_timeout=request_timeout,
            cache=cache,
            cache_threshold=cache_threshold,
            cache_warmup_steps=cache_warmup_steps,
            cache_max_skip=cache_max_skip,
            scheduler=scheduler,
            flow_shift=flow_shift,
            timesteps=timesteps,
            sigmas=sigmas,
        )
        return self.generate_request(request, on_progress=on_progress)

    def generate_batch(
        self,
        items: Iterable[str | Mapping[str, Any]],
        *,
        output_dir: str | Path = "outputs",
        batch_seed: int = 0,
        return_frames: bool = False,
        progress: bool | None = None,
        **defaults: Any,
    ) -> list[BatchResult]:
        """Generate every item (a prompt, or a mapping with `prompt` and optional negative_prompt, seed, num_frames,
        height, width, num_inference_steps, guidance_scale, fps, output) over the engine's replicas, writing one
        video per item and `manifest.jsonl` into `output_dir`; items already done there (same arguments, video
        whole) are not redone. `defaults`: request fields for every item. An item without a seed gets one derived
        from `batch_seed` and its index. Results in input order (frames only with `return_frames`, on the process
        that holds them); a failed item is a result with its error, the batch goes on (docs/batch.md)."""
        from distvideo.batch import plan_batch, run_batch

        template = GenerationRequest(prompt="-", **defaults)  # the item's fields go on top
        plan = plan_batch(items, self.model_info, folder=output_dir, defaults=template, batch_seed=batch_seed)
        show = bool(self.config.progress) if progress is None else progress
        return run_batch(self, plan, return_frames=return_frames, progress=show)

    def cancel(self) -> None:
        """Stop the request this generator is running, at its next denoising step on every rank (it raises
        GenerationCancelled; the generator stays usable). Safe from any thread; a no-op when nothing runs."""
        self.executor.cancel()

    def _checked(self, request: GenerationRequest | ResolvedRequest) -> ResolvedRequest:
        """The request resolved (a ResolvedRequest: its image read in this process), and what this engine and its
        output rank refuse checked: a cached request on compiled blocks, the video file's target."""
        from distvideo.models.plans import compiles_blocks  # torch's (the engine has imported it by now)

        if isinstance(request, ResolvedRequest):
            resolved = request.read_image()
        else:
            resolved = self.model_info.resolve_request(request)
        check_cache_servable(resolved, compiled=compiles_blocks(self.config, self.engine.layout.sp_size))
        if self.executor.is_output_rank and resolved.save_video:  # the writer's problems too, not after generating
            check_video_output(
                resolved.output_path, resolved.prompt, resolved.seed, resolved.width, resolved.height, resolved.fps
            )
        return resolved

    def generate_request(
        self, request: GenerationRequest | ResolvedRequest, on_progress: Callable[[int, int], None] | None = None
    ) -> GenerationResult:
        """Generate one request: a GenerationRequest is resolved against the model here (the Python API's edge); a
        ResolvedRequest (the CLI's, a served job's) is taken as resolved, its image read in this process."""
        start = time.perf_counter()
        executor = self.executor
        try:  # bad input fails here, before any work
            outcome: ResolvedRequest | ConfigError = self._checked(request)
        except ConfigError as exc:
            outcome = exc
        # Under a launcher every rank compares the arguments and whether they were valid, so a request refused on one
        # rank only is refused on every rank (none is left waiting in a collective for it).
        refused = str(outcome) if isinstance(outcome, ConfigError) else None
        executor.ensure_consistent("generate", {**request.digest_fields(), "invalid_request": refused})
        if isinstance(outcome, ConfigError):
            raise outcome
        request = outcome
        if executor.is_output_rank and (warning := prompt_warning(self.model_info.path, request.prompt)):
            logger.warning(warning)
        out = _refusals_as_config_errors(lambda: executor.execute_forward(request, on_progress))
        timings = dict(out.timings)
        video_path: str | None = None
        frames = out.frames if executor.is_output_rank else None
        if executor.is_output_rank and request.save_video and frames is not None:
            t0 = time.perf_counter()
            target = resolve_output_path(request.output_path, request.prompt, request.seed)
            video_path = str(write_video_or_keep_frames(frames, target, request.fps))
            timings["video_writing"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - start
        if executor.is_output_rank:
            logger.info(
                "generated %d frames %dx%d in %.2f s (%s)%s",
                request.num_frames,
                request.width,
                request.height,
                timings["total"],
                run_summary(timings, out.cache),
                f" -> {video_path}" if video_path else "",
            )
        elif not getattr(self, "_told_output_rank", False):
            logger.info("frames and video belong to rank %d; this rank returns none", executor.output_rank)
            self._told_output_rank = True
        return GenerationResult(
            frames=frames if request.return_frames else None,
            video_path=video_path,
            seed=request.seed,
            timings=timings,
            peak_memory_mb=out.peak_memory_mb,
            request=request,
            cache=out.cache,
            weights=out.weights,
        )

    # -- control plane ---------------------------------------------------------------------------
    @property
    def collective_rpc(self) -> RpcCall:
        """`collective_rpc(method, args=(), kwargs=None, timeout=None, unique_reply_rank=None)`: run `method` (a worker
        method's name, or a callable `fn(worker, *args, **kwargs)`) on every rank; every rank's result in rank order,
        or with `unique_reply_rank=r` rank r's result alone (under a launcher: this process's own rank's)."""
        return self.executor.collective_rpc

    def check_health(self) -> None:
        """Raise if the ranks can no longer run requests (mp: a worker died, also while idle), without a call."""
        self.executor.check_health()

    # -- LoRA (distvideo.lora; docs/lora.md) ----------------------------------------------------
    def set_lora_adapter(
        self,
        nickname: str,
        path: str | Path | None = None,
        strength: float = 1.0,
        accumulate: bool = False,
        *,
        target: str = "transformer",
    ) -> None:
        """Load (and cache under `nickname`) a LoRA file, or switch to a cached one with path=None, and activate it
        merged into the weights: on top of the active adapters with accumulate=True, else replacing them. Every
        rank loads and checks it first; on any failure no rank changes its weights and all raise the same error.
        `target`: the transformer it changes ("transformer_2": the low-noise expert of Wan2.2 A14B, as diffusers'
        ``load_into_transformer_2``); each transformer has its own active adapters."""
        from distvideo.lora.control import set_lora_adapter

        set_lora_adapter(self.executor, nickname, path, strength, accumulate, target)

    def unmerge_lora_weights(self) -> None:
        """Restore the exact base weights; the active adapters keep applying on the fly."""
        from distvideo.lora.control import unmerge_weights

        unmerge_weights(self.executor)

    def merge_lora_weights(self) -> None:
        """Fold the active adapters into the weights again (computed from the saved base weights)."""
        from distvideo.lora.control import merge_weights

        merge_weights(self.executor)

    def remove_lora_adapter(self, nickname: str) -> None:
        """Drop a cached adapter that is not active, on every rank (the cache also drops the least recently used
        ones by itself beyond lora_cache_mb)."""
        from distvideo.lora.control import remove_adapter

        remove_adapter(self.executor, nickname)

    def clear_lora_adapters(self) -> None:
        """Deactivate every adapter; the weights become bit-identical to the base. Cached adapters stay."""
        from distvideo.lora.control import clear_adapters

        clear_adapters(self.executor)

    def _apply_lora_specs(self, specs: list[LoraSpec]) -> None:
        """--lora / engine.lora: the first adapter replaces, the following ones stack (per target transformer);
        nicknames are file stems."""
        taken: set[str] = set()
        for i, spec in enumerate(specs):
            stem = Path(spec.path).stem or "lora"
            nickname = stem if stem not in taken else f"{stem}#{i}"
            taken.add(nickname)
            self.set_lora_adapter(nickname, spec.path, strength=spec.strength, accumulate=i > 0, target=spec.target)

    # -- life cycle ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor = None
            self._finalizer()

    def __enter__(self) -> VideoGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _refusals_as_config_errors(run: Callable[[], Any]) -> Any:
    """A request every failing rank refused as bad input (it does not fit their memory) is bad input: ConfigError,
    exit 2, not a runtime failure."""
    try:
        return run()
    except RankFailure as exc:
        if exc.failures and all(kind == "ConfigError" for kind, _ in exc.failures.values()):
            lines = [f"  rank {rank}: {message}" for rank, (_, message) in sorted(exc.failures.items())]
            raise ConfigError("the request was refused:\n" + "\n".join(lines)) from exc
        raise
