"""API fuzzing with schemathesis against the server's own OpenAPI schema (a real server on loopback): no answer is a
500, every status code, content type and body is the one the schema documents, and invalid input is refused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from background import FolderJob, in_a_process
from launchers import format_output
from serving_harness import start_server

KEY = "fuzz-key-0123456789"


def schemathesis_command() -> str:
    exe = Path(sys.executable).parent / "schemathesis"
    if exe.exists():
        return str(exe)
    found = shutil.which("schemathesis")
    if found is None:
        pytest.fail("schemathesis is not installed: run `make setup` (it is in the 'test' extra)", pytrace=False)
    return found


def fuzz_to(folder: Path) -> None:
    """schemathesis against a server, in a process of its own (FUZZ): FOLDER/outcome.json."""
    # tight limits keep every job the fuzzer manages to queue tiny; a small queue makes it meet 429 too
    limits = ["--max-frames", "5", "--max-pixels", "1024", "--max-steps", "1", "--max-queue", "2"]
    with start_server(folder / "serve", "inline", args=[*limits, "--max-body-bytes", "65536"], api_key=KEY) as server:
        cmd = [
            schemathesis_command(),
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "all",
            # positive_data_acceptance: the schema cannot say what the model decides (sizes in multiples of 16,
            # 4k+1 frames, registered adapters, the server's limits): such requests get a 422 naming the field.
            # use_after_free, ensure_resource_availability: DELETE of a running job cancels it (202), it stays listed.
            "--exclude-checks",
            "positive_data_acceptance,use_after_free,ensure_resource_availability",
            "--phases",
            "examples,coverage,fuzzing",
            "--max-examples",
            "20",
            "--seed",
            "17",
            "--workers",
            "1",
            "--no-color",
            "--request-timeout",
            "60",
            "--generation-database",
            "none",
            "-H",
            f"Authorization: Bearer {KEY}",
        ]
        proc = subprocess.run(  # in its own folder: schemathesis keeps its files in the working directory
            cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=folder
        )
        health = server.http.get("/health").json()
    outcome = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "health": health}
    (folder / "outcome.json").write_text(json.dumps(outcome))


# a whole fuzzing run against a server (about 11 s) whose outcome is all the test checks: in the background, in a
# process of its own (its server runs at the job's nice 19; schemathesis waits up to 60 s for an answer)
FUZZ = FolderJob("schemathesis against a served engine", "serve-fuzz", in_a_process("test_serving_fuzz", "fuzz_to"))
BACKGROUND_JOBS = {"fuzzed": FUZZ.hooks}


@pytest.fixture
def fuzzed() -> dict:
    folder, proc = FUZZ.result()
    assert proc.returncode == 0, format_output(proc)
    return json.loads((folder / "outcome.json").read_text())


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(fuzzed):
    assert fuzzed["returncode"] == 0, f"{fuzzed['stdout']}\n{fuzzed['stderr']}"
    assert fuzzed["health"]["status"] == "ok"  # and the server is still serving
