"""asyncio and retry helpers.

:func:`backoff` is a retry's delay: doubled per attempt up to a bound, with
the exponent capped, since ``2.0 ** 1024`` raises OverflowError and an
outage of hours makes that many attempts.

:func:`gather_all` is ``asyncio.gather`` typed as what it returns: a list;
:func:`all_or_none` is one whose first failure cancels the rest.
typeshed types ``gather(a, b)`` as a tuple, and compiled modules (mypyc,
setup.py) check that at run time, so unpacking ``await asyncio.gather(a, b)``
fails there with "tuple object expected; got list".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# 2**32 times the shortest delay is past any bound anyone sets.
_MAX_DOUBLINGS = 32


def backoff(attempt: int, first: float, most: float) -> float:
    """``first`` doubled ``attempt`` times, at most ``most`` (any attempt count)."""
    return min(most, first * 2.0 ** min(attempt, _MAX_DOUBLINGS))


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """Await all together; their results in order (the first failure is raised)."""
    return await asyncio.gather(*awaitables)


async def all_or_none(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run all together; their results in order. The first failure cancels
    the others and is raised itself (not in an ExceptionGroup): with
    ``gather`` the others went on, retrying, after the caller had given up."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]
