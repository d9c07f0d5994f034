"""staleness-metrics: how stale is the data your asynchronous RL trainer trains on."""

from __future__ import annotations

__version__ = "0.1.0"
