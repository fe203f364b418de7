"""Where this process sits in a job started by torchrun, srun or mpirun: resolves rank, world size and rendezvous
address from the launcher's environment variables, as a pure function of a mapping so it can be tested with tables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from distvideo import envs
from distvideo.errors import LaunchEnvError
from distvideo.slurm import expand_slurm_hostlist, first_slurm_host, parse_slurm_tasks_per_node, slurm_port_for_job

__all__ = [
    "LAUNCH_VARIABLES",
    "LaunchEnv",
    "LaunchEnvError",
    "expand_slurm_hostlist",
    "first_slurm_host",
    "launcher_rank_present",
    "parse_slurm_tasks_per_node",
    "read_launch_environ",
    "resolve_launch_env",
    "slurm_port_for_job",
    "torch_env_for",
]

# Each quantity comes from the first of its variables that is set and not blank. MPI comes before Slurm because
# mpirun inside an sbatch script hands its ranks the batch step's SLURM_PROCID=0 and SLURM_NTASKS.
RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
LOCAL_WORLD_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
SLURM_TASKS_PER_NODE_VARIABLES = ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
SLURM_NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")

LAUNCH_VARIABLES: tuple[str, ...] = (
    *RANK_VARIABLES,
    *WORLD_SIZE_VARIABLES,
    *LOCAL_RANK_VARIABLES,
    *LOCAL_WORLD_SIZE_VARIABLES,
    *SLURM_TASKS_PER_NODE_VARIABLES,
    "MASTER_ADDR",
    "MASTER_PORT",
    *SLURM_NODELIST_VARIABLES,
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
)

_LAUNCHER_OF_RANK_VARIABLE = {
    "RANK": "torchrun",
    "OMPI_COMM_WORLD_RANK": "mpi",
    "PMI_RANK": "mpi",
    "SLURM_PROCID": "slurm",
}

# Slurm gives its special steps ids at the top of the uint32 range: interactive 0xfffffffa, batch 0xfffffffb,
# extern 0xfffffffc, pending 0xfffffffd (before 20.11: batch 0xfffffffe, extern 0xffffffff). Anything from
# here up is not a step that srun started.
_FIRST_SPECIAL_SLURM_STEP_ID = 0xFFFFFFF0

_INTEGER = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int | None  # None: unknown (e.g. Slurm placed different task counts on different nodes)
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "mpi": whose variable gave the rank


class _Source(NamedTuple):
    name: str  # the variable actually read
    raw: str  # its value as seen
    value: int


def _first_set(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        raw = environ.get(name)
        if raw is not None and raw.strip():
            return name, raw
    return None


def _parse_int(name: str, raw: str) -> int:
    text = raw.strip()
    if _INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts by default
            raise ValueError(
                f"{name}={text[:20]!r}... has {len(text)} digits; expected a whole number such as 0 or 4"
            ) from None
    raise ValueError(f"{name}={raw!r} is not an integer; expected a whole number such as 0 or 4")


def _read_int(environ: Mapping[str, str], names: Sequence[str]) -> _Source | None:
    found = _first_set(environ, names)
    if found is None:
        return None
    name, raw = found
    return _Source(name, raw, _parse_int(name, raw))


class _LocalWorld(NamedTuple):
    """Processes on this node: `value` None when Slurm placed different task counts on different nodes."""

    name: str
    raw: str
    value: int | None


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> _LocalWorld | None:
    found = _first_set(environ, SLURM_TASKS_PER_NODE_VARIABLES)
    if found is None:
        return None
    name, raw = found
    return _LocalWorld(name, raw, parse_slurm_tasks_per_node(name, raw))


def _master_addr(environ: Mapping[str, str], launcher: str | None) -> str | None:
    found = _first_set(environ, ("MASTER_ADDR",))
    if found is not None:
        return found[1].strip()
    # Under mpirun the SLURM_STEP_* variables, where there are any, belong to the srun step that started MPI's
    # daemons and differ between nodes; the job's list is the same everywhere and mpirun's rank 0 runs on its
    # first node.
    order = SLURM_NODELIST_VARIABLES[::-1] if launcher == "mpi" else SLURM_NODELIST_VARIABLES
    found = _first_set(environ, order)
    if found is None:
        return None
    name, raw = found
    try:
        return first_slurm_host(raw)
    except ValueError as exc:
        raise ValueError(
            f"{name}={raw!r} cannot give the rendezvous host: {exc}. Set MASTER_ADDR to rank 0's host name."
        ) from None


def _master_port(environ: Mapping[str, str]) -> _Source | None:
    port = _read_int(environ, ("MASTER_PORT",))
    if port is not None:
        return port
    job = _read_int(environ, ("SLURM_JOB_ID",))
    if job is None:
        return None
    if job.value < 0:
        raise ValueError(f"SLURM_JOB_ID={job.raw!r} is not a Slurm job id; expected a non-negative integer")
    return _Source(job.name, job.raw, slurm_port_for_job(job.value))


def _missing_line(quantity: str, names: Sequence[str], note: str = "") -> str:
    return f"  - {quantity}: none of {', '.join(names)} is set{note}"


def resolve_launch_env(environ: Mapping[str, str]) -> LaunchEnv:
    """This process's rank, world size and rendezvous point, from launcher variables in ``environ``.

    Pure: reads only ``environ`` (see :func:`read_launch_environ`). Each quantity comes from the first of its
    variables that is set and not blank, torchrun's names first, then Open MPI's, MPICH/Intel MPI's, Slurm's.
    Under Slurm (the variables below exist only there) MASTER_ADDR defaults to the first host of
    SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST (the job's list first when the rank came from MPI), and
    MASTER_PORT to a port derived from SLURM_JOB_ID. A missing quantity raises one :class:`LaunchEnvError`
    listing all of them; a malformed or out-of-range value raises ValueError naming the variable read.

    This does not decide whether a launcher started the process at all: a batch script's own SLURM_PROCID=0 with
    SLURM_NTASKS=4 resolves to rank 0 of 4. Ask :func:`launcher_rank_present` first.
    """
    rank = _read_int(environ, RANK_VARIABLES)
    world = _read_int(environ, WORLD_SIZE_VARIABLES)
    local_rank = _read_int(environ, LOCAL_RANK_VARIABLES)
    launcher = None if rank is None else _LAUNCHER_OF_RANK_VARIABLE[rank.name]
    local_size = _read_int(environ, LOCAL_WORLD_SIZE_VARIABLES)
    local_world = _LocalWorld(*local_size) if local_size is not None else _slurm_tasks_per_node(environ)
    master_addr = _master_addr(environ, launcher)
    master_port = _master_port(environ)
    _raise_if_missing(rank, world, local_rank, master_addr, master_port)
    assert rank is not None and world is not None and master_addr is not None and master_port is not None
    assert launcher is not None
    if local_rank is None:  # only possible with world size 1
        local_rank = _Source("LOCAL_RANK", "", 0)
    _check_ranges(rank, world, local_rank, local_world, master_port)
    return LaunchEnv(
        rank=rank.value,
        local_rank=local_rank.value,
        world_size=world.value,
        local_world_size=local_world.value if local_world is not None else None,
        master_addr=master_addr,
        master_port=master_port.value,
        launcher=launcher,
    )


def _raise_if_missing(
    rank: _Source | None,
    world: _Source | None,
    local_rank: _Source | None,
    master_addr: str | None,
    master_port: _Source | None,
) -> None:
    """One LaunchEnvError listing every quantity no variable gave."""
    missing: list[str] = []
    if rank is None:
        missing.append(_missing_line("rank", RANK_VARIABLES))
    if world is None:
        missing.append(_missing_line("world size", WORLD_SIZE_VARIABLES))
    if local_rank is None and world is not None and world.value > 1:
        missing.append(_missing_line("local rank (rank on this node)", LOCAL_RANK_VARIABLES))
    if master_addr is None:
        missing.append(
            _missing_line(
                "master address",
                ("MASTER_ADDR", *SLURM_NODELIST_VARIABLES),
                " (under Slurm the first host of the node list is used)",
            )
        )
    if master_port is None:
        missing.append(
            _missing_line(
                "master port", ("MASTER_PORT", "SLURM_JOB_ID"), " (under Slurm it is derived from the job id)"
            )
        )
    if missing:
        raise LaunchEnvError(
            "cannot tell where this process sits in a distributed job; missing:\n"
            + "\n".join(missing)
            + "\nLaunch it with torchrun, srun or mpirun, which set these; for ranks started by hand, set RANK, "
            "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself."
        )


def _check_ranges(
    rank: _Source, world: _Source, local_rank: _Source, local_world: _LocalWorld | None, master_port: _Source
) -> None:
    """ValueError naming the variable when a value is out of its range."""
    if world.value < 1:
        raise ValueError(f"{world.name}={world.raw!r} is not a valid world size: it must be at least 1")
    if not 0 <= rank.value < world.value:
        raise ValueError(
            f"{rank.name}={rank.raw!r} is out of range: with world size {world.value} (from {world.name}) a rank "
            f"must be between 0 and {world.value - 1}"
        )
    if local_rank.value < 0:
        raise ValueError(f"{local_rank.name}={local_rank.raw!r} is negative; a local rank is 0 or more")
    local_size = local_world.value if local_world is not None else None
    if local_world is not None and local_size is not None and local_size < 1:
        raise ValueError(
            f"{local_world.name}={local_world.raw!r} gives {local_size} processes on this node; it must be at least 1"
        )
    if local_world is not None and local_size is not None and local_rank.value >= local_size:
        raise ValueError(
            f"{local_rank.name}={local_rank.raw!r} is out of range: with {local_size} processes on this node "
            f"(from {local_world.name}={local_world.raw!r}) a local rank must be between 0 and {local_size - 1}"
        )
    if local_size is None and local_rank.value >= world.value:
        raise ValueError(
            f"{local_rank.name}={local_rank.raw!r} is out of range: with world size {world.value} (from "
            f"{world.name}) a local rank must be between 0 and {world.value - 1}"
        )
    if not 1 <= master_port.value <= 65535:
        raise ValueError(
            f"{master_port.name}={master_port.raw!r} is not a usable TCP port: it must be between 1 and 65535 "
            "(pick a free one such as 29500)"
        )


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    step = (environ.get("SLURM_STEP_ID") or "").strip()
    return step.isdecimal() and step.isascii() and int(step) < _FIRST_SPECIAL_SLURM_STEP_ID


def launcher_rank_present(environ: Mapping[str, str]) -> bool:
    """Whether a launcher gave this process a rank, i.e. it is one of several SPMD processes.

    True when RANK, OMPI_COMM_WORLD_RANK or PMI_RANK is set and not blank. For Slurm, SLURM_PROCID alone is not
    enough: a batch script (and a plain ``python`` run from it) has SLURM_PROCID=0 with SLURM_NTASKS possibly
    above 1, and salloc's interactive step has SLURM_PROCID=0 too. So SLURM_PROCID counts only inside a step that
    srun started: SLURM_STEP_ID is a step number, not unset (batch script) and not one of Slurm's special step
    ids at the top of the 32-bit range (batch, extern, interactive, pending; or their names).
    """
    if _first_set(environ, ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")) is not None:
        return True
    return _first_set(environ, ("SLURM_PROCID",)) is not None and _in_srun_step(environ)


def read_launch_environ() -> dict[str, str]:
    """The set launcher variables of this process (exactly LAUNCH_VARIABLES), read through distvideo.envs, less the
    torchrun names distvideo itself wrote for an earlier generator's rendezvous (``envs.set_external``): they are not
    the launcher's, and would make an srun or mpirun launch read as torchrun's."""
    ours = envs.written_here()
    return {name: value for name, value in envs.snapshot(LAUNCH_VARIABLES).items() if name not in ours}


def torch_env_for(env: LaunchEnv) -> dict[str, str]:
    """torchrun's variable names with the resolved values, for ``envs.set_external`` before an env:// rendezvous."""
    values = {
        "RANK": str(env.rank),
        "WORLD_SIZE": str(env.world_size),
        "LOCAL_RANK": str(env.local_rank),
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": str(env.master_port),
    }
    if env.local_world_size is not None:
        values["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    return values
