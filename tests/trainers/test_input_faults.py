"""Bad input through the trainers' own objects (AReaL's padded dicts, verl's ``DataProto``, TRL's
``RolloutSample``, CPU tensors as a forward pass leaves them): a clear error and nothing queued, or the
values read as they are; never a half-added call or a number read as another."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("areal")
pytest.importorskip("verl")
pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from areal.utils.data import concat_padded_tensors  # noqa: E402  (after the skips)
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from verl import DataProto  # noqa: E402

from staleness_metrics import RolloutBatch, Sink, StalenessConfig, StalenessMonitor, TraceError  # noqa: E402
from staleness_metrics.adapters import areal, trl  # noqa: E402
from staleness_metrics.adapters import verl as verl_adapter  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def sequence(prompt: int, versions: list[int], loss_mask: list[int] | None = None) -> dict[str, Any]:
    n = len(versions)
    return {
        "input_ids": torch.arange(100, 100 + prompt + n).unsqueeze(0),
        "loss_mask": torch.tensor([[0] * prompt + ([1] * n if loss_mask is None else loss_mask)]),
        "logprobs": torch.tensor([[0.0] * prompt + [-0.5] * n]),
        "versions": torch.tensor([[-1] * prompt + versions]),
        "attention_mask": torch.ones(1, prompt + n, dtype=torch.bool),
    }


def test_areal_a_refused_dict_leaves_the_whole_call_unqueued_and_is_named() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    good = concat_padded_tensors([sequence(3, [6, 6, 7]), sequence(3, [7, 7, 8, 8])])
    bad = concat_padded_tensors([sequence(2, [7, 7, 8, 8], loss_mask=[1, 2, 1, 1])])
    with pytest.raises(TraceError, match=r"field batch\[1\]\.loss_mask\[0\]: position 3: expected 0 or 1$"):
        areal.ship(monitor, [good, bad], version=8)
    assert monitor.sink.queued == 0
    out = areal.ship(monitor, [good], version=8)
    assert [d["loss_mask"].shape[0] for d in out] == [2]
    assert monitor.sink.totals.rollouts_shipped == 2


def no_response_mask(rows: int) -> DataProto:
    """Two prompt and four response positions per row, no response_mask (verl derives it later)."""
    steps = {
        "min_global_steps": np.array([1] * rows, dtype=object),
        "max_global_steps": np.array([5] * rows, dtype=object),
    }
    return DataProto.from_dict(
        tensors={"responses": torch.randint(0, 9, (rows, 4)), "attention_mask": torch.ones(rows, 6, dtype=torch.long)},
        non_tensors={"uid": np.array(["p"] * rows, dtype=object), **steps},
    )


@pytest.mark.parametrize("rows", [1, 2])
def test_verl_without_response_mask_masks_the_one_it_derives_not_attention_mask(rows: int) -> None:
    data = no_response_mask(rows)
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    out = verl_adapter.ship(monitor, data, version=5, token_versions=np.array([[1, 1, 5, 5]] * rows))
    assert data.batch["attention_mask"].tolist() == [[1] * 6] * rows
    assert out.batch["response_mask"].tolist() == [[0, 0, 1, 1]] * rows
    assert out.batch["staleness_lag"].tolist() == [[4, 4, 0, 0]] * rows
    assert (monitor.sink.totals.tokens_masked, monitor.sink.totals.tokens_sampled) == (2 * rows, 4 * rows)


def test_from_verl_without_response_mask_leaves_attention_mask_as_it_was() -> None:
    data = no_response_mask(1)
    batch = verl_adapter.from_verl(data, token_versions=np.array([[1, 1, 5, 5]]))
    sink = Sink(StalenessConfig(max_staleness=2))
    sink.add(batch)
    shipment = sink.ship(6)
    assert verl_adapter.verl_response_mask(shipment, batch).tolist() == [[0, 0, 1, 1]]
    assert data.batch["attention_mask"].tolist() == [[1] * 6]


@pytest.mark.parametrize(("start", "shown"), [(4.9, "4.9"), (float("nan"), "nan"), (True, "True")])
def test_verl_a_version_no_integer_is_refused_as_given(start: Any, shown: str) -> None:
    data = DataProto.from_dict(
        tensors={"response_mask": torch.ones(1, 3, dtype=torch.long)},
        non_tensors={"uid": np.array(["p"], dtype=object), "min_global_steps": np.array([start], dtype=object),
                     "max_global_steps": np.array([5], dtype=object)},
    )  # fmt: skip
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))
    message = f"rollout 'p/0': field non_tensor_batch['min_global_steps']: expected an integer, got {shown}"
    with pytest.raises(TraceError) as raised:
        verl_adapter.ship(monitor, data, version=5)
    assert str(raised.value) == message
    assert monitor.sink.queued == 0


def rollout_sample(mask: list[float], version: int = 3) -> Any:
    return RolloutSample(
        prompt=[{"role": "user", "content": "q"}], completion=[{"role": "assistant", "content": "a"}],
        input_ids=np.arange(len(mask)), completion_mask=np.asarray(mask), old_log_probs=np.zeros(len(mask), np.float32),
        advantage=0.0, model_version=version, group_id=0, metrics={},
    )  # fmt: skip


def test_trl_a_completion_mask_of_no_0_or_1_is_refused_not_written_back_as_0() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    sample = rollout_sample([0, 0.5, 1.0, 1.0])
    with pytest.raises(TraceError, match=r"field samples\[0\]\.completion_mask: position 1: expected 0 or 1$"):
        trl.ship(monitor, [sample], version=3)
    assert sample.completion_mask.tolist() == [0, 0.5, 1.0, 1.0]
    assert monitor.sink.queued == 0
    assert trl.ship(monitor, [], version=3) == []


def test_bfloat16_and_grad_tensors_are_read_as_their_values() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    half = torch.full((2, 3), -0.5, dtype=torch.bfloat16)
    grad = torch.ones(2, 3, requires_grad=True)
    batch = RolloutBatch.from_padded(["a", "b"], mask, dispatch_version=np.array([3, 3]), lengths=np.array([2, 3]),
                                     logprobs=half, rl_weights=grad)  # fmt: skip
    assert batch.logprobs is not None and batch.logprobs.dtype == np.float32
    assert batch.logprobs.tolist() == [-0.5] * 6 and batch.rl_weights is not None and batch.rl_weights.sum() == 6
    assert Sink().add(batch) == 2
    data = DataProto.from_dict(
        tensors={"response_mask": torch.ones(2, 3, dtype=torch.long), "rollout_log_probs": half},
        non_tensors={"uid": np.array(["p", "p"], dtype=object), "min_global_steps": np.array([5, 5], dtype=object),
                     "max_global_steps": np.array([5, 5], dtype=object)},
    )  # fmt: skip
    assert verl_adapter.ship(StalenessMonitor(StalenessConfig()), data, version=5) is data


def verl_batch(rows: int, starts: list[Any], **tensors: Any) -> DataProto:
    return DataProto.from_dict(
        tensors={"response_mask": torch.ones(rows, 3, dtype=torch.long), **tensors},
        non_tensors={"uid": np.array(["p"] * rows, dtype=object), "min_global_steps": np.array(starts, dtype=object)},
    )


def test_verl_empty_responses_read_no_prompt_position_as_a_response() -> None:
    data = DataProto.from_dict(
        tensors={
            "responses": torch.zeros(2, 0, dtype=torch.long),
            "attention_mask": torch.ones(2, 3, dtype=torch.long),
        },
        non_tensors={"uid": np.array(["p", "p"], dtype=object), "min_global_steps": np.array([5, 5], dtype=object)},
    )
    assert verl_adapter.from_verl(data).mask.shape == (0,)
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    out = verl_adapter.ship(monitor, data, version=5)
    assert tuple(out.batch["response_mask"].shape) == (2, 0) and monitor.sink.totals.tokens_sampled == 0


@pytest.mark.parametrize(
    ("call", "field"),
    [(lambda m: verl_adapter.ship(m, verl_batch(2, [5, 5]), version=5, token_versions=np.array([[5] * 3, [5, 6, 5]])),
      "token_versions[1]"),
     (lambda m: verl_adapter.ship(m, verl_batch(2, [5, 5], attention_mask=torch.tensor([[1] * 5, [1, 1, 1, 1, 0]])),
                                  version=5), "batch['response_mask'][1]"),
     (lambda m: verl_adapter.ship(m, DataProto.from_dict(
         tensors={"response_mask": torch.ones(2, 3, dtype=torch.long)},
         non_tensors={"uid": np.array(["p", "p"], dtype=object), "min_global_steps": np.array([5, 5], dtype=object),
                      "data_source": np.array(["math", ""], dtype=object)}), version=5),
      "non_tensor_batch['data_source'][1]")],
)  # fmt: skip
def test_verl_refusals_name_verls_own_field(call: Any, field: str) -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    with pytest.raises(TraceError) as raised:
        call(monitor)
    assert (raised.value.rollout_id, raised.value.field) == ("p/1", field)
    assert monitor.sink.queued == 0


@pytest.mark.parametrize(
    ("versions", "reason"),
    [(torch.tensor([[-1.0, 5.0, 5.0]]), "expected integers, got float32"),
     (torch.tensor([[False, True, True]]), "expected integers, got bool"),
     (torch.tensor([[-1, 5]]), "shape (1, 2) differs from the mask's (1, 3)")],
)  # fmt: skip
def test_areal_a_refused_versions_tensor_is_named_by_its_dict(versions: Any, reason: str) -> None:
    good = {"loss_mask": torch.tensor([[0, 1, 1]]), "versions": torch.tensor([[-1, 5, 5]])}
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    with pytest.raises(TraceError) as raised:
        areal.ship(monitor, [dict(good), dict(good, versions=versions)], version=5)
    assert (raised.value.field, raised.value.reason) == ("batch[1].versions[0]", reason)
    padding = dict(good, attention_mask=torch.tensor([[True, True, False]]))
    with pytest.raises(TraceError, match=r"field batch\[1\]\.loss_mask\[0\]: nonzero on a padding position$"):
        areal.ship(monitor, [dict(good), padding], version=5)
    assert monitor.sink.queued == 0


def test_a_tensor_on_the_meta_device_is_refused_by_name() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    data = verl_batch(1, [5])
    data.batch["response_mask"] = torch.ones(1, 3, dtype=torch.long, device="meta")
    with pytest.raises(TypeError, match=r"^batch\['response_mask'\]: a tensor on the meta device holds no values$"):
        verl_adapter.ship(monitor, data, version=5)
    meta = {"loss_mask": torch.ones(1, 3, device="meta"), "versions": torch.full((1, 3), 5)}
    with pytest.raises(TypeError, match=r"^loss_mask: a tensor on the meta device"):
        areal.ship(monitor, [meta], version=5)
    assert monitor.sink.queued == 0


@pytest.mark.parametrize(
    ("field", "tensor"),
    [("token_versions", torch.tensor([-1.0, 9, 9, 10], requires_grad=True)),
     ("token_versions", torch.tensor([-1.0, 9, 9, 10], dtype=torch.bfloat16)),
     ("dispatch_version", torch.tensor([9.0], dtype=torch.bfloat16)),
     ("position_offsets", torch.tensor([0.0, 4.0], requires_grad=True)),
     ("span_starts", torch.tensor([1], dtype=torch.int32))],
)  # fmt: skip
def test_rolloutbatch_reads_its_integer_arrays_from_tensors_as_from_padded_does(field: str, tensor: Any) -> None:
    columns: dict[str, Any] = {
        "ids": ["r0"], "sample_offsets": np.array([0, 1]), "position_offsets": np.array([0, 4]),
        "mask": np.array([0, 1, 1, 1], np.float32), "dispatch_version": np.array([9]),
    }  # fmt: skip
    if field == "span_starts":
        columns |= {"span_offsets": np.array([0, 1]), "span_versions": np.array([9]), "span_starts": np.array([1])}
    else:
        columns["token_versions"] = np.array([-1, 9, 9, 10])
    expected = RolloutBatch(**columns)
    batch = RolloutBatch(**(columns | {field: tensor}))  # (detached, bfloat16 widened)
    read = getattr(batch, field)
    assert read.dtype == np.int64 and read.tolist() == getattr(expected, field).tolist()
    with pytest.raises(TypeError, match=rf"^{field}: a tensor on the meta device holds no values$"):
        RolloutBatch(**(columns | {field: tensor.detach().to("meta")}))


def test_a_version_past_int64_is_refused_naming_its_row() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    with pytest.raises(
        TraceError, match=r"^rollout 'p/0': field non_tensor_batch\['min_global_steps'\]: must be in 0\.\."
    ):
        verl_adapter.ship(monitor, verl_batch(1, [2**70]), version=5)
    with pytest.raises(TraceError, match=r"field samples\[0\]\.model_version: expected an integer in 0\.\."):
        trl.ship(monitor, [rollout_sample([0, 1], version=2**70)], version=5)
    assert monitor.sink.queued == 0


def test_trl_a_completion_mask_it_cannot_write_back_is_refused_before_the_add() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    listed = rollout_sample([0, 1, 1])
    listed.completion_mask = [0, 1, 1]
    read_only = rollout_sample([0, 1, 1])
    read_only.completion_mask.setflags(write=False)
    for bad, reason in [(listed, "expected a numpy array or a tensor, got list"),
                        (read_only, "read-only: the shipped mask is written back into it")]:  # fmt: skip
        with pytest.raises(TraceError) as raised:
            trl.ship(monitor, [rollout_sample([0, 1, 1]), bad], version=3)
        assert (raised.value.field, raised.value.reason) == ("samples[1].completion_mask", reason)
    assert monitor.sink.totals.rollouts_shipped == 0 and monitor.sink.queued == 0


def test_trl_a_sample_without_old_log_probs_ships_with_its_logprobs_missing() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=1))
    sample = rollout_sample([0, 1, 1])
    sample.old_log_probs = None
    assert trl.ship(monitor, [sample], version=3) == [sample]
    assert monitor.sink.totals.rollouts_shipped == 1


def lenient_monitor() -> Any:
    """A lenient monitor that keeps the shipments its ships make (``shipped``)."""
    monitor: Any = StalenessMonitor(StalenessConfig(max_staleness=2, strict=False))
    ship, monitor.shipped = monitor.ship, []

    def ship_and_keep(step: int, ids: Any = None) -> Any:
        monitor.shipped.append(ship(step, ids))
        return monitor.shipped[-1]

    monitor.ship = ship_and_keep
    return monitor


def set_aside(monitor: Any) -> list[tuple[str | None, str]]:
    """The rollouts the monitor's ships report set aside: (id, field)."""
    return [(error.rollout_id, error.field) for shipment in monitor.shipped for error in shipment.invalid]


def test_verl_lenient_sets_refused_rows_aside_as_records_and_ships_the_rest() -> None:
    starts = [5, None, 4, 4.5]
    data = DataProto.from_dict(
        tensors={"response_mask": torch.ones(4, 3, dtype=torch.long)},
        non_tensors={"uid": np.array(list("pqrs"), dtype=object), "min_global_steps": np.array(starts, dtype=object),
                     "data_source": np.array(["math", "code", "math", "code"], dtype=object)},
    )  # fmt: skip
    monitor = lenient_monitor()
    out = verl_adapter.ship(monitor, data, version=5)
    assert out.non_tensor_batch["uid"].tolist() == ["p", "r"]
    assert out.batch["response_mask"].tolist() == [[1, 1, 1]] * 2
    assert set_aside(monitor) == [("q/0", "non_tensor_batch['min_global_steps'][1]"),
                                  ("s/0", "non_tensor_batch['min_global_steps']")]  # fmt: skip
    records = lenient_monitor()  # the same rollouts as SPEC 3 records: counted alike
    records.add([{"id": f"{uid}/0", "env": env, "samples": [{"mask": [1, 1, 1]}], "dispatch_version": start}
                 for uid, env, start in zip("pqrs", ["math", "code", "math", "code"], starts)])  # fmt: skip
    by_env = {env: tally.rollouts_invalid for env, tally in records.ship(6).report.env_tally.items()}
    assert by_env == {"math": 0, "code": 2}
    assert {env: t.rollouts_invalid for env, t in monitor.shipped[0].report.env_tally.items()} == by_env
    assert (monitor.sink.totals.rollouts_invalid, monitor.sink.totals.rollouts_shipped) == (2, 2)
    assert monitor.sink.totals == records.sink.totals
    assert monitor.sink.queued == 0
    no_version = verl_batch(2, [5, 5])
    del no_version.non_tensor_batch["min_global_steps"]
    assert len(verl_adapter.ship(monitor, no_version, version=5)) == 0
    assert monitor.sink.totals.rollouts_invalid == 4
    strict = StalenessMonitor(StalenessConfig(max_staleness=2))
    with pytest.raises(TraceError, match=r"^rollout 'q/0': field non_tensor_batch\['min_global_steps'\]\[1\]: is None"):
        verl_adapter.ship(strict, data, version=5)
    assert strict.sink.queued == 0 and strict.sink.totals.rollouts_invalid == 0


def test_verl_lenient_names_each_row_set_aside_by_its_index_in_the_batch_passed() -> None:
    # after a row set aside, the rows left are read again: a later refusal names its row as the user knows it
    data = DataProto.from_dict(
        tensors={"response_mask": torch.ones(5, 3, dtype=torch.long)},
        non_tensors={"uid": np.array(list("pqrst"), dtype=object),
                     "min_global_steps": np.array([5, None, 5, None, 5], dtype=object)},
    )  # fmt: skip
    monitor = lenient_monitor()
    assert verl_adapter.ship(monitor, data, version=5).non_tensor_batch["uid"].tolist() == ["p", "r", "t"]
    assert set_aside(monitor) == [("q/0", "non_tensor_batch['min_global_steps'][1]"),
                                  ("s/0", "non_tensor_batch['min_global_steps'][3]")]  # fmt: skip


def test_a_lenient_set_aside_waits_for_the_monitors_lock_as_an_add_does() -> None:
    # a scrape or a checkpoint in another thread holds the lock: it must not see a set-aside half made
    data = DataProto.from_dict(
        tensors={"response_mask": torch.ones(2, 3, dtype=torch.long)},
        non_tensors={"uid": np.array(list("pq"), dtype=object), "min_global_steps": np.array([5, None], dtype=object)},
    )  # fmt: skip
    monitor = lenient_monitor()
    release, done = threading.Event(), []
    holder = threading.Thread(target=lambda: (monitor._lock.__enter__(), release.wait(), monitor._lock.__exit__()))
    holder.start()
    caller = threading.Thread(target=lambda: done.append(verl_adapter.ship(monitor, data, version=5)))
    caller.start()
    caller.join(0.5)
    try:  # (released whatever happens: a failure must not leave the run hanging on the holder)
        assert monitor.sink.invalid == () and not done  # (the set-aside, and the add after it, wait)
    finally:
        release.set()
        holder.join()
        caller.join(10)
    assert [len(out) for out in done] == [1]
    assert set_aside(monitor) == [("q/0", "non_tensor_batch['min_global_steps'][1]")]


def test_areal_lenient_sets_refused_rows_aside_and_ships_the_rest() -> None:
    padded = concat_padded_tensors([sequence(2, [5, 5]), sequence(2, [5, 5, 5])])
    padded["loss_mask"][0, -1] = 1  # on row 0's padding
    unlabelled = concat_padded_tensors([sequence(1, [5]), sequence(2, [5, 5, 5])])
    unlabelled["versions"][1] = -1
    good = concat_padded_tensors([sequence(1, [5])])
    monitor = lenient_monitor()
    out = areal.ship(monitor, [padded, unlabelled, good], version=5)
    assert [d["loss_mask"].tolist() for d in out] == [[[0, 0, 1, 1, 1]], [[0, 1, 0, 0, 0]], [[0, 1]]]
    assert [d["staleness_lag"].shape[0] for d in out] == [1, 1, 1]
    assert [d["input_ids"].shape[0] for d in out] == [1, 1, 1]
    assert [(field, rid.endswith(end)) for (rid, field), end in zip(set_aside(monitor), ["/0", "/1"])] == [
        ("batch[0].loss_mask[0]", True), ("batch[1].versions[1]", True)]  # fmt: skip
    assert (monitor.sink.totals.rollouts_invalid, monitor.sink.totals.rollouts_shipped) == (2, 3)
    single = concat_padded_tensors([sequence(2, [5, 5]), sequence(2, [5, 5, 5])])
    single["versions"][0] = -1
    kept = areal.ship(monitor, single, version=5)
    assert kept is single and kept["loss_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert monitor.sink.totals.rollouts_invalid == 3
    strict = StalenessMonitor(StalenessConfig(max_staleness=2))
    with pytest.raises(TraceError, match=r"field batch\[0\]\.loss_mask\[0\]: nonzero on a padding position$"):
        areal.ship(strict, [padded, good], version=5)
    assert strict.sink.queued == 0


def test_trl_lenient_sets_refused_samples_aside_and_ships_the_rest() -> None:
    samples = [rollout_sample([0, 1, 1], version=None), rollout_sample([0, 1, 1], version=3),  # type: ignore[arg-type]
               rollout_sample([0, 1, 1], version=2.5)]  # type: ignore[arg-type]  # fmt: skip
    monitor = lenient_monitor()
    assert trl.ship(monitor, samples, version=3) == [samples[1]]
    assert [field for _, field in set_aside(monitor)] == ["samples[0].model_version", "samples[2].model_version"]
    assert (monitor.sink.totals.rollouts_invalid, monitor.sink.totals.rollouts_shipped) == (2, 1)
    strict = StalenessMonitor(StalenessConfig(max_staleness=2))
    with pytest.raises(TraceError, match=r"field samples\[0\]\.model_version: missing or None"):
        trl.ship(strict, samples, version=3)
    assert strict.sink.queued == 0 and strict.sink.totals.rollouts_invalid == 0
