"""verl, AReaL and TRL calls retried: after a Ctrl-C as the monitor ships (docs/checkpoints.md: that ship did
not happen, the next takes its rollouts), after a refused call in lenient mode, and from two threads on one
monitor. Batches are built with the trainers' own classes."""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl")
pytest.importorskip("areal")
pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from accelerate import PartialState  # noqa: E402
from areal.utils.data import concat_padded_tensors  # noqa: E402  (after the skips)
from torch.utils.data import DataLoader  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (  # noqa: E402
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
)
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from verl import DataProto  # noqa: E402

from staleness_metrics import StalenessConfig, StalenessMonitor, TraceError  # noqa: E402
from staleness_metrics.adapters import areal as areal_adapter  # noqa: E402
from staleness_metrics.adapters import trl as trl_adapter  # noqa: E402
from staleness_metrics.adapters import verl as verl_adapter  # noqa: E402

PartialState()


def verl_batch(mins: tuple[int | None, ...] = (5, 5, 5, 5), uids: str = "aabb") -> DataProto:
    n = len(mins)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]][:n])
    return DataProto.from_dict(
        tensors={"responses": torch.randint(0, 100, (n, 4)), "response_mask": mask,
                 "attention_mask": torch.cat([torch.ones(n, 3, dtype=torch.int64), mask], dim=1)},
        non_tensors={"uid": np.array(list(uids[:n]), dtype=object),
                     "min_global_steps": np.array(list(mins), dtype=object),
                     "max_global_steps": np.array([max(v for v in mins if v is not None)] * n, dtype=object)},
    )  # fmt: skip


def areal_dict(versions: list[list[int]], token: int = 1) -> dict[str, Any]:
    def seq(out: list[int]) -> dict[str, Any]:
        width = 2 + len(out)
        return {
            "input_ids": torch.full((1, width), token),
            "loss_mask": torch.tensor([[0, 0] + [1] * len(out)]),
            "versions": torch.tensor([[-1, -1, *out]]),
            "attention_mask": torch.ones(1, width, dtype=torch.bool),
        }

    return concat_padded_tensors([seq(v) for v in versions])


def trl_sample(group: int, version: int | str | None, completion: int = 3) -> RolloutSample:
    return RolloutSample(
        prompt=[{"role": "user", "content": "q"}], completion=[{"role": "assistant", "content": "a"}],
        input_ids=np.arange(4 + completion, dtype=np.int64),
        completion_mask=np.asarray([0] * 4 + [1] * completion, dtype=np.int64),
        old_log_probs=np.asarray([0.0] * 4 + [-0.5] * completion, dtype=np.float32),
        advantage=0.5, model_version=version, group_id=group, metrics={},
    )  # fmt: skip


def interrupt_next_ship(monitor: StalenessMonitor) -> None:
    """A Ctrl-C inside the monitor's next ship, before the sink takes the batch."""
    ship = monitor.sink.ship

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        monitor.sink.ship = ship  # type: ignore[method-assign]
        raise KeyboardInterrupt

    monitor.sink.ship = interrupted  # type: ignore[method-assign]


def totals(monitor: StalenessMonitor) -> dict[str, int]:
    found: dict[str, int] = monitor.sink.state_dict()["totals"]
    return found


def retried(monitor: StalenessMonitor, call: Callable[[], Any]) -> Any:
    interrupt_next_ship(monitor)
    with pytest.raises(KeyboardInterrupt):
        call()
    return call()


@pytest.mark.parametrize("ids", [None, ["r0", "r1", "r2", "r3"]])
def test_verl_call_retried_after_a_ctrl_c_ships_its_rows_once(ids: list[str] | None) -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    data = verl_batch()
    out = retried(monitor, lambda: verl_adapter.ship(monitor, data, version=6, ids=ids))
    assert out is data and list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b"]
    assert totals(monitor)["rollouts_shipped"] == 4


def test_areal_and_trl_calls_retried_after_a_ctrl_c_ship_their_rows_once() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    dicts = [areal_dict([[6, 6], [7, 7, 8]])]
    out = retried(monitor, lambda: areal_adapter.ship(monitor, dicts, version=8))
    assert [len(d["loss_mask"]) for d in out] == [2] and totals(monitor)["rollouts_shipped"] == 2
    samples = [trl_sample(0, 9), trl_sample(0, 9, 5)]
    assert retried(monitor, lambda: trl_adapter.ship(monitor, samples, version=10)) == samples
    assert totals(monitor)["rollouts_shipped"] == 4


def test_areal_single_dict_never_takes_another_call_rows() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    old, new = areal_dict([[6, 6], [7, 7]], token=111), areal_dict([[9, 9]] * 3, token=222)
    interrupt_next_ship(monitor)
    with pytest.raises(KeyboardInterrupt):
        areal_adapter.ship(monitor, old, version=8)
    with pytest.raises(TraceError, match="field batch: queued by an earlier AReaL call that did not ship"):
        areal_adapter.ship(monitor, new, version=9)
    assert totals(monitor)["rollouts_shipped"] == 0 and new["input_ids"].shape[0] == 3  # nothing changed
    older, own = areal_adapter.ship(monitor, [new], version=9)  # (a list: each call's rows come back)
    assert set(older["input_ids"].flatten().tolist()) == {111} and older["loss_mask"].shape[0] == 2
    assert set(own["input_ids"].flatten().tolist()) == {222} and own["loss_mask"].shape[0] == 3


def refused_then_retried(make: Callable[[], Any], ship: Callable[[StalenessMonitor, Any, Any], Any],
                         wrong: Any, right: int, before: Callable[[StalenessMonitor], Any] = lambda m: None,
                         ) -> int:  # fmt: skip
    """``rollouts_invalid`` of a lenient monitor after a refused call, then the call corrected."""
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4, strict=False))
    before(monitor)
    with pytest.raises((TraceError, ValueError, TypeError)):
        ship(monitor, make(), wrong)
    ship(monitor, make(), right)
    return totals(monitor)["rollouts_invalid"]


def test_a_refused_lenient_call_counts_the_rows_it_set_aside_once_with_its_retry() -> None:
    def verl(monitor: StalenessMonitor, data: Any, version: Any) -> Any:
        return verl_adapter.ship(monitor, data, version=version)

    first = lambda m: verl(m, verl_batch(), 6)  # noqa: E731  (then version 5 goes back: refused)
    assert refused_then_retried(lambda: verl_batch((6, 6, None, 6), uids="ccdd"), verl, 5, 7, first) == 1

    def areal_dicts(broken: bool) -> list[dict[str, Any]]:
        first = areal_dict([[5, 5], [5, 5, 5]])
        first["loss_mask"][0, -1] = 1  # on row 0's padding: set aside
        second = areal_dict([[5]])
        second["versions"] = None if broken else second["versions"]
        return [first, second]

    calls = iter([True, False])
    assert refused_then_retried(lambda: areal_dicts(next(calls)), lambda m, b, v: areal_adapter.ship(m, b, version=v),
                                5, 5) == 1  # fmt: skip
    samples = lambda: [trl_sample(0, 5), trl_sample(0, None)]  # noqa: E731
    assert refused_then_retried(samples, lambda m, s, v: trl_adapter.ship(m, s, version=v), "6", 6) == 1


def work(monitor: StalenessMonitor, barrier: threading.Barrier, got: dict[int, Any], group: int) -> None:
    """Ship four samples of ``group`` once the other thread is ready; note what came back."""
    samples = [trl_sample(group, 5) for _ in range(4)]
    barrier.wait()
    try:
        got[group] = [s.group_id for s in trl_adapter.ship(monitor, samples, version=7)]
    except Exception as error:  # (recorded: the assert names it)
        got[group] = repr(error)


def test_two_threads_on_one_monitor_each_get_their_own_samples_back() -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # frequent switches: any interval allows the interleaving
    try:
        for _ in range(40):
            monitor = StalenessMonitor(StalenessConfig(max_staleness=100))
            barrier, got = threading.Barrier(2), dict[int, Any]()
            threads = [threading.Thread(target=work, args=(monitor, barrier, got, group)) for group in (0, 1)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert got == {0: [0] * 4, 1: [1] * 4}
    finally:
        sys.setswitchinterval(interval)


def trl_trainer(samples: list[RolloutSample], fail_first: bool = False) -> SimpleNamespace:
    """The four attributes ship_at_train_time wraps, over TRL's own dataset, batcher and collator."""
    trainer = SimpleNamespace(model_version=1, staleness_shipping=None, trained=[], rollout_queue=queue.Queue())
    for sample in samples:
        trainer.rollout_queue.put(sample)
    trainer.accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0)

    def loader() -> DataLoader[Any]:
        dataset = RolloutQueueDataset(rollout_queue=trainer.rollout_queue, model_version_fn=lambda: 1,
                                      check_health_fn=lambda _: None, stale_after_s=60.0, metrics=defaultdict(list),
                                      max_staleness=1000, poll_interval_s=0.001)  # fmt: skip
        collate = DataCollatorForRollout(pad_token_id=0, num_processes=1)
        return DataLoader(FixedCountBatcher(dataset, 1, 2), batch_size=1, collate_fn=collate, num_workers=0)

    def step(model: Any, inputs: dict[str, Any], count: Any = None) -> Any:
        if fail_first and not trainer.trained:
            trainer.trained.append(None)
            raise RuntimeError("out of memory in the forward pass")
        trainer.trained.append({k: v.clone() for k, v in inputs.items() if hasattr(v, "clone")})
        return torch.tensor(0.0)

    trainer.get_train_dataloader = loader
    trainer.get_batch_samples = lambda it, n, device: ([next(it) for _ in range(n)], None)
    trainer.training_step = step
    return trainer


@pytest.mark.parametrize("where", ["ship", "forward"])
def test_trl_train_time_step_retried_after_a_failure_ships_once_and_trains(where: str) -> None:
    trainer = trl_trainer([trl_sample(0, 1, 3), trl_sample(0, 0, 4)], fail_first=where == "forward")
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))  # the version-0 sample is dropped
    trl_adapter.ship_at_train_time(trainer, monitor)
    (inputs,), _ = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, None)
    if where == "ship":
        interrupt_next_ship(monitor)
    with pytest.raises(KeyboardInterrupt if where == "ship" else RuntimeError):
        trainer.training_step(None, inputs)
    trainer.training_step(None, inputs)
    trained = trainer.trained[-1]
    assert totals(monitor)["rollouts_shipped"] == 1 and trainer.staleness_shipping.versions == [1]
    kept = (trained["staleness_lag"] >= 0).sum().item()
    assert kept == 3 and trained["global_n_tokens"].item() == 3  # the kept sample's 3 terms, no others
    assert (trained["shift_labels"] != -100).sum().item() == 3


def interrupted_once(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """A Ctrl-C landing in the next call of ``owner.name`` (after the monitor shipped), once."""
    real = getattr(owner, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(owner, name, real)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


def rolled_back(monitor: StalenessMonitor, call: Callable[[], Any]) -> None:
    """``call`` interrupted in its ship, then the monitor loads the checkpoint taken before it."""
    saved = monitor.state_dict()
    interrupt_next_ship(monitor)
    with pytest.raises(KeyboardInterrupt):
        call()
    monitor.load_state_dict(saved)


def test_a_call_interrupted_in_its_ship_then_rolled_back_to_a_checkpoint_ships_its_rows_again() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    verl_adapter.ship(monitor, verl_batch(), version=5)
    data = verl_batch((6,) * 4, uids="ccdd")
    rolled_back(monitor, lambda: verl_adapter.ship(monitor, data, version=6))
    out = verl_adapter.ship(monitor, data, version=6)  # (the restored sink has none of its rows)
    assert out is data and len(out) == 4 and totals(monitor)["rollouts_shipped"] == 8
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    old, new = areal_dict([[6, 6], [7, 7, 8]]), areal_dict([[8, 8]], token=222)
    rolled_back(monitor, lambda: areal_adapter.ship(monitor, old, version=8))
    # the old dict's rows are no earlier call's queued ones now: another dict is no other call's
    assert areal_adapter.ship(monitor, new, version=8)["loss_mask"].shape[0] == 1
    assert areal_adapter.ship(monitor, old, version=8)["loss_mask"].shape[0] == 2
    assert totals(monitor)["rollouts_shipped"] == 3


def test_a_call_interrupted_after_its_ship_and_repeated_ships_its_rows_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    data = verl_batch()
    interrupted_once(monkeypatch, verl_adapter, "new_tensor_like")  # (as it attaches staleness_lag)
    with pytest.raises(KeyboardInterrupt):
        verl_adapter.ship(monitor, data, version=6)
    out = verl_adapter.ship(monitor, data, version=6)
    assert out is data and out.batch["staleness_lag"].shape == (4, 4) and totals(monitor)["rollouts_shipped"] == 4
    batch = areal_dict([[6, 6], [7, 7, 8]])
    interrupted_once(monkeypatch, areal_adapter, "new_tensor_like")
    with pytest.raises(KeyboardInterrupt):
        areal_adapter.ship(monitor, batch, version=8)
    assert areal_adapter.ship(monitor, batch, version=8)["staleness_lag"].shape == (2, 5)
    samples = [trl_sample(0, 9), trl_sample(0, 9, 5)]
    interrupted_once(monkeypatch, trl_adapter._lags, "put")
    with pytest.raises(KeyboardInterrupt):
        trl_adapter.ship(monitor, samples, version=10)
    assert trl_adapter.ship(monitor, samples, version=10) == samples
    assert totals(monitor)["rollouts_shipped"] == 8  # 4 + 2 + 2: each once
    for sample in samples:
        assert trl_adapter.staleness_lag_of(sample.completion_mask).tolist() == [-1] * 4 + [1] * (
            len(sample.completion_mask) - 4
        )


def test_one_batch_object_refilled_each_step_ships_each_step_rows() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=4))
    buffer, samples = verl_batch(), [trl_sample(0, 5)]
    for step in range(3):
        fresh = verl_batch((step + 5,) * 4, uids="abab" if step % 2 else "aabb")
        buffer.batch, buffer.non_tensor_batch = fresh.batch, fresh.non_tensor_batch  # refilled in place
        assert len(verl_adapter.ship(monitor, buffer, version=step + 5)) == 4
        samples[0] = trl_sample(0, step + 5)
        assert trl_adapter.ship(monitor, samples, version=step + 5) == samples
    assert totals(monitor)["rollouts_shipped"] == 15


def test_trl_train_time_step_interrupted_after_its_ship_ships_once(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = trl_trainer([trl_sample(0, 1, 3), trl_sample(0, 0, 4)])
    monitor = StalenessMonitor(StalenessConfig(max_staleness=0))  # the version-0 sample is dropped
    shipping = trl_adapter.ship_at_train_time(trainer, monitor)
    (inputs,), _ = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 1, None)
    interrupted_once(monkeypatch, trl_adapter._MicroBatch, "decide")
    with pytest.raises(KeyboardInterrupt):
        trainer.training_step(None, inputs)
    trainer.training_step(None, inputs)
    assert totals(monitor)["rollouts_shipped"] == 1 and shipping.versions == [1]
    trained = trainer.trained[-1]
    assert (trained["staleness_lag"] >= 0).sum().item() == 3 and trained["global_n_tokens"].item() == 3
