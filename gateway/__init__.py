"""MQTT edge-to-cloud gateway into Apache Cassandra."""

from __future__ import annotations

import hashlib
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).parent


def compiled_modules(package: Path = _HERE) -> list[str]:
    """The modules of ``package`` that run compiled (setup.py,
    GATEWAY_COMPILE=1), as paths like ``gateway/ingest/pipeline.py``; empty
    when none do.

    Raises ImportError when a compiled module's source has changed since it
    was compiled: Python would load the old compiled code and ignore the
    edit, so nothing is imported until ``make venv`` compiles it again.
    """
    try:
        manifest = (package / "compiled.txt").read_text()
    except FileNotFoundError:
        return []
    compiled, stale = [], []
    for line in manifest.splitlines():
        digest, _, source = line.partition(" ")
        path = package.parent / source
        stem = path.with_suffix("")
        if not any(stem.with_name(stem.name + s).exists() for s in EXTENSION_SUFFIXES):
            continue  # not built: the source runs
        compiled.append(source)
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            stale.append(source)
    if stale:
        raise ImportError(
            f"{', '.join(stale)} changed since it was compiled, so the compiled module "
            "would run the old code: run `make venv` to compile again (or "
            "GATEWAY_COMPILE=0 make venv for plain Python; setup.py)"
        )
    return compiled


COMPILED = compiled_modules()
