"""Metrics: what a decision means, computed from it (:mod:`.compute`, :mod:`.report`), the SPEC 11
mismatch sums (:mod:`.mismatch`), the SPEC 14 bound (:mod:`.bound`), and the names every exporter
publishes them under (:mod:`.metric_table`).

Nothing is imported here, so a module of the package costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
