"""Growable tables of typed numpy columns (amortised O(1) appends, columnar reads), declared as
:class:`Column` attributes, and the queue's three: a row per rollout, sample and span it tracks."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar, overload

import numpy as np
import numpy.typing as npt

ScalarT = TypeVar("ScalarT", bound=np.generic)
TableT = TypeVar("TableT", bound="Table")


class Column(Generic[ScalarT]):
    """A column of a :class:`Table`: ``table.name`` is a view of its live rows."""

    def __init__(self, dtype: type[ScalarT]) -> None:
        self.dtype = np.dtype(dtype)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, table: None, owner: type) -> Column[ScalarT]: ...
    @overload
    def __get__(self, table: Table, owner: type) -> npt.NDArray[ScalarT]: ...
    def __get__(self, table: Table | None, owner: type) -> Column[ScalarT] | npt.NDArray[ScalarT]:
        if table is None:
            return self
        return table.column(self.name)

    def __set__(self, table: Table, values: npt.ArrayLike) -> None:
        table.column(self.name)[:] = values


class Table:
    """Columns of equal length (:class:`Column` attributes), grown by appending arrays."""

    columns: ClassVar[dict[str, np.dtype[Any]]] = {}

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        cls.columns = {name: c.dtype for name, c in vars(cls).items() if isinstance(c, Column)}

    def __init__(self) -> None:
        self._capacity = 16
        self._columns: dict[str, npt.NDArray[Any]] = {name: np.zeros(16, dtype=d) for name, d in self.columns.items()}
        self._size = 0
        # the live rows of the columns read since the last append
        self._views: dict[str, npt.NDArray[Any]] = {}

    def __len__(self) -> int:
        return self._size

    def append(self, **values: npt.ArrayLike) -> int:
        """Append equal-length arrays (or scalars) for every column; the first new row."""
        columns = self._columns
        if values.keys() != columns.keys():
            raise KeyError(f"expected columns {sorted(columns)}, got {sorted(values)}")
        for value in values.values():
            if isinstance(value, np.ndarray) and value.ndim:
                n = len(value)
                break
        else:
            raise ValueError("at least one column must be an array")
        start = self._size
        needed = start + n
        if needed > self._capacity:  # (every column has the same capacity)
            self._capacity = max(needed, 2 * self._capacity)
            for name, column in columns.items():
                grown = np.zeros(self._capacity, dtype=column.dtype)
                grown[:start] = column[:start]
                columns[name] = grown
        for name, column in columns.items():
            column[start:needed] = values[name]
        self._size = needed
        self._views = {}
        return start

    def take(self: TableT, rows: npt.NDArray[np.int64], **replace: npt.ArrayLike) -> TableT:
        """A new table of the given rows; ``replace`` gives new values for columns."""
        taken = type(self)()
        taken.append(**{name: replace.get(name, self.column(name)[rows]) for name in self.columns})
        return taken

    def column(self, name: str) -> npt.NDArray[Any]:
        """The live rows of a column by name (a view, made once per length)."""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._columns[name][: self._size]
        return view


class RolloutRows(Table):
    """One row per rollout: where it arrived, where it is, and what the policies read of it."""

    chunk = Column(np.int64)  # the batch it arrived in (the queue's ``chunks``)
    index = Column(np.int64)  # its rollout number in that batch
    status = Column(np.int8)  # queue.QUEUED, SHIPPED, DROPPED or INVALID
    judged = Column(np.int64)  # the last step that judged it (queue.NEVER: none yet)
    frozen = Column(np.bool_)
    dispatch = Column(np.int64)
    completion = Column(np.int64)
    group = Column(np.int64)  # the queue's group index
    env = Column(np.int64)  # the queue's env index (0: none)
    sample_lo = Column(np.int64)  # its sample rows
    sample_hi = Column(np.int64)


class SampleRows(Table):
    """One row per sample: its spans, its masking threshold and what the cut found in it."""

    rollout = Column(np.int64)  # its rollout row
    local = Column(np.int64)  # its number within its rollout
    span_lo = Column(np.int64)  # its span rows
    span_hi = Column(np.int64)
    mask_below = Column(np.int64)  # versions below this are masked (decision.NO_MASK: none)
    dropped = Column(np.bool_)
    had_train = Column(np.bool_)
    unmaskable = Column(np.bool_)
    n_sampled = Column(np.int64)
    n_unlabelled = Column(np.int64)
    max_label = Column(np.int64)
    max_sampled = Column(np.int64)
    seq_min = Column(np.int64)
    label_kind = Column(np.int8)


class SpanRows(Table):
    """One row per span: a range of positions of one version label and one mask value."""

    sample = Column(np.int64)  # its sample row
    lo = Column(np.int64)  # positions in its rollout's batch
    hi = Column(np.int64)
    version = Column(np.int64)
    labelled = Column(np.bool_)
    sampled = Column(np.int64)
    live = Column(np.bool_)
    part = Column(np.int8)  # spans.PART_WHOLE, PART_LABELLED or PART_UNLABELLED
