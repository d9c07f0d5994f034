"""Live trainer integrations (SPEC 15): ``staleness_metrics.adapters.<trainer>.ship`` takes the
trainer's own batch to the sink and the shipment back (:mod:`.verl`, :mod:`.areal`, :mod:`.trl`,
:mod:`.prime_rl_live`; :mod:`._ship` is what they share); :mod:`.prime_rl_monitor` is a monitor of
prime-rl's own kind. Nothing is imported here: a trainer pays for its own module only.
"""

from __future__ import annotations

__all__: list[str] = []
