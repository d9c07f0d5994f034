"""AReaL 1.0.4 from its own package: RLVRWorkflow.arun_episode with a stand-in agenerate returning a real
ModelResponse, grouped by GroupedRolloutWorkflow, batched by concat_batch, and its own PPO actor code
(_compute_advantages, grpo_loss_fn's version_stats) on what :func:`staleness_metrics.adapters.areal.ship`
gives back."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("areal")

from areal.api import ModelResponse  # noqa: E402  (after the skips)
from areal.api.cli_args import GenerationHyperparameters, NormConfig, PPOActorConfig  # noqa: E402
from areal.infra.remote_inf_engine import GroupedRolloutWorkflow  # noqa: E402
from areal.trainer.ppo.actor import PPOActor, grpo_loss_fn  # noqa: E402
from areal.utils import stats_tracker  # noqa: E402
from areal.utils.data import concat_batch  # noqa: E402
from areal.workflow.rlvr import RLVRWorkflow  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from staleness_metrics import StalenessConfig, StalenessMonitor, TraceError, mismatch_sums  # noqa: E402
from staleness_metrics.adapters import areal as staleness  # noqa: E402
from tests.trainers.recording import Recorder  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>", "what", "is", "two", "plus", "three", "four", "five", "six", "the", "answer"]
WORDS += [f"w{i}" for i in range(40)]  # output tokens, one distinct run per reply


def tokenizer() -> PreTrainedTokenizerFast:
    """An offline tokenizer: a WordLevel vocabulary, no download."""
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def reward(
    prompt_text: str, completion_text: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    return float(len(completion_ids) % 3)


def prompt_ids(data: Any, tok: PreTrainedTokenizerFast, enable_thinking: bool) -> list[int]:
    return list(tok(data["question"])["input_ids"])


def extract_prompt(data: dict[str, Any]) -> Any:
    return data


class StandInEngine:
    """``agenerate`` as AReaL's inference engine answers: output tokens, their log-probabilities and the
    version of the weights that sampled each token (a partial rollout spans several)."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies = list(replies)
        self.stamped: dict[tuple[int, ...], list[int]] = {}
        self.sampler_logprobs: dict[tuple[int, ...], list[float]] = {}
        self.next_word = WORDS.index("w0")

    async def agenerate(self, req: Any) -> ModelResponse:
        versions = self.replies.pop(0)
        tokens = list(range(self.next_word, self.next_word + len(versions)))
        self.next_word += len(versions)
        logprobs = [-0.1 * (1 + i % 4) for i in range(len(versions))]
        self.stamped[tuple(tokens)] = versions
        self.sampler_logprobs[tuple(tokens)] = logprobs
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            tokenizer=req.tokenizer,
        )


def areal_rollouts(groups: list[list[list[int]]]) -> tuple[list[dict[str, Any]], StandInEngine]:
    """What ``prepare_batch`` returns: one ``[G, L]`` dict per prompt group, built by AReaL's own workflows."""
    tok = tokenizer()
    workflow = RLVRWorkflow(
        reward_fn=reward,
        gconfig=GenerationHyperparameters(n_samples=1, max_new_tokens=8),
        tokenizer=tok,
        get_input_ids_fn=prompt_ids,
        data_extract_prompt_fn=extract_prompt,
    )
    engine = StandInEngine([versions for group in groups for versions in group])
    prompts = ["what is two plus three", "what is the answer", "two plus four is six"]

    async def episodes() -> list[dict[str, Any]]:
        out = []
        for g, group in enumerate(groups):
            grouped = GroupedRolloutWorkflow(workflow, len(group), logging.getLogger("test"))
            out.append(await grouped.arun_episode(engine, {"question": prompts[g % len(prompts)]}))
        return out

    return asyncio.run(episodes()), engine


def stamped_versions(engine: StandInEngine, traj: dict[str, Any]) -> list[list[int]]:
    """Per row of ``traj``, the versions the engine stamped on its output tokens (found by the tokens)."""
    out = []
    sampled = traj["staleness_lag"] >= 0  # our sampled positions, a masked one included
    for ids, mask in zip(traj["input_ids"].tolist(), sampled.tolist(), strict=True):
        tokens = tuple(t for t, m in zip(ids, mask, strict=True) if m)
        out.append(engine.stamped.get(tokens))
    return out


def areal_version_stats(batch: list[dict[str, Any]], current_version: int) -> dict[str, float]:
    """AReaL's own version_stats/* as its PPO update logs them: _compute_advantages, then grpo_loss_fn."""
    data, _ = concat_batch(batch)
    actor = PPOActor(PPOActorConfig(), None)
    advantages = actor._compute_advantages(data)
    stats_tracker.export_all(reset=True)
    grpo_loss_fn(
        logprobs=advantages["logprobs"].clone(),
        entropy=torch.zeros_like(advantages["logprobs"]),
        input_data=advantages,
        eps_clip=0.2,
        eps_clip_higher=None,
        c_clip=None,
        current_version=current_version,
    )
    return {k: v for k, v in stats_tracker.export_all(reset=True).items() if k.startswith("version_stats/")}


# global_step 6, max_staleness 2: versions below 4 are stale
GROUPS = [
    [[6, 6, 6], [4, 4, 5, 5, 6], [3, 3, 5, 6]],  # the third row loses its two oldest tokens
    [[2, 2, 2], [5, 5, 6]],  # the first row is stale throughout: dropped
    [[1, 1], [0, 0, 0]],  # the whole group is stale: gone from the list
]


def test_the_one_call_masks_in_arealss_own_tensors_and_leaves_out_dropped_rows() -> None:
    global_step = 6
    rollout_batch, engine = areal_rollouts(GROUPS)
    given = [traj["loss_mask"] for traj in rollout_batch]
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))

    rollout_batch = staleness.ship(monitor, rollout_batch, version=global_step)

    assert len(rollout_batch) == 2
    first, second = rollout_batch
    assert first["loss_mask"] is given[0]  # every row kept: AReaL's own tensor, masked in place
    assert first["loss_mask"].dtype == torch.int32 and given[0].dtype == torch.int32
    # the versions we read are the ones the engine stamped: T - staleness_lag on every sampled position
    for traj in rollout_batch:
        for row, versions in zip(traj["staleness_lag"], stamped_versions(engine, traj), strict=True):
            sampled = row >= 0
            assert (global_step - row[sampled]).tolist() == versions
    # stale tokens (version < 4) masked, fresher ones of the same row kept
    lag = first["staleness_lag"]
    assert ((lag > 2) == ((lag >= 0) & (first["loss_mask"] == 0))).all()
    assert int((first["loss_mask"] == 0)[lag >= 0].sum()) == 2
    # the dropped row is gone from everything a group baseline reads (rewards included)
    assert second["loss_mask"].shape[0] == 1 and second["rewards"].shape == (1,)
    assert stamped_versions(engine, second) == [[5, 5, 6]]
    # AReaL's own batching and advantage code take the returned list as it is
    data, meta = concat_batch(rollout_batch)
    assert meta.traj_group_sizes == [3, 1]
    advantages = PPOActor(PPOActorConfig(), None)._compute_advantages(data)
    assert advantages["advantages"].shape == data["loss_mask"].shape


def test_the_padded_dict_of_concat_batch_ships_like_the_list() -> None:
    batch, _ = areal_rollouts(GROUPS)
    data, meta = concat_batch(batch)
    given = data["loss_mask"]
    shipped = staleness.ship(
        StalenessMonitor(StalenessConfig(max_staleness=2)), data, version=6, group_sizes=meta.traj_group_sizes
    )
    assert shipped is data and shipped["loss_mask"].shape[0] == 4  # 7 rows, 3 dropped
    listed, _ = concat_batch(
        staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=2)), areal_rollouts(GROUPS)[0], version=6)
    )

    # AReaL's concat pads every key with 0, staleness_lag too: read it where attention_mask holds tokens
    def rows(data: dict[str, Any]) -> list[tuple[int, ...]]:
        lag = torch.where(data["attention_mask"], data["staleness_lag"], -1)
        return sorted(tuple(row[row >= 0].tolist()) for row in lag)

    assert rows(shipped) == rows(listed)
    assert int(given.sum()) == int(shipped["loss_mask"].sum())  # masked in place, then filtered


def test_arealss_own_version_stats_against_ours() -> None:
    global_step = 6
    fresh = [[[6, 6, 6], [4, 4, 5, 5, 6]], [[5, 5, 6], [4, 5, 6, 6]]]  # nothing stale at max_staleness 2
    batch, _ = areal_rollouts(fresh)
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2), [recorder])
    shipped = staleness.ship(monitor, batch, version=global_step)
    ours = recorder.reports[-1].metrics
    theirs = areal_version_stats(shipped, current_version=global_step)

    # its v_theta is the version it trains (engine.get_version() == global_step): the same T as ours
    assert theirs["version_stats/v_theta"] == global_step
    # the oldest token of every row is kept by its rolled loss mask: the maxima coincide
    assert theirs["version_stats/sample_staleness_theta_max"] == ours["staleness/rollout/max"]
    # AReaL rolls loss_mask by -1 (_compute_advantages) but not versions, so each row's last output token
    # is out of its population: its mean is ours without those tokens
    lags = [row[row >= 0] for traj in shipped for row in traj["staleness_lag"]]
    assert ours["staleness/token/mean"] == pytest.approx(float(torch.cat(lags).float().mean()))
    assert theirs["version_stats/sample_staleness_theta_avg"] == pytest.approx(
        float(torch.cat([lag[:-1] for lag in lags]).float().mean())
    )


@st.composite
def partial_rollouts(draw: st.DrawFn) -> list[list[list[int]]]:
    """Groups of rows whose output versions never decrease (a partial rollout resumed under newer weights)."""
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        rows = []
        for _ in range(draw(st.integers(1, 3))):
            n = draw(st.integers(2, 5))
            rows.append(sorted(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))))
        groups.append(rows)
    return groups


@settings(max_examples=12, deadline=None)
@given(groups=partial_rollouts(), ahead=st.integers(0, 2), bound=st.integers(0, 3))
def test_on_any_partial_rollouts_versions_rows_and_arealss_numbers_agree(
    groups: list[list[list[int]]], ahead: int, bound: int
) -> None:
    global_step = max(v for group in groups for row in group for v in row) + ahead
    batch, engine = areal_rollouts(groups)
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    shipped = staleness.ship(monitor, batch, version=global_step)
    # the rows kept are the rows with a token fresh enough; each carries the versions the engine stamped
    fresh = sorted(tuple(row) for group in groups for row in group if global_step - max(row) <= bound)
    seen = sorted(tuple(v) for traj in shipped for v in stamped_versions(engine, traj))
    assert seen == fresh
    for traj in shipped:
        for lag, versions in zip(traj["staleness_lag"], stamped_versions(engine, traj), strict=True):
            assert (global_step - lag[lag >= 0]).tolist() == versions
    if not shipped:
        return
    ours = recorder.reports[-1].metrics
    theirs = areal_version_stats(shipped, current_version=global_step)
    lag = torch.cat([traj["staleness_lag"].reshape(-1) for traj in shipped])
    trains_next = torch.cat([torch.roll(traj["loss_mask"], -1, -1).reshape(-1) for traj in shipped]) != 0
    population = lag[(lag >= 0) & trains_next].float()
    if len(population):
        assert theirs["version_stats/sample_staleness_theta_max"] == float(population.max())
        assert theirs["version_stats/sample_staleness_theta_avg"] == pytest.approx(float(population.mean()))
    if not (lag > bound).any():  # nothing masked: AReaL's maximum is ours (each row's oldest token is first)
        assert theirs["version_stats/sample_staleness_theta_max"] == ours["staleness/rollout/max"]


def test_after_masking_arealss_numbers_pair_each_version_with_the_next_tokens_mask() -> None:
    global_step = 6
    batch, _ = areal_rollouts(GROUPS)
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2), [recorder])
    shipped = staleness.ship(monitor, batch, version=global_step)
    ours = recorder.reports[-1].metrics
    theirs = areal_version_stats(shipped, current_version=global_step)
    # ours: every shipped sampled token as it arrived, masked ones included (SPEC 6)
    assert ours["staleness/rollout/max"] == 3
    # AReaL's: the positions whose NEXT token trains (loss_mask rolled by -1, versions not), so the masked
    # token just before a row's first kept one still counts, and no row's last token does
    lag = torch.cat([traj["staleness_lag"].reshape(-1) for traj in shipped])
    trains_next = torch.cat([torch.roll(traj["loss_mask"], -1, -1).reshape(-1) for traj in shipped]) != 0
    population = lag[(lag >= 0) & trains_next].float()
    assert theirs["version_stats/sample_staleness_theta_max"] == float(population.max()) == 3
    assert theirs["version_stats/sample_staleness_theta_avg"] == pytest.approx(float(population.mean()))
    assert theirs["version_stats/sample_staleness_theta_min"] == float(population.min())


def test_spec11_sums_from_arealss_own_logprob_fields_through_staleness_lag() -> None:
    global_step = 6
    rollout_batch, engine = areal_rollouts(GROUPS)
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    rollout_batch = staleness.ship(monitor, rollout_batch, version=global_step)
    expected = []
    for traj in rollout_batch:
        # compute_logp's output is aligned like AReaL's labels, torch.roll(input_ids, -1): position t holds
        # the log-probability of token t + 1. A stand-in trained policy drifting with the lag:
        per_token = traj["logprobs"] + 0.07 * traj["staleness_lag"].clamp(min=0).float()
        traj["prox_logp"] = torch.roll(per_token, shifts=-1, dims=-1)
        expected.append((traj["staleness_lag"], traj["logprobs"], per_token, traj["loss_mask"]))

    for traj in rollout_batch:
        masked = (traj["staleness_lag"] >= 0) & (traj["loss_mask"] == 0)
        sums = mismatch_sums(traj["staleness_lag"], traj["logprobs"], traj["prox_logp"].roll(1, -1), masked)
        monitor.record_mismatch(global_step + 1, sums)

    total = monitor.mismatch(global_step + 1)
    assert total is not None
    direct = sum(
        (mismatch_sums(lag, sampler, trainer, (lag >= 0) & (mask == 0)) for lag, sampler, trainer, mask in expected),
        start=type(total).zero(),
    )
    assert total.metrics() == pytest.approx(direct.metrics())
    assert int(total.tokens.sum()) == sum(int((lag >= 0).sum()) for lag, *_ in expected)
    assert int(total.masked.sum()) == 2
    # the sampler log-probs are the engine's own, token by token
    first = rollout_batch[0]
    row = first["staleness_lag"][0] >= 0
    tokens = tuple(first["input_ids"][0][row].tolist())
    assert first["logprobs"][0][row].tolist() == pytest.approx(engine.sampler_logprobs[tokens])
    # unrolled, prox_logp pairs each token with the next one's log-probability: another number
    wrong = mismatch_sums(first["staleness_lag"], first["logprobs"], first["prox_logp"])
    assert wrong.metrics() != pytest.approx(
        mismatch_sums(first["staleness_lag"], first["logprobs"], first["prox_logp"].roll(1, -1)).metrics()
    )


def test_the_epoch_step_instead_of_global_step_names_the_counter() -> None:
    steps_per_epoch, global_step = 4, 6
    step = global_step % steps_per_epoch  # AReaL's loop variable `step`
    batch, _ = areal_rollouts(GROUPS[:1])
    with pytest.raises(TraceError) as caught:
        staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=2)), batch, version=step)
    assert caught.value.field.startswith("versions[")
    assert "global_step" in str(caught.value) and "above the trained version 2" in str(caught.value)


def test_a_batch_without_versions_is_refused_by_arealss_name() -> None:
    batch, _ = areal_rollouts(GROUPS[:1])
    del batch[0]["versions"]
    with pytest.raises(TraceError) as caught:
        staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=2)), batch, version=6)
    assert caught.value.field == "versions[0]" and "missing" in caught.value.reason


def test_the_group_policy_keeps_arealss_fixed_size_groups_for_its_group_normalisation() -> None:
    batch, _ = areal_rollouts([[[6, 6], [5, 6], [4, 4]], [[2, 2], [6, 6], [6, 6]]])
    shipped = staleness.ship(StalenessMonitor(StalenessConfig(max_staleness=2, policy="group")), batch, version=6)
    # a group is kept or dropped whole, so AReaL's Normalization(group_size=3) slices the groups it should
    assert [traj["loss_mask"].shape[0] for traj in shipped] == [3]
    config = PPOActorConfig(reward_norm=NormConfig(mean_level="group", std_level="group", group_size=3))
    data, _ = concat_batch(shipped)
    PPOActor(config, None)._compute_advantages(data)
