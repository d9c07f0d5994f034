"""``migrate --from PEER`` on the numbers each peer's own code computes from a batch its own code built.

For verl, AReaL and TRL: the batch comes from the trainer's own pipeline (the builders of
``test_verl.py``, ``test_areal.py`` and ``test_trl.py``), the peer's staleness numbers from its own
functions (or, where its method needs a cluster, its own lines applied to its own batch), and ours from
the metrics published when the trainer's adapter ``ship``s that batch. Those numbers go into a metrics
history under the peer's key names, ``staleness-metrics migrate --from PEER --write`` rewrites it, and:
every renamed key now holds exactly our metric's value; every key the table keeps (its meaning differs)
stays with its value untouched and the test shows the number it differs from.
"""

from __future__ import annotations

import itertools
import json
import queue
from collections import defaultdict, deque
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from staleness_metrics import StalenessConfig, StalenessMonitor
from staleness_metrics.migrate.driver import MARKER_KEY
from staleness_metrics.migrate.names import peer_lookup
from staleness_metrics.migrate.peers import peer_keys
from tests.migrate.cli import Run, migrate
from tests.trainers.recording import Recorder


def migrated(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, peer: str, logged: list[tuple[int, dict[str, float]]]
) -> tuple[list[dict[str, Any]], Run]:
    """``logged`` (step, metrics) as the peer's tracker writes them, after ``migrate --from peer --write``."""
    history = tmp_path / "metrics.jsonl"
    history.write_text(
        "".join(json.dumps({"step": step, **{k: float(v) for k, v in line.items()}}) + "\n" for step, line in logged)
    )
    run = migrate(capsys, "--from", peer, "--write", str(history))
    lines = [json.loads(line) for line in history.read_text().splitlines()]
    data = [line for line in lines if MARKER_KEY not in line]
    assert [line["step"] for line in data] == [step for step, _ in logged]
    return data, run


def check_migration(
    peer: str, logged: dict[str, float], after: dict[str, Any], ours: dict[str, Any], run: Run
) -> tuple[dict[str, str], set[str]]:
    """Renamed keys hold our value; kept keys hold the peer's, untouched and named in the report.

    Returns the renames (peer key -> ours) and the kept keys, so each test can show what the kept ones
    differ from.
    """
    renamed: dict[str, str] = {}
    kept: set[str] = set()
    for key, value in logged.items():
        row = peer_lookup(peer, key)
        assert row is not None, f"{peer} logs {key}, which the table does not list"
        if row.new is None:
            kept.add(key)
            assert after[key] == pytest.approx(float(value)), key  # the peer's value, untouched
            assert key in run.out, (key, run.out)  # reported with its reason
        else:
            renamed[key] = row.new
            assert key not in after, key
            assert after[row.new] == pytest.approx(float(ours[row.new])), (key, row.new)
            assert after[row.new] == pytest.approx(float(value)), (key, row.new)
    return renamed, kept


def _no_minimum_published(ours: dict[str, Any]) -> None:
    """The table keeps minima: this project publishes means and maxima, no minimum to rename to."""
    assert not [key for key in ours if key.endswith("/min")]


# -- verl 0.9.1 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def verl_tests() -> ModuleType:
    pytest.importorskip("verl")
    from tests.trainers import test_verl

    return test_verl


# one prompt group per sample; a trajectory resumed across two syncs ((0, 2)) makes a share of resumed
# trajectories differ from the mean number of versions passed in flight
VERL_GROUPS = {
    "a": [(0, 0), (0, 2), (0, 1)],
    "b": [(2, 2), (2, 3), (3, 3)],
    "c": [(3, 3), (3, 3), (4, 4)],
}


def test_migrate_from_verl_on_verl_own_batch(
    verl_tests: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = verl_tests.verl_batch(VERL_GROUPS)  # assemble_batch_from_rollout_samples, verl's fully async path
    global_steps = 5  # the v1 trainer's counter; its staleness is against global_steps - 1 = T
    # verl's own assembly computes the partial-rollout statistics (detach_utils.py:151-158) into meta_info
    logged: dict[str, float] = {
        key: float(data.meta_info[key])
        for key in (
            "fully_async/partial/total_partial_num",
            "fully_async/partial/partial_ratio",
            "fully_async/partial/max_partial_span",
        )
    }
    # Its trajectory staleness is computed in RayPPOTrainer._compute_metrics (trainer/ppo/v1/trainer_base.py:
    # 1868-1991), which first reads the batch from the TransferQueue store (tq.kv_batch_get, :1882-1890): a
    # running cluster. Its lines, verbatim, on the same per-trajectory stamps of this DataProto (the tags it
    # reads at :1897-1898 are these non_tensor_batch fields):
    min_global_steps = np.array(list(data.non_tensor_batch["min_global_steps"]), dtype=int)
    max_global_steps = np.array(list(data.non_tensor_batch["max_global_steps"]), dtype=int)
    trajectory_spans = max_global_steps - min_global_steps + 1  # :1978
    trajectory_staleness = (global_steps - 1) - max_global_steps  # :1979
    trajectory_staleness_worst = (global_steps - 1) - min_global_steps  # :1980
    for name, values in (
        ("trajectory_spans", trajectory_spans),
        ("trajectory_staleness", trajectory_staleness),
        ("trajectory_staleness_worst", trajectory_staleness_worst),
    ):
        for stat in ("mean", "max", "min"):  # :1983-1991
            logged[f"training/off_policy/{name}/{stat}"] = float(getattr(values, stat)())

    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=8), [recorder])
    shipped = verl_tests.verl_adapter.ship(monitor, data, version=global_steps - 1)
    assert len(shipped) == len(min_global_steps)  # nothing dropped: both sides see the same population
    ours = dict(recorder.reports[-1].metrics)

    (after,), run = migrated(capsys, tmp_path, "verl", [(global_steps, logged)])
    renamed, kept = check_migration("verl", logged, after, ours, run)
    assert renamed == {
        "training/off_policy/trajectory_staleness/mean": "staleness/rollout/in_queue/mean",
        "training/off_policy/trajectory_staleness/max": "staleness/rollout/in_queue/max",
        "training/off_policy/trajectory_staleness_worst/mean": "staleness/rollout/mean",
        "training/off_policy/trajectory_staleness_worst/max": "staleness/rollout/max",
        "fully_async/partial/max_partial_span": "staleness/rollout/in_flight/max",
    }
    # the newest version a trajectory saw: not our newest-token key, whose unlabelled tokens take the start
    assert ours["staleness/rollout/newest/mean"] != pytest.approx(
        logged["training/off_policy/trajectory_staleness/mean"]
    )

    # what each kept key differs from, on this batch
    spans = "training/off_policy/trajectory_spans"
    assert logged[f"{spans}/mean"] == pytest.approx(ours["staleness/rollout/in_flight/mean"] + 1)  # versions used
    assert logged[f"{spans}/max"] == ours["staleness/rollout/in_flight/max"] + 1
    resumed_share = logged["fully_async/partial/partial_ratio"]
    assert resumed_share == pytest.approx(3 / 9) and ours["staleness/rollout/in_flight/mean"] == pytest.approx(4 / 9)
    assert logged["fully_async/partial/total_partial_num"] == 3  # trajectories, not versions (4 passed in flight)
    _no_minimum_published(ours)
    for name in ("trajectory_spans", "trajectory_staleness", "trajectory_staleness_worst"):
        key = f"training/off_policy/{name}/min"
        assert logged[key] < logged[f"training/off_policy/{name}/mean"]
    assert kept == {
        f"training/off_policy/{name}/{stat}"
        for name, stats in (
            ("trajectory_spans", ("mean", "max", "min")),
            ("trajectory_staleness", ("min",)),
            ("trajectory_staleness_worst", ("min",)),
        )
        for stat in stats
    } | {"fully_async/partial/total_partial_num", "fully_async/partial/partial_ratio"}


# -- AReaL 1.0.4 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def areal_tests() -> ModuleType:
    pytest.importorskip("areal")
    from tests.trainers import test_areal

    return test_areal


# output-token versions per row, per prompt group; at global_step 6 with max_staleness 4 nothing is stale
AREAL_GROUPS = [[[6, 6, 6], [4, 4, 5, 5, 6]], [[5, 5, 6], [4, 5, 6, 6]], [[3, 4, 5], [6, 6]]]


def areal_ppo_update_stats(shipped: list[dict[str, Any]], current_version: int, minibatches: int) -> dict[str, float]:
    """What AReaL's actor logs for one ``ppo_update`` (trainer/ppo/actor.py:252-365), on CPU.

    Its own ``concat_batch``, ``_compute_advantages`` and ``split_padded_tensor_dict_into_mb_list`` (with
    ``ppo_n_minibatches``), then its ``grpo_loss_fn`` once per minibatch inside the tracker scopes
    ``ppo_actor`` / ``update``; only ``engine.train_batch`` is left out (it needs a model), which calls the
    loss once per micro-batch: one call per minibatch here. Exported by its own tracker.
    """
    from areal.api.cli_args import MicroBatchSpec, PPOActorConfig
    from areal.trainer.ppo.actor import PPOActor, grpo_loss_fn
    from areal.utils import stats_tracker
    from areal.utils.data import concat_batch, split_padded_tensor_dict_into_mb_list

    data, _ = concat_batch(shipped)
    advantages = PPOActor(PPOActorConfig(), None)._compute_advantages(data)
    split = split_padded_tensor_dict_into_mb_list(advantages, mb_spec=MicroBatchSpec(n_mbs=minibatches))
    assert len(split.mbs) == minibatches
    stats_tracker.export_all(reset=True)
    with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
        for mb in split.mbs:
            grpo_loss_fn(
                logprobs=mb["logprobs"].clone(),
                entropy=mb["logprobs"].new_zeros(mb["logprobs"].shape),
                input_data=mb,
                eps_clip=0.2,
                eps_clip_higher=None,
                c_clip=None,
                current_version=current_version,
            )
    return {k: v for k, v in stats_tracker.export_all(reset=True).items() if "/version_stats/" in k}


def test_migrate_from_areal_on_areal_own_batch(
    areal_tests: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    global_step = 6  # AReaL trains version g at global step g: its current_version, our T
    batch, _ = areal_tests.areal_rollouts(AREAL_GROUPS)  # RLVRWorkflow + GroupedRolloutWorkflow
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4), [recorder])
    shipped = areal_tests.staleness.ship(monitor, batch, version=global_step)
    ours = dict(recorder.reports[-1].metrics)
    logged = areal_ppo_update_stats(shipped, global_step, minibatches=2)
    scope = "ppo_actor/update/version_stats/"

    (after,), run = migrated(capsys, tmp_path, "areal", [(global_step, logged)])
    renamed, kept = check_migration("areal", logged, after, ours, run)
    assert renamed == {}
    assert kept == set(logged)
    assert {f"{scope}sample_staleness_{p}_{s}" for p in ("theta", "proximal") for s in ("avg", "max", "min")} <= kept

    # its per-token population: versions >= 0 where the loss mask rolled by -1 trains (actor.py:1086-1090)
    lags = [traj["staleness_lag"] for traj in shipped]
    trains_next = [traj["loss_mask"].roll(-1, -1) != 0 for traj in shipped]
    assert ours["staleness/rollout/max"] == 3 and ours["staleness/token/mean"] == pytest.approx(0.85)
    # a mean of the two minibatches' means, not our token mean over the ship
    assert logged[f"{scope}sample_staleness_theta_avg"] == pytest.approx(8 / 7)
    assert logged[f"{scope}sample_staleness_theta_avg"] != pytest.approx(ours["staleness/token/mean"])
    # a mean of the two minibatches' maxima (3 and 2), not the maximum
    assert logged[f"{scope}sample_staleness_theta_max"] == 2.5 != ours["staleness/rollout/max"]
    assert max(int(lag[(lag >= 0) & mask].max()) for lag, mask in zip(lags, trains_next, strict=True)) == 3
    # proximal: one less per token, against the last broadcast weights
    for stat in ("avg", "max", "min"):
        theta, proximal = (
            logged[f"{scope}sample_staleness_theta_{stat}"],
            logged[f"{scope}sample_staleness_proximal_{stat}"],
        )
        assert proximal == pytest.approx(theta - 1)
    _no_minimum_published(ours)
    # versions and counts, not staleness: the trained version and the one before, token counts, loss calls
    assert logged[f"{scope}v_theta"] == global_step and logged[f"{scope}v_proximal"] == global_step - 1
    population = sum(int(((lag >= 0) & mask).sum()) for lag, mask in zip(lags, trains_next, strict=True))
    assert logged[f"{scope}n_valid_generated_tokens"] == pytest.approx(population / 2)  # per loss call
    assert logged[f"{scope}n_valid_tokens"] == sum(int(traj["loss_mask"].roll(-1, -1).sum()) for traj in shipped)
    assert {logged[k] for k in logged if k.endswith("__count")} == {2}


# -- TRL 1.16.0 ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trl_tests() -> ModuleType:
    pytest.importorskip("trl")
    from tests.trainers import test_trl

    return test_trl


@pytest.fixture(scope="module")
def tiny_model(trl_tests: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(trl_tests.save_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def trl_training_run(
    trl_tests: ModuleType,
    samples: list[Any],
    *,
    max_staleness: int,
    microbatch: int,
    token_budget: int = 0,
) -> list[tuple[int, dict[str, float], list[Any]]]:
    """AsyncGRPOTrainer's data path and step order on CPU, one process, no model.

    The dataloader is built as ``get_train_dataloader`` builds it (async_grpo_trainer.py:1419-1475):
    ``RolloutQueueDataset`` over the rollout queue, ``FixedCountBatcher``, ``DataCollatorForRollout``,
    prepared by accelerate (a ``DataLoaderDispatcher``: the dataset is iterable). Each optimizer step takes
    one micro-batch (gradient_accumulation_steps 1), trains it at ``model_version``, then the step-end
    callback syncs the weights (``_sync_weight``: ``model_version += 1``, :1797; the first sync is at
    train begin, :232) and the log that follows reduces the step's window with TRL's own ``_reduce_metric``
    (``log``, :1698-1721, logging_steps 1). Returns, per step: the step, TRL's logged staleness keys, and
    the samples trained with the version they were trained at. ``token_budget > 0``
    batches with ``TokenBudgetBatcher`` (TRL's default), as ``get_train_dataloader`` does.
    """
    from accelerate import Accelerator
    from torch.utils.data import DataLoader
    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
        RolloutQueueDataset,
        TokenBudgetBatcher,
        _reduce_metric,
    )

    rollout_queue: queue.Queue[Any] = queue.Queue()
    for sample in samples:
        rollout_queue.put(sample)
    trainer = SimpleNamespace(model_version=0)
    metrics: dict[str, list[Any]] = defaultdict(list)

    def check_health(_stale_after_s: float) -> None:
        raise trl_tests.Drained  # the queue is empty: the run is over

    trainer.rollout_queue = rollout_queue
    dataset = RolloutQueueDataset(
        rollout_queue=trainer.rollout_queue,
        model_version_fn=lambda: trainer.model_version,
        check_health_fn=check_health,
        stale_after_s=60.0,
        metrics=metrics,
        max_staleness=max_staleness,
        poll_interval_s=0.001,
    )
    collated: deque[list[int]] = deque()  # ids of the samples in each micro-batch, in the order collated
    collator = DataCollatorForRollout(pad_token_id=0, num_processes=1)

    def collate(batch: list[Any]) -> Any:
        collated.append([id(item["input_ids"]) for row in batch[0] for item in row.samples])
        return collator(batch)

    batcher = (
        TokenBudgetBatcher(dataset, 1, token_budget, metrics)
        if token_budget > 0
        else FixedCountBatcher(dataset, 1, microbatch)
    )
    loader = Accelerator(cpu=True).prepare(DataLoader(batcher, batch_size=1, collate_fn=collate, num_workers=0))
    by_id = {id(sample.input_ids): sample for sample in samples}
    logged_keys = {row.key for row in peer_keys("trl")}
    trainer.model_version += 1  # _TrainBeginCallback: the cold weight sync
    steps = []
    batches = iter(loader)
    for step in itertools.count(1):
        try:
            next(batches)
        except trl_tests.Drained:
            break
        trained = [by_id[i] for i in collated.popleft()]
        trained_at = trainer.model_version
        trainer.model_version += 1  # on_step_end: _sync_weight
        window = {key: _reduce_metric(key, values) for key, values in metrics.items() if key in logged_keys and values}
        metrics.clear()  # log() clears the window
        steps.append((step, window, [(sample, trained_at) for sample in trained]))
    return steps


def test_migrate_from_trl_on_trl_own_training_run(
    trl_tests: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from staleness_metrics.adapters import trl as staleness

    bound = 1
    samples = trl_tests.samples_at([1, 1, 2, 2, 3])  # RolloutSamples: 5 at version 1, 6 at 2, 3 at 3
    steps = trl_training_run(trl_tests, samples, max_staleness=bound, microbatch=2)
    assert [step for step, _, _ in steps] == [1, 2, 3, 4]

    # ours: each micro-batch shipped by the adapter at the version it is trained at (SPEC's T)
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    ours = []
    for _, _, trained in steps:
        staleness.ship(monitor, [sample for sample, _ in trained], version=trained[0][1])
        ours.append(dict(recorder.reports[-1].metrics))

    logged = [(step, window) for step, window, _ in steps]
    after, run = migrated(capsys, tmp_path, "trl", logged)
    for (_, window), line, metrics in zip(logged, after, ours, strict=True):
        renamed, kept = check_migration("trl", window, line, metrics, run)
        assert renamed == {} and kept == set(window)

    theirs_mean = [window["sample/staleness_mean"] for _, window in logged]
    theirs_max = [window["sample/staleness_max"] for _, window in logged]
    theirs_dropped = [window.get("sample/dropped_stale_total", 0.0) for _, window in logged]
    # TRL measures a row when its dataloader pulls it, and accelerate's dispatcher pulls the next micro-batch
    # before yielding the current one: from step 2 on, the rows trained were measured one sync early
    assert theirs_mean == [0.0, 0.5, 1.0, 1.0]
    assert theirs_max == [0.0, 1.0, 1.0, 1.0]
    assert [m.get("staleness/rollout/mean") for m in ours] == [0.0, 1.0, 1.0, None]
    assert [m.get("staleness/rollout/max") for m in ours] == [0, 1, 1, None]  # step 4 trains nothing of ours
    # TRL trains rows one version past its own bound, which its window never shows
    trained_lags = [max(at - sample.model_version for sample, at in trained) for _, _, trained in steps]
    assert trained_lags == [0, 1, 2, 2] and max(theirs_max) == bound
    # drops: counted at pull time in another step's window, where ours drop at the ship that would train
    assert theirs_dropped == [0.0, 0.0, 0.0, 3.0]
    assert [m["staleness/rollout/dropped"] for m in ours] == [0, 0, 1, 2]


def test_behind_the_readme_lines_no_row_trains_past_max_staleness(
    trl_tests: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    """TRL's own AsyncGRPOTrainer, its dataloader prepared by accelerate: every row trains within the bound
    with the README's lines; without them TRL trains rows past its own max_staleness (it judges at the pull)."""
    from staleness_metrics.adapters import trl as staleness

    bound = 1

    def run(with_lines: bool) -> list[int]:
        samples = trl_tests.samples_at([1, 1, 2, 2, 3])
        trainer = trl_tests.async_grpo_trainer(
            tiny_model, tmp_path / str(with_lines), samples, monkeypatch,
            max_staleness=bound, per_device_train_batch_size=2, token_budget=0,
        )  # fmt: skip
        if with_lines:
            staleness.ship_at_train_time(trainer, StalenessMonitor(StalenessConfig(max_staleness=bound)))
        calls = trl_tests.train(trainer)
        return list(trl_tests.trained_lags(calls, trl_tests.by_old_log_prob(samples)))

    assert max(run(with_lines=False)) == bound + 1  # accelerate's prefetch: pulled at v, trained at v + 1
    lags = run(with_lines=True)
    assert lags and max(lags) <= bound, lags


def test_behind_the_readme_lines_token_budget_batches_train_within_max_staleness_at_the_lag_reported(
    trl_tests: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model: str
) -> None:
    """TokenBudgetBatcher (TRL's default) pulls the sample that closes a micro-batch one micro-batch earlier
    still: without the README's lines TRL trains rows two versions past its bound; with them each row is
    judged, and its lag reported, at the version it trains at."""
    from staleness_metrics.adapters import trl as staleness

    bound = 1

    def run(with_lines: bool) -> list[tuple[int, list[int]]]:
        """Per micro-batch: the lag of each term when trained, and the lag it carries in staleness_lag."""
        samples = trl_tests.samples_at([1, 1, 2, 2, 3, 3, 4, 4])
        by_logprob = trl_tests.by_old_log_prob(samples)
        trainer = trl_tests.async_grpo_trainer(
            tiny_model, tmp_path / str(with_lines), samples, monkeypatch,
            max_staleness=bound, per_device_train_batch_size=1, token_budget=12,
        )  # fmt: skip
        if with_lines:
            staleness.ship_at_train_time(trainer, StalenessMonitor(StalenessConfig(max_staleness=bound)))
        calls = trl_tests.train(trainer)
        assert len(calls) >= 4, "too few micro-batches trained"
        return [
            (call.version - sample.model_version, lag)
            for call in calls
            for sample, lag in zip(
                call.terms(by_logprob), call.seen.get("staleness_lag", call.seen["token_index"])[call.trained].tolist(),
                strict=True,
            )
        ]  # fmt: skip

    assert max(trained for trained, _ in run(with_lines=False)) == bound + 2
    terms = run(with_lines=True)
    assert terms and max(trained for trained, _ in terms) <= bound
    assert all(trained == reported for trained, reported in terms)  # staleness_lag is the lag trained at
