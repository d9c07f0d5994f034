"""Metrics: what a decision means (SPEC 6), the SPEC 11 mismatch sums, the SPEC 14 bound, and the
names every exporter publishes them under. Nothing is imported here (a module costs its imports)."""

from __future__ import annotations

__all__: list[str] = []
