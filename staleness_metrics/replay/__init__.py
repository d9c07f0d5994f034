"""Recorded runs: the SPEC 9 stream replayed (:mod:`.stream`), its sources (:mod:`.sources`), run
directories (:mod:`.run_dir`) and the bound sweep (:mod:`.what_if`). Nothing is imported here, so
a module of the package costs only what it imports itself."""

from __future__ import annotations

__all__: list[str] = []
