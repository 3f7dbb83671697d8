"""systemd's service notifications (``sd_notify(3)``), the few lines we need:
readiness, the watchdog, and a status text, over the ``NOTIFY_SOCKET`` datagram
socket. Written here rather than taken as a dependency: it is one ``sendto``.

A :class:`Notifier` without a socket (not under systemd, or ``Type=`` other
than notify) does nothing. Sending never blocks and never raises: a lost
notification is logged once, and systemd's own timeouts say the rest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None, watchdog_usec: int | None = None) -> None:
        # "@name" is an abstract socket: a leading NUL byte on the wire.
        self._address = "\0" + address[1:] if address and address.startswith("@") else address
        self._watchdog_usec = watchdog_usec
        self._warned = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Notifier:
        """From systemd's variables (read by the CLI, which owns the environment).
        ``WATCHDOG_PID``, when set, must be this process."""
        usec: int | None = None
        pid = environ.get("WATCHDOG_PID")
        if pid is None or pid == str(os.getpid()):
            try:
                usec = int(environ.get("WATCHDOG_USEC", "")) or None
            except ValueError:
                usec = None
        return cls(environ.get("NOTIFY_SOCKET") or None, usec)

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half the watchdog timeout, as systemd advises), or None."""
        if self._address is None or self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2e6

    def notify(self, *fields: str) -> None:
        if self._address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.setblocking(False)
                sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %s: %s", self._address, exc)

    async def keep_alive(self, stop: asyncio.Event) -> None:
        """Ping the watchdog until ``stop`` is set. It runs on the gateway's event
        loop, where every stage runs: a blocked loop stops the pings and
        systemd restarts the gateway."""
        interval = self.watchdog_interval
        if interval is None:
            return
        while not stop.is_set():
            self.notify("WATCHDOG=1")
            try:
                async with asyncio.timeout(interval):
                    await stop.wait()
            except TimeoutError:
                pass
