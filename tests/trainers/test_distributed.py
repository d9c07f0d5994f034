"""``staleness_metrics.distributed.all_reduce`` on a real torch.distributed group: two CPU processes with
gloo, each summing its share of the tokens, reduce to what one process computes over all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

from staleness_metrics import ConfigError, FieldError, MismatchSums, mismatch_sums  # noqa: E402
from staleness_metrics.distributed import _device_for, all_reduce  # noqa: E402
from staleness_metrics.metrics.mismatch import COUNT_FIELDS, SUM_FIELDS  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")

WORLD = 2


def tokens(seed: int, n: int) -> dict[str, Any]:
    """A batch of ``n`` positions in samples of one lag each (lags 0..90: every bucket kind, some negative),
    NaN trainer log-probabilities (uncovered), clamped differences and masked positions."""
    rng = np.random.default_rng(seed)
    lags = np.repeat(rng.integers(-1, 90, n // 25 + 1), 25)[:n]
    sampler = rng.normal(-1.0, 1.0, n)
    trainer = sampler + rng.normal(0.0, 0.05, n) * (1 + np.maximum(lags, 0) / 4)
    trainer[rng.random(n) < 0.05] = np.nan
    trainer[rng.integers(0, n, 3)] = -60.0
    return {"lags": lags, "sampler": sampler, "trainer": trainer, "masked": rng.random(n) < 0.3}


def shares(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """The batch cut between the two ranks at an uneven point, as a data-parallel sampler would."""
    cut = len(batch["lags"]) * 3 // 7
    return [{k: v[:cut] for k, v in batch.items()}, {k: v[cut:] for k, v in batch.items()}]


def _rank(rank: int, store: str, out: str, seed: int, n: int, tamper: bool, extra: tuple[int, ...]) -> None:
    """One process of the group: its share as CPU tensors (a trainer's layout), its own sums, the reduction."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        share = shares(tokens(seed, n))[rank]
        own = mismatch_sums(
            torch.from_numpy(share["lags"]), torch.from_numpy(share["sampler"]).float(),
            torch.from_numpy(share["trainer"]).float(), masked=torch.from_numpy(share["masked"]),
        )  # fmt: skip
        own.tokens[1] += extra[rank]  # (counts a long run could hold)
        if tamper and rank == 1:  # a rank whose lag buckets differ (another library version)
            import staleness_metrics.distributed as module

            module._FINGERPRINT += 1.0
        try:
            total = all_reduce(own)
            result: dict[str, Any] = {"own": own.to_dict(), "total": total.to_dict()}
        except FieldError as error:
            result = {"error": error.field, "reason": error.reason}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_group(
    tmp_path: Path, seed: int, n: int, *, tamper: bool = False, extra: tuple[int, ...] = (0,) * WORLD
) -> list[dict[str, Any]]:
    tmp_path.mkdir(exist_ok=True)
    args = (str(tmp_path / "store"), str(tmp_path), seed, n, tamper, extra)
    mp.spawn(_rank, args=args, nprocs=WORLD, join=True)
    return [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]


def whole_sums(seed: int, n: int) -> MismatchSums:
    batch = tokens(seed, n)
    as_float32 = {k: batch[k].astype(np.float32) for k in ("sampler", "trainer")}
    return mismatch_sums(batch["lags"], as_float32["sampler"], as_float32["trainer"], masked=batch["masked"])


def test_two_gloo_processes_reduce_to_the_sums_of_one_process_over_all_tokens(tmp_path: Path) -> None:
    seed, n = 7, 20_000
    results = run_group(tmp_path, seed, n)
    totals = [MismatchSums.from_dict(r["total"]) for r in results]
    owns = [MismatchSums.from_dict(r["own"]) for r in results]
    assert totals[0] == totals[1]  # every rank holds the same total, bit for bit
    total, whole = totals[0], whole_sums(seed, n)
    assert total.covered > 0 and total.uncovered > 0 and total.masked.sum() > 0 and total.out_of_band.sum() > 0
    assert total.tokens[0] > 0 and total.tokens[-1] > 0  # lag 0 and the > 64 bucket both present
    for name in COUNT_FIELDS:  # counts: exactly the single process's
        assert getattr(total, name).tolist() == getattr(whole, name).tolist(), name
    assert total.uncovered == whole.uncovered
    # the collective is the one addition of the two ranks' sums: nothing else is rounded
    assert total == owns[0] + owns[1]
    # and the single pass over all tokens adds the same terms in another order: equal to float64 rounding
    for name in SUM_FIELDS:
        np.testing.assert_allclose(getattr(total, name), getattr(whole, name), rtol=1e-12, atol=1e-9)
    assert total.metrics()["staleness/mismatch/k3"] == pytest.approx(whole.metrics()["staleness/mismatch/k3"])


def test_ranks_with_different_lag_buckets_are_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_group(tmp_path, 3, 500, tamper=True)
    assert [r["error"] for r in results] == ["sums", "sums"]
    assert all("lag buckets differ" in r["reason"] for r in results)


def test_counts_are_refused_on_every_rank_only_when_the_groups_total_is_past_float64(tmp_path: Path) -> None:
    """One rank's large count whose group total stays exact is reduced; a total past 2**53 is refused on
    every rank (a check on one rank's own counts refused the first case there, the other rank waiting)."""
    exact = run_group(tmp_path / "exact", 3, 500, extra=(2**52, 0))
    assert exact[0]["total"] == exact[1]["total"] and "error" not in exact[0]
    assert MismatchSums.from_dict(exact[0]["total"]).tokens[1] >= 2**52
    past = run_group(tmp_path / "past", 3, 500, extra=(2**52, 2**52))
    assert [r["error"] for r in past] == ["sums", "sums"]
    assert all("float64 sums inexactly" in r["reason"] for r in past)


def test_bad_arguments_and_an_uninitialised_group_raise_the_project_errors() -> None:
    with pytest.raises(FieldError) as caught:
        all_reduce({"format": 1})  # type: ignore[arg-type]
    assert caught.value.field == "sums" and "MismatchSums" in caught.value.reason
    zero = MismatchSums.zero()
    on_device = MismatchSums(**{**vars(zero), "sum_k3": torch.zeros(len(zero.sum_k3), dtype=torch.float64)})
    with pytest.raises(FieldError) as caught:
        all_reduce(on_device)  # a tensor where the sums hold numpy arrays: named before any collective
    assert caught.value.field == "sums.sum_k3" and "Tensor" in caught.value.reason
    with pytest.raises(FieldError, match=r"sums\.tokens"):
        all_reduce(MismatchSums(**{**vars(zero), "tokens": zero.tokens[:5]}))
    assert not dist.is_initialized()  # the group lives in the spawned processes only
    with pytest.raises(ConfigError, match="init_process_group"):
        all_reduce(MismatchSums.zero())


@pytest.mark.parametrize(
    ("backend", "device"), [("gloo", "cpu"), ("GLOO", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("mpi", "cpu")]
)
def test_the_packed_tensor_goes_where_the_backend_reduces(backend: str, device: str) -> None:
    assert _device_for(backend) == torch.device(device)


def test_nccl_reduces_on_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert _device_for("nccl") == torch.device("cuda", 3)
