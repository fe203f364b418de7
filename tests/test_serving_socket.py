"""The service's listening socket (serving/lifecycle.py `bind`): the connections it accepts under asyncio (uvicorn's
loop) have TCP_NODELAY, so a small answer is not split into a header segment and a body segment held back by Nagle
until the client's delayed ACK (40 ms on Linux, on every request of a kept-alive connection)."""

from __future__ import annotations

import asyncio
import socket

from distvideo.serving.lifecycle import bind


def test_accepted_connections_have_tcp_nodelay():
    listening = bind("127.0.0.1", 0)
    port = listening.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=listening)
        async with server:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            await reader.read()  # until the server closed it: on_connection ran
            writer.close()

    asyncio.run(main())
    assert len(seen) == 1 and seen[0] != 0, seen
