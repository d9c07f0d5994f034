"""``areal.ship``, the one call, on AReaL's shapes in numpy (the real package runs in tests/trainers): the rows it
gives back, their masks and lags equal what the sink decides for the same rollouts as SPEC 3 records."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from staleness_metrics import ConfigError, Sink, StalenessConfig, StalenessMonitor, TraceError
from staleness_metrics.adapters import areal
from tests.adapters.test_areal import areal_batches, areal_sequence, concat_padded


def groups_of(sequences: list[dict[str, list[Any]]], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """One padded dict per group (GroupedRolloutWorkflow's shape), every row told apart by its input_ids."""
    out, at = [], 0
    for size in sizes:
        part = sequences[at : at + size]
        for k, s in enumerate(part):
            s["input_ids"] = [1000 * (at + k + 1) + i for i in range(len(s["input_ids"]))]
        out.append(concat_padded(part))
        at += size
    return out


def records_of(sequences: list[dict[str, list[Any]]], sizes: list[int]) -> list[dict[str, Any]]:
    out, at = [], 0
    for g, size in enumerate(sizes):
        for k in range(at, at + size):
            s = sequences[k]
            labelled = [v for v in s["versions"] if v >= 0]
            sample = {"mask": s["loss_mask"], "token_versions": s["versions"]}
            out.append({"id": f"r{k}", "group_id": f"g{g}", "dispatch_version": min(labelled), "samples": [sample]})
        at += size
    return out


@st.composite
def grouped(draw: st.DrawFn) -> tuple[list[dict[str, list[Any]]], list[int]]:
    sequences = draw(areal_batches())
    sizes, left = [], len(sequences)
    while left:
        size = draw(st.integers(1, left))
        sizes.append(size)
        left -= size
    return sequences, sizes


@settings(max_examples=60, deadline=None)
@given(data=grouped(), bound=st.integers(0, 3), policy=st.sampled_from(["token", "episode", "group", "xtuner"]))
def test_the_rows_given_back_are_the_rows_the_sink_ships(
    data: tuple[list[dict[str, list[Any]]], list[int]], bound: int, policy: str
) -> None:
    sequences, sizes = data
    version = 9
    extra: dict[str, Any] = {"max_token_staleness": 0} if policy == "xtuner" else {}
    config = StalenessConfig(policy=policy, max_staleness=bound, **extra)
    batch = groups_of(sequences, sizes)
    given_masks = [g["loss_mask"] for g in batch]
    out = areal.ship(StalenessMonitor(config), batch, version=version)

    sink = Sink(config)
    sink.add(records_of(sequences, sizes))
    expected = {r.id: r.record() for r in sink.ship(version + 1).rollouts}
    seen = set()
    for traj in out:
        assert traj["staleness_lag"].shape == traj["loss_mask"].shape and traj["staleness_lag"].dtype == np.int64
        for ids, mask, lag in zip(traj["input_ids"], traj["loss_mask"], traj["staleness_lag"], strict=True):
            k = int(ids[0]) // 1000 - 1
            seen.add(f"r{k}")
            n = len(sequences[k]["loss_mask"])
            assert mask[:n].tolist() == expected[f"r{k}"]["samples"][0]["mask"] and not mask[n:].any()
            versions = np.array(sequences[k]["versions"])
            labels = np.where(versions >= 0, versions, min(v for v in versions if v >= 0))
            sampled = np.array(sequences[k]["loss_mask"]) != 0
            assert lag[:n].tolist() == np.where(sampled, version - labels, -1).tolist() and (lag[n:] == -1).all()
    assert seen == set(expected)
    # a group kept whole keeps AReaL's own arrays, masked in place
    for traj in out:
        if any(traj["loss_mask"] is mask for mask in given_masks):
            assert traj["loss_mask"].shape[0] == len(traj["input_ids"])


def test_a_dict_is_filtered_in_place_and_keeps_its_keys_when_every_row_goes() -> None:
    sequences = [areal_sequence(2, [1, 1], [-0.1, -0.1]), areal_sequence(2, [2], [-0.1])]
    data = concat_padded(sequences) | {"rewards": np.array([1.0, 0.0]), "rl_loss_weight": 0.5}
    out = areal.ship(StalenessMonitor(StalenessConfig(max_staleness=1)), data, version=8)
    assert out is data
    assert data["loss_mask"].shape == (0, 4) and data["rewards"].shape == (0,) and data["rl_loss_weight"] == 0.5
    assert data["staleness_lag"].shape == (0, 4)


def test_group_sizes_make_groups_of_a_padded_dict() -> None:
    sequences = [areal_sequence(1, [5, 5], [-0.1] * 2), areal_sequence(1, [1], [-0.1]), areal_sequence(1, [5], [-0.1])]
    data = concat_padded(sequences)
    config = StalenessConfig(policy="group", max_staleness=2)
    areal.ship(StalenessMonitor(config), data, version=6, group_sizes=[2, 1])
    assert data["loss_mask"].shape[0] == 1  # the first group went whole with its stale member
    with pytest.raises(ValueError, match="group_sizes"):
        areal.ship(StalenessMonitor(config), concat_padded(sequences), version=6, group_sizes=[2, 2])


def test_bad_input_names_arealss_field_and_counter() -> None:
    monitor = StalenessMonitor(StalenessConfig(max_staleness=2))
    data = concat_padded([areal_sequence(2, [-1, -1], [0.0, 0.0])])
    with pytest.raises(TraceError) as caught:
        areal.ship(monitor, [data], version=3)
    assert caught.value.field == "versions[0]"
    data = concat_padded([areal_sequence(2, [4], [0.0])])
    data["versions"] = None
    with pytest.raises(TraceError) as caught:
        areal.ship(monitor, [data], version=3)
    assert caught.value.field == "versions[0]" and "None" in caught.value.reason
    fresh_and_too_new = concat_padded([areal_sequence(2, [2], [0.0]), areal_sequence(2, [4], [0.0])])
    with pytest.raises(TraceError) as caught:
        areal.ship(monitor, [fresh_and_too_new], version=3)
    assert caught.value.field == "versions[1]" and "global_step" in caught.value.reason
    with pytest.raises(ValueError, match="global_step"):
        areal.ship(monitor, [concat_padded([areal_sequence(2, [1], [0.0])])], version=-1)


def test_a_non_contiguous_loss_mask_still_receives_the_mask() -> None:
    data = concat_padded([areal_sequence(1, [1, 5], [-0.1, -0.2]), areal_sequence(1, [5, 5], [-0.1, -0.2])])
    data["loss_mask"] = np.asfortranarray(data["loss_mask"])
    given = data["loss_mask"]
    out = areal.ship(StalenessMonitor(StalenessConfig(max_staleness=2)), [data], version=5)
    assert out[0]["loss_mask"] is given
    assert given.tolist() == [[0, 0, 1], [0, 1, 1]]


def test_retry_expired_is_refused_since_areal_re_rolls_nothing() -> None:
    config = StalenessConfig(policy="xtuner", max_staleness=2, retry_expired=True)
    with pytest.raises(ConfigError, match="retry_expired"):
        areal.ship(StalenessMonitor(config), [concat_padded([areal_sequence(2, [4], [0.0])])], version=5)
