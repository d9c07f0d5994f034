"""mkdocs hook: pages another change adds (``docs/multi-gpu.md``) get a place in the nav when they exist,
so the strict build neither lists a missing page nor leaves an existing one out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# page -> (its title, the nav section it goes at the end of)
OPTIONAL = {"multi-gpu.md": ("Multi-GPU", "Trainers")}


def on_config(config: Any) -> Any:
    docs = Path(config["docs_dir"])
    listed = repr(config["nav"])
    for page, (title, section) in OPTIONAL.items():
        if (docs / page).is_file() and f"'{page}'" not in listed:
            for entry in config["nav"]:
                if isinstance(entry, dict) and section in entry:
                    entry[section].append({title: page})
    return config
