"""The engine: what happens to queued rollouts at a ship.

Batches are cut into spans (:mod:`.spans`, :mod:`.segments`, :mod:`.kernels`), judged by a policy
(:mod:`.policies`) into a decision (:mod:`.decision`), written into the arrays (:mod:`.masking`), by the
queue that owns them (:mod:`.sink`, :mod:`.table`, :mod:`.shipped_positions`) and saves them
(:mod:`.checkpoint`).

Nothing is imported here, so a module of the package costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
