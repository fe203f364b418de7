"""The one registry of environment variables distvideo reads or writes.

Every variable is declared once here (name, parser, default, one-line doc) and read lazily through
:func:`get`; no other module touches ``os.environ``. ``docs/env_vars.md`` lists every declaration
(a test keeps the two in sync).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distvideo.errors import ConfigError


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    group: str = "distvideo"


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {value!r}")


def _str(value: str) -> str:
    return value


def _int(value: str) -> int:
    return int(value.strip())


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value.strip().lower() not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {value!r}")
        return value.strip().lower()

    return parse


REGISTRY: dict[str, EnvVar] = {}


def _declare(name: str, parse: Callable[[str], Any], default: Any, doc: str, group: str = "distvideo") -> None:
    if name in REGISTRY:
        raise RuntimeError(f"environment variable {name} declared twice")
    REGISTRY[name] = EnvVar(name, parse, default, doc, group)


# --- distvideo's own settings -------------------------------------------------------------------
_declare("DISTVIDEO_LOG_LEVEL", _str, "INFO", "Log level of the distvideo logger (DEBUG, INFO, WARNING, ERROR).")
_declare(
    "DISTVIDEO_MODEL",
    _str,
    None,
    "Model (folder or Hugging Face repo id) used when none is given. Unset: the embedded demo model.",
)
_declare(
    "DISTVIDEO_NUM_THREADS",
    _int,
    None,
    "Intra-op CPU threads per rank. Default: OMP_NUM_THREADS when the user set it, else cores / local world size.",
)
_declare(
    "DISTVIDEO_DIST_TIMEOUT",
    float,
    600.0,
    "Default dist_timeout in seconds: how long a collective waits for a peer before the job is declared broken.",
)
_declare(
    "DISTVIDEO_LORA_CACHE_MB",
    _int,
    1024,
    "Default lora_cache_mb: MiB of cached LoRA adapters per rank (least recently used inactive ones dropped first).",
)
_declare(
    "DISTVIDEO_API_KEY",
    _str,
    None,
    "distvideo serve: the API key clients must send as 'Authorization: Bearer KEY' when --api-key is not given "
    "(keeps the key off the command line).",
)
_declare(
    "DISTVIDEO_PROBE_FILE",
    _str,
    None,
    "Where `distvideo plan --probe` keeps this machine's measured figures for the automatic layout, and where the "
    "planner reads them. Default: ~/.cache/distvideo/probe.json.",
)
_declare("DISTVIDEO_NO_PROGRESS", _bool, False, "Disable the tqdm progress bar (same as --no-progress).")
_declare(
    "DISTVIDEO_COMPACT_TEXT_PADDING",
    _bool,
    True,
    "Cross-attend to the text padding as one key with weight r instead of r identical keys (exact in math; "
    "docs/parallel.md). 0 runs diffusers' cross-attention unchanged.",
)
_declare(
    "DISTVIDEO_CPU_KERNELS",
    _bool,
    True,
    "Faster CPU kernels for the VAE: float32 3D convolutions through oneDNN (which PyTorch's size heuristic skips "
    "for them) and channel RMS norms as a sum of squares and an rsqrt. 0 keeps diffusers' and PyTorch's own.",
)
_declare(
    "DISTVIDEO_COMPILE",
    _bool,
    False,
    "Default compile: regional torch.compile of the transformer's repeated blocks (compiles at each new shape; "
    "docs/performance.md). 1 turns it on.",
)
_declare(
    "DISTVIDEO_OFFLOAD",
    _choice("none", "text", "model"),  # config.OFFLOAD_MODES (tests/test_offload.py keeps the two equal)
    "none",
    "Default offload: none keeps every component on the device; text keeps the text encoders in host memory except "
    "while they encode; model does so for the text encoders, the image encoder and the VAE (docs/performance.md).",
)
_declare(
    "DISTVIDEO_MP_START",
    _choice("forkserver", "spawn"),
    "forkserver",
    "How the mp executor starts its workers: forked from a fork server that imported torch, diffusers and distvideo "
    "once per driver process (a second executor starts in a fraction of a second), or spawned as new interpreters. "
    "Workers that will use CUDA are always spawned (a CUDA build of torch can initialize the driver in the fork server).",
)

# --- launcher variables (read by distvideo.launch; torchrun, Open MPI, MPICH/Intel MPI, Slurm) ---
_LAUNCH_DOCS = {
    "RANK": "torchrun: global rank of this process.",
    "WORLD_SIZE": "torchrun: number of processes in the job.",
    "LOCAL_RANK": "torchrun: rank of this process on its node.",
    "LOCAL_WORLD_SIZE": "torchrun: number of processes on this node.",
    "MASTER_ADDR": "Address of the rendezvous host (rank 0).",
    "MASTER_PORT": "TCP port of the rendezvous on MASTER_ADDR.",
    "OMPI_COMM_WORLD_RANK": "Open MPI: global rank.",
    "OMPI_COMM_WORLD_SIZE": "Open MPI: number of processes.",
    "OMPI_COMM_WORLD_LOCAL_RANK": "Open MPI: rank on this node.",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "Open MPI: processes on this node.",
    "PMI_RANK": "MPICH / Intel MPI: global rank.",
    "PMI_SIZE": "MPICH / Intel MPI: number of processes.",
    "MPI_LOCALRANKID": "MPICH / Intel MPI: rank on this node.",
    "MPI_LOCALNRANKS": "MPICH / Intel MPI: processes on this node.",
    "SLURM_PROCID": "Slurm: global rank of the task.",
    "SLURM_NTASKS": "Slurm: number of tasks in the step.",
    "SLURM_LOCALID": "Slurm: rank of the task on its node.",
    "SLURM_NTASKS_PER_NODE": "Slurm: tasks per node as requested (N).",
    "SLURM_STEP_TASKS_PER_NODE": "Slurm: tasks per node of the step (N or N(xM),...).",
    "SLURM_TASKS_PER_NODE": "Slurm: tasks per node of the job (N or N(xM),...).",
    "SLURM_STEP_NODELIST": "Slurm: compressed host list of the step; its first host is the default MASTER_ADDR.",
    "SLURM_JOB_NODELIST": "Slurm: compressed host list of the job (fallback for SLURM_STEP_NODELIST).",
    "SLURM_JOB_ID": "Slurm: job id; the default MASTER_PORT is derived from it.",
    "SLURM_STEP_ID": "Slurm: step id; set in tasks srun started (a batch script alone is not a launch).",
}
for _name, _doc in _LAUNCH_DOCS.items():
    _declare(_name, _str, None, _doc, group="launcher")

# --- variables of other libraries that distvideo reads ------------------------------------------
_declare(
    "OMP_NUM_THREADS", _str, None, "OpenMP threads; when set by the user it wins over distvideo's default.", "other"
)
_declare(
    "TORCHELASTIC_RUN_ID", _str, None, "Set by torchrun; tells that OMP_NUM_THREADS=1 came from torchrun.", "other"
)
_declare(
    "GLOO_SOCKET_IFNAME",
    _str,
    None,
    "Network interface gloo binds to; the mp executor sets it to the loopback interface in its workers.",
    "other",
)
_declare(
    "CUDA_VISIBLE_DEVICES", _str, None, "GPUs visible to this process (reported in errors about devices).", "other"
)
_declare(
    "MKL_CBWR",
    _str,
    None,
    "Intel MKL's numerical reproducibility mode; distvideo sets AUTO,STRICT when unset (importing distvideo), so CPU "
    "matrix products give the same bits whatever the thread count (docs/determinism.md).",
    "other",
)

#: MKL_CBWR when the user has not chosen a mode: MKL's own code path for the CPU (AUTO) with strict reproducibility,
#: which makes its matrix products independent of the number of threads. Without it, a small product (a few rows,
#: such as the compacted text of a short prompt) rounds differently with 1 thread than with 2, so one request gave
#: different frames under 2 replicas of 1 thread each than inline with 2 threads (measured: 1 on a uint8 value).
MKL_REPRODUCIBLE = "AUTO,STRICT"


def reproducible_cpu_math() -> None:
    """Set MKL_CBWR to :data:`MKL_REPRODUCIBLE` unless the user set it. MKL reads it at its first call, so this runs
    when distvideo is imported (every rank and worker imports it before it computes anything); a process that already
    ran an MKL product keeps the mode it started with. Spawned workers inherit it."""
    if not os.environ.get("MKL_CBWR"):
        os.environ["MKL_CBWR"] = MKL_REPRODUCIBLE


def _lookup(name: str) -> EnvVar:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in distvideo.envs; declare it there first") from None


def get_raw(name: str) -> str | None:
    """The raw string value of a declared variable, or None when unset."""
    _lookup(name)
    return os.environ.get(name)


def get(name: str) -> Any:
    """The parsed value of a declared variable; its default when unset or empty. A value that does not parse is a
    ConfigError (bad configuration: the CLI's exit 2), naming the variable, the value and what would work."""
    var = _lookup(name)
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is invalid: {exc}") from None


def is_set(name: str) -> bool:
    _lookup(name)
    return bool(os.environ.get(name))


def snapshot(names: Iterable[str] | None = None) -> dict[str, str]:
    """A copy of the set, declared variables (all launcher variables when names is None)."""
    if names is None:
        names = [v.name for v in REGISTRY.values() if v.group == "launcher"]
    out: dict[str, str] = {}
    for name in names:
        value = get_raw(name)
        if value is not None:
            out[name] = value
    return out


#: variables set_external wrote where the process had none: name -> the value written
_WRITTEN: dict[str, str] = {}


def set_external(values: Mapping[str, str | int]) -> None:
    """Write normalised values (e.g. RANK, WORLD_SIZE from an MPI launch) into this process's environment.

    With :func:`reproducible_cpu_math`, the only place distvideo writes environment variables; used so torch.distributed's env://
    rendezvous and any library reading torchrun's names see the resolved values.
    """
    for name, value in values.items():
        _lookup(name)
        ours = name not in os.environ or _WRITTEN.get(name) == os.environ[name]  # unset, or still what we wrote
        if ours:
            _WRITTEN[name] = str(value)
        else:
            _WRITTEN.pop(name, None)
        os.environ[name] = str(value)


def written_here() -> set[str]:
    """The variables set_external wrote into this process where it had none, still holding what was written: not the
    launcher's (a second generator under mpirun must still see Open MPI's variables as its launcher's, not RANK)."""
    return {name for name, value in _WRITTEN.items() if os.environ.get(name) == value}


def whole_environment() -> dict[str, str]:
    """Every variable of this process: what a process it started now would inherit (the mp executor's workers take
    it from their driver, executors/mp_start.py)."""
    return dict(os.environ)


def replace_environment(environ: Mapping[str, str]) -> None:
    """Make this process's environment exactly `environ` (a worker forked from the fork server taking its driver's)."""
    os.environ.clear()
    os.environ.update(environ)


def unset(names: Iterable[str]) -> None:
    for name in names:
        _lookup(name)
        os.environ.pop(name, None)
