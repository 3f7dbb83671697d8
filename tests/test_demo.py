"""`make run`'s demo: its simulator never outlives it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .helpers import base_env, wait_until_blocking


def _state(pid: int) -> str | None:
    """The process's state letter (Z: a zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_the_simulator_dies_with_the_demo(tmp_path: Path) -> None:
    env = base_env(GATEWAY_API__TOKENS_FILE=str(tmp_path / "tokens.jsonl"))
    demo = subprocess.Popen(
        [sys.executable, "-m", "gateway.tools.demo", "--devices", "3", "--rate", "3"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    simulator = None
    try:
        wait_until_blocking(lambda: bool(_children(demo.pid)), 30, "the simulator started")
        simulator = _children(demo.pid)[0]
        demo.kill()  # no finally, no cleanup: as when make alone is signalled
        demo.wait()
        wait_until_blocking(
            lambda: _state(simulator) in (None, "Z"), 10, "the simulator stopped with the demo"
        )
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
