"""``staleness-metrics migrate``: configs, dashboards, rules, W&B panels, histories to new names."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .options import add_command

EPILOG = """\
examples:
  staleness-metrics migrate --check configs/ dashboards/ alerts.yml  # CI: exit 1, listing what is left
  staleness-metrics migrate --write --drop-removed .                 # change the files in place
  staleness-metrics migrate --from verl --check dashboards/ metrics.jsonl

See docs/migrate.md (file kinds, exit status).
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    from ...migrate.model import FileKind
    from ...migrate.peers import PEERS

    names = "legacy off_policy/* keys and max_off_policy_steps"
    summary = f"rename {names} in configs, dashboards, rules and histories"
    parser = add_command(subparsers, run, "migrate", summary, EPILOG)
    add = parser.add_argument
    add("paths", nargs="+", metavar="PATH", help="files or directories")
    mode = parser.add_mutually_exclusive_group()
    check_help = "change nothing; exit 1 and list each legacy name (the default)"
    mode.add_argument("--check", action="store_true", help=check_help)
    mode.add_argument("--diff", action="store_true", help="change nothing; print the changes as a unified diff")
    mode.add_argument("--write", action="store_true", help="change the files in place (atomically)")
    drop_help = "also delete what shows only removed metrics (panels, targets, rules, values)"
    add("--drop-removed", action="store_true", help=drop_help)
    kind_help = "read every named file as this kind instead of detecting it"
    add("--kind", choices=[kind.value for kind in FileKind], help=kind_help)
    peer_help = "map another trainer's staleness keys instead of this project's legacy names"
    add("--from", dest="peer", choices=PEERS, help=peer_help)
    prefix_help = "a prefix of your legacy series names (repeatable; 'orchestrator_' always counts)"
    add("--prometheus-prefix", action="append", default=[], metavar="PREFIX", help=prefix_help)


def run(args: argparse.Namespace) -> int:
    from ...migrate.driver import iter_files, migrate_file, unified_diff, write_atomically
    from ...migrate.legacy import DEFAULT_PROMETHEUS_PREFIXES
    from ...migrate.model import FileKind, Options

    options = Options(
        drop_removed=args.drop_removed,
        prometheus_prefixes=tuple(dict.fromkeys([*DEFAULT_PROMETHEUS_PREFIXES, *args.prometheus_prefix])),
        peer=args.peer,
    )
    kind = FileKind(args.kind) if args.kind else None
    failed = False
    remaining = fixed = files_with_legacy = 0
    for path, explicit in iter_files(args.paths):
        if not explicit and not path.is_file():
            continue
        result = migrate_file(path, options, kind=kind, explicit=explicit)
        if result.skipped:
            continue
        if result.error:
            failed = True
            print(f"{result.path}: {result.error}; not changed", file=sys.stderr)
        files_with_legacy += bool(result.findings)
        if args.diff:
            sys.stdout.write(unified_diff(result))
        if args.write and result.changed:
            assert result.original is not None and result.new_text is not None
            try:
                write_atomically(path, result.original, result.new_text)
            except OSError as exc:
                failed = True
                print(f"{result.path}: cannot write: {exc}; not changed", file=sys.stderr)
                continue
            print(f"updated {result.path}")
        applied = (args.write or args.diff) and result.changed
        for finding in result.findings:
            if applied and finding.fixed_by_write:
                fixed += 1
                if args.write:
                    print(f"  {finding.describe()}")
                continue
            remaining += 1
            print(finding.describe(), file=sys.stderr if args.diff else sys.stdout)
        for note in result.notes if applied else ():
            print(f"  {result.path}: {note}", file=sys.stderr if args.diff else sys.stdout)
    print(_summary(args, remaining, fixed, files_with_legacy), file=sys.stderr)
    return 2 if failed else 1 if remaining and not (args.write or args.diff) else 0


def _summary(args: argparse.Namespace, remaining: int, fixed: int, files: int) -> str:
    names = f"{args.peer} key(s)" if args.peer else "legacy name(s)"
    if not (args.write or args.diff):
        hint = " (staleness-metrics migrate --write [--drop-removed] PATH... fixes what it can)"
        return f"migrate: {remaining} {names} in {files} file(s)" + (hint if remaining else "")
    done = f"{fixed} {names} updated" if args.write else f"the diff updates {fixed} {names}"
    return f"migrate: {done}" + (f"; {remaining} left (listed above)" if remaining else "")
