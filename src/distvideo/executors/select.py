"""Which executor runs an engine, and the engine resolved once for it (`resolve_engine`), before any process starts
or weight loads: bad paths, impossible layouts and a world size that disagrees with the launcher fail here."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

from distvideo import envs
from distvideo.config import EngineConfig
from distvideo.engine import ResolvedEngine
from distvideo.errors import ConfigError
from distvideo.executors.base import Executor
from distvideo.launch import LaunchEnv, launcher_rank_present, read_launch_environ, resolve_launch_env
from distvideo.models.embedded import embedded_model_path
from distvideo.models.hub import resolve_model
from distvideo.models.loading import verify_component_files
from distvideo.models.registry import probe_model
from distvideo.parallel.planner import auto_layout
from distvideo.paths import resolve_lora_path

logger = logging.getLogger(__name__)


def choose_executor(config: EngineConfig, launcher_present: bool) -> str:
    """ "auto": external under a launcher, mp for more than one rank, else inline."""
    if config.executor != "auto":
        return config.executor
    if launcher_present:
        return "external"
    return "mp" if (config.num_gpus or 1) > 1 else "inline"


def resolve_external_env(config: EngineConfig, environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher's environment for the external executor; num_gpus, when given, must match its world size."""
    try:
        env = resolve_launch_env(read_launch_environ() if environ is None else environ)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"{config.naming.subject('executor', 'external')}: {exc}", param="executor") from None
    if config.num_gpus is not None and config.num_gpus != env.world_size:
        n = config.naming
        raise ConfigError(
            f"{n.subject('num_gpus', config.num_gpus)} but the launcher ({env.launcher}) started {env.world_size} "
            f"processes; give {n.setting('num_gpus', env.world_size)} (the total number of launched processes) or "
            "leave it unset",
            param="num_gpus",
        )
    return env


def resolve_engine(
    config: EngineConfig, environ: Mapping[str, str] | None = None, *, objective: str = "latency"
) -> ResolvedEngine:
    """Validate `config`, read the model's JSON files and weight-file headers, choose the executor and the layout
    (with no layout option given, the cost model's best for `objective`: "latency" of one request, or "throughput"
    of many, as a batch or a service runs them). Reads no weights and starts no process; every mistake is a
    ConfigError (exit 2)."""
    config.validate()
    if config.model is None and envs.get("DISTVIDEO_MODEL"):
        config = dataclasses.replace(config, model=envs.get("DISTVIDEO_MODEL"))
    if config.model is None:
        config = dataclasses.replace(config, model=str(embedded_model_path()))
    else:  # a Hugging Face repo id becomes its snapshot folder in the hub cache (downloaded once per node if missing)
        config = dataclasses.replace(config, model=resolve_model(str(config.model)))
    model = probe_model(str(config.model))
    verify_component_files(model, allow_pickle_weights=bool(config.allow_pickle_weights))
    environ = read_launch_environ() if environ is None else environ
    kind = choose_executor(config, launcher_rank_present(environ))
    launch = resolve_external_env(config, environ) if kind == "external" else None
    if kind == "ray":
        check_ray_installed()
    if kind == "inline" and (config.num_gpus or 1) != 1:
        n = config.naming
        raise ConfigError(
            f"{n.subject('executor', 'inline')} runs one rank; {n.subject('num_gpus', config.num_gpus)} needs "
            f"{n.setting('executor', 'mp')}",
            param="num_gpus",
        )
    if kind in ("inline", "mp"):  # its ranks read the adapters on this host: a missing one is refused before they start
        for spec in config.lora:  # (launched or Ray ranks check theirs together, on their own hosts)
            resolve_lora_path(spec.path)
    world_size = launch.world_size if launch is not None else (config.num_gpus or 1)
    per_node = launch.local_world_size if launch is not None else world_size
    chosen = auto_layout(config, model, world_size, per_node, objective=objective)
    layout = chosen.layout
    if kind != "ray" and low_precision_asked(config):  # the ranks' devices are this host's (under Ray the ranks check
        from distvideo.devices import select_device  # at load: the driver may have no GPU); the ring as chosen
        from distvideo.models.quantize import DeviceKind, check_support

        ringed = dataclasses.replace(config, ring_size=layout.ring_size)
        check_support(ringed, DeviceKind.of(select_device(config.device, 0)))
    if chosen.plan is not None:
        config = dataclasses.replace(config, shard_weights=chosen.shard_weights)
        logger.debug("automatic layout: %s", "; ".join(chosen.plan.reasons))
    logger.debug("executor %s, parallel layout: %s", kind, layout.describe())
    config = dataclasses.replace(config, executor=kind).with_defaults()
    return ResolvedEngine(config=config, model=model, layout=layout, launch=launch)


def low_precision_asked(config: EngineConfig) -> bool:
    """Whether `config` asks for quantized weights or an attention kernel other than sdpa."""
    quantized = (config.quantize, config.quantize_text_encoder)
    return any(mode not in (None, "none") for mode in quantized) or config.attention not in (None, "sdpa")


def create_executor(engine: ResolvedEngine) -> Executor:
    """Start the engine's ranks and load the model on each (the expensive part)."""
    if engine.executor == "inline":
        from distvideo.executors.inline import InlineExecutor

        return InlineExecutor(engine)
    if engine.executor == "external":
        from distvideo.executors.external import ExternalExecutor

        return ExternalExecutor(engine)
    if engine.executor == "mp":
        from distvideo.executors.mp import MultiprocExecutor

        return MultiprocExecutor(engine)
    if engine.executor == "ray":
        from distvideo.executors.ray_executor import RayExecutor

        return RayExecutor(engine)
    raise ConfigError(f"executor={engine.executor!r} is not supported")


def check_ray_installed() -> None:
    """executor='ray' needs the optional extra; a clear error (exit 2) without it."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ConfigError(
            "executor='ray' needs Ray, which is not installed: pip install 'distvideo[ray]' (or choose executor "
            "'mp' for ranks on this machine)"
        )
