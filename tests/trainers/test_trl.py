"""TRL 1.16.0's asynchronous GRPO, from its own package: RolloutSample, RolloutQueueDataset, the batcher,
TreeRow.pack and DataCollatorForRollout, with :mod:`staleness_metrics.adapters.trl` at the rollout queue."""

from __future__ import annotations

import itertools
import os
import queue
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from accelerate import PartialState  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402  (after the skips)
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (  # noqa: E402
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    _reduce_metric,
)
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from staleness_metrics import StalenessConfig, StalenessMonitor, TraceError, mismatch_sums  # noqa: E402
from staleness_metrics.adapters import trl as staleness  # noqa: E402
from tests.trainers.recording import Recorder  # noqa: E402

PartialState()  # TRL's dataset logs through accelerate's logger, as inside its trainer (one CPU process here)

WORDS = [
    "<pad>",
    "<unk>",
    "what",
    "is",
    "two",
    "plus",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "the",
    "answer",
    "it",
    "so",
    "yes",
    "no",
    "maybe",
]


def tokenizer() -> PreTrainedTokenizerFast:
    """An offline tokenizer: a WordLevel vocabulary, no download."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>")


def group(tok: PreTrainedTokenizerFast, group_id: int, version: int, completions: list[str]) -> list[Any]:
    """The samples the rollout worker's _score_group makes of one prompt group (one row per conversation)."""
    prompt = tok("what is two plus three")["input_ids"]
    rng = np.random.default_rng(group_id)
    out = []
    for k, text in enumerate(completions):
        completion = tok(text)["input_ids"]
        out.append(
            RolloutSample(
                prompt=[{"role": "user", "content": "what is two plus three"}],
                completion=[{"role": "assistant", "content": text}],
                input_ids=np.asarray(prompt + completion, dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
                old_log_probs=np.asarray(
                    [0.0] * len(prompt) + (-rng.random(len(completion))).tolist(), dtype=np.float32
                ),
                advantage=float(k) - 0.5,
                model_version=version,
                group_id=group_id,
                metrics={"reward": float(k)},
            )
        )
    return out


def samples_at(versions: list[int]) -> list[Any]:
    tok = tokenizer()
    texts = ["the answer is five", "five", "it is six so no", "maybe five yes"]
    return [s for g, v in enumerate(versions) for s in group(tok, g, v, texts[: 2 + g % 3])]


class Drained(Exception):
    """The queue is empty: the test has seen every sample."""


def trl_dataset(samples: Any, version: int, max_staleness: int) -> tuple[RolloutQueueDataset, dict[str, list[Any]]]:
    if isinstance(samples, list):
        rollout_queue: Any = queue.Queue()
        for sample in samples:
            rollout_queue.put(sample)
    else:
        rollout_queue = samples
    metrics: dict[str, list[Any]] = defaultdict(list)

    def health(_stale_after_s: float) -> None:
        raise Drained

    dataset = RolloutQueueDataset(
        rollout_queue=rollout_queue,
        model_version_fn=lambda: version,
        check_health_fn=health,
        stale_after_s=60.0,
        metrics=metrics,
        max_staleness=max_staleness,
        poll_interval_s=0.001,
    )
    return dataset, metrics


def drain(dataset: RolloutQueueDataset) -> list[dict[str, Any]]:
    out = []
    try:
        for item in dataset:
            out.append(item)
    except Drained:
        pass
    return out


def test_kept_samples_and_trls_own_staleness_numbers_agree_with_ours() -> None:
    version, bound = 6, 2
    samples = samples_at([6, 1, 5, 3, 4, 0, 6])
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    masks = [s.completion_mask for s in samples]
    kept = staleness.ship(monitor, samples, version=version)

    theirs, metrics = trl_dataset(list(samples), version, bound)
    yielded = drain(theirs)
    # TRL's own drop rule, version - sample.model_version > max_staleness, keeps exactly what we keep
    assert [id(item["input_ids"]) for item in yielded] == [id(s.input_ids) for s in kept]
    assert all(any(k is s for s in samples) for k in kept) and {s.model_version for s in kept} == {4, 5, 6}
    # the same objects, their own completion_mask arrays
    assert {id(s.completion_mask) for s in kept} <= {id(m) for m in masks}

    ours = recorder.reports[-1].metrics
    assert ours["staleness/rollout/dropped"] == _reduce_metric(
        "sample/dropped_stale_total", metrics["sample/dropped_stale_total"]
    )
    # per sample (one rollout each), not per token: our rollout keys are TRL's sample keys
    assert ours["staleness/rollout/mean"] == pytest.approx(
        _reduce_metric("sample/staleness_mean", metrics["sample/staleness_mean"])
    )
    assert ours["staleness/rollout/max"] == _reduce_metric("sample/staleness_max", metrics["sample/staleness_max"])
    # our token mean weighs by trained tokens, TRL's sample mean does not: they differ on this batch
    per_sample = [version - s.model_version for s in kept]
    tokens = [int(s.completion_mask.sum()) for s in kept]
    assert ours["staleness/token/mean"] == pytest.approx(np.average(per_sample, weights=tokens))


@settings(max_examples=40, deadline=None)
@given(versions=st.lists(st.integers(0, 8), min_size=1, max_size=6), ahead=st.integers(0, 3), bound=st.integers(0, 4))
def test_trls_own_drop_rule_and_numbers_equal_ours_on_any_versions(versions: list[int], ahead: int, bound: int) -> None:
    version = max(versions) + ahead
    samples = samples_at(versions)
    recorder = Recorder()
    kept = staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder]), samples, version=version)
    dataset, metrics = trl_dataset(list(samples), version, bound)
    assert [id(item["input_ids"]) for item in drain(dataset)] == [id(s.input_ids) for s in kept]
    ours = recorder.reports[-1].metrics
    dropped = metrics.get("sample/dropped_stale_total", [])
    assert ours["staleness/rollout/dropped"] == (
        _reduce_metric("sample/dropped_stale_total", dropped) if dropped else 0
    )
    if kept:
        assert ours["staleness/rollout/max"] == _reduce_metric("sample/staleness_max", metrics["sample/staleness_max"])
        mean = _reduce_metric("sample/staleness_mean", metrics["sample/staleness_mean"])
        assert ours["staleness/rollout/mean"] == pytest.approx(mean)
    else:
        assert "staleness/rollout/mean" not in ours and not metrics["sample/staleness_mean"]


def test_the_shipping_queue_feeds_trls_dataset_batcher_and_collator_with_lags_per_loss_term() -> None:
    version, bound = 5, 1
    samples = samples_at([5, 4, 2, 5, 3, 4])
    inner: queue.Queue[Any] = queue.Queue()
    for sample in samples:
        inner.put(sample)
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    expected = [s for s in samples if version - s.model_version <= bound]
    samples_per_step = len(expected)  # per_device_train_batch_size * gradient_accumulation_steps * num_processes
    trainer = SimpleNamespace(rollout_queue=inner, model_version=version)  # the two attributes the lines read
    trainer.rollout_queue = staleness.ShippingQueue(
        trainer.rollout_queue, monitor, lambda: trainer.model_version, samples_per_step=samples_per_step
    )
    dataset, metrics = trl_dataset(trainer.rollout_queue, version, bound)
    batcher = FixedCountBatcher(dataset, num_processes=2, microbatch_size=len(expected))
    (rows,) = itertools.islice(iter(batcher), 1)
    assert metrics["sample/dropped_stale_total"] == []  # TRL finds nothing left to drop
    assert sorted(id(s["input_ids"]) for r in rows for s in r.samples) == sorted(id(s.input_ids) for s in expected)
    # every ship of the step is at the trained version; the drops it made are the samples TRL would drop
    assert {report.step for report in recorder.reports} == {version + 1}
    assert sum(r.metrics["staleness/rollout/dropped"] for r in recorder.reports) == len(samples) - len(expected)

    data_collator = staleness.with_staleness_lag(DataCollatorForRollout(pad_token_id=0, num_processes=2))
    inputs = data_collator([rows])
    selected = inputs["token_index"] >= 0
    lag = inputs["staleness_lag"][selected]
    segment = inputs["segment_id"][selected]
    assert len(lag) == int(selected.sum()) and (lag >= 0).all()
    # each loss term's lag is the version its sample was generated at, seen from the trained version
    row_of_term = torch.arange(inputs["token_index"].shape[0])[:, None].expand_as(selected)[selected]
    for term in range(len(lag)):
        sample = rows[int(row_of_term[term])].samples[int(segment[term])]
        by_input = next(s for s in expected if s.input_ids is sample["input_ids"])
        assert int(lag[term]) == version - by_input.model_version

    # SPEC 11 from TRL's own fields: old_log_probs (sampler) against the trainer's log_probs of compute_loss
    old_log_probs = inputs["old_log_probs"][selected]
    log_probs = (old_log_probs + 0.05 * lag.float()).requires_grad_()  # the trained weights drift with lag
    self = trainer  # the lines below are the ones that go into AsyncGRPOTrainer.compute_loss
    lag = inputs["staleness_lag"][selected]
    monitor.record_mismatch(self.model_version + 1, mismatch_sums(lag, old_log_probs, log_probs.detach()))
    sums = monitor.mismatch(version + 1)
    assert sums is not None
    direct = mismatch_sums(
        np.concatenate([np.full(int(s.completion_mask[1:].sum()), version - s.model_version) for s in expected]),
        np.concatenate([s.old_log_probs[1:][s.completion_mask[1:] != 0] for s in expected]),
        np.concatenate(
            [
                s.old_log_probs[1:][s.completion_mask[1:] != 0] + np.float32(0.05 * (version - s.model_version))
                for s in expected
            ]
        ),
    )
    assert sums.tokens.tolist() == direct.tokens.tolist() and int(sums.tokens.sum()) == len(lag)
    assert sums.metrics() == pytest.approx(direct.metrics())
    assert recorder.mismatch[-1].step == version + 1


def test_the_packed_lags_follow_treerow_pack_order_with_shared_prefixes() -> None:
    version = 3
    samples = samples_at([3, 2])
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    kept = staleness.ship(monitor, samples, version=version)
    dataset, _ = trl_dataset(kept, version, 4)
    row = TreeRow()
    for item in drain(dataset):
        row.add(item)
    packed = row.pack()
    lags = staleness.packed_staleness_lag(row)
    assert len(lags) == len(packed["token_index"]) == len(packed["old_log_probs"])
    by_segment = {i: version - kept[i].model_version for i in range(len(kept))}
    assert lags.tolist() == [by_segment[int(s)] for s in packed["segment_id"]]
    # the loss terms' old_log_probs are the samples' own, position by position
    expected = np.concatenate([s.old_log_probs[1:][s.completion_mask[1:] != 0] for s in kept])
    np.testing.assert_array_equal(packed["old_log_probs"].numpy(), expected)


def test_a_wrong_counter_names_the_one_to_pass() -> None:
    samples = samples_at([2, 3])
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    with pytest.raises(TraceError) as caught:
        staleness.ship(monitor, samples, version=2)  # e.g. model_version - 1, or an optimizer-step count
    first_at_3 = next(i for i, s in enumerate(samples) if s.model_version == 3)
    assert caught.value.field == f"samples[{first_at_3}].model_version"
    assert "self.model_version" in str(caught.value) and "above the trained version 2" in str(caught.value)


def test_a_sample_without_model_version_is_refused_by_name() -> None:
    samples = samples_at([1])
    samples[0].model_version = None
    with pytest.raises(TraceError) as caught:
        staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=4)), samples, version=1)
    assert caught.value.field == "samples[0].model_version"
