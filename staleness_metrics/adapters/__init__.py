"""Live trainer integrations (SPEC 15): ``adapters.<trainer>.ship`` takes a trainer's own batch to
the sink and the shipment back. Nothing is imported here: a trainer pays for its own module only."""

from __future__ import annotations

__all__: list[str] = []
