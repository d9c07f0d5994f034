"""A griffe extension for the API reference: the package's docstrings are written for Sphinx
(``:class:`~staleness_metrics.errors.TraceError```, ``Example::`` before an indented block), mkdocstrings
reads Markdown. Roles become code spans of the name they show, and ``::`` a colon before the block."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.M)  # "Example::" -> "Example:"; a lone "::" line goes
LONE_LITERAL = re.compile(r"^[ \t]*::[ \t]*\n", re.M)


def _role(match: re.Match[str]) -> str:
    target = match.group(2).lstrip(".")
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def plain(text: str) -> str:
    return LONE_LITERAL.sub("", LITERAL.sub(r"\1:", ROLE.sub(_role, text)))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
