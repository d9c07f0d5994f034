"""The engine: what happens to queued rollouts at a ship (cut into spans, judged by a policy,
masked in place, saved in checkpoints). Nothing is imported here, so a module of the package costs
only what it imports itself."""

from __future__ import annotations

__all__: list[str] = []
