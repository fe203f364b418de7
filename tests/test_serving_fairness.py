"""Fair queueing across API keys (issue 29): each key is one client, jobs are taken round-robin across clients, the
queue bound counts them together, and a bad keys file is refused (exit 2) before anything loads. The order is
checked on the Service itself and on a real server with two keys."""

from __future__ import annotations

import sqlite3

import pytest

from distvideo.cli.main import main
from distvideo.request import GenerationRequest
from distvideo.serving.jobs import QueuedJob, QueueFull, Service

from serving_harness import HELD, SMALL, start_server


def job(name: str, client: str) -> QueuedJob:
    return QueuedJob(id=name, request=GenerationRequest(prompt=name), client=client)


def test_jobs_are_taken_round_robin_across_clients():
    service = Service(max_queue=8)
    for name in ("a1", "a2", "a3", "a4"):
        service.enqueue(job(name, "key 1"))
    service.enqueue(job("b1", "key 2"))
    service.enqueue(job("c1", "key 3"))
    service.enqueue(job("b2", "key 2"))
    service.enqueue(job("b3", "key 2"))
    with pytest.raises(QueueFull):  # the bound (8) counts every client's jobs
        service.enqueue(job("c2", "key 3"))
    assert service.remove_queued("a3")
    taken = [service.take().id for _ in range(service.depth)]  # type: ignore[union-attr]
    assert taken == ["a1", "b1", "c1", "a2", "b2", "a4", "b3"]


def test_one_client_is_one_fifo():
    service = Service(max_queue=8)
    for name in ("x1", "x2", "x3"):
        service.enqueue(job(name, ""))
    assert [service.take().id for _ in range(3)] == ["x1", "x2", "x3"]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("text", "says"),
    [("", "no key in it"), ("short\n", "key 1 must be 8 or more"), ("k" * 9 + "\n" + "k" * 9, "given twice")],
)
def test_a_bad_keys_file_is_refused_before_loading(tmp_path, capsys, text, says):
    keys = tmp_path / "keys.txt"
    keys.write_text(text)
    assert main(["serve", "--api-keys-file", str(keys), "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--api-keys-file" in err and says in err, err


def test_a_missing_keys_file_is_refused(tmp_path, capsys):
    assert main(["serve", "--api-keys-file", str(tmp_path / "none.txt"), "--output", str(tmp_path)]) == 2
    assert "--api-keys-file" in capsys.readouterr().err


def test_a_server_with_two_keys_serves_them_in_turn(tmp_path):
    first, second = "first-client-key", "second-client-key"
    keys = tmp_path / "keys.txt"
    keys.write_text(f"# more clients\n{second}\n\n")
    # the first key comes from DISTVIDEO_API_KEY (the harness's client sends it), the second from the file
    with start_server(tmp_path, "inline", args=["--api-keys-file", str(keys)], api_key=first, hold=True) as server:
        one = {"Authorization": f"Bearer {first}"}
        two = {"Authorization": f"Bearer {second}"}
        held = server.http.post("/v1/videos", json={"prompt": "hold", **HELD}, headers=one).json()
        server.wait_progress(held["id"])
        ones = [
            server.http.post("/v1/videos", json={"prompt": f"one {i}", **SMALL}, headers=one).json() for i in range(3)
        ]
        other = server.http.post("/v1/videos", json={"prompt": "two", **SMALL}, headers=two).json()
        assert server.http.get("/v1/models", headers={"Authorization": "Bearer wrong-key-1"}).status_code == 401
        server.release()
        for video in [*ones, other]:
            assert server.wait(video["id"])["status"] == "completed"
        with sqlite3.connect(f"file:{server.output / 'jobs.sqlite3'}?mode=ro", uri=True) as db:
            started = [
                row[0] for row in db.execute("SELECT id FROM videos WHERE started_at IS NOT NULL ORDER BY started_at")
            ]
    # the second client's one job runs right after the first client's running job, not after its three queued ones
    assert started == [held["id"], ones[0]["id"], other["id"], ones[1]["id"], ones[2]["id"]], started
