"""Write the checkpoints of format 2 (the queue's tables and batches) that test_old_checkpoints.py loads.

Run once with the tree of the commit before checkpoints of meaning (format 3), from the repository root:
``PYTHONPATH=<that tree> python tests/engine/old_checkpoints/make.py``. Each file holds a random stream's
monitor calls (tests/engine/test_checkpoint_cuts.py) and the monitor's state saved before a few of them.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engine.test_checkpoint import POLICIES, config_of, new_monitor
from tests.engine.test_checkpoint_cuts import apply, calls_of
from tests.reference.streams import SeededChooser, generate_events, random_config

HERE = Path(__file__).resolve().parent


def main() -> None:
    import staleness_metrics

    commit = subprocess.run(
        ["git", "-C", str(Path(staleness_metrics.__file__).parent), "rev-parse", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    for policy in POLICIES:
        for seed in (1, 2):
            chooser = SeededChooser(seed * 7 + len(policy))
            replay_config = random_config(chooser, policy, lenient=seed == 2)
            events = generate_events(chooser, replay_config, defects=seed)
            calls = calls_of(events, random.Random(seed))
            cuts = sorted({len(calls) // 4, len(calls) // 2, (3 * len(calls)) // 4})
            monitor, states = new_monitor(config_of(replay_config)), []
            for index, call in enumerate(calls):
                if index in cuts:
                    states.append({"before_call": index, "state": monitor.state_dict()})
                apply(monitor, call)
            record = {
                "made_by": f"staleness_metrics {staleness_metrics.__version__} at {commit or 'unknown commit'}",
                "config": dataclasses.asdict(replay_config),
                "calls": calls,
                "checkpoints": states,
            }
            (HERE / f"{policy}-{seed}.json").write_text(json.dumps(record, allow_nan=False, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
