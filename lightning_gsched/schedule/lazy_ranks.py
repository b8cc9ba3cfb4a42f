"""``Programs.ranks``: a list whose item is made when first read, and kept.

Why: at W=1024 fsdp's programs hold ~10 million actions (over 1 GB); a rank executing its
program needs only its own (~10,000), which :class:`~.lower.Lowering` makes in about 0.1 s.
Reading ranks one by one lowers only the ranks read; a reader of every rank (``--programs``, the
replays, the full dry run) calls :meth:`LazyList.make_all`: one full lowering, several times
cheaper than W rank-local ones.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, Sequence, TypeVar, overload

T = TypeVar("T")


class LazyList(Sequence[T], Generic[T]):
    """A list whose item i is ``make(i)``, made on first access and kept; also a lazy plan's
    per-worker metrics. ``make_all``: every item at once."""

    def __init__(self, size: int, make: Callable[[int], T],
                 make_all: Callable[[], Sequence[T]] | None = None) -> None:
        self._make, self._make_all = make, make_all
        self._items: list[T | None] = [None] * size

    @classmethod
    def of(cls, items: Sequence[T]) -> LazyList[T]:
        """A list whose items are all made already."""
        made: LazyList[T] = cls(len(items), items.__getitem__)  # never called: all are made
        made._items = list(items)
        return made

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        item = self._items[index]  # IndexError as a list's
        if item is None:
            item = self._items[index] = self._make(index % len(self))
        return item

    def make_all(self) -> LazyList[T]:
        """Make every missing item (by ``make_all`` where given, else one by one); returns self."""
        if None not in self._items:
            return self
        if self._make_all is not None:
            items = self._make_all()  # may raise (a verified plan's dry run): it stays to retry
            self._make_all = None
            for index, item in enumerate(items):
                if self._items[index] is None:
                    self._items[index] = item
        for index in range(len(self)):
            self[index]
        return self

    def __iter__(self) -> Iterator[T]:
        return (self[index] for index in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LazyList, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as the list it stands for

    @property
    def lowered(self) -> int:
        """How many items are made so far."""
        return sum(item is not None for item in self._items)

    def __repr__(self) -> str:
        return f"LazyList({len(self)} items, {self.lowered} made)"
