"""Recorded runs: the SPEC 9 event stream replayed through the engine (:mod:`.stream`), the sources
it is read from (:mod:`.sources`: event files, prime-rl run directories, xtuner states), run
directories (:mod:`.run_dir`) and the bound sweep (:mod:`.what_if`).

Nothing is imported here, so a module of the package costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
