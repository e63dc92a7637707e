"""A raw HTTP/1.1 server on an anyio listener (so it runs on either backend) that answers
each request with exactly the bytes a test wants: for the transports' tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc

__all__ = ("Reply", "answer_bytes", "raw_server")

Reply = Callable[[bytes, bytes], tuple[bytes, bool]]  # (head, body) -> (bytes to send, close)


class RawServer:
    def __init__(self, url: str) -> None:
        self.url = url
        self.connections = 0
        self.heads: list[bytes] = []


@asynccontextmanager
async def raw_server(reply: Reply) -> AsyncIterator[RawServer]:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    server = RawServer(f"http://127.0.0.1:{port}")

    async def serve(stream: anyio.abc.SocketStream) -> None:
        server.connections += 1
        buf = b""
        async with stream:
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        buf += await stream.receive()
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    while len(buf) < length:
                        buf += await stream.receive()
                    body, buf = buf[:length], buf[length:]
                    server.heads.append(head)
                    data, close = reply(head, body)
                    await stream.send(data)
                    if close:
                        return
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield server
        tg.cancel_scope.cancel()


def answer_bytes(
    body: bytes, *, status: str = "200 OK", headers: str = "", length: bool = True
) -> bytes:
    head = f"HTTP/1.1 {status}\r\n{headers}"
    if length:
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body
