"""A growable table of numpy columns (amortised O(1) appends, columnar reads)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Table"]


class Table:
    """Named numpy columns of equal length that grow by appending whole arrays."""

    def __init__(self, **dtypes: npt.DTypeLike) -> None:
        self._capacity = 16
        self._columns: dict[str, npt.NDArray[Any]] = {name: np.zeros(16, dtype=d) for name, d in dtypes.items()}
        self._size = 0
        self._views: dict[str, npt.NDArray[Any]] = {}  # the live rows of the columns read since the last append

    def __len__(self) -> int:
        return self._size

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in the order they were declared."""
        return tuple(self._columns)

    def append(self, **values: npt.ArrayLike) -> int:
        """Append equal-length arrays for every column (a scalar: that value in every new row; at least one
        column is an array); returns the index of the first new row."""
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

    def take(self, rows: npt.NDArray[np.int64], **replace: npt.ArrayLike) -> Table:
        """A new table of the given rows (in that order); ``replace`` gives new values for columns."""
        taken = Table(**{name: column.dtype for name, column in self._columns.items()})
        taken.append(**{name: replace.get(name, self[name][rows]) for name in self._columns})
        return taken

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        """The live rows of a column (a view: writes go to the table). (A ship reads a few dozen columns: each
        view is made once per length.)"""
        view = self._views.get(name)
        if view is None:
            view = self._views[name] = self._columns[name][: self._size]
        return view
