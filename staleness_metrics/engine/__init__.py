"""The engine: what happens to queued rollouts at a ship.

Batches are cut into spans (:mod:`.cuts`, :mod:`.spans`, :mod:`.segments`), judged by a policy
(:mod:`.policies`) into a decision (:mod:`.decision`, :mod:`.judging`), written into the arrays
(:mod:`.masking`), by the queue that owns them (:mod:`.sink`, :mod:`.queue`, :mod:`.table`,
:mod:`.shipped_positions`) and saves them (:mod:`.checkpoint`). Each compiled loop sits beside the
concept it computes; :mod:`.warm_up` compiles them all.

Nothing is imported here, so a module of the package costs only what it imports itself.
"""

from __future__ import annotations

__all__: list[str] = []
