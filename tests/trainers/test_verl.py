"""SPEC 15's call on verl 0.9.1's own batches, built by verl's own fully async path.

``AgentLoopOutput`` -> ``AgentLoopWorker._agent_loop_postprocess`` -> ``AgentLoopWorker._postprocess`` ->
``RolloutSample`` -> ``assemble_batch_from_rollout_samples``, with an offline word-level tokenizer (no
model). The rollout servers' stamps (``min_global_steps`` / ``max_global_steps``) are the versions a
trajectory was generated across.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")

from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker  # noqa: E402
from verl.experimental.fully_async_policy.detach_utils import (  # noqa: E402
    RolloutSample,
    assemble_batch_from_rollout_samples,
)
from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer  # noqa: E402
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # noqa: E402
from verl.workers.config import RolloutConfig  # noqa: E402

from staleness_metrics import StalenessConfig, StalenessMonitor  # noqa: E402
from staleness_metrics.adapters import verl as verl_adapter  # noqa: E402
from staleness_metrics.adapters._ship import TrainerNames, ship_rows  # noqa: E402
from staleness_metrics.adapters.verl import from_verl  # noqa: E402
from staleness_metrics.errors import TraceError  # noqa: E402
from staleness_metrics.exporters.jsonl import JsonlExporter  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 6, 8
PAGE = Path(__file__).resolve().parents[2] / "docs" / "trainers" / "verl.md"


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(40)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")), pad_token="[PAD]")


def worker() -> AgentLoopWorker:
    """verl's agent loop worker without its Ray clients: what ``_agent_loop_postprocess`` and
    ``_postprocess`` read (no processor, no reward workers, no distillation)."""
    loop = AgentLoopWorker.__new__(AgentLoopWorker)
    loop.rollout_config = RolloutConfig(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    loop.tokenizer = tokenizer()
    loop.processor = None
    loop.reward_loop_worker_handles = None
    loop.distillation_enabled = False
    loop.mm_processor_kwargs = {}
    return loop


def trajectory(start: int | None, end: int | None, length: int, reward: float, seed: int) -> AgentLoopOutput:
    rng = np.random.default_rng(seed)
    mask = [1] * length
    if length > 4:
        mask[2:4] = [0, 0]  # a tool response inside the trajectory
    return AgentLoopOutput(
        prompt_ids=[2, 3, 4],
        response_ids=[int(t) for t in rng.integers(5, 40, size=length)],
        response_mask=mask,
        response_logprobs=[float(x) for x in -rng.random(length)],
        reward_score=reward,
        num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields={"global_steps": end, "min_global_steps": start, "max_global_steps": end},
    )


def rollout_sample(
    loop: AgentLoopWorker, sample_id: str, spans: list[tuple[int | None, int | None]], seed: int
) -> RolloutSample:
    """One prompt's ``n`` trajectories as the fully async rollouter hands them to the message queue."""

    async def build() -> DataProto:
        internal = [
            await loop._agent_loop_postprocess(
                trajectory(start, end, 3 + (seed + k) % 5, float((seed + k) % 2), seed * 10 + k),
                False,
                raw_prompt=[{"role": "user", "content": "w1"}],
            )
            for k, (start, end) in enumerate(spans)
        ]
        return loop._postprocess(internal, input_non_tensor_batch=None, validate=False)

    sample = RolloutSample(full_batch=asyncio.run(build()), sample_id=sample_id, epoch=0, rollout_status={})
    # fully_async_rollouter.py, _process_single_sample_streaming: the group id of the prompt's trajectories
    sample.full_batch.non_tensor_batch["uid"] = np.array([f"uid_{sample_id}"] * len(sample.full_batch), dtype=object)
    return sample


def verl_batch(groups: dict[str, list[tuple[int | None, int | None]]]) -> DataProto:
    loop = worker()
    # each prompt's trajectories depend on its id only: a batch of some of the groups holds the same rows
    samples = [rollout_sample(loop, sid, spans, ord(sid[0])) for sid, spans in groups.items()]
    return assemble_batch_from_rollout_samples(samples, loop.tokenizer, None, None)


GROUPS = {
    "a": [(0, 0), (0, 1), (0, 0)],  # dispatched under version 0; one resumed under version 1
    "b": [(2, 2), (2, 3), (2, 2)],
    "c": [(3, 3), (3, 3), (3, 3)],
}


def page_block(title: str) -> str:
    """The first ```python block after ``title`` on verl's page of the docs: the test runs what the page says."""
    text = PAGE.read_text(encoding="utf-8")
    after = text[text.index(title) :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)  # type: ignore[union-attr]


def test_versions_read_are_the_ones_verl_stamped() -> None:
    batch = verl_batch(GROUPS)
    rollouts = from_verl(batch)
    stamped = [span for spans in GROUPS.values() for span in spans]
    assert rollouts.dispatch_version.tolist() == [s for s, _ in stamped]
    assert rollouts.completion_version is not None
    assert rollouts.completion_version.tolist() == [e for _, e in stamped]
    assert rollouts.ids[:3] == ["uid_a/0", "uid_a/1", "uid_a/2"]
    assert batch.batch["response_mask"].dtype == torch.int64  # verl's own, read without a copy


def test_dropped_rows_leave_the_batch_and_the_group_baseline() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    data = verl_batch(GROUPS)
    mask_before = data.batch["response_mask"].clone()
    shipped = verl_adapter.ship(monitor, data, version=4)  # T = 4: group a (lag 4) is past the bound
    assert list(shipped.non_tensor_batch["uid"]) == ["uid_b"] * 3 + ["uid_c"] * 3
    assert shipped.batch["response_mask"].dtype == torch.int64
    assert torch.equal(shipped.batch["response_mask"], mask_before[3:])
    # the masking landed in verl's own tensor: the dropped rows are zero there
    assert int(data.batch["response_mask"][:3].sum()) == 0
    assert shipped.batch["staleness_lag"].dtype == torch.int64
    lag = shipped.batch["staleness_lag"]
    assert torch.equal(lag >= 0, shipped.batch["response_mask"] != 0)
    assert sorted(set(lag[lag >= 0].tolist())) == [1, 2]  # b starts at 2, c at 3
    assert shipped.meta_info["global_token_num"] == shipped.batch["attention_mask"].sum(-1).tolist()

    # verl's GRPO baseline on the returned batch equals the one on the fresh groups alone: the dropped
    # group's rewards are nowhere in it
    fresh = verl_batch({k: v for k, v in GROUPS.items() if k != "a"})
    ours, _ = compute_grpo_outcome_advantage(
        shipped.batch["rm_scores"], shipped.batch["response_mask"], shipped.non_tensor_batch["uid"]
    )
    alone, _ = compute_grpo_outcome_advantage(
        fresh.batch["rm_scores"], fresh.batch["response_mask"], fresh.non_tensor_batch["uid"]
    )
    assert torch.allclose(ours, alone)


def test_every_row_shipped_returns_verl_own_object() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=8))
    data = verl_batch(GROUPS)
    tensor = data.batch["response_mask"]
    shipped = verl_adapter.ship(monitor, data, version=3)
    assert shipped is data and shipped.batch["response_mask"] is tensor
    data.check_consistency()


def test_trigger_parameter_sync_step_4_global_steps_is_not_the_version() -> None:
    """verl's own counters: ``fit`` adds 1 to ``global_steps`` before the first step, each ``fit_step``
    calls ``_fit_update_local_step`` then ``_fit_postprocess_step`` (``global_steps += 1``)."""
    trainer = SimpleNamespace(global_steps=0, local_trigger_step=1, trigger_parameter_sync_step=4)
    trainer.current_param_version = 0
    update_local_step = FullyAsyncTrainer.__ray_actor_class__._fit_update_local_step
    trainer.global_steps += 1  # fit()
    seen = []
    for _ in range(9):
        seen.append((trainer.global_steps, trainer.current_param_version))
        update_local_step(trainer)
        trainer.global_steps += 1  # _fit_postprocess_step
    assert seen == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1), (7, 1), (8, 1), (9, 2)]
    trainer.global_steps, trainer.current_param_version = seen[-1]

    fresh = {"d": [(2, 2)] * 3, "e": [(2, 2)] * 3}  # six trajectories sampled under version 2
    wrong = verl_adapter.ship(
        StalenessMonitor(StalenessConfig(max_staleness=4)), verl_batch(fresh), version=trainer.global_steps
    )
    assert len(wrong) == 0  # the wrong counter: every trajectory looks 7 versions old and is dropped

    # the page's lines, as they run in FullyAsyncTrainer.fit_step
    data = verl_batch(fresh)
    tokens = int(data.batch["response_mask"].sum())
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    namespace: dict[str, Any] = {"self": trainer, "batch": data, "monitor": monitor}
    exec(page_block("verl, the lines to add"), namespace)
    right = namespace["batch"]
    assert len(right) == 6 and int(right.batch["response_mask"].sum()) == tokens


def test_a_version_above_the_one_passed_names_verl_field_and_counter() -> None:
    with pytest.raises(TraceError) as caught:
        verl_adapter.ship(StalenessMonitor(), verl_batch(GROUPS), version=2)
    assert caught.value.field == "non_tensor_batch['min_global_steps'][6]"  # group c starts at 3 > 2
    assert "current_param_version" in str(caught.value)


def test_a_server_that_never_got_set_global_steps_is_a_clear_error() -> None:
    """``_postprocess`` always adds the version keys, ``None`` where the server had none; verl's own fully
    async assembly stops on it (detach_utils.py:153, a bare ``TypeError``), the agent loop manager's batch
    (colocated and one-step-off trainers) goes on to the trainer, where the call names the row."""
    data = rollout_sample(worker(), "a", [(0, 0), (None, None)], 1).full_batch
    with pytest.raises(TypeError):
        assemble_batch_from_rollout_samples([rollout_sample(worker(), "a", [(None, None)], 1)], None, None, None)
    with pytest.raises(TraceError) as caught:
        verl_adapter.ship(StalenessMonitor(), data, version=1)
    assert caught.value.rollout_id == "uid_a/1"
    assert caught.value.field == "non_tensor_batch['min_global_steps'][1]" and "set_global_steps" in str(caught.value)


def test_verl_trajectory_staleness_against_ours(tmp_path: Path) -> None:
    """verl's ``training/off_policy/trajectory_staleness`` (trainer/ppo/v1/trainer_base.py:1979-1980, where
    ``global_steps - 1`` is the trained version ``T``) is ``T - max_global_steps``: our ``in_queue``
    staleness; ``trajectory_staleness_worst`` is ``T - min_global_steps``: our rollout staleness."""
    data = verl_batch(GROUPS)
    min_global_steps = np.asarray(data.non_tensor_batch["min_global_steps"], dtype=np.int64)
    max_global_steps = np.asarray(data.non_tensor_batch["max_global_steps"], dtype=np.int64)
    global_steps = 4 + 1
    trajectory_staleness = (global_steps - 1) - max_global_steps  # verl's lines, verbatim
    trajectory_staleness_worst = (global_steps - 1) - min_global_steps
    monitor = StalenessMonitor(StalenessConfig(max_staleness=8), [JsonlExporter(tmp_path / "m.jsonl")])
    verl_adapter.ship(monitor, data, version=global_steps - 1)
    monitor.close()
    metrics = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert metrics["staleness/rollout/in_queue/mean"] == pytest.approx(trajectory_staleness.mean())
    assert metrics["staleness/rollout/in_queue/max"] == trajectory_staleness.max()
    assert metrics["staleness/rollout/mean"] == pytest.approx(trajectory_staleness_worst.mean())
    assert metrics["staleness/rollout/max"] == trajectory_staleness_worst.max()


def test_spec11_sums_from_verl_log_probabilities_through_staleness_lag() -> None:
    """The page's three lines, on verl's own ``rollout_log_probs`` and an ``old_log_probs`` of the shape
    the actor's recompute writes, give the sums the sink takes when the batch carries both fields."""
    rng = np.random.default_rng(7)
    noise = torch.from_numpy(rng.normal(0, 0.1, (9, RESPONSE_LENGTH))).float()
    step = 5
    monitor = StalenessMonitor(StalenessConfig(max_staleness=3))
    batch = verl_adapter.ship(monitor, verl_batch(GROUPS), version=step - 1)  # group a dropped: rows 3..8 left
    assert len(batch) == 6
    # _fit_compute_log_prob adds the actor's log-probabilities of the shipped rows
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"] + noise[3:]
    namespace: dict[str, Any] = {"monitor": monitor, "batch": batch, "step": step}
    exec(page_block("verl, the cost family"), namespace)
    sums = namespace["sums"]

    carried = verl_batch(GROUPS)  # the same batch, carrying old_log_probs when it ships
    carried.batch["old_log_probs"] = carried.batch["rollout_log_probs"] + noise
    reference = ship_rows(
        StalenessMonitor(StalenessConfig(max_staleness=3)), [(from_verl(carried), None, None)],
        version=step - 1,
        names=TrainerNames("verl", "current_param_version"),
    )  # fmt: skip
    assert reference.shipment.report.mismatch is not None
    ours, sinks = sums.to_dict(), reference.shipment.report.mismatch.to_dict()
    assert ours["uncovered"] == sinks["uncovered"] == 0
    for bucket, values in sinks["lags"].items():  # counts exactly; sums to the last bits (summation order)
        assert ours["lags"][bucket] == pytest.approx(values, rel=1e-12, abs=1e-12)
    assert int(sums.tokens.sum()) == int((batch.batch["response_mask"] != 0).sum())


def test_per_token_versions_mask_inside_verl_own_tensor() -> None:
    """A trajectory resumed under newer weights (``max_global_steps > min_global_steps``) with its
    per-token versions: the stale head is masked in ``data``'s own ``response_mask``, the row ships."""
    data = verl_batch({"p": [(1, 2), (2, 2)]})
    mask = data.batch["response_mask"]
    versions = np.where(np.arange(RESPONSE_LENGTH) < 2, 1, 2)[None, :].repeat(2, axis=0)
    versions[1] = 2
    before = mask.clone()
    shipped = verl_adapter.ship(
        StalenessMonitor(StalenessConfig(max_staleness=1)), data, version=3, token_versions=versions
    )
    assert shipped is data and shipped.batch["response_mask"] is mask and mask.dtype == torch.int64
    assert mask[0, :2].tolist() == [0, 0] and torch.equal(mask[0, 2:], before[0, 2:])
    assert torch.equal(mask[1], before[1])
    lag = shipped.batch["staleness_lag"]
    assert lag[0, :2].tolist() == [2, 2] and lag[1][before[1] != 0].unique().tolist() == [1]


def test_rows_held_back_come_back_as_verl_rows_with_the_call_that_ships_them() -> None:
    """xtuner's rule with ``retry_expired``: a group whose member expired waits for its re-rollout; the
    waiting rows come back, first, in the ``DataProto`` of the call that ships them."""
    monitor = StalenessMonitor(StalenessConfig(policy="xtuner", max_staleness=1, retry_expired=True))
    first = verl_batch({"q": [(0, 0), (3, 3), (3, 3)]})
    held = verl_adapter.ship(monitor, first, version=3)
    assert len(held) == 0 and held.batch["staleness_lag"].shape == (0, RESPONSE_LENGTH)
    retry = rollout_sample(worker(), "q", [(3, 3)], ord("r")).full_batch  # the expired member, sampled again
    retry.non_tensor_batch["uid"] = np.array(["uid_q"], dtype=object)
    second = assemble_batch_from_rollout_samples(
        [RolloutSample(full_batch=retry, sample_id="q-retry", epoch=0, rollout_status={})], None, None, None
    )
    second.non_tensor_batch["uid"] = np.array(["uid_q"], dtype=object)
    shipped = verl_adapter.ship(monitor, second, version=3)  # its default id skips the first call's: "uid_q/3"
    assert len(shipped) == 3 and list(shipped.non_tensor_batch["uid"]) == ["uid_q"] * 3
    assert torch.equal(shipped.batch["responses"][:2], first.batch["responses"][1:])
    assert torch.equal(shipped.batch["responses"][2], second.batch["responses"][0])
    assert shipped.meta_info["global_token_num"] == shipped.batch["attention_mask"].sum(-1).tolist()
    shipped.check_consistency()


@pytest.mark.parametrize("change", ["extra key", "missing key", "wider responses"])
def test_a_call_whose_batch_cannot_join_the_held_rows_is_refused_before_anything_changes(change: str) -> None:
    """Rows held by an earlier call come back concatenated with the shipping call's (``DataProto.concat``):
    a batch with other keys or widths is refused naming a held row, before its add; the same call made
    right then gives back every row."""
    monitor = StalenessMonitor(StalenessConfig(policy="xtuner", max_staleness=1, retry_expired=True))
    first = verl_batch({"q": [(0, 0), (3, 3), (3, 3)]})
    assert len(verl_adapter.ship(monitor, first, version=3)) == 0  # the expired member's group is held
    retry = rollout_sample(worker(), "q", [(3, 3)], ord("r")).full_batch
    retry.non_tensor_batch["uid"] = np.array(["uid_q"], dtype=object)
    second = assemble_batch_from_rollout_samples(
        [RolloutSample(full_batch=retry, sample_id="q-retry", epoch=0, rollout_status={})], None, None, None
    )
    second.non_tensor_batch["uid"] = np.array(["uid_q"], dtype=object)
    wrong = DataProto(batch=second.batch.clone(), non_tensor_batch=dict(second.non_tensor_batch))
    if change == "extra key":  # e.g. the old log-probabilities computed after the first call's ship
        wrong.batch["old_log_probs"] = torch.zeros_like(wrong.batch["responses"], dtype=torch.float32)
        expected = "+old_log_probs"
    elif change == "missing key":
        del wrong.non_tensor_batch["raw_prompt"]
        expected = "-raw_prompt"
    else:
        wrong.batch["responses"] = torch.cat([wrong.batch["responses"], wrong.batch["responses"][:, :1]], dim=1)
        expected = f"responses (1, {RESPONSE_LENGTH + 1})"
    before = (monitor.sink.queued, monitor.sink.state_dict()["totals"])
    with pytest.raises(TraceError) as refused:
        verl_adapter.ship(monitor, wrong, version=3)
    assert refused.value.rollout_id == "uid_q/1" and refused.value.field == "batch"
    assert expected in refused.value.reason and "held from an earlier call" in refused.value.reason
    assert (monitor.sink.queued, monitor.sink.state_dict()["totals"]) == before  # nothing added
    shipped = verl_adapter.ship(monitor, second, version=3)
    assert len(shipped) == 3 and torch.equal(shipped.batch["responses"][:2], first.batch["responses"][1:])
    shipped.check_consistency()
