"""The train sink of an async orchestrator (SPEC 4): rollouts enter with :meth:`Sink.add`, are
judged at :meth:`Sink.sweep` and :meth:`Sink.ship`, and leave shipped, dropped or set aside."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..config import StalenessConfig
from ..errors import FieldError, FieldTypeError, TraceError
from ..metrics.bound import BoundTracker, ShipBound, env_tracker_config
from ..metrics.compute import PopulationColumns, ShippedSlice, WindowCounts, compute_report
from ..metrics.mismatch import MismatchSums
from ..metrics.report import Tally
from ..records.columnar import LABELS_SPANS, RolloutBatch
from ..records.model import ParsedRollout, Rollout, UnparsedRollout, pack, parse_or_error
from ..records.validation import Verdicts, plainly_valid
from .cuts import SpanTable
from .decision import Decision, Judgement
from .judging import apply_decision, judgement_again, judgement_of, with_groups
from .policies import Policy, policy_for
from .queue import COMPACT_MIN_ROWS, QUEUED, SHIPPED, STAGE_MAX_POSITIONS, RolloutQueue
from .segments import IntArray, distinct, expand_ranges, segment_any
from .shipment import Shipment, ShippedRollout, ShippedSpans
from .spans import checked_spans

if TYPE_CHECKING:
    from .checkpoint import SinkState


MAX_STEP = 2**53
StepNumber = int | np.integer[Any]  # a train step: numpy's integers too (``np.uint64`` included)


def checked_step(step: StepNumber) -> int:
    """A train step checked, as an int (numpy's unsigned ones wrap in arithmetic)."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer) or not 1 <= step <= MAX_STEP:
        raise FieldError("step", f"must be an integer in 1..{MAX_STEP}, got {step!r}")
    return int(step)


class Sink:
    """Queue of finished rollouts, judged by one policy (SPEC 4 and 5)."""

    def __init__(
        self,
        config: StalenessConfig | None = None,
        *,
        policy: Policy | None = None,
        compact_min_rows: int = COMPACT_MIN_ROWS,
        env_reports: bool = True,
    ) -> None:
        """``env_reports=False``: a ship's report covers the whole batch only (no per-env keys)."""
        self.config = config or StalenessConfig()
        self.compact_min_rows = compact_min_rows
        self.env_reports = env_reports
        self.policy = policy or policy_for(self.config)
        self.queue = RolloutQueue(self.policy.observe_added)
        self._step = 0
        self._window = WindowCounts()
        self._invalid: list[TraceError] = []
        self.totals = Tally()
        self.bound_tracker = BoundTracker(self.config)  # SPEC 14
        self.env_trackers: dict[str, BoundTracker] = {}
        self._bound_moved_at = 0  # the step an adaptive bound last moved at (0: never)

    def state_dict(self) -> dict[str, Any]:
        """The sink's state as plain JSON-serialisable data (SPEC 13); the sink does not change."""
        from .checkpoint import SinkState, save_sink

        self._build_staged()  # (first: it tells the policy of the staged adds)
        policy = self.policy.checkpoint_state(self.queue.named_groups())
        parts = SinkState(self._step, self.queue, self._window, tuple(self._invalid), self.totals, policy,
                          self.bound_tracker, self.env_trackers, self._bound_moved_at)  # fmt: skip
        return save_sink(self.config, parts)

    def check_state_dict(self, state: Any, path: str = "") -> SinkState:
        """``state`` checked and built as new objects for :meth:`load_checked` (``ConfigError``
        naming the key path of a fault); the sink does not change."""
        from .checkpoint import read_sink

        return read_sink(state, path, config=self.config, policy=self.policy)

    def load_checked(self, checked: SinkState) -> None:
        """Continue from a state :meth:`check_state_dict` accepted."""
        self.policy.load_state_dict(checked.policy_state)
        self.queue = checked.queue
        self._step = checked.step
        self._window = checked.window
        self._invalid = list(checked.invalid)
        self.totals = checked.totals
        self.bound_tracker = checked.bound_tracker
        self.env_trackers = dict(checked.env_trackers)
        self._bound_moved_at = checked.bound_moved_at
        self.sync_bound()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`, all or nothing: a state that fails a check (or was
        taken under another policy or bound) raises ``ConfigError`` naming the key path."""
        self._build_staged()  # (so that a refused state leaves the sink as it was)
        self.load_checked(self.check_state_dict(state))

    @property
    def queued(self) -> int:
        """How many rollouts wait in the queue."""
        return self.queue.queued

    @property
    def tracked_rollouts(self) -> int:
        """Rollout rows held in memory: the queue plus those resolved since the last compaction."""
        return self.queue.tracked_rollouts

    @property
    def tokens_queued(self) -> int:
        """Sampled positions of live rollouts still queued (samples not dropped)."""
        return self.queue.tokens_queued

    @property
    def tokens_entered(self) -> int:
        """Sampled positions of live rollouts accepted so far (set aside at ship: taken out)."""
        return self.queue.tokens_entered

    @property
    def step(self) -> int:
        """The latest step a sweep or ship used (0 before any)."""
        return self._step

    @property
    def invalid(self) -> tuple[TraceError, ...]:
        """Errors of the rollouts set aside in lenient mode, oldest first."""
        return tuple(self._invalid)

    def add(self, rollouts: RolloutBatch | Rollout | Mapping[str, Any] | Iterable[Any]) -> int:
        """Queue finished rollouts: records (dicts or :class:`Rollout`), an iterable of them, a
        :class:`RolloutBatch` (its arrays the sink then owns and masks in place) or a list of them,
        all or nothing: strict mode raises :class:`TraceError` for the first invalid rollout and
        adds nothing; lenient mode sets invalid ones aside (counted). Returns how many it queued."""
        if isinstance(rollouts, RolloutBatch):
            return self._add_batch(rollouts)
        if not isinstance(rollouts, Iterable | Mapping | Rollout):
            raise FieldTypeError("rollouts", f"expected records or batches, got {rollouts!r}")
        records = [rollouts] if isinstance(rollouts, (Mapping, Rollout)) else list(rollouts)
        if records and all(isinstance(batch, RolloutBatch) for batch in records):
            return self._add_batches(records)
        items = [parse_or_error(r.to_record() if isinstance(r, Rollout) else r) for r in records]
        parsed_here = [item for item in items if isinstance(item, ParsedRollout)]
        return self.add_parsed(items, pack(parsed_here, adopt=True) if parsed_here else None)

    def add_parsed(
        self,
        items: Sequence[ParsedRollout | UnparsedRollout],
        packed: RolloutBatch | None = None,
        checked: tuple[Verdicts, SpanTable] | None = None,
        part: tuple[int, int] | None = None,
    ) -> int:
        """:meth:`add` of records :func:`~staleness_metrics.records.model.parse_or_error` read;
        ``packed``: the parsed ones packed, ``checked``: its verdicts and spans, ``part``: the
        rollouts of ``packed`` that are these records (replay's windows; None: all of them)."""
        parsed: list[ParsedRollout] = []
        unparsed: list[tuple[int, UnparsedRollout]] = []  # (each after how many parsed ones)
        for item in items:
            if isinstance(item, UnparsedRollout):
                unparsed.append((len(parsed), item))
            else:
                parsed.append(item)
        if not parsed:
            self._refuse([(item.error, item.env) for _, item in unparsed])
            return 0
        return self._add_batch(pack(parsed) if packed is None else packed, checked, part, unparsed)

    def _add_batches(self, batches: list[Any]) -> int:
        """Several batches, all or nothing: each checked first, the valid ids of those before it
        standing in the queue's seen ids meanwhile (a repeat is a duplicate, as if added)."""
        self._build_staged()
        seen, earlier, checked = self.queue.seen_ids, set(), []
        try:
            for batch in batches:
                verdicts, spans = checked_spans(batch, seen)
                if verdicts.errors and self.config.strict:
                    raise verdicts.errors[min(verdicts.errors)]
                checked.append((verdicts, spans))
                valid = {rid for i, rid in enumerate(batch.ids) if i not in verdicts.errors}
                seen |= valid
                earlier |= valid
        finally:
            seen -= earlier
        return sum(self._add_batch(b, found) for b, found in zip(batches, checked, strict=True))

    def _build_staged(self) -> None:
        """The staged rows built; one changed by its caller since the add set aside (or raised)."""
        self.queue.build_staged()
        refused, self.queue.refused = self.queue.refused, []
        self._refuse([(error, env or None) for error, env in refused])

    def _refuse(self, errors: Sequence[tuple[TraceError, str | None]]) -> None:
        """Strict mode raises the first error; lenient mode sets each aside (counted per env)."""
        if errors and self.config.strict:
            raise errors[0][0]
        for error, env in errors:
            self._invalid.append(error)
            self._window.add(np.array([self.queue.env(env)]), "rollouts_invalid")

    def _add_batch(
        self,
        batch: RolloutBatch,
        checked: tuple[Verdicts, SpanTable] | None = None,
        part: tuple[int, int] | None = None,
        unparsed: Sequence[tuple[int, UnparsedRollout]] = (),
    ) -> int:
        small = checked is None and not unparsed and batch.n_positions <= STAGE_MAX_POSITIONS
        if small and plainly_valid(batch, self.queue.seen_ids, positions=False):
            staged = self.queue.stage(batch)  # (it reads the positions)
            if staged is not None:
                return staged
        self._build_staged()
        verdicts, spans = checked if checked is not None else checked_spans(batch, self.queue.seen_ids)
        if verdicts.errors or unparsed:  # refused in record order (SPEC 3)
            refused = [(i - 0.5, item.error, item.env) for i, item in unparsed]  # (before the next)
            for i, error in verdicts.errors.items():
                env = batch.envs[i] if batch.envs is not None else None
                refused.append((i, error, env if isinstance(env, str) and env else None))
            self._refuse([(error, env) for _, error, env in sorted(refused, key=lambda r: r[0])])
            assert part is None, "a window is cut at once only when every rollout passes"
        kept_ids = np.flatnonzero(~verdicts.invalid).tolist() if verdicts.errors else None  # (all)
        if kept_ids == [] or batch.n_rollouts == 0:  # (nothing to queue: as add([]))
            return 0
        if part is not None:
            self.queue.add_part(batch, spans, part)
            return part[1] - part[0]
        self.queue.add_checked(batch, spans, kept_ids)
        return batch.n_rollouts if kept_ids is None else len(kept_ids)

    def next_step(self, step: StepNumber) -> int:
        """``step`` checked as the next sweep's or ship's, as an int; the sink does not change."""
        if (step := checked_step(step)) < self._step:
            raise FieldError("step", f"{step} is below the previous step {self._step}: steps never decrease")
        return step

    def _judge(self, rows: IntArray, step: int) -> tuple[Judgement, Decision]:
        judgement = judgement_of(self.queue, rows, step)
        decision = self.policy.decide(judgement)
        apply_decision(self.queue, self._window, judgement, decision)
        self.queue.rollouts.judged[rows] = step
        return judgement, decision

    def observe_mismatch(
        self, step: int, total: MismatchSums, *, merge: bool = False, bound: int | None = None
    ) -> ShipBound | None:
        """Give SPEC 14's tracker a ship's SPEC 11 sums (``merge``: the trainer's running total of a
        step; ``bound``: the one the ship used); returns the ship's floor, curve and advice."""
        found = self.bound_tracker.observe(step, total, merge=merge, bound=bound)
        if self.bound_tracker.bound != self.policy.max_staleness:  # moved: from the next judging on
            self._bound_moved_at = self._step
        self.sync_bound()
        return found

    def observe_env_mismatch(
        self, step: int, env: str, total: MismatchSums, *, merge: bool = False, bound: int | None = None
    ) -> ShipBound | None:
        """The same per env: its own floor, window and advice (only the batch's bound adapts)."""
        tracker = self.env_trackers.get(env)
        if tracker is None:
            tracker = self.env_trackers[env] = BoundTracker(env_tracker_config(self.config))
        return tracker.observe(step, total, merge=merge, bound=self.bound_tracker.bound if bound is None else bound)

    def sync_bound(self) -> None:
        """Let the policy judge with the tracker's (adaptive) bound."""
        if self.bound_tracker.adaptive:
            self.policy.max_staleness = self.bound_tracker.bound

    def sweep(self, step: StepNumber) -> None:
        """Judge every queued rollout not yet judged at ``step``; drops leave the queue now."""
        self._build_staged()
        step = self._step = self.next_step(step)
        self._sweep(step, self.queue.queued_rows())

    def _sweep(self, step: int, queued: IntArray) -> Judgement | None:
        rows = queued[self.queue.rollouts.judged[queued] < step]
        if len(rows) == 0:
            return None
        return self._judge(with_groups(self.queue, rows, self.policy.judges_groups), step)[0]

    def ship(self, step: StepNumber, ids: Iterable[str] | None = None) -> Shipment:
        """Sweep at ``step``, then ship the named queued rollouts (all for ``ids=None``). A version
        above the trained one raises :class:`TraceError` (strict) or is set aside (lenient)."""
        names: list[Any] = [*ids] if isinstance(ids, Iterable) and not isinstance(ids, str) else [None]
        if ids is not None and not all(isinstance(name, str) for name in names):  # (before changes)
            raise FieldTypeError("ids", f"must be rollout id strings (not one string), got {ids!r}")
        self._build_staged()
        step = self._step = self.next_step(step)
        queue, r = self.queue, self.queue.rollouts
        queued = queue.queued_rows()
        taken = queued if ids is None else queue.rows_named(names)
        before = queue.queued
        judged = self._sweep(step, queued)
        if queue.queued != before:  # the sweep dropped some
            taken = taken[r.status[taken] == QUEUED]
        taken = self._check_versions(taken, step)
        # A ship judges what it takes (SPEC 4); again only where that decides something: holds, or
        # rollouts judged at this step before the adaptive bound moved
        if len(taken) and (self.policy.holds or self._bound_moved_at == step):
            judged, decision = self._judge(with_groups(queue, taken, self.policy.judges_groups), step)
            taken = taken[r.status[taken] == QUEUED]
            hold = np.isin(taken, judged.rows[decision.hold_rollout])
            held, shipped = taken[hold], taken[~hold]
        else:
            held, shipped = taken[:0], taken
        # Interrupted (Ctrl-C too) before the totals' store, a ship undoes what it changed: it did
        # not happen (its sweep and judging did: a valid state)
        window, n_held = self._window, len(self._window.held)
        counts = {env: dict(found) for env, found in window.counts.items()}
        trackers = self.bound_tracker, self.env_trackers
        bounds = self._bound_moved_at, self.policy.max_staleness
        queue_was = queue.queued, list(queue.chunk_open), list(queue.closing)
        try:
            window.add(r.env[held], "rollouts_held")
            window.held.extend(queue.ids[i] for i in held)
            shipped_slice = judgement_again(queue, judged, shipped, step)
            spans = ShippedSpans(queue, shipped_slice)
            band, judged_with = self.config.mismatch_band, self.bound_tracker.bound
            mismatch = spans.mismatch(band) if spans.carries_trainer_logprobs() else None
            env_costs: dict[str, tuple[MismatchSums, ShipBound | None]] = {}
            if mismatch is not None:  # SPEC 14's trackers change: copies, kept if the ship is
                self.bound_tracker, self.env_trackers = copy.copy(trackers[0]), dict(trackers[1])
            if mismatch is not None and self.config.env_breakdown:
                for env in distinct(spans.rows.env[spans.rows.lag >= 0]):
                    if name := queue.env_names[env]:
                        if (tracker := self.env_trackers.get(name)) is not None:
                            self.env_trackers[name] = copy.copy(tracker)
                        sums = spans.mismatch(band, env)
                        env_bound = self.observe_env_mismatch(step, name, sums, bound=judged_with)
                        env_costs[name] = sums, env_bound
            bound = None if mismatch is None else self.observe_mismatch(step, mismatch)
            columns = PopulationColumns(*(getattr(shipped_slice, f) for f in PopulationColumns._fields))
            report = compute_report(
                ShippedSlice(step, shipped_slice.env, columns), window, judged_with,
                queue.env_names, self.config.env_breakdown, mismatch, bound, env_costs,
                per_env=self.env_reports,
            )  # fmt: skip
            shipment = Shipment(
                step=step, report=report, dropped_rollouts=tuple(window.dropped_rollouts),
                dropped_samples=tuple(window.dropped_samples), held=tuple(window.held),
                invalid=tuple(self._invalid), _spans=spans,
                _build_rollouts=self._shipped_rollouts(shipped_slice, spans),
            )  # fmt: skip
            totals, fresh = self.totals + report.tally, WindowCounts()
            queue.leave(shipped, SHIPPED)
        except BaseException:
            window.counts, window.held[n_held:], r.status[shipped] = counts, [], QUEUED
            queue.queued, queue.chunk_open, queue.closing = queue_was
            self.bound_tracker, self.env_trackers = trackers
            self._bound_moved_at, self.policy.max_staleness = bounds
            raise
        self.totals, self._window, self._invalid = totals, fresh, []  # (stores only: one point)
        queue.release_chunks()
        if queue.tracked_rollouts > max(self.compact_min_rows, 2 * queue.queued):
            queue.compact()
        return shipment

    def _shipped_rollouts(self, shipped: Judgement, spans: ShippedSpans) -> Callable[[], tuple[ShippedRollout, ...]]:
        """Capture what the shipped rollouts are now; build the objects when asked (the ids and the
        columns read are only ever appended to: a compaction makes new ones)."""
        rows, ids, local, index = shipped.rows, self.queue.ids, self.queue.samples.local, self.queue.rollouts.index

        def build() -> tuple[ShippedRollout, ...]:
            kept = ~shipped.dropped
            owner, kept_local = shipped.sample_rollout[kept], local[shipped.sample_rows[kept]]
            bounds = np.searchsorted(owner, np.arange(len(rows) + 1))
            batches = dict(zip(spans.used, spans.batches))
            out = []
            for i, (row, c, k) in enumerate(zip(rows.tolist(), spans.chunks.tolist(), index[rows].tolist())):
                samples = tuple(kept_local[bounds[i] : bounds[i + 1]].tolist())
                out.append(ShippedRollout(ids[row], batches[c], k, samples))
            return tuple(out)

        return build

    def _check_versions(self, rows: IntArray, step: int) -> IntArray:
        """Ship-time rule, no version above the trained one: the rows that pass."""
        r, s = self.queue.rollouts, self.queue.samples
        samples = expand_ranges(r.sample_lo[rows], r.sample_hi[rows])
        bad, errors = versions_above(
            lambda i: self.queue.ids[int(rows[i])], r.dispatch[rows], r.sample_hi[rows] - r.sample_lo[rows],
            s.max_label[samples], s.label_kind[samples], step - 1,
        )  # fmt: skip
        if not errors:
            return rows
        bad_rows = rows[bad]
        envs = [self.queue.env_names[int(env)] or None for env in r.env[bad_rows]]
        self._refuse(list(zip(errors, envs, strict=True)))
        self.queue.set_aside(bad_rows)
        return rows[~bad]


def versions_above(
    id_of: Callable[[int], str],
    dispatch: IntArray,
    sample_counts: IntArray,
    max_label: IntArray,
    label_kind: npt.NDArray[np.int8],
    trained: int,
) -> tuple[npt.NDArray[np.bool_], list[TraceError]]:
    """SPEC 3's ship-time rule, no version above the trained one (frozen rollouts too): per rollout
    whether it breaks it, and each offender's error (its dispatch version, else its first sample's)."""
    bad_dispatch, bad_sample = dispatch > trained, max_label > trained
    if not (bad_dispatch.any() or bad_sample.any()):  # (the usual case: nothing to name)
        return bad_dispatch, []
    offsets = np.concatenate(([0], np.cumsum(sample_counts)))
    bad = bad_dispatch | segment_any(bad_sample, offsets)
    errors = []
    for i in np.flatnonzero(bad).tolist():
        if bad_dispatch[i]:
            version, field_name = int(dispatch[i]), "dispatch_version"
        else:
            k = int(np.argmax(bad_sample[offsets[i] : offsets[i + 1]]))
            kind = "weight_versions" if label_kind[offsets[i] + k] == LABELS_SPANS else "token_versions"
            version, field_name = int(max_label[offsets[i] + k]), f"samples[{k}].{kind}"
        errors.append(TraceError(id_of(i), field_name, f"version {version} is above the trained version {trained}"))
    return bad, errors
