"""``staleness_metrics.distributed.all_reduce`` on a real torch.distributed group: two CPU processes with
gloo, each summing its share of the tokens, reduce to what one process computes over all of them."""

from __future__ import annotations

import json
from datetime import timedelta
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


def _init(rank: int, store: str, backend: str | None = "gloo") -> None:
    """Join the group (no backend argument: torch's default); a collective left waiting fails in a minute."""
    chosen = {} if backend is None else {"backend": backend}
    dist.init_process_group(**chosen, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # fmt: skip


def _rank(rank: int, store: str, out: str, seed: int, n: int, options: dict[str, Any]) -> None:
    """One process of the group: its share as CPU tensors (a trainer's layout), its own sums, the reduction
    (``options``: counts ``extra`` per rank, rank 1's ``tamper``ed buckets)."""
    _init(rank, store)
    try:
        share = shares(tokens(seed, n))[rank]
        own = mismatch_sums(
            torch.from_numpy(share["lags"]), torch.from_numpy(share["sampler"]).float(),
            torch.from_numpy(share["trainer"]).float(), masked=torch.from_numpy(share["masked"]),
        )  # fmt: skip
        own.tokens[1] += options.get("extra", (0,) * WORLD)[rank]  # (counts a long run could hold)
        if options.get("tamper") and rank == 1:  # a rank whose lag buckets differ (another library version)
            import staleness_metrics.distributed as module

            if options["tamper"] == "fingerprint":
                module._FINGERPRINT += 1.0
            else:  # one more bucket (its fingerprint unchanged): a longer packed tensor
                module.N_BUCKETS += 1
                longer = {name: np.append(getattr(own, name), 0) for name in (*COUNT_FIELDS, *SUM_FIELDS)}
                own = MismatchSums(**longer, uncovered=own.uncovered)
        try:
            total = all_reduce(own)
            result: dict[str, Any] = {"own": own.to_dict(), "total": total.to_dict()}
        except FieldError as error:
            result = {"error": error.field, "reason": error.reason}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# The envs each rank saw in one step, with their tokens (rank 1 saw no "code", rank 0 no "tool")
ENV_TOKENS = ({"math": 300, "code": 120}, {"math": 200, "tool": 50})


def _env_rank(rank: int, store: str, out: str, seed: int, n: int, options: dict[str, Any]) -> None:
    """Per-env sums reduced as docs/multi-gpu.md does it: the group's envs gathered, in sorted order, zero
    sums for an env this rank did not see; then one call whose env differs between the ranks. The group is
    made without a backend argument (torch's default: ``get_backend()`` "undefined", a CPU reduction)."""
    _init(rank, store, backend=None)
    try:
        batch, mine, start = tokens(seed + rank, n), {}, 0
        for env, count in ENV_TOKENS[rank].items():
            part = {k: torch.from_numpy(v[start : start + count]) for k, v in batch.items()}
            mine[env] = mismatch_sums(part["lags"], part["sampler"], part["trainer"], masked=part["masked"])
            start += count
        seen: list[Any] = [None] * WORLD
        dist.all_gather_object(seen, sorted(mine))
        totals = {env: all_reduce(mine.get(env, MismatchSums.zero()), env=env) for env in sorted(set().union(*seen))}
        result: dict[str, Any] = {"own": {env: sums.to_dict() for env, sums in mine.items()}}
        result["total"] = {env: sums.to_dict() for env, sums in totals.items()}
        try:
            all_reduce(mine["math"], env=("math", "code")[rank])
        except FieldError as error:
            result["error"] = {"field": error.field, "reason": error.reason}
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_group(tmp_path: Path, seed: int, n: int, *, process: Any = _rank, **options: Any) -> list[dict[str, Any]]:
    tmp_path.mkdir(exist_ok=True)
    args = (str(tmp_path / "store"), str(tmp_path), seed, n, options)
    mp.spawn(process, args=args, nprocs=WORLD, join=True)
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


@pytest.mark.parametrize("tamper", ["fingerprint", "bucket count"])
def test_ranks_with_different_lag_buckets_are_refused_on_every_rank(tmp_path: Path, tamper: str) -> None:
    """Refused before any rank sends its sums: a rank with more buckets sends more values (gloo aborted)."""
    results = run_group(tmp_path, 3, 500, tamper=tamper)
    assert [r["error"] for r in results] == ["sums", "sums"]
    assert all("lag buckets differ" in r["reason"] for r in results)


def test_per_env_sums_reduce_env_by_env_and_ranks_on_different_envs_are_refused(tmp_path: Path) -> None:
    """Each env's total is its own ranks' sums (a rank that did not see it adds zero); a call where one rank
    reduces "math" and the other "code" raises on both, where the sums were added under one name."""
    results = run_group(tmp_path, 11, 500, process=_env_rank)
    assert results[0]["total"] == results[1]["total"] and sorted(results[0]["total"]) == ["code", "math", "tool"]
    for env, total in results[0]["total"].items():
        parts = [MismatchSums.from_dict(r["own"][env]) for r in results if env in r["own"]]
        assert MismatchSums.from_dict(total) == sum(parts, MismatchSums.zero()) and parts[0].covered > 0, env
    assert [r["error"]["field"] for r in results] == ["env", "env"]
    assert "'math' here" in results[0]["error"]["reason"] and "'code' here" in results[1]["error"]["reason"]


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
    with pytest.raises(FieldError, match=r"^env: expected an env name"):
        all_reduce(zero, env=("math",))  # type: ignore[arg-type]
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
