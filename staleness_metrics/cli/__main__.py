"""``python -m staleness_metrics.cli``: the console script."""

from __future__ import annotations

import sys

from . import main

sys.exit(main())
