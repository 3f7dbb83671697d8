"""The per-message modules compiled with mypyc (setup.py): the install runs
them compiled, and a compiled module whose source changed refuses to load."""

from __future__ import annotations

import ast
import hashlib
import importlib
import os
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

import gateway
from gateway import compiled_modules

ROOT = Path(__file__).parent.parent


def setup_list() -> list[str]:
    """setup.py's COMPILED, read without running setup.py."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "COMPILED":
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py has no COMPILED list")


def test_the_per_message_modules_run_compiled() -> None:
    """`make venv` compiles them unless GATEWAY_COMPILE=0: each is loaded from
    its extension, not its source."""
    if os.environ.get("GATEWAY_COMPILE") == "0":
        assert gateway.COMPILED == []
        return
    assert setup_list() == gateway.COMPILED, (
        "this install runs them as plain Python: `make venv` compiles them "
        "(or set GATEWAY_COMPILE=0 for the tests too, after GATEWAY_COMPILE=0 make venv)"
    )
    for source in gateway.COMPILED:
        module = importlib.import_module(source.removesuffix(".py").replace("/", "."))
        assert module.__file__ is not None
        assert not module.__file__.endswith(".py"), module.__file__


def fake_package(tmp_path: Path, built: bool) -> Path:
    package = tmp_path / "gateway"
    (package / "ingest").mkdir(parents=True)
    source = package / "ingest" / "pipeline.py"
    source.write_text("X = 1\n")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    (package / "compiled.txt").write_text(f"{digest} gateway/ingest/pipeline.py\n")
    if built:
        (package / "ingest" / f"pipeline{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    return package


def test_a_compiled_module_whose_source_changed_does_not_load(tmp_path: Path) -> None:
    package = fake_package(tmp_path, built=True)
    assert compiled_modules(package) == ["gateway/ingest/pipeline.py"]
    (package / "ingest" / "pipeline.py").write_text("X = 2\n")
    with pytest.raises(ImportError, match=r"gateway/ingest/pipeline\.py changed.*make venv"):
        compiled_modules(package)


def test_a_module_left_uncompiled_is_not_checked(tmp_path: Path) -> None:
    """A source listed but not built (the compiler failed on it) runs as
    source, so editing it is fine."""
    package = fake_package(tmp_path, built=False)
    (package / "ingest" / "pipeline.py").write_text("X = 2\n")
    assert compiled_modules(package) == []
    (package / "compiled.txt").unlink()
    assert compiled_modules(package) == []


def test_no_compiled_module_waits_inside_an_except_clause() -> None:
    """Compiled code suspended inside an ``except`` clause leaves the error as
    the thread's current exception, and every exception raised meanwhile, in
    any task, is chained to it: a failed assertion in CI came under 60 "No
    hosts available" errors from a retry loop (tests/test_outage.py). Wait
    after the clause instead."""
    found = []
    for source in setup_list():
        tree = ast.parse((ROOT / source).read_text())
        for handler in ast.walk(tree):
            if isinstance(handler, ast.ExceptHandler):
                found += [
                    f"{source}:{node.lineno}"
                    for node in ast.walk(handler)
                    if isinstance(node, ast.Await | ast.AsyncWith | ast.AsyncFor)
                ]
    assert found == []


def test_no_compiled_module_waits_inside_a_finally_clause() -> None:
    """A compiled coroutine that is cancelled and awaits in a ``finally``
    clause loses the cancellation (mypy 2.4.1): it carries on after the
    ``finally`` as if nothing had happened. The roll-up worker's lease loop
    written so, compiled, went on working after its stop, and its task never
    ended. (Twenty lines show it: a loop calling a coroutine whose ``finally``
    awaits ``asyncio.gather``, cancelled, goes round again.) Such waits live in
    the interpreted modules (store/lease.py)."""
    found = []
    for source in setup_list():
        tree = ast.parse((ROOT / source).read_text())
        for statement in ast.walk(tree):
            if isinstance(statement, ast.Try | ast.TryStar):
                found += [
                    f"{source}:{node.lineno}"
                    for clause in statement.finalbody
                    for node in ast.walk(clause)
                    if isinstance(node, ast.Await | ast.AsyncWith | ast.AsyncFor)
                ]
    assert found == []
