"""With ``GATEWAY_COMPILE=1``, compiles the per-message modules with mypyc;
everything else about the package is in pyproject.toml.

The modules every message passes through (:data:`COMPILED`) are compiled to
C extensions by mypyc, mypy's compiler: the code is already typed for
``mypy --strict``. That cut the gateway's CPU per message by about a sixth
(bench/PERFORMANCE.md). The sources stay plain Python and run as such
without ``GATEWAY_COMPILE=1``.

mypyc type-checks the modules against the installed dependencies, so the
build needs them, and the ``compile`` extra, in the environment it runs in:
``pip install '.[compile]'``, then ``GATEWAY_COMPILE=1 pip install
--no-build-isolation .``. ``make venv`` does that as an editable install,
which builds the extensions next to the sources. ``gateway/compiled.txt``
records a hash of each source compiled: a compiled module whose source has
changed since will not load (gateway/__init__.py) until it is built again.
This file never deletes anything: a wheel built from the same tree (a test
does that) must not take the editable install's extensions away. The
Makefile clears them before it builds again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).parent
MANIFEST = HERE / "gateway" / "compiled.txt"
# Receive, decode, classify, sample and write: what each message runs through.
COMPILED = [
    "gateway/event.py",
    "gateway/histogram.py",
    "gateway/identity.py",
    "gateway/lru.py",
    "gateway/topic_filters.py",
    "gateway/ingest/connection.py",
    "gateway/ingest/decode.py",
    "gateway/ingest/pipeline.py",
    "gateway/ingest/receive.py",
    "gateway/ingest/sampling.py",
    "gateway/ingest/topics.py",
    "gateway/store/hot.py",
    "gateway/store/latest.py",
    "gateway/store/metadata.py",
    "gateway/store/requests.py",
    "gateway/store/rollups.py",
    "gateway/store/sink.py",
    "gateway/store/telemetry.py",
    "gateway/store/write_session.py",
]


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extensions() -> list[object]:
    if os.environ.get("GATEWAY_COMPILE") != "1":
        return []
    from mypyc.build import mypycify  # noqa: PLC0415 - only when compiling (the compile extra)

    MANIFEST.write_text("".join(f"{source_hash(HERE / s)} {s}\n" for s in COMPILED))
    # Two shared libraries, built at once on two cores: 36 s here against
    # 66 s for one, at the same CPU per message (bench/drain.py, three pairs
    # alternated: 66, 62, 62 against 61, 65, 59 µs). Named inside the
    # package: an editable install maps only the package's directory.
    store = [s for s in COMPILED if s.startswith("gateway/store/")]
    rest = [s for s in COMPILED if s not in store]
    groups = [(store, "gateway.compiled_store"), (rest, "gateway.compiled")]
    return list(mypycify(COMPILED, separate=groups))


setup(
    ext_modules=extensions(),
    options={"build_ext": {"parallel": 2}},  # the two libraries above
)
