"""Client CPU of the transport alone, per request, on the same answers, in one run.

A server process answers every POST with the same body (``--answer`` bytes of JSON, as big as
a scoring answer: 1.1 MB is one sample of ``bench.cpu_burst``) after reading a request body
of ``--request`` bytes. ``--concurrency`` requests are in flight at once. Interleaved over
``--reps`` repeats, the least kept (noise on a shared machine only ever adds):

* :class:`opd_stream.AsyncioTransport` (the default under asyncio);
* :class:`opd_stream.AiohttpTransport` (the default before it);
* the floor: the standard library's ``http.client``, one kept-alive connection, one request
  at a time, each answer read whole into one buffer (no event loop, no cap, no budget).

Run::

    .venv/bin/python -m bench.transport_micro [--answer 1100000] [--request 245000]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import socket
import subprocess
import sys
import time
from typing import Any

from opd_stream import AiohttpTransport, AsyncioTransport
from opd_stream.transport import Request

__all__ = ("main",)

_SERVER = r"""
import socket, sys, threading
size = int(sys.argv[1])
body = b'{"x":"' + b"a" * max(0, size - 8) + b'"}'
head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
answer = head % len(body) + body

def handle(conn):
    f = conn.makefile("rb")
    while True:
        if not f.readline():
            return
        n = 0
        while True:
            line = f.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"content-length"):
                n = int(line.split(b":")[1])
        f.read(n)
        conn.sendall(answer)

s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
s.listen(128)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


async def _through(make: Any, url: str, body: bytes, n: int, concurrency: int) -> float:
    """Client CPU seconds per request through a transport made by ``make``."""
    async with make() as transport:

        async def worker(k: int) -> None:
            for _ in range(k):
                resp = await transport.send(Request(url=url, max_bytes=1 << 30, body=body))
                assert resp.status == 200

        await asyncio.gather(*(worker(2) for _ in range(concurrency)))  # connections made
        start = time.process_time()
        await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
        return (time.process_time() - start) / (n // concurrency * concurrency)


def _floor(port: int, body: bytes, n: int) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.connect()
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    headers = {"Content-Type": "application/json"}
    for _ in range(2):
        conn.request("POST", "/generate", body=body, headers=headers)
        conn.getresponse().read()
    start = time.process_time()
    for _ in range(n):
        conn.request("POST", "/generate", body=body, headers=headers)
        conn.getresponse().read()
    took = time.process_time() - start
    conn.close()
    return took / n


def measure(answer: int, request: int, n: int, concurrency: int, reps: int) -> dict[str, Any]:
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, str(answer)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/generate"
        body = b"[" + b"123456," * max(0, (request - 2) // 7) + b"1]"
        best = {"asyncio": float("inf"), "aiohttp": float("inf"), "floor": float("inf")}
        for _ in range(reps):
            for name, make in (("asyncio", AsyncioTransport), ("aiohttp", AiohttpTransport)):
                cpu = asyncio.run(_through(make, url, body, n, concurrency))
                best[name] = min(best[name], cpu)
            best["floor"] = min(best["floor"], _floor(port, body, n))
    finally:
        server.kill()
        server.wait()
    return {
        "answer_bytes": answer,
        "request_bytes": len(body),
        "concurrency": concurrency,
        "ms_per_request": {k: v * 1e3 for k, v in best.items()},
        "aiohttp_over_asyncio": best["aiohttp"] / best["asyncio"],
        "asyncio_over_floor": best["asyncio"] / best["floor"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transport_micro", description=__doc__)
    p.add_argument("--answer", type=int, default=1_100_000)
    p.add_argument("--request", type=int, default=245_000)
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    print(
        "| answer | request | in flight | AsyncioTransport | AiohttpTransport "
        "| http.client floor | aiohttp / asyncio | asyncio / floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for answer, request in ((args.answer, args.request), (4_000, 2_000)):
        m = measure(answer, request, args.n, args.concurrency, args.reps)
        ms = m["ms_per_request"]
        print(
            f"| {answer:,} B | {m['request_bytes']:,} B | {args.concurrency} "
            f"| {ms['asyncio']:.3f} ms | {ms['aiohttp']:.3f} ms | {ms['floor']:.3f} ms "
            f"| {m['aiohttp_over_asyncio']:.2f}x | {m['asyncio_over_floor']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
