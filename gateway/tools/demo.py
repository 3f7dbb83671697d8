"""``make run``: the gateway in the foreground, fed by a small simulated fleet.

Starts ``gateway simulate`` as a child process (tenant ``demo``), makes a read
token for tenant ``demo`` (revoking the one an earlier ``make run`` made),
prints where the page is and how to query what arrives, then runs ``gateway
run`` in this process until Ctrl-C or SIGTERM, and stops the simulator with
it. Without the simulator (``--devices 0``) it is plain ``gateway run``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

from ..config import load_config
from ..web.tokens import TokenStore
from . import cli

DEMO_LABEL = "make run demo"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> Callable[[], None]:
    """For the simulator's child process: SIGTERM when this demo process
    (``parent``) dies, however it dies (a signal to make alone, SIGKILL), so no
    simulator is left publishing on its own. Linux only; elsewhere a no-op."""

    def arm() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:
                # The demo died between the fork and the line above: no
                # signal will come, so do not start at all.
                os._exit(0)

    return arm


def demo_token(store: TokenStore) -> str:
    """A fresh read token for tenant demo; the one an earlier run made is revoked."""
    for info in store.list():
        if info.label == DEMO_LABEL:
            store.revoke(info.id)
    return store.add(tenant="demo", label=DEMO_LABEL).token


HINTS = """\
------------------------------------------------------------------------------
 The gateway is running; {devices} simulated devices of tenant "demo" publish
 {rate:g} msg/s to tenants/demo/devices/<id>/events.

 The page: open {url}/ and paste this read token (tenant "demo"):

   {token}

 The same through the API:
   curl -H 'Authorization: Bearer {token}' {url}/api/v1/tenants/demo/states

 In another terminal:

   .venv/bin/gateway devices --tenant demo --state on      # who is on right now
   .venv/bin/gateway devices --tenant demo --state off --json
   .venv/bin/gateway device  --tenant demo dev-000001      # latest event
   .venv/bin/gateway history --tenant demo dev-000001 --since 10m
   .venv/bin/gateway rejected --tenant demo                # bad messages, if any
   .venv/bin/gateway rollup --tenant demo dev-000001 --metric temperature --step 1m
   .venv/bin/gateway meta tags --tenant demo               # tag keys (also: metrics, values)
   mosquitto_pub -q 1 -t tenants/demo/devices/lamp-1/events \\
       -m '{{"ts": "2026-01-01T12:00:00Z", "state": "on", "value": "manual"}}'

 Ctrl-C stops the gateway (it finishes and acknowledges what it holds).
------------------------------------------------------------------------------"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway.tools.demo")
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--rate", type=float, default=20.0)
    args = parser.parse_args(argv)
    simulator = None
    if args.devices > 0:
        simulator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.tools.cli",
                "--log-level",
                "WARNING",
                "simulate",
                "--tenant",
                "demo",
                "--devices",
                str(args.devices),
                "--rate",
                str(args.rate),
            ],
            preexec_fn=_die_with_parent(os.getpid()),  # noqa: PLW1509 (no threads run yet)
        )
        config = load_config()
        token = demo_token(TokenStore(config.api.tokens_file))
        url = f"http://{config.api.host}:{config.api.port}"
        print(HINTS.format(devices=args.devices, rate=args.rate, url=url, token=token), flush=True)
    try:
        return cli.main(["run"])
    finally:
        if simulator is not None:
            simulator.terminate()
            simulator.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
