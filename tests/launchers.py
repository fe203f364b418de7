"""Run test programs under real launchers (torchrun, srun, Open MPI's mpirun, MPICH's mpiexec) on CPU.

Usage from a test module (tests/ is on sys.path, so ``from launchers import ...`` works; importing the
``local_slurm`` fixture into a module registers it there)::

    from launchers import run_launcher
    from launchers import local_slurm  # noqa: F401  (a fixture: importing it registers it in this module)

    @pytest.mark.launcher
    @pytest.mark.slurm
    @pytest.mark.usefixtures("local_slurm")  # or take it as an argument (add "# noqa: F811") for SLURM_CONF
    def test_something(tmp_path):
        proc = run_launcher("srun", [str(script), "--flag"], nproc=2, env={"FOO": "1"}, check=True)
        assert "..." in proc.stdout

``run_launcher`` fails the test, naming what to install, when the launcher is missing (never a skip); starts
this session's private two-node Slurm when needed (stopped when the session ends); lets torchrun pick its own
free port (``--standalone``); and kills everything it started when the timeout expires, then fails the test with
the output captured so far. srun ranks get no MASTER_ADDR/MASTER_PORT: the product derives them from the node
list and the job id, as on a real cluster. mpirun and mpiexec ranks get them (MPI has no rendezvous of its own).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil
import pytest

from background import popen

REPO_ROOT = Path(__file__).resolve().parent.parent
START_SLURM_SCRIPT = REPO_ROOT / "scripts" / "slurm" / "start_local_slurm.sh"
STOP_SLURM_SCRIPT = REPO_ROOT / "scripts" / "slurm" / "stop_local_slurm.sh"

LAUNCHERS = ("torchrun", "srun", "mpirun", "mpich")

LAUNCHER_INSTALL = {
    "torchrun": "pip install torch  (or: bash scripts/setup_venv.sh)",
    "srun": "apt-get install -y slurm-wlm munge  (or: make system-deps)",
    "mpirun": "apt-get install -y openmpi-bin  (or: make system-deps)",
    "mpich": "apt-get install -y mpich  (or: make system-deps)",
}

# Programs each launcher needs on this machine (srun also needs the daemons of the local Slurm). Open MPI and MPICH
# are called by their own names: both install a `mpirun`, and Debian's alternatives decide which one that is.
_LAUNCHER_PROGRAMS = {
    "torchrun": (),
    "srun": ("srun", "sinfo", "scontrol", "scancel", "slurmctld", "slurmd", "munged", "munge", "mungekey"),
    "mpirun": ("mpirun.openmpi",),
    "mpich": ("mpiexec.mpich",),
}

# Variables set by an enclosing launcher or job; inheriting them would confuse the children.
_INHERITED_DROP_EXACT = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    }
)
_INHERITED_DROP_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMIX_", "PMI_", "HYDRA_", "HYDI_")
_INHERITED_KEEP_PREFIXES = ("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")

# Nothing forced by default: in particular not OMP_NUM_THREADS, so the product's own thread policy per rank (cores on
# the node / ranks on the node, unless the user set it) is what the launched ranks run with.
DEFAULT_CHILD_ENV: dict[str, str] = {}

# Dropped from the inherited environment unless the caller passes them: with PYTHONUNBUFFERED every
# print() is two write() calls (text, then newline), so the lines of different ranks interleave mid-line
# (seen with mpirun). Ranks should print(..., flush=True): one write per line, visible even if killed.
_INHERITED_DROP_OUTPUT = frozenset({"PYTHONUNBUFFERED"})


class LauncherTimeout(AssertionError):
    """Raised (as a test failure) when a launched command runs past its timeout."""


def _which(program: str) -> str | None:
    # Daemons live in /usr/sbin, which is not on every user's PATH.
    path = os.environ.get("PATH", os.defpath)
    return shutil.which(program, path=os.pathsep.join([path, "/usr/local/sbin", "/usr/sbin", "/sbin"]))


def missing_programs(name: str) -> list[str]:
    """Programs that launcher ``name`` needs and that are not installed (empty when usable)."""
    if name not in _LAUNCHER_PROGRAMS:
        raise ValueError(f"unknown launcher {name!r}; expected one of {LAUNCHERS}")
    if name == "torchrun":
        try:
            import torch.distributed.run  # noqa: F401
        except ImportError:
            return ["torch.distributed.run"]
        return []
    return [p for p in _LAUNCHER_PROGRAMS[name] if _which(p) is None]


def require_launcher(name: str) -> None:
    """Fail the test, naming what to install, when launcher ``name`` is missing (the suite never skips it)."""
    missing = missing_programs(name)
    if missing:
        pytest.fail(
            f"{name} not available (missing: {', '.join(missing)}); install with: {LAUNCHER_INSTALL[name]}",
            pytrace=False,
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release it). Another process may take
    it before the caller's rank binds it: callers retry such a launch (``port_was_taken``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def python_executable() -> str:
    """The interpreter running the tests (the venv's python), used for every rank."""
    return sys.executable


def console_script(name: str) -> str:
    """Path of a console script installed next to the test interpreter (e.g. ``distvideo``), else ``name``."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def torchrun_command() -> list[str]:
    """The torchrun entry point of the test interpreter's environment."""
    exe = Path(sys.executable).parent / "torchrun"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "torch.distributed.run"]


@functools.cache
def _mpirun_version() -> tuple[int, ...]:
    try:
        out = subprocess.run(
            ["mpirun.openmpi", "--version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(g) for g in m.groups() if g is not None) if m else ()


def _mpirun_shared_memory_btl() -> str:
    # Open MPI 4.x calls its shared-memory transport "vader"; 5.x renamed it "sm".
    version = _mpirun_version()
    return "sm" if version and version[0] >= 5 else "vader"


# ----------------------------------------------------------------------------------------------------------
# Local Slurm
# ----------------------------------------------------------------------------------------------------------

SLURM_NODES = ("distvideo-n1", "distvideo-n2")  # the two emulated nodes of the local Slurm (both on this host)

_slurm_state: dict[str, object] = {}


def start_local_slurm(timeout: float = 120) -> dict[str, str]:
    """Start (once per process) this session's private two-node Slurm and return the env additions srun needs.

    The cluster lives in a directory of its own (``DISTVIDEO_SLURM_DIR`` when the user set it, else a new one from
    mkdtemp) with ports chosen free, so another test session on the machine, with its own Slurm, is not disturbed;
    ``stop_local_slurm`` (called when the session ends) stops the daemons this process started and removes the
    directory it created. Fails the test (with the daemon logs) when the cluster cannot be started, e.g. without
    root; a failure is remembered, so later tests fail at once instead of waiting again.
    """
    if "env" in _slurm_state:
        return dict(_slurm_state["env"])  # type: ignore[call-overload]
    if "error" in _slurm_state:
        pytest.fail(str(_slurm_state["error"]), pytrace=False)
    require_launcher("srun")
    env = _base_env()
    given = os.environ.get("DISTVIDEO_SLURM_DIR")
    directory = given or tempfile.mkdtemp(prefix="distvideo-slurm-")
    env["DISTVIDEO_SLURM_DIR"] = directory
    started = time.monotonic()
    _slurm_state["dir"] = directory
    _slurm_state["remove_dir"] = not given
    try:
        proc = subprocess.run(
            ["bash", str(START_SLURM_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        _slurm_state["error"] = f"{START_SLURM_SCRIPT} timed out after {timeout}s\n{_decode(exc.stderr)}"
        pytest.fail(str(_slurm_state["error"]), pytrace=False)
    # what it started (all of it, unless it found the user's cluster already running) is ours to stop
    _slurm_state["started_here"] = "already running" not in proc.stderr
    if proc.returncode != 0:
        _slurm_state["error"] = (
            f"{START_SLURM_SCRIPT} failed (rc={proc.returncode}); it needs root and: {LAUNCHER_INSTALL['srun']}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
        pytest.fail(str(_slurm_state["error"]), pytrace=False)
    additions: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key == "SLURM_CONF":
            additions[key] = value
    if "SLURM_CONF" not in additions:
        pytest.fail(f"{START_SLURM_SCRIPT} printed no SLURM_CONF line:\n{proc.stdout}\n{proc.stderr}", pytrace=False)
    _slurm_state["env"] = additions
    _slurm_state["start_seconds"] = time.monotonic() - started
    return dict(additions)


def stop_local_slurm() -> None:
    """Stop the daemons ``start_local_slurm`` started in this process and remove the directory it created."""
    directory = _slurm_state.get("dir")
    if directory is None:
        return
    if _slurm_state.get("started_here", True):
        args = ["--remove"] if _slurm_state.get("remove_dir") else []
        subprocess.run(
            ["bash", str(STOP_SLURM_SCRIPT), *args, str(directory)],
            capture_output=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    _slurm_state.clear()


@pytest.fixture(scope="session")
def local_slurm() -> dict[str, str]:
    """Session fixture: the private two-node Slurm is up; returns env additions for srun (SLURM_CONF)."""
    return start_local_slurm()


# ----------------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------------


def _decode(data: bytes | str | None) -> str:
    if data is None:
        return ""
    if isinstance(data, bytes):
        return data.decode("utf-8", errors="replace")
    return data


def _base_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {}
    for key, value in (os.environ if base is None else base).items():
        if key in _INHERITED_DROP_EXACT or key in _INHERITED_DROP_OUTPUT:
            continue
        if key.startswith(_INHERITED_DROP_PREFIXES) and not key.startswith(_INHERITED_KEEP_PREFIXES):
            continue
        env[key] = value
    return env


def launcher_env(env: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for launched programs: os.environ (or ``base``) without launcher/job variables and PYTHONUNBUFFERED,
    then DEFAULT_CHILD_ENV and GLOO_SOCKET_IFNAME=lo where unset, then ``env`` (which wins)."""
    child = _base_env(base)
    for key, value in DEFAULT_CHILD_ENV.items():
        child.setdefault(key, value)
    if "GLOO_SOCKET_IFNAME" not in child and Path("/sys/class/net/lo").exists():
        # Gloo otherwise resolves the hostname to pick an interface, which fails on odd hostnames.
        child["GLOO_SOCKET_IFNAME"] = "lo"
    if env:
        child.update({k: str(v) for k, v in env.items()})
    return child


def format_output(proc: subprocess.CompletedProcess) -> str:
    """Command, return code, stdout and stderr of a finished launch, for assertion messages."""
    cmd = " ".join(str(c) for c in proc.args) if isinstance(proc.args, (list, tuple)) else str(proc.args)
    return (
        f"command: {cmd}\nreturncode: {proc.returncode}\n--- stdout ---\n{_decode(proc.stdout)}\n"
        f"--- stderr ---\n{_decode(proc.stderr)}"
    )


def _kill_tree(root_pid: int, grace: float = 5.0) -> None:
    """SIGTERM the process group and every descendant of ``root_pid``, then SIGKILL what is left."""
    procs: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(root_pid, sig)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        if sig == signal.SIGTERM:
            _, alive = psutil.wait_procs(procs, timeout=grace)
            procs = alive
            if not procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(root_pid, signal.SIGKILL)
                return


def run_command(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike | None = None,
    on_timeout=None,
    check: bool = False,
    timeout_from: Callable[[], bool] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session with stdout/stderr captured (text), never hanging past ``timeout``.

    Output goes to temporary files rather than pipes, so a stray grandchild holding them open cannot block
    us. On timeout ``on_timeout()`` is called (e.g. scancel), the process group and all descendants are
    killed, and the test fails with the output captured so far. Leftovers in the process group are killed
    after a normal exit too. With ``check`` a non-zero return code fails the test with the output.
    ``timeout_from``: the timeout counts from the moment this returns True (polled), e.g. once every rank is up;
    until then only a hang detector of 300 s applies.
    """
    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        proc = popen(  # in a background job: at nice 19 (background.py)
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out_f,
            stderr=err_f,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
        timed_out = False
        try:
            if timeout_from is not None:
                hang = time.monotonic() + max(timeout, 300)
                while not timeout_from() and proc.poll() is None:
                    if time.monotonic() > hang:
                        raise subprocess.TimeoutExpired(cmd, timeout)
                    time.sleep(0.05)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            if on_timeout is not None:
                with contextlib.suppress(Exception):
                    on_timeout()
            _kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        except BaseException:  # KeyboardInterrupt and the like: do not leave ranks behind
            _kill_tree(proc.pid, grace=2.0)
            raise
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        out_f.seek(0)
        err_f.seek(0)
        result = subprocess.CompletedProcess(
            cmd, proc.returncode if proc.returncode is not None else -9, _decode(out_f.read()), _decode(err_f.read())
        )
    if timed_out:
        raise LauncherTimeout(f"timed out after {timeout}s; killed the launcher and its ranks\n{format_output(result)}")
    if check and result.returncode != 0:
        pytest.fail(f"launch failed\n{format_output(result)}", pytrace=False)
    return result


def build_launch(
    launcher: str,
    argv: Sequence[str],
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    *,
    python: bool = True,
    nodes: int = 1,
    kill_on_bad_exit: bool = False,
    timeout: float = 300,
    job_name: str | None = None,
    launcher_args: Sequence[str] = (),
    base: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Command line and environment that run ``argv`` as ``nproc`` ranks under ``launcher``.

    ``argv`` is ``[script.py, args...]``, ``["-m", module, args...]`` or ``["-c", code, args...]``, run with the
    test interpreter, or, with ``python=False``, an executable and its arguments (see ``console_script``). For srun the
    caller must have started the local Slurm (``start_local_slurm``) and passed its env additions in ``env``; ``nodes``
    (srun only) spreads the ranks over that many emulated nodes, ``nproc / nodes`` per node. mpirun and mpiexec get a
    MASTER_PORT that was free a moment ago (rank 0 binds it); the callers retry a launch whose rank 0 found it taken
    (``port_was_taken``). ``launcher_args`` are inserted right after the launcher's own options. ``base``: the
    environment to start from instead of os.environ (a background job's copy, tests/background.py).
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; expected one of {LAUNCHERS}")
    if nodes != 1 and launcher != "srun":
        raise ValueError(f"nodes={nodes}: only srun spreads ranks over several (emulated) nodes")
    if nproc % nodes:
        raise ValueError(f"nproc={nproc} does not split evenly over {nodes} nodes")
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("argv is empty")
    child_env = launcher_env(env, base)
    program = argv if not python else [python_executable(), *argv]

    if launcher == "torchrun":
        # --standalone: the agent binds its store on a free port itself and hands it to the ranks (no port of ours
        # chosen, released and bound again later)
        cmd = [
            *torchrun_command(),
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--local-addr",
            "127.0.0.1",
            "--max-restarts",
            "0",
            *launcher_args,
        ]
        if not python:
            cmd += ["--no-python", *argv]
        elif argv[0] == "-c":  # torchrun has no -c: run the interpreter itself as the program
            cmd += ["--no-python", python_executable(), *argv]
        else:
            cmd += argv
        return cmd, child_env

    if launcher == "srun":
        # no MASTER_ADDR/MASTER_PORT: derived by the product from the node list and the job id (the nodes resolve)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if env is None or name not in env:
                child_env.pop(name, None)
        minutes = max(1, math.ceil(timeout / 60) + 1)
        cmd = [
            "srun",
            "--overcommit",
            "-N",
            str(nodes),
            "-n",
            str(nproc),
            f"--ntasks-per-node={nproc // nodes}",
            "--mpi=none",
            "--export=ALL",
            f"--job-name={job_name or 'distvideo-test'}",
            f"--time={minutes}",
            f"--kill-on-bad-exit={1 if kill_on_bad_exit else 0}",
            *launcher_args,
            *program,
        ]
        return cmd, child_env

    # MPI has no rendezvous of its own: the ranks get one (what a user's job script exports)
    child_env.setdefault("MASTER_ADDR", "127.0.0.1")
    child_env.setdefault("MASTER_PORT", str(free_port()))
    if launcher == "mpich":
        # Hydra passes the whole environment by default
        cmd = ["mpiexec.mpich", "-n", str(nproc), "-bind-to", "none", *launcher_args, *program]
        return cmd, child_env

    # Open MPI: forward PATH/PYTHONPATH/LD_LIBRARY_PATH, the rendezvous and everything the test passed.
    exported = ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "HOME", "MASTER_ADDR", "MASTER_PORT", *DEFAULT_CHILD_ENV]
    exported += ["GLOO_SOCKET_IFNAME", *(env or {})]
    cmd = [
        "mpirun.openmpi",
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "--mca",
        "oob_tcp_if_include",
        "lo",
        "--mca",
        "btl",
        f"self,{_mpirun_shared_memory_btl()}",
        "-np",
        str(nproc),
    ]
    seen: set[str] = set()
    for key in exported:
        if key in child_env and key not in seen:
            seen.add(key)
            cmd += ["-x", key]
    cmd += [*launcher_args, *program]
    return cmd, child_env


_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE|errno 98\b", re.IGNORECASE)


def port_was_taken(output: str) -> bool:
    """Whether a launch's output says a rank could not bind its rendezvous port (another process took it between
    ``free_port`` and the bind): such a launch is retried with a new port, not counted as the product's failure."""
    return bool(_PORT_TAKEN.search(output))


def run_launcher(
    launcher: str,
    argv: Sequence[str],
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike | None = None,
    *,
    python: bool = True,
    nodes: int = 1,
    kill_on_bad_exit: bool = False,
    check: bool = False,
    launcher_args: Sequence[str] = (),
    timeout_from: Callable[[], bool] | None = None,
    base: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Launch ``argv`` as ``nproc`` ranks under ``launcher`` ("torchrun", "srun", "mpirun" or "mpich") and wait.

    Returns the CompletedProcess (text stdout/stderr of all ranks together). Fails the test via ``require_launcher``
    when the launcher is missing; starts the local Slurm for srun. On timeout the launcher and every rank are killed
    and ``LauncherTimeout`` (an AssertionError) is raised with the output. ``check=True`` fails the test on a non-zero
    return code. ``python=False`` runs ``argv[0]`` as an executable (torchrun ``--no-python``); ``kill_on_bad_exit``
    is srun's ``--kill-on-bad-exit``. An MPI or srun launch whose rank 0 found its rendezvous port taken is started
    again with a new port (up to 3 times). ``base``: as for ``build_launch``.
    """
    require_launcher(launcher)
    env = dict(env or {})
    on_timeout = None
    job_name = None
    if launcher == "srun":
        slurm_env = start_local_slurm()
        env = {**slurm_env, **env}
        job_name = f"distvideo-test-{uuid.uuid4().hex[:12]}"
        scancel_env = {**_base_env(), **slurm_env}

        def on_timeout() -> None:
            subprocess.run(
                ["scancel", f"--name={job_name}"],
                env=scancel_env,
                timeout=30,
                capture_output=True,
                stdin=subprocess.DEVNULL,
            )

    for attempt in range(3):
        cmd, child_env = build_launch(
            launcher,
            argv,
            nproc,
            env,
            python=python,
            nodes=nodes,
            kill_on_bad_exit=kill_on_bad_exit,
            timeout=timeout,
            job_name=job_name,
            launcher_args=launcher_args,
            base=base,
        )
        proc = run_command(
            cmd, env=child_env, timeout=timeout, cwd=cwd, on_timeout=on_timeout, timeout_from=timeout_from
        )
        # MPI ranks bind a port that was free a moment ago; srun ranks one derived from the job id (a new job, a new
        # port): another process holding it is the machine's doing, not the product's
        retry = launcher in ("mpirun", "mpich", "srun") and "MASTER_PORT" not in env and attempt < 2
        if not (retry and proc.returncode != 0 and port_was_taken(proc.stdout + proc.stderr)):
            break
    if check and proc.returncode != 0:
        pytest.fail(f"launch failed\n{format_output(proc)}", pytrace=False)
    return proc


__all__ = [
    "DEFAULT_CHILD_ENV",
    "LAUNCHERS",
    "LAUNCHER_INSTALL",
    "REPO_ROOT",
    "SLURM_NODES",
    "START_SLURM_SCRIPT",
    "STOP_SLURM_SCRIPT",
    "LauncherTimeout",
    "build_launch",
    "console_script",
    "format_output",
    "free_port",
    "launcher_env",
    "local_slurm",
    "missing_programs",
    "port_was_taken",
    "python_executable",
    "require_launcher",
    "run_command",
    "run_launcher",
    "start_local_slurm",
    "stop_local_slurm",
    "torchrun_command",
]
