"""The peer table against the peers' own code: real key names, and values on their own batches.

Key names are copied here from each peer's newest release (file:line beside each), independently of the
table, so a key dropped from the table or one the peer never logs fails. Each value test computes the
peer's number by its own formula (transcribed with its file:line) on a small batch in the peer's own shape,
and ours with the sink on the same data: a renamed key must give the same number, and where the table
reports a key instead, the test shows the difference that keeps it from being renamed.
No peer package is needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from staleness_metrics import Sink, StalenessConfig
from staleness_metrics.adapters.areal import from_areal
from staleness_metrics.adapters.verl import from_verl
from staleness_metrics.migrate.peers import PEER_KEYS, PEERS, peer_keys

# Every staleness key (and staleness setting) each peer's newest code logs or reads, with where.
UPSTREAM_KEYS: dict[str, dict[str, str]] = {
    "verl": {  # verl 0.9.1; FA = verl/experimental/fully_async_policy/
        **{f"training/off_policy/{name}/{stat}": "verl/trainer/ppo/v1/trainer_base.py:1983-1991"
           for name in ("trajectory_spans", "trajectory_staleness", "trajectory_staleness_worst")
           for stat in ("mean", "max", "min")},
        "training/off_policy/evicted_samples": "verl/trainer/ppo/v1/replay_buffer.py:367",
        **{f"training/off_policy/evicted_samples_staleness/{stat}": "verl/trainer/ppo/v1/replay_buffer.py:368-370"
           for stat in ("mean", "max", "min")},
        "max_off_policy_threshold": "verl/trainer/ppo/v1/replay_buffer.py:528",
        "fully_async/partial/total_partial_num": "FA/detach_utils.py:156",
        "fully_async/partial/partial_ratio": "FA/detach_utils.py:157",
        "fully_async/partial/max_partial_span": "FA/detach_utils.py:158",
        "fully_async/count/stale_samples_processed": "FA/detach_utils.py:215",
        "fully_async/count/stale_trajectory_processed": "FA/fully_async_trainer.py:1043",
        "fully_async/count/current_param_version": "FA/fully_async_trainer.py:1044",
        # the rollouter's statistics get the fully_async/ prefix in FA/detach_utils.py:113
        "fully_async/count/staleness_samples": "FA/fully_async_rollouter.py:1176",
        "fully_async/count/dropped_stale_samples": "FA/fully_async_rollouter.py:1177",
        "fully_async/static/staleness_threshold": "FA/fully_async_rollouter.py:1181",
        "staleness_threshold": "FA/fully_async_trainer.py:201",
    },
    "skyrl": {  # skyrl 0.4.0, skyrl/train/fully_async_trainer.py
        "async/staleness_mean": "fully_async_trainer.py:1124",
        "async/staleness_max": "fully_async_trainer.py:1125",
        "async/staleness_min": "fully_async_trainer.py:1126",
        "async/staleness_ratio": "fully_async_trainer.py:1127",
        "async/staleness_violation_count": "fully_async_trainer.py:1128",
        "async/num_groups_dropped": "fully_async_trainer.py:573",
        "async/keep_rate": "fully_async_trainer.py:574",
        "max_staleness_steps": "skyrl/train/config/config.py:1035",
    },
    "areal": {  # areal 1.0.4; the tracker logs them as ppo_actor/update/version_stats/<name>
        **{f"sample_staleness_{policy}_{stat}": "areal/trainer/ppo/actor.py:1100-1105"
           for policy in ("theta", "proximal") for stat in ("avg", "max", "min")},
        "v_theta": "areal/trainer/ppo/actor.py:1106",
        "v_proximal": "areal/trainer/ppo/actor.py:1107",
        "n_valid_generated_tokens": "areal/trainer/ppo/actor.py:1108",
        "version_stats/n_valid_tokens": "areal/trainer/ppo/actor.py:1079",
        "behave_imp_weight": "areal/trainer/ppo/actor.py:542",
        "behave_approx_kl": "areal/trainer/ppo/actor.py:543",
        "max_head_offpolicyness": "areal/api/cli_args.py:2113",
    },
    "trl": {  # trl 1.16.0, trl/experimental/async_grpo/async_grpo_trainer.py
        "sample/staleness_mean": "async_grpo_trainer.py:386",
        "sample/staleness_max": "async_grpo_trainer.py:387",
        "sample/dropped_stale_total": "async_grpo_trainer.py:371",
        "sample/time_in_queue_s": "async_grpo_trainer.py:384",
    },
    "nemo-rl": {  # NVIDIA-NeMo/RL@7ea279ab; log_metrics(..., prefix="train") at grpo.py:5394, single_controller.py:1201
        "train/avg_trajectory_age": "nemo_rl/algorithms/grpo.py:5293",
        "train/evicted_stale_prompt_groups": "nemo_rl/algorithms/single_controller.py:1118",
        "train/aborted_stale_inflight_groups": "nemo_rl/algorithms/single_controller.py:1119",
        "max_trajectory_age_steps": "nemo_rl/algorithms/grpo.py:189",
        "max_staleness_versions": "nemo_rl/algorithms/async_utils/staleness_sampler.py:490",
    },
    "roll": {  # alibaba/ROLL@8eb27cc2
        "scheduler/off_policy_ratio": "roll/distributed/scheduler/generate_scheduler.py:726",
        "async_generation_ratio": "roll/configs/base_config.py:502",
    },
    "pipelinerl": {  # ServiceNow/PipelineRL@58d39345, pipelinerl/finetune_loop.py
        "stats/lag": "finetune_loop.py:881",
        # Named in issue 32, not in this snapshot: summaries of the same per-batch lag (680-689, 881).
        "stats/lag_mean": "issue 32",
        "stats/lag_max": "issue 32",
        "stats/min_actor_version": "finetune_loop.py:877",
        "stats/max_actor_version": "finetune_loop.py:878",
        "stats/samples_too_old_to_queue": "finetune_loop.py:872",
        "stats/samples_too_old_to_train": "finetune_loop.py:873",
        "max_lag": "finetune_loop.py:681",
    },
}  # fmt: skip


@pytest.mark.parametrize("peer", PEERS)
def test_the_table_holds_exactly_the_peers_real_keys_each_with_its_file_and_line(peer: str) -> None:
    rows = {row.key: row for row in peer_keys(peer)}
    assert set(rows) == set(UPSTREAM_KEYS[peer])
    for row in rows.values():
        assert any(ch.isdigit() for ch in row.source.rsplit(":", 1)[-1]), row  # a line number is cited
        assert row.reason


def _ship(records_or_batch: Any, step: int, max_staleness: int = 16) -> dict[str, Any]:
    sink = Sink(StalenessConfig(max_staleness=max_staleness))
    sink.add(records_or_batch)
    return dict(sink.ship(step).metrics)


def _renamed(peer: str) -> dict[str, str]:
    return {row.key: row.new for row in peer_keys(peer) if row.new is not None}


def _assert_renames_agree(peer: str, theirs: dict[str, float], ours: dict[str, Any]) -> None:
    renamed = _renamed(peer)
    assert renamed, peer
    for key, new in renamed.items():
        if key in theirs:
            assert ours[new] == pytest.approx(theirs[key]), (key, new)
    assert set(renamed) <= set(theirs)  # every rename is checked


# -- verl 0.9.1 -------------------------------------------------------------------------------------------


def _verl_batch(versions: Sequence[tuple[int, int]], length: int = 3) -> SimpleNamespace:
    """An agent-loop batch: min/max_global_steps per trajectory (agent_loop.py:1125-1126), object arrays."""
    b = len(versions)
    return SimpleNamespace(
        batch={
            "responses": np.ones((b, length), dtype=np.int64),
            "response_mask": np.ones((b, length), dtype=np.int64),
            "attention_mask": np.ones((b, 2 + length), dtype=np.int64),
        },
        non_tensor_batch={
            "min_global_steps": np.array([lo for lo, _ in versions], dtype=object),
            "max_global_steps": np.array([hi for _, hi in versions], dtype=object),
            "uid": np.array([f"p{i // 2}" for i in range(b)], dtype=object),
        },
    )


def _verl_metrics(global_steps: int, versions: Sequence[tuple[int, int]]) -> dict[str, float]:
    """verl's own formulas: trainer_base.py:1978-1991 and detach_utils.py:151-158."""
    lo = np.array([v[0] for v in versions])
    hi = np.array([v[1] for v in versions])
    out: dict[str, float] = {}
    for name, values in (
        ("trajectory_spans", hi - lo + 1),
        ("trajectory_staleness", (global_steps - 1) - hi),
        ("trajectory_staleness_worst", (global_steps - 1) - lo),
    ):
        for stat in ("mean", "max", "min"):
            out[f"training/off_policy/{name}/{stat}"] = float(getattr(values, stat)())
    out["fully_async/partial/max_partial_span"] = float(max(abs(a - b) for a, b in zip(hi, lo, strict=True)))
    return out


def test_verl_trajectory_staleness_is_our_in_queue_not_newest_on_a_real_batch() -> None:
    # the batch: at global_steps 3 (T = 2) one trajectory ran on version 1, one resumed under 2
    versions = [(1, 1), (1, 2)]
    theirs = _verl_metrics(3, versions)
    ours = _ship(from_verl(_verl_batch(versions)), 3)
    assert theirs["training/off_policy/trajectory_staleness/mean"] == 0.5
    assert ours["staleness/rollout/in_queue/mean"] == 0.5
    assert ours["staleness/rollout/newest/mean"] == 1.0  # unlabelled tokens take the start: not verl's number
    _assert_renames_agree("verl", theirs, ours)


def test_verl_renames_agree_on_a_mixed_batch_with_and_without_per_token_versions() -> None:
    versions = [(1, 1), (1, 2), (2, 2), (0, 2), (0, 1)]
    theirs = _verl_metrics(3, versions)
    ours = _ship(from_verl(_verl_batch(versions)), 3)
    _assert_renames_agree("verl", theirs, ours)
    # with per-token versions (first token at the start, the rest at the end) in_queue still agrees, and
    # newest now agrees too: the table's reason for preferring in_queue
    labels = np.array([[lo, hi, hi] for lo, hi in versions], dtype=np.int64)
    labelled = _ship(from_verl(_verl_batch(versions), token_versions=labels), 3)
    _assert_renames_agree("verl", theirs, labelled)
    assert labelled["staleness/rollout/newest/mean"] == pytest.approx(
        theirs["training/off_policy/trajectory_staleness/mean"]
    )


# -- SkyRL 0.4.0 -----------------------------------------------------------------------------------------


def test_skyrl_staleness_is_our_rollout_staleness() -> None:
    global_step = 5
    scheduled = [5, 4, 2, 4]  # global_step_when_scheduled per group (fully_async_trainer.py:920,939)
    per_group = 2  # n_samples_per_prompt
    stalenesses = [global_step - s for s in scheduled]  # fully_async_trainer.py:1002
    theirs = {
        "async/staleness_mean": sum(stalenesses) / len(stalenesses),  # :1124
        "async/staleness_max": max(stalenesses),  # :1125
    }
    records = [
        {"id": f"g{g}/{k}", "group_id": f"g{g}", "dispatch_version": s - 1, "samples": [{"mask": [1, 1]}]}
        for g, s in enumerate(scheduled)
        for k in range(per_group)
    ]
    ours = _ship(records, global_step)
    _assert_renames_agree("skyrl", theirs, ours)


# -- NeMo-RL ---------------------------------------------------------------------------------------------


def test_nemo_rl_average_trajectory_age_is_our_rollout_mean() -> None:
    current_weight_version = 6  # the version trained this step (grpo.py:4539)
    generation_versions = [6, 5, 5, 3]  # per prompt group (trajectory_collector.py:516,543)
    per_group = 4  # num_generations_per_prompt
    # replay_buffer.py:293-296
    theirs = {"train/avg_trajectory_age": current_weight_version - sum(generation_versions) / len(generation_versions)}
    records = [
        {"id": f"g{g}/{k}", "group_id": f"g{g}", "dispatch_version": v, "samples": [{"mask": [1]}]}
        for g, v in enumerate(generation_versions)
        for k in range(per_group)
    ]
    ours = _ship(records, current_weight_version + 1)
    assert theirs["train/avg_trajectory_age"] == 1.25
    _assert_renames_agree("nemo-rl", theirs, ours)


# -- AReaL 1.0.4 -----------------------------------------------------------------------------------------


def _areal_version_stats(
    versions: np.ndarray, loss_mask: np.ndarray, current_version: int, micro_batches: int
) -> dict[str, float]:
    """actor.py:1078-1105 per loss call, then stats_tracker.scalar's mean over calls (stats_tracker.py:202-215)."""
    calls: dict[str, list[float]] = {"avg": [], "max": []}
    for rows in np.array_split(np.arange(len(versions)), micro_batches):
        valid = loss_mask[rows].astype(bool) & (versions[rows] >= 0)
        theta = (current_version - versions[rows].astype(float))[valid]
        calls["avg"].append(float(theta.mean()))
        calls["max"].append(float(theta.max()))
    return {f"sample_staleness_theta_{stat}": sum(v) / len(v) for stat, v in calls.items()}


def test_areal_version_stats_average_micro_batches_so_they_are_reported_not_renamed() -> None:
    # an AReaL batch (rlvr.py layout): prompt positions version -1 and loss_mask 0, then output tokens
    versions = np.array(
        [[-1, -1, 4, 4, 4, 4, 4, 5], [-1, -1, 3, 0, 0, 0, 0, 0], [-1, -1, 5, 5, 0, 0, 0, 0]], dtype=np.int64
    )
    loss_mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0]])
    attention = np.array([[1] * 8, [1] * 3 + [0] * 5, [1] * 4 + [0] * 4])
    current_version = 6  # AReaL trains version g at global step g (rl_trainer.py:768-775)
    batch = {"loss_mask": loss_mask, "versions": versions, "attention_mask": attention}
    ours = _ship(from_areal(batch, ids=["a", "b", "c"]), current_version + 1)

    one_call = _areal_version_stats(versions, loss_mask, current_version, micro_batches=1)
    assert one_call["sample_staleness_theta_avg"] == pytest.approx(ours["staleness/token/mean"])
    three_calls = _areal_version_stats(versions, loss_mask, current_version, micro_batches=3)
    assert three_calls["sample_staleness_theta_avg"] != pytest.approx(ours["staleness/token/mean"])
    assert three_calls["sample_staleness_theta_max"] != pytest.approx(ours["staleness/rollout/max"])
    assert _renamed("areal") == {}


# -- TRL 1.16.0 ------------------------------------------------------------------------------------------


def _trl_run(micro_batches: Sequence[Sequence[int]], *, prefetch: bool) -> tuple[list[float | None], list[list[int]]]:
    """TRL's async GRPO loop, one micro-batch per optimizer step and a weight sync after each.

    Returns the logged sample/staleness_mean per step and, per step, the TRL model_version it trained at.
    The row's staleness is taken when the dataloader pulls it (async_grpo_trainer.py:367-368,386);
    accelerate's DataLoaderDispatcher pulls the next batch before yielding the current one
    (accelerate data_loader.py:906,930); the sync bumps model_version (async_grpo_trainer.py:1797), the first
    one before training (:232), so training starts at model_version 1.
    """
    state = SimpleNamespace(version=1)
    window: list[float] = []

    def pull(rows: Sequence[int]) -> Sequence[int]:
        window.extend(float(state.version - v) for v in rows)
        return rows

    def dispatcher() -> Iterator[Sequence[int]]:
        source = iter(micro_batches)
        if not prefetch:
            for rows in source:
                yield pull(rows)
            return
        ahead = pull(next(source))
        for following in source:
            current, ahead = ahead, pull(following)
            yield current
        yield ahead

    logged: list[float | None] = []
    trained_at: list[list[int]] = []
    for rows in dispatcher():
        trained_at.append([state.version] * len(rows))
        # window mean (async_grpo_trainer.py:105) with logging_steps 1; an empty window logs nothing (:1712)
        logged.append(sum(window) / len(window) if window else None)
        window.clear()
        state.version += 1
    return logged, trained_at


def test_trl_measures_staleness_when_it_pulls_a_row_so_it_is_reported_not_renamed() -> None:
    micro_batches = [[1, 1], [1, 1], [1, 2], [2, 3]]  # each row's model_version (its group's dispatch)
    logged, trained_at = _trl_run(micro_batches, prefetch=True)
    ours = []
    for rows, versions in zip(micro_batches, trained_at, strict=True):
        # TRL's model_version starts at 1 after its first sync: ours is one less on both sides
        records = [{"id": f"r{i}", "dispatch_version": v - 1, "samples": [{"mask": [1]}]} for i, v in enumerate(rows)]
        ours.append(_ship(records, versions[0])["staleness/rollout/mean"])
    assert ours == [0.0, 1.0, 1.5, 1.5]
    without_prefetch, _ = _trl_run(micro_batches, prefetch=False)
    assert without_prefetch == ours  # TRL's formula is ours; only the moment it is taken differs
    assert logged != ours
    assert not any(row.new for row in PEER_KEYS if row.peer == "trl")


def test_areal_version_stats_denominator_is_matched_only_inside_its_scope() -> None:
    from staleness_metrics.migrate.names import peer_lookup

    # the tracker's n_valid_tokens under version_stats (actor.py:1079) is listed; the same name under
    # other scopes (the loss's own denominators) is not a staleness key at all
    row = peer_lookup("areal", "ppo_actor/update/version_stats/n_valid_tokens")
    assert row is not None and row.new is None and "1079" in row.source
    assert peer_lookup("areal", "ppo_actor/update/n_valid_tokens") is None
    assert peer_lookup("areal", "ppo_actor/update/compute_logp/n_valid_tokens") is None
