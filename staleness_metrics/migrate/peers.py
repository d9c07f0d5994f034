"""Other trainers' staleness keys for ``migrate --from PEER`` (issues 14, 21; docs/migrate.md):
where each is computed (newest release, else ``owner/repo@commit``) and this project's key with the
same number, or why there is none. TRL's ``max_staleness`` is this project's own setting name."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..metrics import keys

# AReaL's stats tracker logs ``<key>__count`` beside each scalar (areal/utils/stats_tracker.py:215)
TRACKER_SUFFIXES: tuple[str, ...] = ("__count",)


@dataclass(frozen=True)
class PeerKey:
    """One peer key: ``new`` is this project's key with the same value, None when it differs."""

    peer: str
    key: str
    new: str | None
    source: str
    reason: str
    # True: matched as whole path segments of a longer logged key (AReaL's tracker adds scopes
    # such as ``ppo_actor/update/version_stats/`` and suffixes such as ``/avg`` or ``__count``).
    segment: bool = False


# -- where each key is computed --------------------------------------------------------------------
_VERL = "verl 0.9.1 "
_VERL_V1 = _VERL + "verl/trainer/ppo/v1/trainer_base.py"
_VERL_RB = _VERL + "verl/trainer/ppo/v1/replay_buffer.py"
_VERL_DU = _VERL + "verl/experimental/fully_async_policy/detach_utils.py"
_VERL_FT = _VERL + "verl/experimental/fully_async_policy/fully_async_trainer.py"
_VERL_RO = _VERL + "verl/experimental/fully_async_policy/fully_async_rollouter.py"
_SKYRL = "skyrl 0.4.0 skyrl/train/fully_async_trainer.py"
_AREAL = "areal 1.0.4 areal/trainer/ppo/actor.py"
_AREAL_TRACKER = "areal/utils/stats_tracker.py:109-113,202-215"
_TRL = "trl 1.16.0 trl/experimental/async_grpo/async_grpo_trainer.py"
_TRL_DISTIL = "trl/experimental/async_distillation/async_distillation_trainer.py"
_NEMO = "NVIDIA-NeMo/RL@7ea279abfbeb698b092856d0dab61e7cf39bc909 "
_ROLL = "alibaba/ROLL@8eb27cc2dc34c4d1310b169d9b86d339004d811a "
_PIPELINE = "ServiceNow/PipelineRL@58d393458625ad63ed539f2dcd072c85700c557f pipelinerl/finetune_loop.py"

# -- reasons shared by several rows ----------------------------------------------------------------
_NO_MINIMA = "a minimum over trajectories; this project reports means and maxima only"
_AREAL_AGG = (
    "AReaL logs it with stats_tracker.scalar, which averages the value of every loss call "
    f"({_AREAL_TRACKER}): one value per micro-batch and rank, then their plain mean"
)
_TRL_TIMING = (
    "measured when the dataloader pulls the row, with the trainer's model_version at that moment; "
    "accelerate's DataLoaderDispatcher pulls the next micro-batch before yielding the current one "
    "(accelerate data_loader.py:906,930), so the first micro-batch of step s+1 is measured before "
    "the weight sync that ends step s (one step less than at training) and lands in step s's "
    "logging window; per training row (one RolloutSample per sequence, "
    "async_rollout_worker.py:1110-1121) with the group's first dispatch version "
    "(async_rollout_worker.py:626)"
)
_PIPELINE_UNIT = (
    "unit is samples: PipelineRL versions its weights by the training samples seen "
    "(last_broadcasted_version = samples), not by optimizer steps"
)

PEER_KEYS: tuple[PeerKey, ...] = (
    # -- verl 0.9.1 --------------------------------------------------------------------------------
    PeerKey("verl", "training/off_policy/trajectory_staleness/mean", keys.ROLLOUT_IN_QUEUE_MEAN,
            f"{_VERL_V1}:1979,1986", "(global_steps - 1) - max_global_steps per trajectory, mean "
            "over the batch: T minus the version of the trajectory's last generate call "
            "(verl/workers/rollout/llm_server.py:325-327,349), i.e. T - completion version. "
            "from_verl sets completion_version = max_global_steps, so staleness/rollout/in_queue "
            "(Q = R - clamp(end - start, 0, R) = T - end) is this number on every verl batch; "
            "staleness/rollout/newest (T - newest token label) is it only when per-token "
            "versions are passed, since unlabelled tokens take the start version (a batch where "
            "verl logs 0.5 has newest 1.0)"),
    PeerKey("verl", "training/off_policy/trajectory_staleness/max", keys.ROLLOUT_IN_QUEUE_MAX,
            f"{_VERL_V1}:1979,1987", "T - max_global_steps, maximum over the batch: "
            "staleness/rollout/in_queue/max (see trajectory_staleness/mean for why not "
            "staleness/rollout/newest)"),
    PeerKey("verl", "training/off_policy/trajectory_staleness/min", None, f"{_VERL_V1}:1979,1988", _NO_MINIMA),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/mean", keys.ROLLOUT_MEAN,
            f"{_VERL_V1}:1980,1989", "(global_steps - 1) - min_global_steps: T minus the version "
            "the trajectory's generation started at, SPEC 6's R (from_verl's dispatch_version is "
            "min_global_steps)"),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/max", keys.ROLLOUT_MAX,
            f"{_VERL_V1}:1980,1990", "T - min_global_steps, maximum: staleness/rollout/max"),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/min", None, f"{_VERL_V1}:1980,1991",
            _NO_MINIMA),
    *(
        PeerKey("verl", f"training/off_policy/trajectory_spans/{stat}", None, f"{_VERL_V1}:1978,{line}",
                "max_global_steps - min_global_steps + 1: a count of versions used, one more than "
                "the versions that passed in flight (staleness/rollout/in_flight counts those)")
        for stat, line in (("mean", 1983), ("max", 1984), ("min", 1985))
    ),
    PeerKey("verl", "training/off_policy/evicted_samples", None, f"{_VERL_RB}:367",
            "prompt groups evicted as stale by the replay buffer (max_off_policy_strategy drop): "
            "groups, not rollouts (staleness/rollout/dropped counts rollouts)"),
    *(
        PeerKey("verl", f"training/off_policy/evicted_samples_staleness/{stat}", None, f"{_VERL_RB}:360-{line}",
                "global_steps - the dataloader step of the prompt + 1, over evicted groups: the "
                "age of dropped prompts counted from when they were loaded; this project "
                "measures only what it ships")
        for stat, line in (("mean", 368), ("max", 369), ("min", 370))
    ),
    PeerKey("verl", "max_off_policy_threshold", None, f"{_VERL_RB}:520-529",
            "evicts a prompt group when global_steps - its load step + 1 > threshold (or "
            "waits, strategy wait): counted from prompt load, plus one; max_staleness bounds "
            "T - the sampling version"),
    PeerKey("verl", "fully_async/partial/max_partial_span", keys.ROLLOUT_IN_FLIGHT_MAX, f"{_VERL_DU}:151-158",
            "max(|max_global_steps - min_global_steps|): versions that passed while a trajectory "
            "was generated; from_verl's F = clamp(end - start, 0, R) is the same number"),
    PeerKey("verl", "fully_async/partial/partial_ratio", None, f"{_VERL_DU}:157",
            "share of trajectories resumed under newer weights (end > start): a share, not a staleness"),
    PeerKey("verl", "fully_async/partial/total_partial_num", None, f"{_VERL_DU}:156",
            "count of resumed trajectories, not a staleness"),
    PeerKey("verl", "fully_async/count/stale_trajectory_processed", None, f"{_VERL_FT}:1038-1043",
            "cumulative count of trained trajectories with current_param_version - "
            "max_global_steps >= 1 (trained, not dropped)"),
    PeerKey("verl", "fully_async/count/stale_samples_processed", None, f"{_VERL_DU}:215",
            "only named in MetricsAggregator's 'last' rule; nothing in verl 0.9.1 sets it"),
    PeerKey("verl", "fully_async/count/dropped_stale_samples", None,
            f"{_VERL_RO}:1014,1177 and verl/experimental/fully_async_policy/message_queue.py:66-71",
            "cumulative count of samples pushed out of the full message queue (the oldest one "
            "goes): a capacity drop, not a staleness bound; staleness/sample/dropped counts drops "
            "by max_staleness per ship window"),
    PeerKey("verl", "fully_async/count/staleness_samples", None, f"{_VERL_RO}:605,952,1176",
            "samples generated since the last parameter sync (active + queued): a capacity counter, not an age"),
    PeerKey("verl", "fully_async/static/staleness_threshold", None, f"{_VERL_RO}:421,495,1181",
            "the setting: generation may run staleness_threshold batches ahead (a capacity bound "
            "before generation); max_staleness masks and drops by age at ship time"),
    PeerKey("verl", "staleness_threshold", None, f"{_VERL_FT}:201 and {_VERL_RO}:421",
            "async_training.staleness_threshold: a share of a batch that may be generated ahead, a "
            "capacity bound before generation; max_staleness masks and drops by age at ship time"),
    PeerKey("verl", "fully_async/count/current_param_version", None, f"{_VERL_FT}:1044",
            "the trainer's parameter version, not a staleness"),
    # -- SkyRL 0.4.0 -------------------------------------------------------------------------------
    PeerKey("skyrl", "async/staleness_mean", keys.ROLLOUT_MEAN, f"{_SKYRL}:1002,1124",
            "global_step - global_step_when_scheduled per group (scheduled at 920,939) = T - "
            "dispatch version with dispatch_version = global_step_when_scheduled - 1 and the ship "
            "at step global_step; groups have n_samples_per_prompt trajectories each, so the group "
            "mean is the rollout mean"),
    PeerKey("skyrl", "async/staleness_max", keys.ROLLOUT_MAX, f"{_SKYRL}:1002,1125",
            "T - dispatch version, maximum over groups"),
    PeerKey("skyrl", "async/staleness_min", None, f"{_SKYRL}:1126", _NO_MINIMA),
    PeerKey("skyrl", "async/staleness_ratio", None, f"{_SKYRL}:1127",
            "share of groups with staleness > 0, not a mean lag"),
    PeerKey("skyrl", "async/staleness_violation_count", None, f"{_SKYRL}:1025-1033,1128",
            "groups trained although older than max_staleness_steps (SkyRL warns and trains them); "
            "this project masks or drops them, counted in staleness/rollout/dropped"),
    PeerKey("skyrl", "async/num_groups_dropped", None, f"{_SKYRL}:569-573",
            "zero-variance groups dropped by sample_full_batch: a reward filter, not staleness"),
    PeerKey("skyrl", "async/keep_rate", None, f"{_SKYRL}:571-574", "share of groups kept by the zero-variance filter"),
    PeerKey("skyrl", "max_staleness_steps", None, "skyrl 0.4.0 skyrl/train/config/config.py:1035",
            "a scheduling bound (capacity, so nothing is ever dropped); max_staleness masks and drops at ship time"),
    # -- AReaL 1.0.4 -------------------------------------------------------------------------------
    PeerKey("areal", "sample_staleness_theta_avg", None, f"{_AREAL}:1082,1086,1093,1103",
            "current_version - version per token (AReaL trains version g at global step g: T - v, "
            f"token staleness) over behave_mask tokens, averaged per loss call; {_AREAL_AGG}, so "
            "it is staleness/token/mean (token-weighted over the ship) only when one micro-batch "
            "carries the whole batch", segment=True),
    PeerKey("areal", "sample_staleness_theta_max", None, f"{_AREAL}:1093,1104",
            f"T - v per token, maximum per loss call; {_AREAL_AGG}: a mean of micro-batch maxima, "
            "not the maximum (staleness/rollout/max)", segment=True),
    PeerKey("areal", "sample_staleness_theta_min", None, f"{_AREAL}:1093,1105", _NO_MINIMA, segment=True),
    *(
        PeerKey("areal", f"sample_staleness_proximal_{stat}", None, f"{_AREAL}:1081,1092,{line}",
                "(current_version - 1) - version per token: the lag behind the proximal policy (the last "
                f"broadcast weights), one less than token staleness; {_AREAL_AGG}", segment=True)
        for stat, line in (("avg", 1100), ("max", 1101), ("min", 1102))
    ),
    PeerKey("areal", "v_theta", None, f"{_AREAL}:1082,1106", "a version, not a staleness", segment=True),
    PeerKey("areal", "v_proximal", None, f"{_AREAL}:1081,1107", "a version, not a staleness", segment=True),
    PeerKey("areal", "n_valid_generated_tokens", None, f"{_AREAL}:1086,1108", "a token count, not a staleness",
            segment=True),
    PeerKey("areal", "version_stats/n_valid_tokens", None, f"{_AREAL}:1079",
            "the tracker's denominator in the version_stats scope: tokens whose next token trains (loss_mask "
            "rolled by -1), summed over loss calls; a token count, not a staleness", segment=True),
    PeerKey("areal", "max_head_offpolicyness", None,
            "areal 1.0.4 areal/api/cli_args.py:2113 and areal/infra/staleness_manager.py:92-112",
            "bounds admissions before generation ((bound + version + 1) x batch); max_staleness "
            "masks and drops what arrives too old"),
    PeerKey("areal", "behave_imp_weight", None, f"{_AREAL}:539-545",
            "behaviour importance weight over all tokens: a policy mismatch, not a staleness "
            "(see staleness/mismatch/*, SPEC 11)", segment=True),
    PeerKey("areal", "behave_approx_kl", None, f"{_AREAL}:539-545",
            "approximate KL to the behaviour policy over all tokens: a mismatch, not a staleness "
            "(see staleness/mismatch/*, SPEC 11)", segment=True),
    # -- TRL 1.16.0 (async GRPO; the async distillation trainer logs the same keys) ----------------
    PeerKey("trl", "sample/staleness_mean", None, f"{_TRL}:367-368,386 and {_TRL_DISTIL}:684",
            "model_version - the row's model_version, window mean "
            f"(async_grpo_trainer.py:105); {_TRL_TIMING}; staleness/rollout/mean is T - "
            "dispatch per rollout at the ship that trains it"),
    PeerKey("trl", "sample/staleness_max", None, f"{_TRL}:367-368,387 and {_TRL_DISTIL}:685",
            f"the same per-row value, window maximum (async_grpo_trainer.py:101-102); {_TRL_TIMING}"),
    PeerKey("trl", "sample/dropped_stale_total", None, f"{_TRL}:369-372 and {_TRL_DISTIL}:667-670",
            "rows dropped when pulled because fetch version - dispatch version > max_staleness, "
            "summed over the logging window (a 'total' word sums, async_grpo_trainer.py:99-100): "
            "measured at fetch time, one step early for prefetched rows; staleness/sample/dropped "
            "counts drops at the ship that would train"),
    PeerKey("trl", "sample/time_in_queue_s", None, f"{_TRL}:383-384",
            "seconds a row waited in the rollout queue: a time, not a count of versions"),
    # -- NeMo-RL (no release) ----------------------------------------------------------------------
    PeerKey("nemo-rl", "train/avg_trajectory_age", keys.ROLLOUT_MEAN,
            f"{_NEMO}nemo_rl/algorithms/async_utils/replay_buffer.py:293-296, nemo_rl/algorithms/grpo.py:5293,5394",
            "current_weight_version - mean generation weight version over the sampled prompt "
            "groups; current_weight_version is the version trained (grpo.py:4539, += 1 after "
            "each refit at 4937) and the generation version is the collector's version when "
            "the group was dispatched (async_utils/trajectory_collector.py:516,543): T - "
            "dispatch, and groups have num_generations_per_prompt trajectories each, so the "
            "group mean is the rollout mean"),
    PeerKey("nemo-rl", "train/evicted_stale_prompt_groups", None,
            f"{_NEMO}nemo_rl/algorithms/single_controller.py:878-882,1118,1201-1203",
            "prompt groups evicted outside the staleness window: groups, not rollouts"),
    PeerKey("nemo-rl", "train/aborted_stale_inflight_groups", None,
            f"{_NEMO}nemo_rl/algorithms/single_controller.py:1113-1119,1201-1203",
            "in-flight prompt groups aborted at a weight sync: groups, and before generation ended"),
    PeerKey("nemo-rl", "max_trajectory_age_steps", None, f"{_NEMO}nemo_rl/algorithms/grpo.py:189",
            "a setting: how far generation runs ahead and the age window of the replay buffer (a "
            "capacity bound before generation)"),
    PeerKey("nemo-rl", "max_staleness_versions", None,
            f"{_NEMO}nemo_rl/algorithms/async_utils/staleness_sampler.py:490-504",
            "a sampler setting (windowed / ready_first / weight_fifo): what it bounds depends on "
            "the sampler (selection window or generation lead in dispatch batches)"),
    # -- ROLL (no release) -------------------------------------------------------------------------
    PeerKey("roll", "scheduler/off_policy_ratio", None,
            f"{_ROLL}roll/distributed/scheduler/generate_scheduler.py:705-726",
            "despite its name a mean lag: replay-buffer step at collection - the step the "
            "prompt began sampling, mean over responses; every response of a prompt takes the "
            "prompt's begin step (ROLL's own comment, generate_scheduler.py:933-934, says the "
            "real start can differ) and the step is ROLL's pipeline step, so it is not T - each "
            "rollout's dispatch version"),
    PeerKey("roll", "async_generation_ratio", None, f"{_ROLL}roll/configs/base_config.py:502",
            "how many steps generation may run ahead (an integer named a ratio): a bound on "
            "generation lead, not on the age of the data trained"),
    # -- PipelineRL (no release; stats/lag_{mean,max} postdate the snapshot, issue 32) -------------
    PeerKey("pipelinerl", "stats/lag", None, f"{_PIPELINE}:881",
            f"last broadcast version - oldest actor version in the batch; {_PIPELINE_UNIT}"),
    *(
        PeerKey("pipelinerl", f"stats/lag_{stat}", None, f"{_PIPELINE}:680-689,881 (the per-batch lag)",
                f"the {word} over the step's batches of last broadcast version - batch "
                "version, a lag in samples where this project counts policy versions: no "
                f"equivalent; {_PIPELINE_UNIT}")
        for stat, word in (("mean", "mean"), ("max", "maximum"))
    ),
    PeerKey("pipelinerl", "stats/min_actor_version", None, f"{_PIPELINE}:877",
            f"a version, not a staleness; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/max_actor_version", None, f"{_PIPELINE}:878",
            f"a version, not a staleness; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/samples_too_old_to_queue", None, f"{_PIPELINE}:872",
            f"cumulative count of samples refused before queueing; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/samples_too_old_to_train", None, f"{_PIPELINE}:680-684,873",
            "cumulative count over the run, counted but still trained (staleness/sample/dropped is "
            f"per ship window and counts drops); {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "max_lag", None, f"{_PIPELINE}:680-684",
            f"a setting: samples older than it are counted, not dropped, by the trainer; {_PIPELINE_UNIT}"),
)  # fmt: skip

PEERS: tuple[str, ...] = ("verl", "skyrl", "areal", "trl", "nemo-rl", "roll", "pipelinerl")


def peer_keys(peer: str) -> tuple[PeerKey, ...]:
    """The table rows of one peer (``ConfigError`` for a peer the table does not know)."""
    if peer not in PEERS:
        known = ", ".join(PEERS)
        message = f"unknown peer {peer!r}; known: {known}"
        raise ConfigError(message, field="peer", reason=f"unknown (known: {known})")
    return tuple(row for row in PEER_KEYS if row.peer == peer)
