"""PromQL built from the metric table for the dashboards and the rules; rows are looked up by name
when an expression is built, so a rename in the table shows in every generated file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..metrics import metric_table
from ..metrics.metric_table import BATCH_WIDE_COUNTERS, CURVE_LAG, MetricDef, MetricKind

Labels = tuple[str, ...]  # label names to group by, or matchers to add


def table_row(name: str) -> MetricDef:
    """The table row called ``name``, read from the table as it is now."""
    for metric in metric_table.METRICS:
        if metric.name == name:
            return metric
    raise KeyError(f"no metric called {name!r} in the metric table")


def prometheus_name(name: str) -> str:
    """The Prometheus family of the table row called ``name`` (``KeyError`` when it has none)."""
    family = table_row(name).prometheus_name
    if family is None:
        raise KeyError(f"metric {name!r} is not exported to Prometheus")
    return family


def _stem(name: str) -> str:
    family = prometheus_name(name)
    return family.removesuffix("_total") if table_row(name).kind is MetricKind.COUNTER else family


def recorded_name(level: str, names: tuple[str, ...], operations: str) -> str:
    """A recording-rule name ``level:metric:operations``: one row's family, or ``A_per_B``."""
    if len(names) == 1:
        return f"{level}:{_stem(names[0])}:{operations}"
    numerator, denominator = (_stem(n).split("_") for n in names)
    # B without the words it shares with A's start, but never all of either
    shared, most = 0, min(len(numerator), len(denominator)) - 1
    while shared < most and numerator[shared] == denominator[shared]:
        shared += 1
    return f"{level}:{'_'.join(numerator)}_per_{'_'.join(denominator[shared:])}:{operations}"


@dataclass(frozen=True)
class Scope:
    """Where queries look and how they aggregate."""

    matchers: Labels = ()  # in every selector (the dashboards' Grafana variables)
    env: str | None = None  # regex picking the env of counters and histograms (None: every env)
    by: Labels = ("run",)  # the grouping aggregations keep
    window: str = "5m"  # the range of every rate

    def selector(self, name: str, *, suffix: str = "", env: str | None = None, extra: Labels = ()) -> str:
        """``family{matchers}``; ``env`` overrides the scope's env matcher, ``extra`` adds some."""
        row = table_row(name)
        matchers = [*self.matchers, *extra]
        if "env" in row.labels:
            if env is not None:
                matchers.append(env)
            elif row.kind is MetricKind.GAUGE or row.name in BATCH_WIDE_COUNTERS:
                matchers.append('env=""')  # the overall series, not the per-env ones
            elif self.env is not None:
                matchers.append(f'env=~"{self.env}"')
        braces = f"{{{', '.join(matchers)}}}" if matchers else ""
        return f"{prometheus_name(name)}{suffix}{braces}"

    def _by(self, *extra: str) -> str:
        return f"by ({', '.join((*self.by, *extra))})"

    def gauge(self, name: str, *, per_env: bool = False, extra_by: Labels = (), extra: Labels = ()) -> str:
        """A gauge's overall (or per-env) series, kept per ``by`` and ``extra_by`` labels."""
        if not per_env:
            return f"max {self._by(*extra_by)} ({self.selector(name, extra=extra)})"
        picked = f'env=~"{self.env or ".+"}", env!=""'
        return f"max {self._by('env')} ({self.selector(name, env=picked)})"

    def shipping(self, window: str) -> str:
        """The runs whose train step moved within ``window``: those still shipping."""
        return f"max {self._by()} (changes({self.selector('train_step')}[{window}])) > 0"

    def rate(self, name: str, *, extra_by: Labels = (), extra: Labels = ()) -> str:
        """Per-second rate of a counter, summed over env (and processes) per ``by`` labels."""
        return f"sum {self._by(*extra_by)} (rate({self.selector(name, extra=extra)}[{self.window}]))"

    def ratio(self, numerator: str, denominator: str, *, extra_by: Labels = ()) -> str:
        """Ratio of two counters' rates over the window (never an average of per-step ratios)."""
        return " / ".join(self.rate(name, extra_by=extra_by) for name in (numerator, denominator))

    def quantile(self, q: float, name: str) -> str:
        """Quantile of a histogram from summed bucket rates (merges exactly across processes)."""
        buckets = f"rate({self.selector(name, suffix='_bucket')}[{self.window}])"
        return f"histogram_quantile({q}, sum {self._by('le')} ({buckets}))"

    def bucket_increase(self, name: str) -> str:
        return f"sum by (le) (increase({self.selector(name, suffix='_bucket')}[{self.window}]))"

    def _step_slope(self) -> str:
        # train_step is a gauge: deriv, never rate; max keeps one series per run.
        return f"max {self._by()} (deriv({self.selector('train_step')}[{self.window}]))"

    def steps_per_second(self) -> str:
        """How fast the train step advances, clamped at 0 (a restarted run steps back)."""
        return f"clamp_min({self._step_slope()}, 0)"

    def per_step(self, name: str) -> str:
        """A counter's increase per train step, while steps advance."""
        return f"{self.rate(name)} / ({self._step_slope()} > 0)"

    # SPEC 11 and 12: every ratio divides rates of sums (summed over processes first), so a
    # fleet-wide value is the merged run's; a bucket without tokens in the window gives no point.

    def per_lag_token(self, name: str, *, by_lag: bool = True, extra: Labels = ()) -> str:
        """Σ ``name`` / covered tokens over the window (mean k3, out-of-band share), by lag."""
        by = ("lag",) if by_lag else ()
        numerator = self.rate(name, extra_by=by, extra=extra)
        return f"{numerator} / ({self.rate('mismatch_tokens', extra_by=by, extra=extra)} > 0)"

    def excess_k3(self, *, by_lag: bool = False) -> str:
        """Mean k3 at lag >= 1 (per lag bucket or all) minus the floor, each run's over its own."""
        by = ("lag",) if by_lag else ()
        stale = ('lag!="0"',)  # lag 0 has no excess key: it is where the floor is measured
        run = self if "run" in self.by else dataclasses.replace(self, by=(*self.by, "run"))
        on = f"on ({', '.join(run.by)})"
        # SPEC 14's floor, whatever its source: a fully async run has no lag-0 token after step 1
        floor = run.gauge("mismatch_floor")
        minus = f"{on} group_left () {floor}"
        if run is self:
            return f"{self.per_lag_token('mismatch_kl', by_lag=by_lag, extra=stale)} - {minus}"
        tokens = f"({run.rate('mismatch_tokens', extra_by=by, extra=stale)} and {on} {floor})"
        above = f"{run.rate('mismatch_kl', extra_by=by, extra=stale)} - {tokens} * {minus}"
        return f"sum {self._by(*by)} ({above}) / (sum {self._by(*by)} ({tokens}) > 0)"

    def ess_by_lag(self) -> str:
        """Normalised effective sample size (Σr)² / (n Σr²) per lag bucket."""
        ratio = self.rate("mismatch_ratio", extra_by=("lag",))
        squares = self.rate("mismatch_ratio_squared", extra_by=("lag",))
        return f"{ratio} ^ 2 / ({self.rate('mismatch_tokens', extra_by=('lag',))} * {squares} > 0)"

    def sampled_length_mean(self) -> str:
        """Mean sampled length of the window's shipped and dropped samples (SPEC 12)."""
        return f"{self.rate('length_sampled_tokens')} / ({self.rate('length_samples')} > 0)"

    def trained_length_mean(self) -> str:
        """The same with masked positions and dropped samples counted as 0: what trains."""
        kept = f"{self.rate('length_sampled_tokens')} - {self.rate('length_removed_tokens')}"
        return f"({kept}) / ({self.rate('length_samples')} > 0)"

    def curve_at_suggested(self) -> str:
        """The curve at the suggested bound: a term per lag (PromQL reads no label from a value)."""
        suggested, on = self.gauge("bound_suggested"), ", ".join(self.by)
        terms = []
        for lag in CURVE_LAG.values:
            at_lag = self.gauge("mismatch_curve", extra=(f'lag="{lag}"',))
            terms.append(f"({at_lag} and on ({on}) {suggested} == {lag})")
        return " or ".join(terms)

    def removed_share_by_length(self) -> str:
        """Share of sampled positions masked or dropped, per sample length bucket."""
        by = ("length",)
        removed = self.rate("length_removed_tokens", extra_by=by)
        return f"{removed} / ({self.rate('length_sampled_tokens', extra_by=by)} > 0)"
