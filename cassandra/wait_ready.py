"""Wait until the local Cassandra answers a CQL query, or fail with a clear message.

Used by `make up`. Exits 0 once `SELECT release_version FROM system.local`
succeeds; exits 1 when the deadline passes or the server process dies, printing
the tail of its log so the reason is on screen.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def tail(path: str, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9042)
    parser.add_argument("--deadline", type=float, default=90.0)
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--console", required=True)
    args = parser.parse_args()

    # Imported here so a missing venv shows up as a clear error above, not a traceback.
    from cassandra.cluster import EXEC_PROFILE_DEFAULT, Cluster, ExecutionProfile  # noqa: PLC0415
    from cassandra.policies import RoundRobinPolicy  # noqa: PLC0415

    start = time.monotonic()
    last_error = "no attempt yet"
    while time.monotonic() - start < args.deadline:
        if not alive(args.pid):
            print(f"cassandra: the server (pid {args.pid}) exited during start-up. Last log lines:",
                  file=sys.stderr)
            print(tail(args.log), file=sys.stderr)
            print(tail(args.console, 10), file=sys.stderr)
            return 1
        profile = ExecutionProfile(load_balancing_policy=RoundRobinPolicy(), request_timeout=5)
        cluster = Cluster([args.host], port=args.port, protocol_version=5, connect_timeout=2,
                          control_connection_timeout=2,
                          execution_profiles={EXEC_PROFILE_DEFAULT: profile})
        try:
            session = cluster.connect()
            row = session.execute("SELECT release_version FROM system.local").one()
            print(f"cassandra: ready after {time.monotonic() - start:.1f} s "
                  f"(release {row.release_version}, CQL on {args.host}:{args.port})")
            return 0
        except Exception as exc:  # any failure means "not yet"
            last_error = f"{type(exc).__name__}: {exc}"
        finally:
            cluster.shutdown()
        time.sleep(1.0)
    print(f"cassandra: not ready after {args.deadline:.0f} s (last error: {last_error}). "
          f"Last log lines from {args.log}:", file=sys.stderr)
    print(tail(args.log), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
