"""Host-side page and slot allocators (free lists). Page 0 and slot 0 are reserved as trash."""

from __future__ import annotations


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold positions ``0 .. num_tokens-1``."""
    return -(-num_tokens // page_size)


class FreeList:
    """Ids ``1 .. size-1`` (id 0 is the trash id), handed out lowest first."""

    def __init__(self, size: int, what: str):
        self.size, self.what = size, what
        self._free = list(range(size - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"out of {self.what}: need {n}, {len(self._free)} free of "
                              f"{self.size - 1}")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, ids) -> None:
        self._free.extend(sorted(ids, reverse=True))

    def reset(self, used=()) -> None:
        """Free every id but ``used``, in a fresh list's order (for an owner that knows every
        id in use, e.g. an engine left without requests after an error)."""
        used = set(used)
        self._free = [i for i in range(self.size - 1, 0, -1) if i not in used]
