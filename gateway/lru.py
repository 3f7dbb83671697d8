"""One small bounded LRU map, for every cache the gateway keeps.

Each cache is bounded by ``capacity`` entries. At the bound the least recently
used entry is evicted, the eviction is counted (``evictions``), and ``put``
hands the evicted pair back so a caller with bookkeeping of its own can tidy
up. What forgetting costs is the caller's to document (usually one read, or one
idempotent write, again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    __slots__ = ("_data", "capacity", "evictions")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self.evictions = 0
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value (marked as just used), or None."""
        data = self._data
        value = data.get(key)
        if value is not None:
            data.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value, without marking it used."""
        return self._data.get(key)

    def put(self, key: K, value: V) -> tuple[K, V] | None:
        """Store (as just used); returns the evicted (key, value) at the bound."""
        data = self._data
        data[key] = value
        data.move_to_end(key)
        if len(data) > self.capacity:
            return self.evict_oldest()
        return None

    def evict_oldest(self) -> tuple[K, V] | None:
        """Evict the least recently used entry (counted), for a cache with a
        bound of its own beside the count (bytes, say); None when empty."""
        if not self._data:
            return None
        self.evictions += 1
        return self._data.popitem(last=False)

    def touch(self, key: K) -> bool:
        """Mark as just used; False if absent."""
        if key in self._data:
            self._data.move_to_end(key)
            return True
        return False

    def pop(self, key: K) -> V | None:
        return self._data.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(self._data.items())
