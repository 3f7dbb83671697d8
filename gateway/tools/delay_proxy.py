"""A TCP proxy that delays every byte by a fixed time in each direction: a slow link.

Used by ``bench/slow_link.py`` and ``tests/test_inflight_limit.py`` to put a
local Cassandra "tens of milliseconds away", and by hand to try a config
against a given round trip before going to the field::

    python -m gateway.tools.delay_proxy --listen 19042 --to 127.0.0.1:9042 --rtt 50ms

Each chunk read is stamped with its arrival time and written at arrival +
``delay`` (one way; the round trip is twice that). Chunks are delivered in
order and the delay does not cost bandwidth: a chunk waits only for its own due
time, not for the sum of the delays of those before it. What is read ahead of
the writer is bounded (``MAX_QUEUED`` bytes per direction): past it reading
stops, as a full link would. ``delay`` may be changed while connections are
open (a link that degrades); it applies to chunks read from then on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import deque

from ..units import parse_duration

MAX_QUEUED = 8 * 1024 * 1024  # bytes read but not yet delivered, per direction
CHUNK = 65536


class DelayProxy:
    """``async with DelayProxy(...)`` listens on ``port`` (0: any free port)."""

    def __init__(
        self, target_host: str, target_port: int, *, delay: float = 0.0, port: int = 0
    ) -> None:
        self.target = (target_host, target_port)
        self.delay = delay  # seconds, one way
        self.port = port
        self.connections = 0
        self.bytes_out = 0  # towards the target
        self.bytes_in = 0  # from the target
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __aenter__(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop listening and cut every connection."""
        self._closed = True  # one accepted but not yet handled is cut when it is
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closed:
            client_w.transport.abort()
            return
        self._tasks.add(task)
        try:
            try:
                server_r, server_w = await asyncio.open_connection(*self.target)
            except OSError:
                client_w.transport.abort()
                return
            except asyncio.CancelledError:
                # Cut by close() while connecting: the client's socket was left
                # open, and its garbage collection warned (a failed test).
                client_w.transport.abort()
                raise
            self.connections += 1
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._pipe(client_r, server_w, outwards=True))
                    group.create_task(self._pipe(server_r, client_w, outwards=False))
            except* (ConnectionError, OSError):
                pass  # one side went away: cut the other too
            finally:
                client_w.transport.abort()
                server_w.transport.abort()
        finally:
            self._tasks.discard(task)

    async def _pipe(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, outwards: bool
    ) -> None:
        """Read as fast as the sender sends; deliver each chunk at arrival + delay."""
        queue: deque[tuple[float, bytes]] = deque()
        queued = 0
        more = asyncio.Event()  # set when the queue gains a chunk or the source ends
        room = asyncio.Event()  # set when the queue drops below MAX_QUEUED
        room.set()
        ended = False

        async def deliver() -> None:
            nonlocal queued
            loop = asyncio.get_running_loop()
            while True:
                while not queue:
                    if ended:
                        return
                    more.clear()
                    await more.wait()
                due, data = queue[0]
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                queue.popleft()
                queued -= len(data)
                if queued < MAX_QUEUED:
                    room.set()
                dst.write(data)
                await dst.drain()

        async with asyncio.TaskGroup() as group:
            group.create_task(deliver())
            loop = asyncio.get_running_loop()
            try:
                while data := await src.read(CHUNK):
                    queue.append((loop.time() + self.delay, data))
                    if outwards:
                        self.bytes_out += len(data)
                    else:
                        self.bytes_in += len(data)
                    queued += len(data)
                    more.set()
                    if queued >= MAX_QUEUED:
                        room.clear()
                        await room.wait()
            except (ConnectionError, OSError):
                pass
            finally:
                ended = True
                more.set()
        # The source closed: so does the destination, once everything is delivered.
        with contextlib.suppress(ConnectionError, OSError):
            dst.write_eof()


async def _serve(listen: int, host: str, port: int, delay: float) -> None:
    async with DelayProxy(host, port, delay=delay, port=listen) as proxy:
        print(
            f"delay proxy 127.0.0.1:{proxy.port} -> {host}:{port}, "
            f"{delay * 1000:.1f} ms each way ({delay * 2000:.1f} ms round trip)",
            flush=True,
        )
        started = time.monotonic()
        try:
            await asyncio.Event().wait()  # until interrupted
        finally:
            elapsed = time.monotonic() - started
            print(f"delay proxy: {proxy.connections} connections in {elapsed:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, default=19042, help="local port (0: any)")
    parser.add_argument("--to", default="127.0.0.1:9042", help="host:port to forward to")
    parser.add_argument("--rtt", default="50ms", help="added round trip, e.g. 50ms (half each way)")
    args = parser.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args.listen, host, int(port), parse_duration(args.rtt) / 2))


if __name__ == "__main__":
    main()
