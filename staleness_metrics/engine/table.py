"""Growable tables of typed numpy columns (amortised O(1) appends, columnar reads), declared as
:class:`Column` attributes of a subclass: ``rows.status`` is a name mypy checks."""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar, overload

import numpy as np
import numpy.typing as npt

__all__ = ["Column", "Table"]

ScalarT = TypeVar("ScalarT", bound=np.generic)
TableT = TypeVar("TableT", bound="Table")


class Column(Generic[ScalarT]):
    """A column of a :class:`Table` subclass: ``table.name`` reads its live rows (a view: writes go
    to the table); assigning ``table.name = values`` writes every row."""

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
    """Columns of equal length that grow by appending whole arrays; a subclass declares them as
    :class:`Column` attributes (in the order they are saved)."""

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

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in the order they were declared."""
        return tuple(self.columns)

    def append(self, **values: npt.ArrayLike) -> int:
        """Append equal-length arrays for every column (a scalar: that value in every new row; at
        least one column is an array); returns the index of the first new row."""
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
