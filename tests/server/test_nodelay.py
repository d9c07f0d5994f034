"""The keep-alive stall of issue 12: every request after the first on a connection waited ~40 ms.

Cause: the serve command's listening socket was made by ``socket.create_server``, whose protocol
number is 0; accepted sockets inherit it, and asyncio turns ``TCP_NODELAY`` on only for sockets that
say ``IPPROTO_TCP``. A response written in two sends (headers, then body) then waited for the
client's delayed ACK (Nagle). These tests check the mechanism itself (no timing): the listening socket
names TCP, and a connection accepted through it by asyncio, as uvicorn does, has ``TCP_NODELAY`` on.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from staleness_metrics.cli.commands.serve import _listen


def test_the_listening_socket_names_tcp() -> None:
    with _listen("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockname()[1] > 0


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connections_accepted_by_the_event_loop_have_nodelay_on(loop: str) -> None:
    """asyncio (uvicorn without the ``server`` extra) and uvloop (with it, uvicorn's choice)."""

    async def accept_one() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                peer = transport.get_extra_info("socket")
                accepted.set_result(peer.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        with _listen("127.0.0.1", 0) as sock:
            server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
            port = sock.getsockname()[1]
            async with server:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                value = await asyncio.wait_for(accepted, 30)
                writer.close()
        return value

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        assert uvloop.run(accept_one()) != 0
    else:
        assert asyncio.run(accept_one()) != 0
