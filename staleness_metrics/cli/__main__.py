"""``python -m staleness_metrics.cli``: the console script."""

from __future__ import annotations

from . import main

raise SystemExit(main())
