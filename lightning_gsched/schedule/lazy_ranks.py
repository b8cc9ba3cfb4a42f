"""Programs lowered on first access: a rank reads its own program without the others' built.

Why: at W=1024 fsdp's programs hold ~10 million actions (over 1 GB); a rank executing its
program needs only its own (~10,000), which :class:`~.lower.Lowering` makes in about
0.1 s. :data:`LazyRanks` is the ``Programs.ranks`` sequence of such a plan: indexing lowers a
rank once and keeps it, iterating lowers every rank in order, and it compares equal to the list
of the same programs, so every reader of ``Programs.ranks`` works unchanged.

A reader of every rank (the CLI's table, ``--json``, the runtime's channel set-up, the
predictor's walk) would pay W rank-local lowerings, each several times the full lowering's
share of one rank; so where the list is given ``make_all`` (every item at once: the full
lowering, and for a verified plan the full dry run), iterating, or indexing more than
:data:`EAGER_AFTER` distinct items one by one, makes the missing items that way instead.

A reader that shows a bounded sample of a large list (``gsched plan``'s table: the first and
last workers' rows at W=1024) uses :meth:`LazyList.sample`, which makes those items alone and
does not count them towards that switch: its bound is the caller's promise.
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar, overload

from lightning_gsched.schedule.program import Action

T = TypeVar("T")

# distinct items made one by one before a LazyList with ``make_all`` makes the rest at once: a
# rank reads its own program (and an engine a few more); more is a reader of every rank
EAGER_AFTER = 8


class LazyList(Sequence[T], Generic[T]):
    """A list whose item i is ``make(i)``, made on first access and kept (module docstring).

    Used for ``Programs.ranks`` (:data:`LazyRanks`) and a plan's per-worker metrics, which
    read each rank's program. ``reads``: the LazyList whose item i ``make(i)`` reads (a metrics
    row reads rank i's program), so that :meth:`sample` samples it too: else reading the
    sampled rows would count their programs towards that list's eager switch.
    """

    def __init__(self, size: int, make: Callable[[int], T],
                 make_all: Callable[[], Sequence[T]] | None = None,
                 reads: LazyList[Any] | None = None) -> None:
        self._make = make
        self._make_all = make_all
        self._reads = reads
        self._made = 0
        self._items: list[T | None] = [None] * size

    def __len__(self) -> int:
        return len(self._items)

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        program = self._items[index]  # IndexError as a list's
        if program is None:
            if self._make_all is not None and self._made >= EAGER_AFTER:
                self.make_all()
                return self._items[index]  # type: ignore[return-value]  # made now
            program = self._items[index] = self._make(index % len(self))
            self._made += 1
        return program

    def sample(self, indices: Iterable[int]) -> list[T]:
        """The items at ``indices``, each missing one made alone by ``make`` (never by
        ``make_all``) and not counted towards :data:`EAGER_AFTER`; kept as indexing keeps them.

        Why: a reader of a bounded number of items (the text table's shown workers) must not
        turn a plan of 1,024 ranks into the full lowering of all of them, which is what
        indexing a ninth item does; the bound is the caller's to keep (a sample of every item
        is W rank-local lowerings, slower than ``make_all``).
        """
        wanted = list(indices)
        if self._reads is not None:
            self._reads.sample(wanted)  # made here, so that make() finds them made
        items: list[T] = []
        for index in wanted:
            item = self._items[index]  # IndexError as a list's
            if item is None:
                item = self._items[index] = self._make(index % len(self))
            items.append(item)
        return items

    def make_all(self) -> None:
        """Make every missing item at once by ``make_all`` (module docstring); items already
        made (or set) stay as they are. Without ``make_all``, nothing."""
        make_all = self._make_all
        if make_all is None or None not in self._items:
            return
        items = make_all()  # may raise (a verified plan's dry run): then it stays to retry
        self._make_all = None
        for index, item in enumerate(items):
            if self._items[index] is None:
                self._items[index] = item

    def __iter__(self) -> Iterator[T]:
        self.make_all()
        return (self[rank] for rank in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (LazyList, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as the list it stands for

    @property
    def lowered(self) -> int:
        """How many items were made so far."""
        return sum(item is not None for item in self._items)

    def __repr__(self) -> str:
        return f"LazyList({len(self)} items, {self.lowered} made)"


LazyRanks = LazyList[list[Action]]

