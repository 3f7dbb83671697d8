"""asyncio helpers.

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


async def gather_all(*awaitables: Awaitable[T]) -> list[T]:
    """Await all together; their results in order (the first failure is raised)."""
    return await asyncio.gather(*awaitables)
