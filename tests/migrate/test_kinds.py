"""Each file kind's corner cases: conflicts, unparseable files, escapes, aliases, histories, writing."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from staleness_metrics.migrate import FileKind, Options, detect_kind, migrate_file, write_atomically
from staleness_metrics.migrate.driver import MARKER_KEY

from .cli import migrate


def _write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode())
    return path


# -- configs -----------------------------------------------------------------------------------------


def test_a_config_with_both_names_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "[orchestrator]\nmax_off_policy_steps = 8\nmax_staleness = 4\n"
    config = _write(tmp_path / "orch.toml", text)
    refused = f"{config}: refusing to edit: both 'max_off_policy_steps' and 'max_staleness' are set"
    for mode in ("--write", "--diff", "--check"):  # --write and --diff said so, yet exited 0
        run = migrate(capsys, mode, str(config))
        assert run.code == 2 and refused in run.err and "not changed" in run.err
        assert f"{config}:2: max_off_policy_steps -> max_staleness: not edited" in run.out + run.err
    assert config.read_text() == text


@pytest.mark.parametrize(
    ("name", "text", "parser", "line"),
    [
        ("broken.toml", "[orchestrator\nmax_off_policy_steps = 8\n", "TOML", 2),
        ("broken.yaml", "orchestrator:\n  max_off_policy_steps: [8\n", "YAML", 2),
        ("broken.json", '{"max_off_policy_steps": 8,}\n', "JSON", 1),
    ],
)
def test_an_unparseable_file_is_never_touched_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, parser: str, line: int
) -> None:
    config = _write(tmp_path / name, text)
    run = migrate(capsys, "--write", str(config))
    assert run.code == 2
    assert f"{config}: cannot parse as {parser}" in run.err and "not changed" in run.err
    assert config.read_text() == text
    assert f"{config}:{line}: max_off_policy_steps -> max_staleness: not edited" in run.out


def test_yaml_config_keeps_quotes_flow_style_and_anchors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "defaults: &d\n"
        "  max_off_policy_steps: 8 # shared\n"
        "run_a:\n"
        "  <<: *d\n"
        "  keys: {mean: 'off_policy/mean', max: \"off_policy/max\"}\n"
    )
    config = _write(tmp_path / "runs.yml", text)
    assert migrate(capsys, "--write", str(config)).code == 0
    assert config.read_text() == text.replace("max_off_policy_steps", "max_staleness").replace(
        "'off_policy/mean'", "'staleness/rollout/mean'"
    ).replace('"off_policy/max"', '"staleness/rollout/max"')


@pytest.mark.parametrize(
    ("name", "text"),
    [
        (
            "values.yaml",
            "rules:\n  - expr: orchestrator_off_policy_mean > 4  # off_policy_max\n  - off_policy_token_max\n",
        ),
        (
            "values.toml",
            'expr = "orchestrator_off_policy_mean > 4"  # off_policy_max\nold = ["off_policy_token_max"]\n',
        ),
        ("cm.json", '{"expr": "orchestrator_off_policy_mean > 4", "x": "off_policy_max", "y": "off_policy_token_max"}'),
    ],
)
def test_old_series_names_in_a_config_are_renamed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    config = _write(tmp_path / name, text)
    assert migrate(capsys, "--check", str(config)).code == 1
    run = migrate(capsys, "--write", str(config))
    assert run.code == 0 and "off_policy_token_max: removed" in run.out
    assert config.read_text() == text.replace(
        "orchestrator_off_policy_mean", "rl_staleness_rollout_mean_steps"
    ).replace("off_policy_max", "rl_staleness_rollout_max_steps")


def test_removed_keys_in_a_config_are_reported_for_a_human(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _write(tmp_path / "watch.json", '{"watch": ["off_policy/token/max", "off_policy/*"]}\n')
    run = migrate(capsys, "--write", "--drop-removed", str(config))
    assert config.read_text() == '{"watch": ["off_policy/token/max", "off_policy/*"]}\n'
    assert "off_policy/token/max: removed" in run.out and "delete it from the config by hand" in run.out
    assert "off_policy/*: not edited (old off_policy/ namespace" in run.out


# -- dashboards, rules, W&B ----------------------------------------------------------------------------


def test_json_escapes_are_rewritten_correctly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dashboard = {"schemaVersion": 39, "panels": [{"title": "x", "targets": [{"expr": "off_policy_mean"}]}]}
    text = json.dumps(dashboard).replace('"x"', '"off_policy\\/mean"')  # an escaped slash
    path = _write(tmp_path / "d.json", text)
    assert migrate(capsys, "--write", str(path)).code == 0
    migrated = json.loads(path.read_text())
    assert migrated["panels"][0]["title"] == "staleness/rollout/mean"
    assert migrated["panels"][0]["targets"][0]["expr"] == "rl_staleness_rollout_mean_steps"


def test_prefixes_and_counter_notes_in_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "groups:\n"
        "  - name: g\n"
        "    rules:\n"
        "      - alert: A\n"
        "        expr: myteam_off_policy_mean > 3 or off_policy_dropped > 0\n"
    )
    rules = _write(tmp_path / "rules.yml", text)
    run = migrate(capsys, "--check", str(rules))
    assert "myteam_off_policy_mean: not edited (looks like a legacy series name" in run.out
    assert "off_policy_dropped -> rl_staleness_rollouts_dropped_total (was a per-step gauge" in run.out
    assert migrate(capsys, "--write", "--prometheus-prefix", "myteam_", str(rules)).code == 0
    assert rules.read_text() == text.replace(
        "myteam_off_policy_mean > 3 or off_policy_dropped > 0",
        "rl_staleness_rollout_mean_steps > 3 or rl_staleness_rollouts_dropped_total > 0",
    )


_LIVE = "off_policy_token_max - rl_staleness_rollout_max_steps"


@pytest.mark.parametrize("name", ["d.json", "rules.yml"])
@pytest.mark.parametrize(
    ("expr", "renamed"),
    [
        ("off_policy_token_max - off_policy_max", _LIVE),
        (_LIVE, _LIVE),  # what the first run leaves: a second run must not delete it
        ("off_policy_token_max > on(run) train_loss", "off_policy_token_max > on(run) train_loss"),
    ],
)
def test_a_query_mixing_removed_and_live_series_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, expr: str, renamed: str
) -> None:
    dashboard = {"schemaVersion": 39, "panels": [{"title": "gap", "targets": [{"expr": expr}]}]}
    rules = f"groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: {expr}\n"
    text = json.dumps(dashboard, indent=2) if name == "d.json" else rules
    path = _write(tmp_path / name, text)
    run = migrate(capsys, "--write", "--drop-removed", str(path))
    assert run.code == 0 and "off_policy_token_max: removed" in run.out
    assert path.read_text() == text.replace(expr, renamed)


def test_wandb_view_spec_in_camel_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = {
        "section": {
            "panels": [
                {
                    "viewType": "Run History Line Plot",
                    "config": {"metricRegex": "off_policy/in_queue/.*", "useMetricRegex": True},
                },
                {"viewType": "Run History Line Plot", "config": {"metrics": ["dispatcher/off_policy/mean"]}},
                {"viewType": "Run History Line Plot", "config": {"metrics": ["staleness/mean", "loss"]}},
            ]
        }
    }
    path = _write(tmp_path / "view.json", json.dumps(spec, indent=1) + "\n")
    assert migrate(capsys, "--write", "--drop-removed", str(path)).code == 0
    panels = json.loads(path.read_text())["section"]["panels"]
    assert [p["config"].get("metricRegex") or p["config"]["metrics"] for p in panels] == [
        "^staleness/rollout/in_queue/(?:max|mean)$",
        ["staleness/rollout/mean", "loss"],
    ]


def test_yaml_aliases_are_rewritten_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = "panels:\n  - title: a\n    y: [&k off_policy/mean]\n  - title: b\n    y: [*k]\n"
    path = _write(tmp_path / "panels.yaml", text)
    assert migrate(capsys, "--write", str(path)).code == 0
    assert path.read_text() == text.replace("off_policy/mean", "staleness/rollout/mean")


def test_yaml_merge_keys_are_followed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "x-common: &common\n"
        "  severity: page\n"
        "  summary: off_policy/mean is high\n"
        "groups:\n"
        "  - name: g\n"
        "    rules:\n"
        "      - alert: A\n"
        "        expr: off_policy_mean > 3\n"
        "        labels:\n"
        "          <<: [*common, {team: rl}]\n"
        "          severity: warn\n"
    )
    rules = _write(tmp_path / "alerts.yml", text)
    (tmp_path / "later.toml").write_text("max_off_policy_steps = 3\n")
    assert migrate(capsys, "--write", str(tmp_path)).code == 0
    assert rules.read_text() == text.replace("off_policy/mean", "staleness/rollout/mean").replace(
        "off_policy_mean", "rl_staleness_rollout_mean_steps"
    )
    assert (tmp_path / "later.toml").read_text() == "max_staleness = 3\n"
    assert migrate(capsys, "--check", str(tmp_path)).code == 0


_LAB = "      - alert: Fresh\n        expr: train_loss > 1\n        labels: &lab {severity: page}\n"
_KEEP = "keep: &keep staleness/rollout/mean\npanels:\n  - title: a\n"


@pytest.mark.parametrize(
    ("name", "head", "doomed", "tail"),
    [
        pytest.param(  # the value of an alias is written at its *name, not at its anchor
            "rules.yml",
            "groups:\n  - name: g\n    rules:\n" + _LAB,
            "      - alert: Lag\n        expr: dispatcher_staleness_max > 2\n        labels: *lab\n",
            "      - alert: Other\n        expr: train_loss > 2\n        labels: *lab\n",
            id="mapping-alias-last",
        ),
        pytest.param(
            "rules.yml",
            "x-wait: &wait 5m\ngroups:\n  - name: g\n    rules:\n" + _LAB,
            "      - alert: Lag\n        expr: dispatcher_staleness_max > 2\n        for: *wait\n",
            "",
            id="scalar-alias-last",
        ),
        pytest.param(
            "rules.yml",
            "x-common: &common\n  labels: {severity: page}\ngroups:\n  - name: g\n    rules:\n",
            "      - alert: Lag\n        expr: dispatcher_staleness_max > 2\n        <<: *common\n",
            "      - alert: Other\n        expr: train_loss > 2\n        <<: *common\n",
            id="merge-key-last",
        ),
        pytest.param(
            "panels.yaml", _KEEP + "    y: [*keep", ", dispatcher/off_policy/mean", "]\n", id="flow-item-after-alias"
        ),
        pytest.param(
            "panels.yaml", _KEEP + "    y:\n      - *keep\n", "      - dispatcher/off_policy/max\n", "", id="block-item"
        ),
        pytest.param(
            "panels.yaml", _KEEP + "    y:\n", "      - dispatcher/off_policy/max\n", "      - *keep\n", id="alias-item"
        ),
    ],
)
def test_drop_removed_beside_yaml_aliases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, head: str, doomed: str, tail: str
) -> None:
    """A mapping ending with ``labels: *lab`` was refused ("duplicate key"): the alias took its anchor's span."""
    path = _write(tmp_path / name, head + doomed + tail)
    run = migrate(capsys, "--write", "--drop-removed", str(path))
    assert (run.code, run.err.splitlines()[-1]) == (0, "migrate: 1 legacy name(s) updated")
    assert path.read_text() == head + tail


@pytest.mark.parametrize(
    "expr",
    [
        "dispatcher_staleness_max > 2",
        "max by (run) (rate(off_policy_token_max{job=~'$job'}[$__rate_interval])) > bool 2",  # no other series
        "off_policy_token_max offset 5m unless on(run) group_left dispatcher_staleness_max > 1e3",
    ],
)
def test_rules_group_emptied_by_drop_removed_stays_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expr: str
) -> None:
    text = f"groups:\n  - name: g\n    rules:\n      - alert: Lag\n        expr: {expr}\n"
    rules = _write(tmp_path / "r.yaml", text)
    assert migrate(capsys, "--write", "--drop-removed", str(rules)).code == 0
    assert rules.read_text() == "groups:\n  - name: g\n    rules:\n      []\n"


# -- metrics history ---------------------------------------------------------------------------------


def test_history_keeps_values_line_endings_and_marks_the_boundary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        '{"step": 1, "off_policy/mean": 1.50, "loss": 2e-3}',
        '{"step": 2, "off_policy/mean": 0.1, "staleness/rollout/mean": 0.25}',
        '{"step": 3, "staleness/rollout/mean": 1.0}',
    ]
    history = _write(tmp_path / "metrics.jsonl", "\r\n".join(lines))  # CRLF, no final newline
    run = migrate(capsys, "--write", str(history))
    assert "off_policy/mean -> staleness/rollout/mean" in run.out
    assert "staleness/rollout/mean is already on the line" in run.out
    assert history.read_bytes().decode() == "\r\n".join(
        [
            '{"step": 1, "staleness/rollout/mean": 1.50, "loss": 2e-3}',
            lines[1],
            json.dumps({"step": 2, MARKER_KEY: 2}),
            lines[2],
        ]
    )
    before = history.read_bytes()  # (--drop-removed drops removed keys: an old key's value beside its new
    assert migrate(capsys, "--write", "--drop-removed", str(history)).code == 0  # key's may differ: kept)
    assert history.read_bytes() == before
    history.write_text('{"step": 1, "staleness/rollout/mean": 1.0, "staleness/mean": 2.0, "off_policy/token/max": 3}\n')
    run = migrate(capsys, "--write", "--drop-removed", str(history))
    assert "staleness/mean -> staleness/rollout/mean" in run.out and "is already on the line" in run.out
    assert json.loads(history.read_text().splitlines()[0]) == {
        "step": 1,
        "staleness/rollout/mean": 1.0,
        "staleness/mean": 2.0,
    }
    before = history.read_bytes()
    assert migrate(capsys, "--write", "--drop-removed", str(history)).code == 0
    assert history.read_bytes() == before


def test_a_replay_event_stream_is_not_a_history(tmp_path: Path) -> None:
    events = '{"type": "ship", "step": 1}\n'
    assert detect_kind(tmp_path / "events.jsonl", events) is FileKind.TEXT
    assert detect_kind(tmp_path / "metrics.jsonl", '{"step": 1, "loss": 1}\n') is FileKind.HISTORY


_MARK = json.dumps({"step": 2, MARKER_KEY: 2}) + "\n"


@pytest.mark.parametrize(
    ("args", "text", "expected"),
    [
        pytest.param(  # the boundary after a renamed last line ends with the file's final newline
            [],
            '{"step": 1, "off_policy/mean": 1.5}\n{"step": 2, "off_policy/mean": 2.5}\n',
            '{"step": 1, "staleness/rollout/mean": 1.5}\n{"step": 2, "staleness/rollout/mean": 2.5}\n' + _MARK,
            id="final-newline",
        ),
        pytest.param(  # a removed key left before the boundary does not pull it back on the second run
            [],
            '{"step": 1, "off_policy/token/max": 3}\n{"step": 2, "off_policy/mean": 1.5}\n{"step": 3, "loss": 0.1}\n',
            '{"step": 1, "off_policy/token/max": 3}\n{"step": 2, "staleness/rollout/mean": 1.5}\n'
            + _MARK
            + '{"step": 3, "loss": 0.1}\n',
            id="boundary-stays",
        ),
        pytest.param(  # nothing renamed (the new key is already there): no boundary line
            ["--from", "skyrl"],
            '{"step": 1, "async/staleness_mean": 1.5, "staleness/rollout/mean": 1.5}\n{"step": 2, "loss": 0.1}\n',
            '{"step": 1, "async/staleness_mean": 1.5, "staleness/rollout/mean": 1.5}\n{"step": 2, "loss": 0.1}\n',
            id="peer-nothing-renamed",
        ),
        pytest.param(  # U+2028 in a value: still one line, and still a history
            [],
            '{"step": 2, "off_policy/mean": 1.5, "note": "a\u2028b"}\n',
            '{"step": 2, "staleness/rollout/mean": 1.5, "note": "a\u2028b"}\n' + _MARK,
            id="u2028",
        ),
        pytest.param(  # NaN and Infinity, as json.dumps writes them, are read and kept byte for byte
            [],
            '{"step": 2, "off_policy/mean": NaN, "loss": -Infinity, "lr": Infinity}\n',
            '{"step": 2, "staleness/rollout/mean": NaN, "loss": -Infinity, "lr": Infinity}\n' + _MARK,
            id="nan",
        ),
    ],
)
def test_history_boundary_and_line_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], text: str, expected: str
) -> None:
    history = _write(tmp_path / "metrics.jsonl", text)
    assert migrate(capsys, "--write", *args, str(history)).code == 0
    assert history.read_bytes().decode() == expected
    assert migrate(capsys, "--write", *args, str(history)).code == 0
    assert history.read_bytes().decode() == expected  # a second --write changes nothing


def test_diff_splits_lines_on_newlines_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = '{"step": 1, "loss": 0.2}\n{"step": 2, "off_policy/mean": 1.5, "note": "a\u2028b\x85c"}\n'
    history = _write(tmp_path / "metrics.jsonl", text)
    run = migrate(capsys, "--diff", str(history))
    assert run.code == 0
    assert run.out == (
        f"--- a/{history}\n+++ b/{history}\n@@ -1,2 +1,3 @@\n"
        ' {"step": 1, "loss": 0.2}\n'
        '-{"step": 2, "off_policy/mean": 1.5, "note": "a\u2028b\x85c"}\n'
        '+{"step": 2, "staleness/rollout/mean": 1.5, "note": "a\u2028b\x85c"}\n'
        f"+{_MARK}"
    )


def test_a_broken_history_line_stops_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = '{"step": 1, "off_policy/max": 2}\n{"step": 2, "off_policy/max": \n'
    history = _write(tmp_path / "metrics.jsonl", text)
    run = migrate(capsys, "--write", str(history))
    assert run.code == 2 and "line 2: not a JSON object" in run.err
    assert history.read_text() == text


# -- plain text, walking and writing -----------------------------------------------------------------


def test_plain_text_is_reported_never_edited(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _write(
        tmp_path / "launch.sh",
        "uv run rl --orchestrator.max-off-policy-steps 8\n# off_policy/max renamed  staleness-migrate: ignore\n",
    )
    (tmp_path / "blob.bin").write_bytes(b"\0off_policy/mean")
    run = migrate(capsys, "--write", str(tmp_path))
    assert run.code == 0
    assert run.lines == [
        f"{script}:1: max-off-policy-steps -> max-staleness: not edited "
        "(this kind of file is only reported: edit by hand)"
    ]
    assert "blob.bin" not in run.out + run.err  # binary files met while walking are skipped silently
    assert migrate(capsys, "--check", str(tmp_path)).code == 1


def test_a_removed_family_written_as_a_glob_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """prime-rl's own notes read `dispatcher/off_policy/{mean,max}`: --check passed it (exit 0)."""
    notes = _write(tmp_path / "SKILL.md", "watch `dispatcher/off_policy/{mean,max}`, dispatcher/off_policy_level/*\n")
    tool = _write(tmp_path / "tool.py", 'KEYS = ("dispatcher/off_policy/{mean,max}", f"off_policy/{name}")\n')
    run = migrate(capsys, "--check", str(notes), str(tool))
    assert run.code == 1
    gauge = "live dispatcher gauge with no replacement; this kind of file is only reported: edit by hand"
    unmapped = "old off_policy/ namespace, no known mapping; this kind of file is only reported: edit by hand"
    assert run.lines == [  # the whole key as written, brace list included
        f"{notes}:1: dispatcher/off_policy/{{mean,max}}: not edited (dispatcher/off_policy/*: {gauge})",
        f"{notes}:1: dispatcher/off_policy_level/*: not edited (dispatcher/off_policy_level/*: {gauge})",
        f"{tool}:1: dispatcher/off_policy/{{mean,max}}: not edited (dispatcher/off_policy/*: {gauge})",
        f"{tool}:1: off_policy/{{name}}: not edited ({unmapped})",
    ]


@pytest.mark.parametrize(
    ("name", "raw", "error"),
    [
        pytest.param("o.toml", "# r\xe9glage\nmax_off_policy_steps = 8\n".encode("latin-1"), "not UTF-8", id="latin1"),
        pytest.param("trainer.yaml", "max_off_policy_steps: 8\n".encode("utf-16"), "not UTF-8 text", id="utf16"),
        pytest.param("deep.json", ('{"c": ' * 330 + "1" + "}" * 330).encode(), "nested too deeply", id="deep"),
    ],
)
def test_text_that_cannot_be_read_met_while_walking_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, raw: bytes, error: str
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / name).write_bytes(raw)
    (tmp_path / "a" / "blob.bin").write_bytes(b"\0off_policy/mean")
    later = _write(tmp_path / "a" / "z.toml", "max_off_policy_steps = 3\n")
    run = migrate(capsys, "--check", str(tmp_path / "a"))
    assert run.code == 2 and f"{tmp_path / 'a' / name}: {error}" in run.err
    assert f"{later}:1: max_off_policy_steps -> max_staleness (renamed setting)" in run.lines
    assert "blob.bin" not in run.out + run.err  # binary files are still skipped silently


def test_a_byte_order_mark_on_a_reported_file_is_fine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    notes = _write(tmp_path / "NOTES.md", "\ufeff# Notes\nuse --max-off-policy-steps 8\n")
    _write(tmp_path / "tool.py", "\ufeffimport os\n")
    run = migrate(capsys, "--check", str(tmp_path))
    assert run.code == 1 and run.err.startswith("migrate: 1 legacy name(s) in 1 file(s)")
    assert run.lines == [
        f"{notes}:2: max-off-policy-steps -> max-staleness: not edited "
        "(this kind of file is only reported: edit by hand)"
    ]


_HINT = " (staleness-metrics migrate --write [--drop-removed] PATH... fixes what it can)"
_HISTORY = '{"step": 1, "off_policy/max": 2}\n'
_DASHBOARD = '{"panels": [{"gridPos": {}, "targets": [{"expr": "off_policy_mean > 1"}]}], "schemaVersion": 39}\n'


@pytest.mark.parametrize(
    ("name", "text", "new"),
    [
        pytest.param("o.toml", "max_off_policy_steps = 8\n", "max_staleness = 8\n", id="toml"),
        pytest.param("trainer.yaml", "max_off_policy_steps: 8 # ok\n", "max_staleness: 8 # ok\n", id="yaml"),
        pytest.param(
            "dash.json", _DASHBOARD, _DASHBOARD.replace("off_policy_mean", "rl_staleness_rollout_mean_steps"), id="json"
        ),
        pytest.param(
            "metrics.jsonl",
            _HISTORY,
            _HISTORY.replace("off_policy/max", "staleness/rollout/max") + f'{{"step": 1, "{MARKER_KEY}": 1}}\n',
            id="history",
        ),
    ],
)
def test_a_byte_order_mark_is_read_past_and_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, new: str
) -> None:
    """Editors on Windows write one: --check counted such a file as holding 0 names, and a clean one exited 2."""
    (tmp_path / "old").mkdir()
    (tmp_path / "clean").mkdir()
    path = _write(tmp_path / "old" / name, "\ufeff" + text)
    _write(tmp_path / "clean" / name, "\ufeff" + new)
    check = migrate(capsys, "--check", str(tmp_path))
    assert (check.code, check.err) == (1, f"migrate: 1 legacy name(s) in 1 file(s){_HINT}\n")
    diff = migrate(capsys, "--diff", str(path))
    assert diff.code == 0 and diff.out.startswith(f"--- a/{path}\n+++ b/{path}\n@@ -1")
    assert migrate(capsys, "--write", str(path)).code == 0
    assert path.read_bytes() == ("\ufeff" + new).encode()  # the mark is kept
    assert migrate(capsys, "--check", str(tmp_path)).code == 0


def test_a_file_with_a_byte_order_mark_that_cannot_be_migrated_counts_its_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = _write(tmp_path / "o.toml", "\ufeff[orchestrator\nmax_off_policy_steps = 8\n")
    run = migrate(capsys, "--check", str(broken))
    assert run.code == 2 and "cannot parse as TOML" in run.err
    assert run.err.endswith(f"migrate: 1 legacy name(s) in 1 file(s){_HINT}\n")
    assert run.lines == [
        f"{broken}:2: max_off_policy_steps -> max_staleness: not edited (the file could not be migrated: edit by hand)"
    ]


def test_usage_errors_and_missing_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert migrate(capsys, "--check", "--write", str(tmp_path)).code == 2
    missing = migrate(capsys, "--check", str(tmp_path / "nope.toml"))
    assert missing.code == 2 and "cannot read" in missing.err


def test_write_follows_symlinks_and_keeps_permissions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = _write(tmp_path / "real.toml", "max_off_policy_steps = 3\n")
    real.chmod(0o640)
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert migrate(capsys, "--write", str(link)).code == 0
    assert link.is_symlink()
    assert real.read_text() == "max_staleness = 3\n"
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o640


def test_a_file_changed_meanwhile_is_not_overwritten(tmp_path: Path) -> None:
    config = _write(tmp_path / "c.toml", "max_off_policy_steps = 3\n")
    result = migrate_file(config, Options())
    assert result.new_text == "max_staleness = 3\n" and result.original is not None
    config.write_text("max_off_policy_steps = 5\n")  # someone else edits it in between
    with pytest.raises(OSError, match="changed while it was being migrated"):
        write_atomically(config, result.original, result.new_text)
    assert config.read_text() == "max_off_policy_steps = 5\n"


@pytest.mark.parametrize(
    ("name", "text", "module", "message"),
    [
        ("orch.yaml", "max_off_policy_steps: 8\n", "ruamel.yaml", "reading YAML needs ruamel.yaml"),
        ("orch.toml", "max_off_policy_steps = 8\n", "tomlkit", "reading TOML needs tomlkit"),
    ],
)
def test_a_missing_parser_is_named_not_reported_as_a_parse_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str, module: str, message: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as in a base install without the cli extra
    result = migrate_file(_write(tmp_path / name, text), Options())
    assert result.error is not None and result.error.startswith(message)
    assert "pip install 'staleness-metrics[cli]'" in result.error
    assert [f.old for f in result.findings] == ["max_off_policy_steps"]  # still reported, never edited
