"""A growable table of numpy columns (amortised O(1) appends, columnar reads)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["Table"]


class Table:
    """Named numpy columns of equal length that grow by appending whole arrays."""

    def __init__(self, **dtypes: npt.DTypeLike) -> None:
        self._columns: dict[str, npt.NDArray[Any]] = {name: np.zeros(16, dtype=d) for name, d in dtypes.items()}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def names(self) -> tuple[str, ...]:
        """The column names, in the order they were declared."""
        return tuple(self._columns)

    def append(self, **values: npt.ArrayLike) -> int:
        """Append equal-length arrays for every column (a scalar: that value in every new row; at least one
        column is an array); returns the index of the first new row."""
        if values.keys() != self._columns.keys():
            raise KeyError(f"expected columns {sorted(self._columns)}, got {sorted(values)}")
        n = next(len(v) for v in values.values() if isinstance(v, np.ndarray) and v.ndim)
        start = self._size
        needed = start + n
        columns = self._columns
        if needed > len(next(iter(columns.values()))):  # (every column has the same capacity)
            for name, column in columns.items():
                grown = np.zeros(max(needed, 2 * len(column)), dtype=column.dtype)
                grown[:start] = column[:start]
                columns[name] = grown
        for name, column in columns.items():
            column[start:needed] = values[name]
        self._size = needed
        return start

    def take(self, rows: npt.NDArray[np.int64], **replace: npt.ArrayLike) -> Table:
        """A new table of the given rows (in that order); ``replace`` gives new values for columns."""
        taken = Table(**{name: column.dtype for name, column in self._columns.items()})
        taken.append(**{name: replace.get(name, self[name][rows]) for name in self._columns})
        return taken

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        """The live rows of a column (a view: writes go to the table)."""
        return self._columns[name][: self._size]
