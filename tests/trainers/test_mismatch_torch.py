"""SPEC 11's sums of torch tensors: CPU tensors through the compiled pass (the numpy numbers exactly), tensors
on an accelerator summed there by torch (the same counts, the float sums to float64 rounding), with no
per-token value copied to the host, and no torch import for a caller without tensors."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from staleness_metrics import FieldError, MismatchSums, mismatch_sums  # noqa: E402
from staleness_metrics.metrics import mismatch_torch  # noqa: E402
from staleness_metrics.metrics.buckets import LAG_BUCKETS, LAG_UPPER_BOUNDS  # noqa: E402
from staleness_metrics.metrics.mismatch import ARGUMENT_KINDS, COUNT_FIELDS, LOG_RATIO_CLAMP, SUM_FIELDS  # noqa: E402

CPU = torch.device("cpu")
SPECIAL_LOGPROBS = [0.0, -1e-9, -25.0, -100.0, float("nan"), float("inf"), float("-inf"), math.log(0.5), -50.0]


def on_device(
    lags: Any, sampler: Any, trainer: Any, masked: Any = None, band: tuple[float, float] = (0.5, 2.0)
) -> MismatchSums:
    """The torch computation (what a GPU runs), here on the CPU."""
    arrays = {"lags": lags, "sampler_logprobs": sampler, "trainer_logprobs": trainer, "masked": masked}
    counts, sums, uncovered = mismatch_torch.device_sums(arrays, ARGUMENT_KINDS, *band, CPU, LOG_RATIO_CLAMP)
    sums[2] = np.maximum(sums[2], 0.0)  # as mismatch_sums does with either pass's Σk3
    return MismatchSums(**dict(zip(COUNT_FIELDS, counts)), **dict(zip(SUM_FIELDS, sums)), uncovered=uncovered)


def assert_same_sums(got: MismatchSums, want: MismatchSums) -> None:
    """Counts identical; each float sum within float64 rounding of its terms (Σd and Σk3 add terms of
    either sign or with cancellation, up to e^20 each after the clamp)."""
    for name in COUNT_FIELDS:
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.uncovered == want.uncovered
    cancelling = want.tokens * math.exp(20) * 1e-14
    for name in SUM_FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        slack = cancelling if name in ("sum_log_ratio", "sum_k3") else 0.0
        assert np.all(np.abs(g - w) <= 1e-11 * np.abs(w) + slack + 1e-300), (name, g, w)


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(0, 400),
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]),
    with_flags=st.booleans(),
    band=st.sampled_from([(0.5, 2.0), (0.9, 1.1), (1.0, 1.0)]),
    run_length=st.integers(1, 40),
    specials=st.lists(st.sampled_from(SPECIAL_LOGPROBS), max_size=12),
    rows=st.sampled_from([1, 2, 4]),
)
def test_the_torch_computation_equals_the_compiled_pass(
    n: int,
    seed: int,
    dtype: Any,
    with_flags: bool,
    band: tuple[float, float],
    run_length: int,
    specials: list[float],
    rows: int,
) -> None:
    """Lags in runs (negative ones outside the population), every bucket, NaN and infinite log-probabilities
    (uncovered), differences beyond the clamp, ratios on a band edge, each dtype, ``[B, L]`` batches."""
    n -= n % rows
    rng = np.random.default_rng(seed)
    lags = np.repeat(rng.integers(-2, 120, size=n // run_length + 1), run_length)[:n]
    sampler = rng.normal(-1, 2, n)
    trainer = sampler + rng.normal(0, 0.7, n)
    for value in specials:
        if n:
            (sampler if rng.random() < 0.5 else trainer)[rng.integers(0, n)] = value
    if dtype is torch.int64:
        sampler = np.nan_to_num(np.round(sampler * 3), posinf=9, neginf=-9)
        trainer = np.nan_to_num(np.round(trainer * 3), posinf=9, neginf=-9)
    s, t = (torch.from_numpy(x).to(dtype).reshape(rows, -1) for x in (sampler, trainer))
    masked = torch.from_numpy(rng.random(n) < 0.3).reshape(rows, -1) if with_flags else None
    lag = torch.from_numpy(lags).reshape(rows, -1)
    want = mismatch_sums(lags, s.to(torch.float64).numpy(), t.to(torch.float64).numpy(),
                         None if masked is None else masked.numpy(), band=band)  # fmt: skip
    assert_same_sums(on_device(lag, s, t, masked, band), want)


def test_ratios_on_a_band_edge_fall_where_the_c_library_s_exp_puts_them() -> None:
    """Within 2**-39 of an edge the side is ``math.exp``'s, as in the compiled pass: the counts never move."""
    steps = np.arange(-40, 41)
    for edge, band in ((0.5, (0.5, 2.0)), (2.0, (0.5, 2.0)), (1.1, (0.9, 1.1))):
        d = np.array([math.log(edge) + k * 2.0**-52 for k in steps])
        lags = np.arange(len(d)) % 70
        got = on_device(torch.from_numpy(lags), torch.zeros(len(d), dtype=torch.float64), torch.from_numpy(d),
                        band=band)  # fmt: skip
        outside = np.array([not band[0] <= math.exp(x) <= band[1] for x in d.tolist()])
        want = np.bincount(np.searchsorted(LAG_UPPER_BOUNDS, lags, "left"), weights=outside, minlength=len(LAG_BUCKETS))
        assert got.out_of_band.tolist() == want.astype(np.int64).tolist()
        assert got.out_of_band.tolist() == mismatch_sums(lags, np.zeros(len(d)), d, band=band).out_of_band.tolist()


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.clone().requires_grad_(x.is_floating_point()),  # a trainer's log-probs before .detach()
        lambda x: x.to(torch.bfloat16) if x.is_floating_point() else x,  # no numpy dtype for it
        lambda x: x.reshape(4, -1).t(),  # not contiguous: read flat as numpy reads it
        lambda x: x,
    ],
)
def test_cpu_tensors_give_exactly_the_numpy_sums(make: Any) -> None:
    rng = np.random.default_rng(4)
    lags = rng.integers(-1, 80, 400)
    sampler = rng.normal(-1, 1, 400)
    trainer = sampler + rng.normal(0, 0.2, 400)
    trainer[::37] = np.nan
    masked = rng.random(400) < 0.5
    tensors = [make(torch.from_numpy(x)) for x in (lags, sampler, trainer, masked)]
    got = mismatch_sums(*tensors[:3], masked=tensors[3])
    arrays = [t.detach().to(torch.float64 if t.is_floating_point() else t.dtype).numpy().reshape(-1) for t in tensors]
    assert got == mismatch_sums(*arrays[:3], masked=arrays[3])
    assert got.uncovered > 0 and got.covered > 0


def test_finite_log_probabilities_whose_difference_overflows_are_clamped_on_a_device_too() -> None:
    """As in the compiled pass: uncovered only where a value is NaN or infinite, not where d overflows."""
    lags = torch.tensor([0, 0, 1, 2])
    sampler = torch.tensor([-1e308, 1e308, -1e308, -1e308], dtype=torch.float64)
    trainer = torch.tensor([1e308, -1e308, 1e308, math.inf], dtype=torch.float64)
    got = on_device(lags, sampler, trainer)
    assert got.covered == 3 and got.uncovered == 1 and got.sum_abs_log_ratio[0] == 40.0
    assert got == on_device(lags, torch.tensor([-1.0, 1.0, -1.0, -1.0]), torch.tensor([50.0, -50.0, 50.0, math.inf]))
    assert_same_sums(got, mismatch_sums(lags.numpy(), sampler.numpy(), trainer.numpy()))


def test_numpy_lags_with_device_tensors_are_moved_to_the_device() -> None:
    """A shipment's lags are numpy; with GPU log-probabilities they go to the GPU, not the reverse."""
    lags = np.array([0, 1, 1, 70])
    sampler, trainer = torch.tensor([-1.0, -1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.5, float("nan"), -0.5])
    got = on_device(lags, sampler, trainer, [0, 1, 0, 1])
    assert_same_sums(got, mismatch_sums(lags, sampler.numpy(), trainer.numpy(), masked=[0, 1, 0, 1]))
    assert got.tokens.tolist()[:2] == [1, 1] and got.masked[1] == got.masked[-1] == 1 and got.uncovered == 1


def test_unsigned_lags_beyond_int64_land_in_the_last_bucket() -> None:
    lags = torch.tensor([3, 2**63 + 5, 2**64 - 1], dtype=torch.uint64)
    got = on_device(lags, torch.zeros(3), torch.zeros(3))
    assert got.tokens[3] == 1 and got.tokens[-1] == 2


# ------------------------------------------------------------------------------------- nothing comes back


class Transfers(TorchDispatchMode):
    """Every aten operation that reads values on the host or copies across devices, with its input's size."""

    SYNCS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.transfers: list[tuple[str, int]] = []
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        self.ops.append(name)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        moves = name in ("aten._to_copy", "aten.copy_") and first is not None and (
            (kwargs or {}).get("device", first.device) != first.device
            or (name == "aten.copy_" and args[1].device != first.device)
        )  # fmt: skip
        if moves or name in self.SYNCS:
            self.transfers.append((name, first.numel() if first is not None else 0))
        return func(*args, **(kwargs or {}))


def test_on_a_device_the_per_token_arrays_never_leave_it() -> None:
    """On the meta device (no values at all) the whole per-token computation runs: nothing reads a value or
    copies it to the host. The call then stops where the one transfer of the packed sums would be."""
    n = 10_000
    meta = {
        "lags": torch.zeros(8, n // 8, dtype=torch.int64, device="meta"),
        "sampler_logprobs": torch.zeros(8, n // 8, dtype=torch.bfloat16, device="meta"),
        "trainer_logprobs": torch.zeros(8, n // 8, dtype=torch.float32, device="meta"),
        "masked": torch.zeros(8, n // 8, dtype=torch.bool, device="meta"),
    }
    with Transfers() as log, pytest.raises(FieldError, match="meta device") as caught:
        mismatch_sums(meta["lags"], meta["sampler_logprobs"], meta["trainer_logprobs"], masked=meta["masked"])
    assert caught.value.field == "trainer_logprobs"
    assert log.transfers == []
    assert log.ops.count("aten.index_add_") == len(mismatch_torch.PACKED_ROWS)  # every row was summed


def test_the_only_values_fetched_are_the_packed_sums_and_positions_on_a_band_edge() -> None:
    """On the CPU (where a copy would be invisible) a tensor subclass marks the per-token arrays and all
    derived from them: none is ever read by the host, except the positions on a band edge."""
    fetched: list[int] = []

    class PerToken(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = getattr(func, "__name__", "")
            if name in ("cpu", "numpy", "tolist", "item", "__array__") or (
                name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
            ):
                fetched.append(args[0].numel())
            return super().__torch_function__(func, types, args, kwargs)

    rng = np.random.default_rng(9)
    n = 50_000
    lags, trainer = rng.integers(0, 90, n), rng.normal(-1, 0.3, n)
    trainer[[5, 17]] = math.log(2.0)  # two ratios on the upper band edge (the sampler's are 0)
    tensors = [torch.from_numpy(x).as_subclass(PerToken) for x in (lags, np.zeros(n), trainer)]
    np.asarray(tensors[0][:3])  # the subclass does see a host read
    assert fetched == [3]
    fetched.clear()
    got = on_device(*tensors)
    assert fetched and all(size <= 2 for size in fetched), fetched  # the two edge positions, nothing else
    assert_same_sums(got, mismatch_sums(lags, np.zeros(n), trainer))


# ------------------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("field", "arguments"),
    [
        ("trainer_logprobs", lambda: (torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(2))),
        ("masked", lambda: (torch.zeros(3, dtype=torch.int64), torch.zeros(3), torch.zeros(3), torch.ones(4) > 0)),
        ("lags", lambda: (torch.zeros(3), torch.zeros(3), torch.zeros(3))),
        ("sampler_logprobs", lambda: (torch.zeros(3, dtype=torch.int64), torch.zeros(3) > 0, torch.zeros(3))),
        ("trainer_logprobs", lambda: (torch.zeros(1, dtype=torch.int64), torch.zeros(1), torch.zeros(1) * 1j)),
        ("masked", lambda: (torch.zeros(2, dtype=torch.int64), torch.zeros(2), torch.zeros(2), torch.zeros(2))),
        ("lags", lambda: (["a", "b"], torch.zeros(2), torch.zeros(2))),
        (
            "trainer_logprobs",
            lambda: (torch.zeros(2, dtype=torch.int64), torch.zeros(2), torch.zeros(2).to(torch.complex32)),
        ),
        ("sampler_logprobs", lambda: (torch.zeros(2, dtype=torch.int64), torch.zeros(2).to_sparse(), torch.zeros(2))),
        (
            "lags",
            lambda: (torch.quantize_per_tensor(torch.zeros(2), 1.0, 0, torch.qint8), torch.zeros(2), torch.zeros(2)),
        ),
    ],
)
@pytest.mark.parametrize("path", ["public", "device"])
@pytest.mark.filterwarnings("ignore:ComplexHalf support:UserWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_bad_arguments_raise_field_errors_naming_them(field: str, arguments: Any, path: str) -> None:
    """Lengths that differ and dtypes of the wrong kind, on the CPU path and the device path alike."""
    args = arguments()
    with pytest.raises(FieldError) as caught:
        if path == "public":
            mismatch_sums(*args[:3], masked=args[3] if len(args) > 3 else None)
        else:
            on_device(*args)
    assert caught.value.field == field and isinstance(caught.value, ValueError)
    assert str(caught.value).startswith(f"{field}: ")


@pytest.mark.parametrize("device", ["cpu", "meta"])  # (meta takes a GPU's path)
@pytest.mark.parametrize("missing", ["lags", "sampler_logprobs", "trainer_logprobs"])
def test_an_argument_given_as_none_is_named_as_missing(device: str, missing: str) -> None:
    """``batch.get("rollout_log_probs")`` of a batch without them: refused, not one uncovered position."""
    for n in (1, 4):
        arguments: dict[str, Any] = {"lags": torch.zeros(n, dtype=torch.int64, device=device)}
        arguments.update(sampler_logprobs=torch.zeros(n, device=device), trainer_logprobs=torch.zeros(n, device=device))
        arguments[missing] = None
        with pytest.raises(FieldError) as caught:
            mismatch_sums(**arguments)
        assert (caught.value.field, caught.value.reason) == (missing, "required, got None")


FLOAT8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")]


@pytest.mark.parametrize("dtype", FLOAT8)
def test_float8_cpu_tensors_are_summed_as_their_float32_values(dtype: Any) -> None:
    """numpy has no float8: the CPU tensors are widened (exactly), as bfloat16 is, and summed as the GPU does."""
    rng = np.random.default_rng(4)
    lags = torch.from_numpy(rng.integers(-1, 90, 300))
    sampler, trainer = (torch.from_numpy(rng.normal(-2.0, 1.0, 300)).to(dtype) for _ in range(2))
    got = mismatch_sums(lags, sampler, trainer)
    assert got.covered > 0 and got == mismatch_sums(lags.numpy(), sampler.float().numpy(), trainer.float().numpy())
    assert_same_sums(on_device(lags, sampler, trainer), got)


def test_a_tensor_on_another_device_is_refused_naming_it() -> None:
    with pytest.raises(FieldError) as caught:
        mismatch_sums(torch.zeros(2, dtype=torch.int64, device="meta"), torch.zeros(2), torch.zeros(2))
    assert caught.value.field == "lags" and "meta" in caught.value.reason


# ------------------------------------------------------------------------------------------------- imports


def _loaded(code: str) -> list[str]:
    code += "; import sys; print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('mismatch_torch')))"
    return ast.literal_eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)  # fmt: skip


def test_torch_is_imported_only_by_a_caller_that_holds_tensors() -> None:
    assert _loaded("import staleness_metrics, staleness_metrics.monitor") == []
    assert _loaded("from staleness_metrics import mismatch_sums; mismatch_sums([0, 1], [0.0, 0.0], [0.0, 1.0])") == []
    with_tensors = "import torch; from staleness_metrics import mismatch_sums; mismatch_sums(torch.zeros(2, dtype=torch.int64), torch.zeros(2), torch.ones(2))"  # noqa: E501
    assert _loaded(with_tensors) == ["staleness_metrics.metrics.mismatch_torch", "torch"]
