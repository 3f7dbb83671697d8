"""Bytes the spool writes per message by commit size, `Spool` alone.

Appends N messages in commits of ``a`` and deletes them in commits of ``d``,
for each (a, d) pair given, on a fresh spool under ``--dir``; prints this
process's ``write_bytes`` (benchlib.write_bytes: what reached the page
cache, so the disk) per message for each. Shows why the spool groups its
commits (spool.commit_delay): a commit rewrites a few 4 KiB pages however
little it holds.

Usage: .venv/bin/python bench/spool_commit_bytes.py [--pairs 1:1,10:10,1:50] [--count 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from benchlib import write_bytes

from gateway.ingest.spool import Appended, Spool

PAYLOAD = b'{"device_id":"dev-000001","state":"on","value":20.5,"ts":"2026-11-28T14:00:00Z"}' * 6


async def measure(folder: Path, append_by: int, delete_by: int, count: int) -> tuple[float, float]:
    """Bytes written per message appending, and deleting."""
    record: Appended = (int(time.time() * 1000), "t/dev-1/state", "application/json", PAYLOAD)
    async with Spool(folder / f"spool-{append_by}-{delete_by}.sqlite", 10**6, 10**10) as spool:
        await spool.delete(await spool.append([record] * 50))  # the file's first pages
        os.sync()
        before = write_bytes(os.getpid())
        seqs: list[int] = []
        for _ in range(0, count, append_by):
            seqs += await spool.append([record] * append_by)
        appended = write_bytes(os.getpid())
        for at in range(0, len(seqs), delete_by):
            await spool.delete(seqs[at : at + delete_by])
        deleted = write_bytes(os.getpid())
    return (appended - before) / len(seqs), (deleted - appended) / len(seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default="1:1,2:2,5:5,10:10,50:50,1:50,10:100")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--dir", default="/var/tmp", help="a disk, not a tmpfs (its writes)")
    args = parser.parse_args()
    print(f"payload {len(PAYLOAD)} bytes, {args.count} messages per pair, under {args.dir}")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for pair in args.pairs.split(","):
            append_by, delete_by = (int(n) for n in pair.split(":"))
            app, dele = asyncio.run(measure(Path(folder), append_by, delete_by, args.count))
            print(
                f"append {append_by:3} a commit: {app:7,.0f} B/msg; "
                f"delete {delete_by:3} a commit: {dele:7,.0f} B/msg"
            )


if __name__ == "__main__":
    main()
