"""``staleness-metrics demo``: a simulated asynchronous RL pipeline driving the real
monitor and exporters."""

from __future__ import annotations

from .runner import DemoOptions, run_demo
from .simulation import DemoSettings, EnvProfile, Simulation, StepEvents

__all__ = ["DemoOptions", "DemoSettings", "EnvProfile", "Simulation", "StepEvents", "run_demo"]
