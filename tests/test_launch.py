"""Tables for distvideo.launch: launcher variables in, LaunchEnv or a precise error out."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distvideo import envs, launch
from distvideo.launch import (
    LAUNCH_VARIABLES,
    LaunchEnv,
    LaunchEnvError,
    expand_slurm_hostlist,
    first_slurm_host,
    launcher_rank_present,
    read_launch_environ,
    resolve_launch_env,
    slurm_port_for_job,
    torch_env_for,
)


@dataclass(frozen=True)
class Raises:
    type: type[Exception]
    substrings: tuple[str, ...]


def raises(exc_type: type[Exception], *substrings: str) -> Raises:
    return Raises(exc_type, substrings)


def env(**values: object) -> dict[str, str]:
    return {name: str(value) for name, value in values.items()}


RENDEZVOUS = env(MASTER_ADDR="host0", MASTER_PORT=29500)
TORCHRUN = env(RANK=1, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, **RENDEZVOUS)
OPEN_MPI = env(
    OMPI_COMM_WORLD_RANK=3,
    OMPI_COMM_WORLD_SIZE=4,
    OMPI_COMM_WORLD_LOCAL_RANK=1,
    OMPI_COMM_WORLD_LOCAL_SIZE=2,
    **RENDEZVOUS,
)
MPICH = env(PMI_RANK=2, PMI_SIZE=4, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=2, **RENDEZVOUS)
# One task of `srun -N2 --ntasks-per-node=2` inside job 12345.
SLURM = env(
    SLURM_PROCID=1,
    SLURM_NTASKS=4,
    SLURM_LOCALID=1,
    SLURM_STEP_TASKS_PER_NODE="2(x2)",
    SLURM_TASKS_PER_NODE="2(x2)",
    SLURM_STEP_NODELIST="n[3-4]",
    SLURM_JOB_NODELIST="n[1-4]",
    SLURM_JOB_ID=12345,
    SLURM_STEP_ID=0,
)
# the documented derivation (docs/launching.md): 20000 + job id % 12000, written out here rather than computed by the
# function under test
SLURM_PORT = 20345
# The environment of an sbatch script on the first of two nodes, one task each.
SBATCH = env(
    SLURM_PROCID=0,
    SLURM_NTASKS=2,
    SLURM_LOCALID=0,
    SLURM_TASKS_PER_NODE="1(x2)",
    SLURM_JOB_NODELIST="n[1-2]",
    SLURM_JOB_ID=777,
)


def le(rank, local_rank, world_size, local_world_size, addr, port, launcher) -> LaunchEnv:
    return LaunchEnv(rank, local_rank, world_size, local_world_size, addr, port, launcher)


def without(base: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in base.items() if k not in names}


ALL_RANK = "RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID"
ALL_WORLD = "WORLD_SIZE, OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS"
ALL_LOCAL = "LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID"
ALL_ADDR = "MASTER_ADDR, SLURM_STEP_NODELIST, SLURM_JOB_NODELIST"
ALL_PORT = "MASTER_PORT, SLURM_JOB_ID"

CASES: list[tuple[str, dict[str, str], LaunchEnv | Raises]] = [
    # --- each launcher alone
    ("torchrun", TORCHRUN, le(1, 1, 4, 2, "host0", 29500, "torchrun")),
    ("open-mpi", OPEN_MPI, le(3, 1, 4, 2, "host0", 29500, "mpi")),
    ("mpich", MPICH, le(2, 0, 4, 2, "host0", 29500, "mpi")),
    ("slurm", SLURM, le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm")),
    # --- precedence: torchrun over Open MPI over MPICH over Slurm, per quantity
    (
        "torchrun-over-mpi-and-slurm",
        {**SLURM, **MPICH, **OPEN_MPI, **TORCHRUN},
        le(1, 1, 4, 2, "host0", 29500, "torchrun"),
    ),
    ("open-mpi-over-mpich", {**MPICH, **OPEN_MPI}, le(3, 1, 4, 2, "host0", 29500, "mpi")),
    ("mpich-over-slurm", {**SLURM, **MPICH}, le(2, 0, 4, 2, "host0", 29500, "mpi")),
    (
        "mpirun-inside-sbatch",
        {
            **SBATCH,
            **env(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=0),
            **env(OMPI_COMM_WORLD_LOCAL_SIZE=1),
        },
        le(1, 0, 2, 1, "n1", 20777, "mpi"),
    ),
    (
        # On a non-head node Open MPI's ranks descend from the srun step that started its daemons.
        "mpirun-inside-sbatch-uses-job-nodelist",
        {**SBATCH, **env(PMI_RANK=1, PMI_SIZE=2, MPI_LOCALRANKID=0, MPI_LOCALNRANKS=1, SLURM_STEP_NODELIST="n2")},
        le(1, 0, 2, 1, "n1", 20777, "mpi"),
    ),
    ("per-quantity-fallback", {**without(TORCHRUN, "LOCAL_RANK"), **SLURM}, le(1, 1, 4, 2, "host0", 29500, "torchrun")),
    # --- empty or blank counts as unset
    ("empty-rank-falls-through", {**SLURM, "RANK": "", "WORLD_SIZE": "  "}, le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm")),
    (
        "empty-master-addr-under-slurm",
        {**SLURM, "MASTER_ADDR": "", "MASTER_PORT": ""},
        le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "empty-everything",
        {name: "" for name in LAUNCH_VARIABLES},
        raises(LaunchEnvError, ALL_RANK, ALL_WORLD, ALL_ADDR, ALL_PORT),
    ),
    # --- Slurm tasks per node
    (
        "tasks-per-node-plain",
        {**without(SLURM, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE": "4"},
        le(1, 1, 4, 4, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "tasks-per-node-repeat-with-spaces",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": " 4(x2) "},
        le(1, 1, 4, 4, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "tasks-per-node-repeat-alone",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3)", "SLURM_NTASKS": "6"},
        le(1, 1, 6, 2, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "tasks-per-node-heterogeneous",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NTASKS": "7"},
        le(1, 1, 7, None, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "tasks-per-node-equal-list",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2,2"},
        le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "tasks-per-node-equal-mixed-list",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2), 2"},
        le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "ntasks-per-node-first",
        {**SLURM, "SLURM_NTASKS_PER_NODE": "3", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "1"},
        le(1, 1, 4, 3, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "step-tasks-before-job-tasks",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "8"},
        le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "job-tasks-last",
        {**without(SLURM, "SLURM_STEP_TASKS_PER_NODE"), "SLURM_TASKS_PER_NODE": "8"},
        le(1, 1, 4, 8, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "no-tasks-per-node",
        without(SLURM, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
        le(1, 1, 4, None, "n3", SLURM_PORT, "slurm"),
    ),
    (
        "mpi-local-size-over-slurm-tasks",
        {**SLURM, **without(MPICH, "MPI_LOCALRANKID"), "SLURM_STEP_TASKS_PER_NODE": "garbage"},
        le(2, 1, 4, 2, "host0", 29500, "mpi"),
    ),
    (
        "tasks-per-node-malformed",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x"},
        raises(ValueError, "SLURM_STEP_TASKS_PER_NODE='2(x'", "N(xM)"),
    ),
    (
        "tasks-per-node-not-a-number",
        {**SLURM, "SLURM_NTASKS_PER_NODE": "four"},
        raises(ValueError, "SLURM_NTASKS_PER_NODE='four'"),
    ),
    (
        "tasks-per-node-zero-repeat",
        {**SLURM, "SLURM_TASKS_PER_NODE": "2(x0)", "SLURM_STEP_TASKS_PER_NODE": ""},
        raises(ValueError, "SLURM_TASKS_PER_NODE='2(x0)'"),
    ),
    (
        "tasks-per-node-empty-entry",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2,,2"},
        raises(ValueError, "SLURM_STEP_TASKS_PER_NODE"),
    ),
    (
        "tasks-per-node-zero",
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "0"},
        raises(ValueError, "SLURM_STEP_TASKS_PER_NODE='0'", "at least 1"),
    ),
    # --- Slurm host lists give MASTER_ADDR
    ("hostlist-range", {**SLURM, "SLURM_STEP_NODELIST": "n[3-4]"}, le(1, 1, 4, 2, "n3", SLURM_PORT, "slurm")),
    (
        "hostlist-brackets-with-commas",
        {**SLURM, "SLURM_STEP_NODELIST": "gpu-a[01,03],gpu-b7"},
        le(1, 1, 4, 2, "gpu-a01", SLURM_PORT, "slurm"),
    ),
    ("hostlist-zero-padding", {**SLURM, "SLURM_STEP_NODELIST": "n[07-10]"}, le(1, 1, 4, 2, "n07", SLURM_PORT, "slurm")),
    ("hostlist-plain", {**SLURM, "SLURM_STEP_NODELIST": "node1,node2"}, le(1, 1, 4, 2, "node1", SLURM_PORT, "slurm")),
    ("hostlist-job-fallback", without(SLURM, "SLURM_STEP_NODELIST"), le(1, 1, 4, 2, "n1", SLURM_PORT, "slurm")),
    ("hostlist-empty-step-falls-back", {**SLURM, "SLURM_STEP_NODELIST": ""}, le(1, 1, 4, 2, "n1", SLURM_PORT, "slurm")),
    (
        "master-addr-over-hostlist",
        {**SLURM, "MASTER_ADDR": "10.0.0.9"},
        le(1, 1, 4, 2, "10.0.0.9", SLURM_PORT, "slurm"),
    ),
    (
        "hostlist-malformed",
        {**SLURM, "SLURM_STEP_NODELIST": "n[3-"},
        raises(ValueError, "SLURM_STEP_NODELIST='n[3-'", "MASTER_ADDR"),
    ),
    (
        "hostlist-backwards-range",
        {**SLURM, "SLURM_STEP_NODELIST": "n[4-3]"},
        raises(ValueError, "SLURM_STEP_NODELIST='n[4-3]'"),
    ),
    # --- MASTER_PORT from the job id
    ("port-derived", SLURM, le(1, 1, 4, 2, "n3", 20345, "slurm")),
    ("port-derived-job-0", {**SLURM, "SLURM_JOB_ID": "0"}, le(1, 1, 4, 2, "n3", 20000, "slurm")),
    (
        "port-derived-huge-job",
        {**SLURM, "SLURM_JOB_ID": "9" * 40},
        le(1, 1, 4, 2, "n3", 23999, "slurm"),  # (10**40 - 1) % 12000 == 3999
    ),
    ("master-port-over-job-id", {**SLURM, "MASTER_PORT": "1234"}, le(1, 1, 4, 2, "n3", 1234, "slurm")),
    (
        "master-port-hides-bad-job-id",
        {**SLURM, "MASTER_PORT": "1234", "SLURM_JOB_ID": "x"},
        le(1, 1, 4, 2, "n3", 1234, "slurm"),
    ),
    (
        "job-id-not-integer",
        {**SLURM, "SLURM_JOB_ID": "12a"},
        raises(ValueError, "SLURM_JOB_ID='12a' is not an integer"),
    ),
    ("job-id-negative", {**SLURM, "SLURM_JOB_ID": "-3"}, raises(ValueError, "SLURM_JOB_ID='-3'")),
    # --- missing quantities: one error listing every one, with every alternative
    (
        "missing-all",
        {},
        raises(LaunchEnvError, ALL_RANK, ALL_WORLD, ALL_ADDR, ALL_PORT, "torchrun", "srun", "mpirun", "by hand"),
    ),
    ("missing-rank", without(TORCHRUN, "RANK"), raises(LaunchEnvError, "rank: none of " + ALL_RANK)),
    ("missing-world", without(TORCHRUN, "WORLD_SIZE"), raises(LaunchEnvError, ALL_WORLD)),
    ("missing-addr", without(TORCHRUN, "MASTER_ADDR"), raises(LaunchEnvError, ALL_ADDR)),
    ("missing-port", without(TORCHRUN, "MASTER_PORT"), raises(LaunchEnvError, ALL_PORT)),
    (
        "missing-addr-and-port-outside-slurm",
        without(OPEN_MPI, "MASTER_ADDR", "MASTER_PORT"),
        raises(LaunchEnvError, ALL_ADDR, ALL_PORT),
    ),
    (
        "missing-rank-and-local-rank",
        without(TORCHRUN, "RANK", "LOCAL_RANK"),
        raises(LaunchEnvError, ALL_RANK, ALL_LOCAL),
    ),
    (
        "malformed-reported-before-missing",
        {**without(TORCHRUN, "RANK"), "WORLD_SIZE": "x"},
        raises(ValueError, "WORLD_SIZE='x'"),
    ),
    # --- local rank missing
    (
        "local-rank-missing-world-1",
        env(RANK=0, WORLD_SIZE=1, **RENDEZVOUS),
        le(0, 0, 1, None, "host0", 29500, "torchrun"),
    ),
    ("local-rank-missing-world-4", without(TORCHRUN, "LOCAL_RANK"), raises(LaunchEnvError, "local rank", ALL_LOCAL)),
    (
        "local-rank-missing-slurm",
        without(SLURM, "SLURM_LOCALID"),
        raises(LaunchEnvError, "LOCAL_RANK", "SLURM_LOCALID"),
    ),
    # --- validation: the variable read, the value seen
    ("rank-not-integer", {**SLURM, "SLURM_PROCID": "abc"}, raises(ValueError, "SLURM_PROCID='abc' is not an integer")),
    ("rank-float", {**TORCHRUN, "RANK": "1.0"}, raises(ValueError, "RANK='1.0' is not an integer")),
    (
        "world-not-integer",
        {**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "four"},
        raises(ValueError, "OMPI_COMM_WORLD_SIZE='four'"),
    ),
    ("local-rank-not-integer", {**MPICH, "MPI_LOCALRANKID": "0x1"}, raises(ValueError, "MPI_LOCALRANKID='0x1'")),
    (
        "local-world-not-integer",
        {**TORCHRUN, "LOCAL_WORLD_SIZE": "2 nodes"},
        raises(ValueError, "LOCAL_WORLD_SIZE='2 nodes'"),
    ),
    (
        "port-not-integer",
        {**TORCHRUN, "MASTER_PORT": "http"},
        raises(ValueError, "MASTER_PORT='http' is not an integer"),
    ),
    ("integer-with-spaces-ok", {**TORCHRUN, "RANK": " 1 "}, le(1, 1, 4, 2, "host0", 29500, "torchrun")),
    ("world-zero", {**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, raises(ValueError, "WORLD_SIZE='0'", "at least 1")),
    ("world-negative", {**SLURM, "SLURM_NTASKS": "-2"}, raises(ValueError, "SLURM_NTASKS='-2'", "at least 1")),
    ("rank-equals-world", {**TORCHRUN, "RANK": "4"}, raises(ValueError, "RANK='4'", "WORLD_SIZE", "between 0 and 3")),
    (
        "rank-negative",
        {**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "-1"},
        raises(ValueError, "OMPI_COMM_WORLD_RANK='-1'", "between 0 and 3"),
    ),
    ("local-rank-negative", {**TORCHRUN, "LOCAL_RANK": "-1"}, raises(ValueError, "LOCAL_RANK='-1'", "0 or more")),
    (
        "local-world-zero",
        {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "0"},
        raises(ValueError, "OMPI_COMM_WORLD_LOCAL_SIZE='0'", "at least 1"),
    ),
    (
        "local-rank-vs-local-world",
        {**TORCHRUN, "LOCAL_RANK": "2"},
        raises(ValueError, "LOCAL_RANK='2'", "LOCAL_WORLD_SIZE='2'", "between 0 and 1"),
    ),
    (
        "local-rank-vs-slurm-tasks",
        {**SLURM, "SLURM_LOCALID": "3"},
        raises(ValueError, "SLURM_LOCALID='3'", "SLURM_STEP_TASKS_PER_NODE='2(x2)'"),
    ),
    (
        "local-rank-vs-world-when-local-unknown",
        {**without(TORCHRUN, "LOCAL_WORLD_SIZE"), "LOCAL_RANK": "4"},
        raises(ValueError, "LOCAL_RANK='4'", "WORLD_SIZE", "between 0 and 3"),
    ),
    (
        "local-rank-below-world-when-local-unknown",
        {**without(TORCHRUN, "LOCAL_WORLD_SIZE"), "LOCAL_RANK": "3"},
        le(1, 3, 4, None, "host0", 29500, "torchrun"),
    ),
    # --- port bounds
    ("port-0", {**TORCHRUN, "MASTER_PORT": "0"}, raises(ValueError, "MASTER_PORT='0'", "between 1 and 65535")),
    ("port-1", {**TORCHRUN, "MASTER_PORT": "1"}, le(1, 1, 4, 2, "host0", 1, "torchrun")),
    ("port-65535", {**TORCHRUN, "MASTER_PORT": "65535"}, le(1, 1, 4, 2, "host0", 65535, "torchrun")),
    (
        "port-65536",
        {**TORCHRUN, "MASTER_PORT": "65536"},
        raises(ValueError, "MASTER_PORT='65536'", "between 1 and 65535"),
    ),
    ("port-negative", {**TORCHRUN, "MASTER_PORT": "-29500"}, raises(ValueError, "MASTER_PORT='-29500'")),
    ("port-huge", {**TORCHRUN, "MASTER_PORT": "9" * 5000}, raises(ValueError, "MASTER_PORT='99999", "5000 digits")),
]


@pytest.mark.parametrize(("environ", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolve_launch_env(environ: dict[str, str], expected: LaunchEnv | Raises) -> None:
    if isinstance(expected, LaunchEnv):
        assert resolve_launch_env(environ) == expected
        return
    with pytest.raises(expected.type) as info:
        resolve_launch_env(environ)
    if expected.type is ValueError:
        assert not isinstance(info.value, RuntimeError)
    message = str(info.value)
    for substring in expected.substrings:
        assert substring in message, f"{substring!r} not in {message!r}"


def test_case_ids_are_unique() -> None:
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


def test_launch_env_error_is_a_runtime_error() -> None:
    assert issubclass(LaunchEnvError, RuntimeError)
    assert not issubclass(LaunchEnvError, ValueError)


def test_resolve_does_not_mutate_its_input() -> None:
    environ = dict(SLURM)
    resolve_launch_env(environ)
    assert environ == SLURM


# --- port derivation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("job_id", [0, 1, 12345, 2**31 - 1, 2**32 + 7, 10**30])
def test_slurm_port_in_range(job_id: int) -> None:
    assert 20000 <= slurm_port_for_job(job_id) <= 31999


def test_slurm_port_does_not_depend_on_the_process() -> None:
    code = "from distvideo.launch import resolve_launch_env as r; print(r({'SLURM_PROCID': '0', 'SLURM_NTASKS': '1', 'SLURM_JOB_NODELIST': 'n1', 'SLURM_JOB_ID': '987654'}).master_port)"
    ports = {
        subprocess.run(
            [sys.executable, "-c", code], env={"PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert ports == {"23654"}  # 20000 + 987654 % 12000


def test_consecutive_jobs_get_different_ports() -> None:
    assert len({slurm_port_for_job(j) for j in range(1000, 1100)}) == 100


# --- host lists -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "hosts"),
    [
        ("n1", ["n1"]),
        ("node1,node2", ["node1", "node2"]),
        ("n[3-4]", ["n3", "n4"]),
        ("n[07-10]", ["n07", "n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("gpu-a[01,03],gpu-b7", ["gpu-a01", "gpu-a03", "gpu-b7"]),
        ("n[1-2,5],m[3]", ["n1", "n2", "n5", "m3"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("rack[1-2]-ib", ["rack1-ib", "rack2-ib"]),
        ("  n[1-2]  ", ["n1", "n2"]),
        ("n1, n2", ["n1", "n2"]),
        ("", []),
        ("10.0.0.1", ["10.0.0.1"]),
    ],
)
def test_expand_slurm_hostlist(value: str, hosts: list[str]) -> None:
    assert expand_slurm_hostlist(value) == hosts
    if hosts:
        assert first_slurm_host(value) == hosts[0]


@pytest.mark.parametrize(
    "value",
    ["n[1-", "n]1[", "n[[1]]", "n[]", "n[a-b]", "n[4-3]", "n[1-2", "a,,b", "a,", "[1-2]", "n 1", "n[0-99999999]"],
)
def test_expand_slurm_hostlist_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="Slurm host list"):
        expand_slurm_hostlist(value)
    with pytest.raises(ValueError):
        first_slurm_host(value)


def test_first_slurm_host_does_not_expand_everything() -> None:
    assert first_slurm_host("a[0-65535]b[0-65535]c[0-65535]") == "a0b0c0"


def test_first_slurm_host_of_blank_list() -> None:
    with pytest.raises(ValueError, match="names no host"):
        first_slurm_host("  ")


# --- launcher_rank_present ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "present"),
    [
        ({}, False),
        (env(RANK=0), True),
        (env(RANK=""), False),
        (env(OMPI_COMM_WORLD_RANK=2), True),
        (env(PMI_RANK=0), True),
        ({**SBATCH, "OMPI_COMM_WORLD_RANK": "0"}, True),  # mpirun inside sbatch
        (SLURM, True),  # srun step 0
        ({**SLURM, "SLURM_STEP_ID": "17"}, True),
        (SBATCH, False),  # plain python in a batch script: no step id
        ({**SBATCH, "SLURM_STEP_ID": "4294967291"}, False),  # batch step
        ({**SBATCH, "SLURM_STEP_ID": "4294967290"}, False),  # salloc's interactive step
        ({**SBATCH, "SLURM_STEP_ID": "4294967292"}, False),  # extern step
        ({**SBATCH, "SLURM_STEP_ID": "4294967294"}, False),  # batch step before Slurm 20.11
        ({**SBATCH, "SLURM_STEP_ID": "batch"}, False),
        ({**SBATCH, "SLURM_STEP_ID": ""}, False),
        ({**SLURM, "SLURM_PROCID": ""}, False),
        (env(SLURM_STEP_ID=0), False),
    ],
)
def test_launcher_rank_present(environ: dict[str, str], present: bool) -> None:
    assert launcher_rank_present(environ) is present


# --- torch_env_for --------------------------------------------------------------------------------------------


def test_torch_env_for() -> None:
    resolved = resolve_launch_env(SLURM)
    assert torch_env_for(resolved) == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n3",
        "MASTER_PORT": str(SLURM_PORT),
    }
    unknown_local = le(0, 0, 3, None, "h", 80, "slurm")
    assert "LOCAL_WORLD_SIZE" not in torch_env_for(unknown_local)
    # What it produces resolves back to the same place under torchrun's names.
    assert resolve_launch_env(torch_env_for(resolved)) == le(1, 1, 4, 2, "n3", SLURM_PORT, "torchrun")


# --- reading the real environment -----------------------------------------------------------------------------


@pytest.fixture
def declared_launch_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # SLURM_STEP_ID is read by launch.py but awaits its declaration in envs.py.
    for name in LAUNCH_VARIABLES:
        if name not in envs.REGISTRY:
            monkeypatch.setitem(envs.REGISTRY, name, envs.EnvVar(name, str, None, "test stand-in", "launcher"))
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("declared_launch_variables")
def test_read_launch_environ_reads_set_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv("MASTER_ADDR", "")
    monkeypatch.setenv("DISTVIDEO_LOG_LEVEL", "DEBUG")  # declared, but not a launch variable
    assert read_launch_environ() == {"RANK": "3", "WORLD_SIZE": "8", "SLURM_JOB_NODELIST": "n[1-2]", "MASTER_ADDR": ""}


@pytest.mark.usefixtures("declared_launch_variables")
def test_read_launch_environ_goes_through_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def fake_get_raw(name: str) -> str | None:
        asked.append(name)
        return "5" if name == "PMI_RANK" else None

    monkeypatch.setattr(envs, "get_raw", fake_get_raw)
    assert read_launch_environ() == {"PMI_RANK": "5"}
    assert sorted(asked) == sorted(LAUNCH_VARIABLES)


def test_every_launch_variable_is_declared_in_envs() -> None:
    undeclared = {name for name in LAUNCH_VARIABLES if name not in envs.REGISTRY}
    assert not undeclared
    assert all(envs.REGISTRY[name].group == "launcher" for name in LAUNCH_VARIABLES)


def test_launch_variables_are_unique() -> None:
    assert len(LAUNCH_VARIABLES) == len(set(LAUNCH_VARIABLES))


def test_launch_module_leaves_os_environ_to_envs() -> None:
    source = Path(launch.__file__).read_text()
    assert "os.environ" not in source
    assert "import os" not in source
    assert "getenv" not in source


# --- property: any environment gives a valid LaunchEnv or an error naming a variable --------------------------

_VALUES = st.one_of(
    st.integers(-3, 9).map(str),
    st.sampled_from(["", " ", "abc", "1.5", "0x10", " 2 ", "+1", "٣", "1_0"]),
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["n[3-4]", "gpu-a[01,03],gpu-b7", "n[07-10]", "node1,node2", "n[", "n[5-2]", "[1]", "a,,b"]),
    st.sampled_from(["4", " 4(x2) ", "2(x3),1", "2,2", "1(x2)", "2(x0)", "(x2)", "3(x"]),
    st.text(max_size=8),
)
_BASES = st.sampled_from([{}, TORCHRUN, OPEN_MPI, MPICH, SLURM, SBATCH])
_LAUNCHERS = {"torchrun", "mpi", "slurm"}


@settings(max_examples=300, deadline=None)
@given(base=_BASES, overrides=st.dictionaries(st.sampled_from(LAUNCH_VARIABLES), _VALUES, max_size=6))
def test_resolve_never_returns_nonsense(base: dict[str, str], overrides: dict[str, str]) -> None:
    environ = {**base, **overrides}
    try:
        result = resolve_launch_env(environ)
    except (ValueError, RuntimeError) as exc:
        assert any(name in str(exc) for name in LAUNCH_VARIABLES), str(exc)
        return
    assert result.world_size >= 1
    assert 0 <= result.rank < result.world_size
    assert result.local_rank >= 0
    if result.local_world_size is None:
        assert result.local_rank < result.world_size
    else:
        assert 1 <= result.local_world_size
        assert result.local_rank < result.local_world_size
    assert 1 <= result.master_port <= 65535
    assert result.master_addr and result.master_addr == result.master_addr.strip()
    assert result.launcher in _LAUNCHERS
    rank_name = next(n for n in launch.RANK_VARIABLES if environ.get(n, "").strip())
    assert result.launcher == {"RANK": "torchrun", "SLURM_PROCID": "slurm"}.get(rank_name, "mpi")
    assert torch_env_for(result)["RANK"] == str(result.rank)


@pytest.mark.usefixtures("declared_launch_variables")
@pytest.mark.parametrize(
    ("launcher_vars", "expected"),
    [
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "mpi"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "torchrun"),
    ],
    ids=["mpirun", "torchrun"],
)
def test_a_second_generator_sees_the_launchers_variables_not_ours(monkeypatch, launcher_vars, expected) -> None:
    """The external executor writes torchrun's names for env:// (``envs.set_external``); a second generator in the
    same process (found by the launched CLI-then-API test) must still resolve the launcher that started it, not
    "torchrun" from the names distvideo wrote. Variables the launcher itself set stay the launcher's."""
    monkeypatch.setattr(envs, "_WRITTEN", {})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # restored (unset) after the test, whatever set_external writes
        monkeypatch.delenv(name)
    for name, value in {**launcher_vars, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}.items():
        monkeypatch.setenv(name, value)
    first = resolve_launch_env(read_launch_environ())
    assert first.launcher == expected
    envs.set_external(torch_env_for(first))
    assert envs.get_raw("RANK") == "1"  # written: env:// reads it
    second = resolve_launch_env(read_launch_environ())
    assert second == first
    assert envs.written_here() == ({"RANK", "WORLD_SIZE", "LOCAL_RANK"} if expected == "mpi" else set())
