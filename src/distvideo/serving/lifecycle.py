"""The service's process life: stop signals that start a graceful shutdown instead of raising, and the HTTP server in
its own thread on a socket bound before the model loads (port 0 picks a free port, which is printed)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM and SIGINT call `on_stop(name, count)` from a thread (never from the signal handler, which must not
    take locks the interrupted code may hold): the handlers do nothing themselves, and the interpreter writes each
    signal's number to a wakeup pipe that this thread reads, also while the main thread is blocked in native code (a
    collective, a store wait). `hard_exit_after(seconds, code)` ends the process if a shutdown cannot finish."""

    def __init__(self, on_stop: Callable[[str, int], None]):
        self.on_stop = on_stop
        self.count = 0
        self._previous: dict[int, Any] = {}
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._closing = False
        self._previous_fd = -1
        self._thread = threading.Thread(target=self._run, name="distvideo-serve-signals", daemon=True)

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, _ignore)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._closing:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum in STOP_SIGNALS and not self._closing:
                    self.count += 1
                    try:
                        self.on_stop(signal.Signals(signum).name, self.count)
                    except Exception:
                        logger.exception("stopping after %s failed", signal.Signals(signum).name)

    @staticmethod
    def hard_exit_after(seconds: float, code: int) -> None:
        timer = threading.Timer(seconds, os._exit, args=(code,))
        timer.daemon = True
        timer.start()

    def restore(self) -> None:
        self._closing = True
        signal.set_wakeup_fd(self._previous_fd)
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"\0")
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)
        for sig, handler in self._previous.items():
            # once stopping, a repeated signal (a launcher signalling every task again while this one finishes) must
            # not turn a clean exit into death by signal: keep ignoring it for the little time left
            signal.signal(sig, signal.SIG_IGN if self.count else handler)
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: nothing (StopSignals' thread acts on the wakeup pipe)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; OSError (port taken, address not on this machine) before anything expensive starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on the connections it accepts only for sockets that say
    # they are TCP (base_events._set_nodelay). Without it a small response went out as two segments, the body held
    # back by Nagle until the client's delayed ACK: 40 ms added to every answer on a kept-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)  # spawned mp workers must not hold the port open
    return sock


class HttpServer:
    """uvicorn serving `app` on `sock` in a daemon thread, each route warmed up first (`warm_up`); `stop()` lets open
    requests finish, briefly."""

    def __init__(self, app: Any, sock: socket.socket):
        import uvicorn

        warm_up(app)
        self.sock = sock
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="distvideo-serve-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _serve(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        with contextlib.suppress(OSError):
            self.sock.close()


def warm_up(app: Any) -> None:
    """Answer one in-process GET of every GET route (path parameters: a placeholder id, so 404), responses dropped,
    on a throwaway event loop, before the socket serves. What a first request would do once on the event loop, holding
    every other request meanwhile, is done here: anyio's asyncio backend is imported (the event stream's first use
    imported a dozen modules: 40 ms on a busy machine), the app builds its middleware stack, and FastAPI reads each
    endpoint's source lines for its error messages."""
    import anyio

    async def each_route() -> None:
        for route in getattr(app, "routes", []):
            if "GET" in (getattr(route, "methods", None) or ()):
                await _get(app, re.sub(r"{[^}]*}", "warm-up", route.path))

    anyio.run(each_route, backend="asyncio")


async def _get(app: Any, path: str) -> None:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"warm-up")],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)
