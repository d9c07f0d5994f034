"""The shared call on torch tensors: a tensor the sink cannot view flat gets the masked values copied in,
keeping its dtype and device; ``staleness_lag`` is a tensor on the reference's device."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from staleness_metrics import StalenessConfig, StalenessMonitor  # noqa: E402
from staleness_metrics.adapters._ship import TrainerArray, TrainerNames, new_tensor_like, ship_rows  # noqa: E402
from staleness_metrics.records.columnar import RolloutBatch  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_a_transposed_tensor_is_masked_through_a_copy(dtype: object) -> None:
    owned = torch.ones((3, 2), dtype=dtype).t()  # [2, 3], not contiguous: numpy sees a strided view
    view = TrainerArray(owned)
    versions = np.array([[0, 2, 2], [2, 2, 2]])
    batch = RolloutBatch.from_padded(["a", "b"], view.array, token_versions=versions, attention_mask=np.ones((2, 3)))
    result = ship_rows(
        StalenessMonitor(StalenessConfig(max_staleness=0)), [(batch, owned, lambda: view.write_back(batch.mask))],
        version=2, names=TrainerNames("demo", "version"),
    )  # fmt: skip
    assert owned.dtype == dtype and owned.to(torch.int64).tolist() == [[0, 1, 1], [1, 1, 1]]
    (part,) = result.parts
    lag = new_tensor_like(owned, part.lag_matrix())
    assert lag.dtype == torch.int64 and lag.device == owned.device and lag.tolist() == [[2, 0, 0], [0, 0, 0]]


def test_a_tensor_that_needs_grad_is_read_through_a_copy_and_written_back() -> None:
    owned = torch.ones((1, 3), requires_grad=True)
    view = TrainerArray(owned)
    assert not view.shared
    batch = RolloutBatch.from_padded(["a"], view.array, token_versions=np.array([[0, 1, 1]]))
    ship_rows(
        StalenessMonitor(StalenessConfig(max_staleness=0)), [(batch, owned, lambda: view.write_back(batch.mask))],
        version=1, names=TrainerNames("demo", "version"),
    )  # fmt: skip
    assert owned.detach().tolist() == [[0.0, 1.0, 1.0]] and owned.requires_grad
