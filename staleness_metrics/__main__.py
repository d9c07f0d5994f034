"""``python -m staleness_metrics``: the console script."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
