"""asyncio and retry helpers.

:func:`backoff` is a retry's delay: doubled per attempt up to a bound, with
the exponent capped, since ``2.0 ** 1024`` raises OverflowError and an
outage of hours makes that many attempts.

:func:`gather_all` is ``asyncio.gather`` typed as what it returns: a list.
typeshed types ``gather(a, b)`` as a tuple, and compiled modules (mypyc,
setup.py) check that at run time, so unpacking ``await asyncio.gather(a, b)``
fails there with "tuple object expected; got list".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

# 2**32 times the shortest delay is past any bound anyone sets.
_MAX_DOUBLINGS = 32


def backoff(attempt: int, first: float, most: float) -> float:
    """``first`` doubled ``attempt`` times, at most ``most`` (any attempt count)."""
    return min(most, first * 2.0 ** min(attempt, _MAX_DOUBLINGS))


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """Await all together; their results in order (the first failure is raised)."""
    return await asyncio.gather(*awaitables)
