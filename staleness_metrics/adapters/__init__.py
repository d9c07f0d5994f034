"""Live trainer integrations (SPEC 15): each module takes its trainer's own batch shapes to the sink
and the shipment back, ``staleness_metrics.adapters.<trainer>.ship``.

- :mod:`.verl`, :mod:`.areal`, :mod:`.trl`, :mod:`.prime_rl_live`; :mod:`._ship`, what they share.
- :mod:`.prime_rl_monitor`: a monitor of prime-rl's own kind (``log_episodes`` /
  ``log_annotations``) over a :class:`~staleness_metrics.StalenessMonitor`, for
  prime-rl's current episode stream.

Recorded runs (prime-rl run directories, xtuner states, event files) are read by
:mod:`staleness_metrics.replay.sources`. Nothing is imported here: a trainer pays
for its own module only.
"""

from __future__ import annotations

__all__: list[str] = []
