"""TRL 1.16.0's asynchronous GRPO, from its own package: RolloutSample, RolloutQueueDataset, TreeRow.pack and
DataCollatorForRollout with :func:`staleness_metrics.adapters.trl.ship`, and AsyncGRPOTrainer itself, trained on
CPU, with :func:`~staleness_metrics.adapters.trl.ship_at_train_time` (the README's lines)."""

from __future__ import annotations

import json
import os
import queue
import socket
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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


# -- AsyncGRPOTrainer itself, trained on CPU ----------------------------------------------------------------


class Drains(queue.Queue[Any]):
    """The rollout buffer of the worker below: once empty, the run is over (no poll timeout to wait out)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        try:
            return super().get(block=False)
        except queue.Empty:
            raise Drained from None


class QueuedRollouts:
    """A rollout worker through TRL's ``RolloutWorkerProtocol`` (its injection point, "e.g. a stub in tests"):
    no generation, its buffer holds the given ``RolloutSample`` s from the start, oldest version first, as a
    worker running ahead leaves them (the tests' versions are never ahead of the trainer when pulled)."""

    def __init__(self, samples: list[Any]) -> None:
        self.rollout_buffer = Drains()
        for sample in samples:
            self.rollout_buffer.put(sample)
        self.metrics_queue: queue.Queue[Any] = queue.Queue()

    def update_model_version(self, model_version: int) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def check_health(self, stale_after_s: float) -> None:
        pass


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol`` with no inference server: a weight sync only bumps ``model_version``."""

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Any) -> None:
        for _ in iterator:
            pass

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def tree_attention_on_cpu(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    *,
    tree_kv_index: Any,
    tree_cu_seqlens_q: Any,
    tree_cu_seqlens_k: Any,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """``packing.tree_attention`` without its CUDA kernel (flash-attn 3 from the hub): each segment's queries
    attend causally, aligned to the end, to the K/V of the segment's root-to-segment path only."""
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [tokens, heads, dim]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    repeat = q.shape[1] // k.shape[1]
    out = []
    for segment in range(len(tree_cu_seqlens_q) - 1):
        q_lo, q_hi = int(tree_cu_seqlens_q[segment]), int(tree_cu_seqlens_q[segment + 1])
        k_lo, k_hi = int(tree_cu_seqlens_k[segment]), int(tree_cu_seqlens_k[segment + 1])
        causal = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool).tril((k_hi - k_lo) - (q_hi - q_lo))
        heads = [x.repeat_interleave(repeat, 1).transpose(0, 1) for x in (k[k_lo:k_hi], v[k_lo:k_hi])]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1), *heads, attn_mask=causal, scale=scaling
        )
        out.append(attended.transpose(0, 1))
    return torch.cat(out).unsqueeze(0), None


def save_tiny_model(path: Any) -> str:
    """A one-layer Llama over the offline vocabulary, saved where ``AsyncGRPOTrainer(model=path)`` loads it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def async_grpo_trainer(
    model: str, output_dir: Any, samples: list[Any], monkeypatch: pytest.MonkeyPatch, **config: Any
) -> Any:
    """TRL's own ``AsyncGRPOTrainer`` on CPU, its rollout worker's buffer holding ``samples``.

    AsyncGRPO runs on GPUs only; two device calls are replaced so it runs here: the peak-FLOPs lookup
    (``torch.cuda.get_device_name``, for MFU metrics) and the flash-attn 3 kernel of its tree attention.
    """
    from datasets import Dataset
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as module
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    monkeypatch.setattr(module, "get_peak_flops_per_device", lambda accelerator, dtype: None)
    args = AsyncGRPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **{"max_steps": 100, **config},  # by default the run ends when the worker's buffer is empty
    )
    trainer = AsyncGRPOTrainer(
        model,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "what is two plus three"}]] * 4}),
        processing_class=tokenizer(),
        rollout_worker=QueuedRollouts(samples),
        weight_transfer=NoWeightTransfer(),
    )
    AttentionInterface.register(TREE_ATTENTION, tree_attention_on_cpu)  # after __init__, which registers the kernel
    return trainer


LOSS_KEYS = ("token_index", "old_log_probs", "advantages", "segment_id", "shift_labels", "global_n_tokens")


@dataclass
class LossCall:
    """One micro-batch as TRL's ``compute_loss`` got it."""

    version: int  # trainer.model_version when compute_loss ran
    fetched: dict[str, Any]  # LOSS_KEYS as the dataloader handed the micro-batch out (copies)
    seen: dict[str, Any]  # LOSS_KEYS and staleness_lag as compute_loss got them (copies)
    own_tensors: bool  # compute_loss got the very tensors the dataloader handed out

    @property
    def trained(self) -> Any:
        """The loss terms trained: selected by compute_loss (``token_index >= 0``), with a lag once shipped."""
        if "staleness_lag" not in self.seen:  # a run without the README's lines
            return self.seen["token_index"] >= 0
        return (self.seen["token_index"] >= 0) & (self.seen["staleness_lag"] >= 0)

    @property
    def placeholder(self) -> Any:
        """A term compute_loss selects without a lag: the one a row keeps, at advantage 0, once all are void."""
        return (self.seen["token_index"] >= 0) & (self.seen["staleness_lag"] < 0)

    def terms(self, by_logprob: dict[float, Any], when: str = "seen") -> list[Any]:
        """The sample of each loss term trained (or, ``when="fetched"``, of each term as fetched), in order."""
        selected = self.trained if when == "seen" else self.fetched["token_index"] >= 0
        tensors = self.seen if when == "seen" else self.fetched
        return [by_logprob[float(x)] for x in tensors["old_log_probs"][selected]]


def by_old_log_prob(samples: list[Any]) -> dict[float, Any]:
    """Each completion token's sample, by its generator log-probability (random, so one sample each)."""
    out = {float(s.old_log_probs[p]): s for s in samples for p in np.flatnonzero(s.completion_mask[1:]) + 1}
    assert len(out) == sum(int(s.completion_mask[1:].sum()) for s in samples)
    return out


def train(
    trainer: Any, during_loss: Callable[[Any, dict[str, Any], Any, LossCall], None] | None = None
) -> list[LossCall]:
    """``trainer.train()`` until the worker's buffer is empty, keeping each micro-batch's tensors as the
    dataloader handed them out (``get_batch_samples``) and as ``compute_loss`` got them."""
    calls: list[LossCall] = []
    fetched: dict[int, tuple[Any, dict[str, Any]]] = {}
    get_batch_samples, compute_loss = trainer.get_batch_samples, trainer.compute_loss

    def fetch(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, count = get_batch_samples(epoch_iterator, num_batches, device)
        for batch in batches:
            fetched[id(batch["token_index"])] = (batch["token_index"], {k: batch[k].clone() for k in LOSS_KEYS})
        return batches, count

    def loss(model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        tensor, before = fetched.pop(id(inputs["token_index"]))
        seen = {k: inputs[k].clone() for k in (*LOSS_KEYS, "staleness_lag") if k in inputs}
        calls.append(LossCall(trainer.model_version, before, seen, tensor is inputs["token_index"]))
        value = compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if during_loss is not None:
            during_loss(model, inputs, value, calls[-1])
        return value

    trainer.get_batch_samples, trainer.compute_loss = fetch, loss
    with pytest.raises(Drained):
        trainer.train()
    return calls


def unique(samples: list[Any]) -> list[Any]:
    """Each sample once, in order (RolloutSample is an unhashable dataclass)."""
    return list({id(s): s for s in samples}.values())


def trained_lags(calls: list[LossCall], by_logprob: dict[float, Any]) -> list[int]:
    """The lag each trained sample was trained at: the version compute_loss ran at minus its model_version."""
    return [call.version - sample.model_version for call in calls for sample in unique(call.terms(by_logprob))]


def test_the_readme_lines_void_stale_samples_in_the_micro_batch_trl_trains(
    tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 1
    samples = samples_at([1, 1, 2, 2, 3])
    by_logprob = by_old_log_prob(samples)
    trainer = async_grpo_trainer(
        tiny_model, tmp_path, samples, monkeypatch, max_staleness=bound, per_device_train_batch_size=2, token_budget=0
    )
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    staleness.ship_at_train_time(trainer, monitor)
    calls = train(trainer)
    assert len(calls) >= 4 and all(call.own_tensors for call in calls)  # TRL's own tensors, masked in place

    voided_any = unscored_any = False
    for call in calls:
        before, now = call.terms(by_logprob, "fetched"), call.terms(by_logprob)
        stale = [s for s in before if call.version - s.model_version > bound]
        # the terms trained are exactly those of the samples within the bound at the version trained
        assert now == [s for s in before if call.version - s.model_version <= bound]
        # the others left token_index (compute_loss's `selected`), but for one kept at advantage 0 when none is left
        voided = (call.fetched["token_index"] >= 0) & (call.seen["token_index"] < 0)
        assert int(call.placeholder.sum()) == (0 if now else 1)
        assert int(voided.sum()) + int(call.placeholder.sum()) == len(stale)
        assert (call.seen["advantages"][voided | call.placeholder] == 0).all()
        voided_any = voided_any or bool(stale)
        # positions that only voided terms read are no longer scored (shift_labels -100); the others keep theirs
        read_before = call.fetched["token_index"][call.fetched["token_index"] >= 0].tolist()
        read_now = call.seen["token_index"][call.seen["token_index"] >= 0].tolist()
        labels_before, labels_now = call.fetched["shift_labels"][0], call.seen["shift_labels"][0]
        assert all(labels_now[p] == -100 for p in set(read_before) - set(read_now))
        unscored_any = unscored_any or bool(set(read_before) - set(read_now))
        assert all(labels_now[p] == labels_before[p] != -100 for p in read_now)
        # TRL normalises its loss by global_n_tokens: the terms trained
        assert call.seen["global_n_tokens"].tolist() == [float(len(now))]
        # each of them carries the lag it is trained at
        assert call.seen["staleness_lag"][call.trained].tolist() == [call.version - s.model_version for s in now]
    assert voided_any and unscored_any, "no micro-batch held a sample TRL's pull-time rule let through"
    assert max(trained_lags(calls, by_logprob)) <= bound
    # one ship per optimizer step (one micro-batch each here), at the version compute_loss then trained
    assert [report.step for report in recorder.reports] == [call.version + 1 for call in calls]
    assert trainer.staleness_shipping.versions == [call.version for call in calls]
    # what the monitor dropped is what left the micro-batches (TRL's own pull-time drops never reach it)
    dropped = sum(report.metrics["staleness/rollout/dropped"] for report in recorder.reports)
    trained_or_dropped = {id(s) for call in calls for s in call.terms(by_logprob, "fetched")}
    assert dropped == len(trained_or_dropped) - len({id(s) for call in calls for s in call.terms(by_logprob)})


def test_a_voided_sample_adds_nothing_to_trls_loss_or_gradient(
    tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's compute_loss on the micro-batch with a voided sample equals its loss on the kept samples alone,
    packed by TRL's own dataset, TreeRow and collator: the same value, the same gradient."""
    bound = 1
    samples = samples_at([1, 1, 2, 2, 3])
    by_logprob = by_old_log_prob(samples)
    trainer = async_grpo_trainer(
        tiny_model, tmp_path, samples, monkeypatch, max_staleness=bound, per_device_train_batch_size=2, token_budget=0
    )
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound))
    staleness.ship_at_train_time(trainer, monitor)
    compared: list[float] = []
    compute_loss = trainer.compute_loss  # TRL's own, unwrapped

    def compare(model: Any, inputs: dict[str, Any], loss: Any, call: LossCall) -> None:
        kept = unique(call.terms(by_logprob))
        if len(kept) == len(unique(call.terms(by_logprob, "fetched"))):
            return  # nothing voided in this micro-batch
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        if not kept:  # every sample voided: the loss and its gradient are zero
            assert float(loss.detach()) == 0.0 and all(not grad.any() for grad in grads)
            compared.append(0.0)
            return
        dataset, _ = trl_dataset(kept, trainer.model_version, bound)
        row = TreeRow()
        for item in drain(dataset):
            row.add(item)
        alone = DataCollatorForRollout(pad_token_id=0, num_processes=1)([[row]])
        alone_loss = compute_loss(model, alone)
        alone_grads = torch.autograd.grad(alone_loss, params)
        assert float(loss.detach()) == pytest.approx(float(alone_loss.detach()), rel=1e-5, abs=1e-7)
        for grad, alone_grad in zip(grads, alone_grads, strict=True):
            torch.testing.assert_close(grad, alone_grad, rtol=1e-4, atol=1e-7)
        compared.append(float(loss.detach()))

    train(trainer, compare)
    assert len(compared) >= 2 and 0.0 in compared, compared  # one partly voided micro-batch, one wholly


def trl_log_probs(model: Any, inputs: dict[str, Any]) -> Any:
    """The trainer's log-probability of each selected loss term, computed as ``AsyncGRPOTrainer.compute_loss``
    computes its ``log_probs`` (async_grpo_trainer.py:1497-1523), with the model being trained."""
    mask_bool = inputs["attention_mask"].bool()
    selected = inputs["token_index"] >= 0
    tree_kwargs = {
        key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")
    }
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    outputs = model(
        input_ids=inputs["input_ids"][mask_bool].unsqueeze(0),
        position_ids=inputs["position_ids"][mask_bool].unsqueeze(0),
        shift_labels=inputs["shift_labels"][mask_bool].unsqueeze(0),
        fused_lm_head=True,
        **tree_kwargs,
    )
    return outputs.log_probs.flatten()[inputs["token_index"][selected]]


def test_with_gradient_accumulation_each_step_ships_once_at_the_version_it_trains_and_costs_add_up(
    tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bound = 1
    samples = samples_at([1, 1, 2, 2, 3, 3])
    by_logprob = by_old_log_prob(samples)
    trainer = async_grpo_trainer(
        tiny_model, tmp_path, samples, monkeypatch,
        max_staleness=bound, per_device_train_batch_size=2, gradient_accumulation_steps=2, token_budget=0,
    )  # fmt: skip
    recorder = Recorder()
    monitor = StalenessMonitor(StalenessConfig(max_staleness=bound), [recorder])
    staleness.ship_at_train_time(trainer, monitor)
    seen: list[tuple[Any, Any]] = []

    def cost_family(model: Any, inputs: dict[str, Any], loss: Any, call: LossCall) -> None:
        selected = inputs["token_index"] >= 0
        old_log_probs = inputs["old_log_probs"][selected]
        log_probs = trl_log_probs(model, inputs)
        self = trainer  # the lines below are the ones that go into AsyncGRPOTrainer.compute_loss, after log_probs
        lag = inputs["staleness_lag"][selected]
        monitor.record_mismatch(self.model_version + 1, mismatch_sums(lag, old_log_probs, log_probs.detach()))
        trained = (lag >= 0).numpy()
        seen.append((old_log_probs.numpy()[trained], log_probs.detach().numpy()[trained]))

    calls = train(trainer, cost_family)
    # get_batch_samples fetches a whole optimizer step before training it: the steps trained are whole
    assert len(calls) >= 4 and len(calls) % 2 == 0
    steps = [calls[k : k + 2] for k in range(0, len(calls), 2)]
    assert all(first.version == second.version for first, second in steps)
    # one ship per optimizer step, at the version compute_loss then trains (TRL's model_version, bumped per step)
    versions = [first.version for first, _ in steps]
    assert trainer.staleness_shipping.versions == versions == list(range(1, len(steps) + 1))
    assert [report.step for report in recorder.reports] == [v + 1 for v in versions]
    assert max(trained_lags(calls, by_logprob)) <= bound

    # the cost family: per step, over the terms trained, each at the lag it trained at
    for k, (version, step) in enumerate(zip(versions, steps, strict=True)):
        lags = np.concatenate([[call.version - s.model_version for s in call.terms(by_logprob)] for call in step])
        old = np.concatenate([seen[2 * k + j][0] for j in range(2)])
        new = np.concatenate([seen[2 * k + j][1] for j in range(2)])
        direct = mismatch_sums(lags.astype(np.int64), old, new)
        sums = monitor.mismatch(version + 1)
        assert sums is not None and int(sums.tokens.sum()) == len(lags) > 0
        assert sums.tokens.tolist() == direct.tokens.tolist()
        assert sums.metrics() == pytest.approx(direct.metrics())


def train_on_rank(rank: int, port: int, model: str, out: str) -> None:
    """One of two CPU processes (gloo) of ``AsyncGRPOTrainer`` with the README's lines; what each
    ``compute_loss`` got goes to ``out/<rank>.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    monkeypatch = pytest.MonkeyPatch()
    samples = samples_at([1, 1, 2, 2, 3, 3, 4, 4])  # the same objects on both ranks; only rank 0's worker is used
    trainer = async_grpo_trainer(
        model, os.path.join(out, str(rank)), samples, monkeypatch,
        max_staleness=1, per_device_train_batch_size=1, token_budget=0, max_steps=4,
    )  # fmt: skip
    assert trainer.accelerator.num_processes == 2
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    staleness.ship_at_train_time(trainer, monitor)
    seen = []
    compute_loss = trainer.compute_loss

    def loss(model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        selected = inputs["token_index"] >= 0
        seen.append(
            {
                "model_version": trainer.model_version,
                "old_log_probs": inputs["old_log_probs"][selected].tolist(),
                "staleness_lag": inputs["staleness_lag"][selected].tolist(),
                "global_n_tokens": float(inputs["global_n_tokens"][0]),
            }
        )
        return compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer.compute_loss = loss
    trainer.train()
    with open(os.path.join(out, f"{rank}.json"), "w") as file:
        json.dump({"seen": seen, "versions": trainer.staleness_shipping.versions}, file)


def test_with_two_processes_rank_0_ships_and_every_rank_trains_its_row_of_the_decision(
    tiny_model: str, tmp_path: Any
) -> None:
    """Only rank 0 collates and bumps model_version (TRL's own code): its decision reaches every rank's row."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    torch.multiprocessing.spawn(train_on_rank, args=(port, tiny_model, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    by_logprob = by_old_log_prob(samples_at([1, 1, 2, 2, 3, 3, 4, 4]))
    by_value = {value: sample.model_version for value, sample in by_logprob.items()}
    versions = ranks[0]["versions"]
    assert versions == [1, 2, 3, 4] and ranks[1]["versions"] == []  # one ship per step, on rank 0 only
    assert {seen["model_version"] for seen in ranks[1]["seen"]} == {0}  # TRL bumps it on rank 0 only
    placeholders = 0
    for step, version in enumerate(versions):
        rows = [rank["seen"][step] for rank in ranks]
        trained = [(lag, value) for row in rows for lag, value in zip(row["staleness_lag"], row["old_log_probs"])]
        kept = [(lag, value) for lag, value in trained if lag >= 0]
        # each rank's kept terms carry rank 0's lag, trained within the bound
        assert all(lag == version - by_value[value] <= 1 for lag, value in kept)
        # global_n_tokens, TRL's normaliser, counts the kept terms of both rows, on both ranks
        assert [row["global_n_tokens"] for row in rows] == [float(len(kept))] * 2
        for row in rows:  # a row with nothing kept keeps one term at lag -1 (advantage 0)
            if not [lag for lag in row["staleness_lag"] if lag >= 0]:
                assert row["staleness_lag"] == [-1]
                placeholders += 1
    assert placeholders >= 2, "no row lost all its terms"
    assert any(lag > 0 for lag in ranks[1]["seen"][1]["staleness_lag"])  # rank 1 could not have judged that
