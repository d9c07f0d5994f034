"""The engine: queued rollouts at a ship (cut into spans, judged by a policy, masked in place, saved
in checkpoints). Nothing is imported here: a module of the package costs what it imports only."""

from __future__ import annotations

__all__: list[str] = []
