"""Other trainers' staleness keys for ``migrate --from PEER`` (issues 14, 21; docs/migrate.md):
where each is computed (newest release, else ``owner/repo@commit``) and this project's key with the
same number, or why there is none. TRL's ``max_staleness`` is this project's own setting name."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ..errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# AReaL's stats tracker logs ``<key>__count`` beside each scalar (areal/utils/stats_tracker.py:215)
TRACKER_SUFFIXES: tuple[str, ...] = ("__count",)


@dataclass(frozen=True)
class PeerKey:
    """One peer key: ``new`` is this project's key with the same value, None when it differs."""

    peer: str
    key: str
    new: str | None
    source: str
    reason: str
    # True: matched as whole path segments of a longer logged key (AReaL's tracker adds scopes
    # such as ``ppo_actor/update/version_stats/`` and suffixes such as ``/avg`` or ``__count``).
    segment: bool = False


# the table, in the order it is matched: data (``data/peers.toml``), kept apart from the code
_TABLE: dict[str, list[dict[str, Any]]] = tomllib.loads(
    resources.files("staleness_metrics").joinpath("data/peers.toml").read_text(encoding="utf-8")
)
PEER_KEYS: tuple[PeerKey, ...] = tuple(
    PeerKey(peer, row["key"], row.get("new"), row["source"], row["reason"], row.get("segment", False))
    for peer, rows in _TABLE.items()
    for row in rows
)
PEERS: tuple[str, ...] = tuple(_TABLE)


def peer_keys(peer: str) -> tuple[PeerKey, ...]:
    """The table rows of one peer (``ConfigError`` for a peer the table does not know)."""
    if peer not in PEERS:
        known = ", ".join(PEERS)
        message = f"unknown peer {peer!r}; known: {known}"
        raise ConfigError(message, field="peer", reason=f"unknown (known: {known})")
    return tuple(row for row in PEER_KEYS if row.peer == peer)
