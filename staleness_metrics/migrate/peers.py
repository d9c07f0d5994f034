"""Other trainers' staleness keys, for ``staleness-metrics migrate --from PEER`` (issue 14).

One table, :data:`PEER_KEYS`: each key a peer framework logs (or a setting it reads), the source file it
was read from, and either this project's key with the same meaning or the reason there is none. A key is
renamed only when the meaning is the same (same quantity, same unit, same population up to this
project's rule of leaving frozen rollouts out); every other key is reported with its reason and never
renamed, so nobody's plot silently changes meaning.

Sources were read in the stored copies of the peers' repositories (``owner/repo@commit path``). Where
the index held a key only in files it could not attribute to a repository, the source says so; where a
peer logs no staleness key at all, only its settings are listed:

- AReaL logs no staleness metric in the stored sources: it bounds staleness before generation
  (``max_head_offpolicyness``, a capacity rule in ``areal/core/staleness_manager.py``) and logs the
  behaviour importance weight (a mismatch, SPEC 11), so nothing is renamed.
- ROLL: only its setting ``async_generation_ratio`` was found; no logged staleness metric.
- NeMo-RL: ``train/avg_trajectory_age`` was found only in NeMo-RL-derived files the index did not
  attribute (the stored ``NVIDIA/NeMo-RL`` ``nemo_rl/algorithms/grpo.py`` predates async GRPO).
- verl: the per-trajectory ``training/off_policy/*`` family was found in verl-derived trainer files the
  index did not attribute; its definitions (``T - max_global_steps``, ``T - min_global_steps``,
  ``max - min + 1``) are quoted from that code.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PEERS", "PEER_KEYS", "PeerKey", "peer_keys"]


@dataclass(frozen=True)
class PeerKey:
    """One peer key: ``new`` is this project's key with the same meaning, None when it differs."""

    peer: str
    key: str
    new: str | None
    source: str
    reason: str
    # True: matched as one path segment of a longer logged key (AReaL's tracker adds scope prefixes
    # and statistic suffixes around the names its code uses).
    segment: bool = False


_VERL_FA = (
    "volcengine/verl@0794432856e48e1c769b38899f6300ae9caa69ba verl/experimental/fully_async_policy/detach_utils.py"
)
_VERL_OP = (
    "verl trainers' training/off_policy/* family: seen in stored verl-derived trainer code, "
    "file not attributable in the index"
)
_SKYRL = "NovaSky-AI/SkyRL@3041820a8d70cb44c5b421b3ab53c44903d6f2fe skyrl-train/skyrl_train/fully_async_trainer.py"
_AREAL_ACTOR = "inclusionAI/AReaL@5ac9adfdc8ed23c2e5a5c58d7ad2d8f0ae83b54e areal/engine/ppo/actor.py"
_AREAL_STALE = "inclusionAI/AReaL@a4afec4b4690cfe69a0cbce0cf686c3f990d74a7 areal/core/staleness_manager.py"
_NEMO = (
    "NeMo-RL async GRPO replay buffer (sample() returns avg_trajectory_age): seen in stored NeMo-RL-derived "
    "files, not attributable in the index"
)
_ROLL = "alibaba/ROLL@51e53586d87babf0bf02716eb6b77f4ee3de2e97 roll/configs/base_config.py"
_PIPELINE = "ServiceNow/PipelineRL@a296c972810dcd576b9452618ef433c0fa1e1fc2 pipelinerl/finetune_loop.py"

_NO_MINIMA = "a minimum over trajectories; this project reports means and maxima only"
_PIPELINE_UNIT = (
    "unit is samples: PipelineRL versions its weights by the training samples seen "
    "(last_broadcasted_version = samples), not by optimizer steps"
)

PEER_KEYS: tuple[PeerKey, ...] = (
    # -- verl --------------------------------------------------------------------------------------
    PeerKey("verl", "training/off_policy/trajectory_staleness/mean", "staleness/rollout/newest/mean", _VERL_OP,
            "(global_steps - 1) - max_global_steps per trajectory: T minus its newest version, mean over trajectories"),
    PeerKey("verl", "training/off_policy/trajectory_staleness/max", "staleness/rollout/newest/max", _VERL_OP,
            "T minus the trajectory's newest version, maximum"),
    PeerKey("verl", "training/off_policy/trajectory_staleness/min", None, _VERL_OP, _NO_MINIMA),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/mean", "staleness/rollout/mean", _VERL_OP,
            "(global_steps - 1) - min_global_steps: T minus the oldest version, SPEC 6's R"),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/max", "staleness/rollout/max", _VERL_OP,
            "T minus the oldest version, maximum"),
    PeerKey("verl", "training/off_policy/trajectory_staleness_worst/min", None, _VERL_OP, _NO_MINIMA),
    *(
        PeerKey("verl", f"training/off_policy/trajectory_spans/{stat}", None, _VERL_OP,
                "max - min + 1: a count of versions used, one more than the versions that passed in flight "
                "(staleness/rollout/in_flight counts those)")
        for stat in ("mean", "max", "min")
    ),
    PeerKey("verl", "fully_async/partial/max_partial_span", "staleness/rollout/in_flight/max", _VERL_FA,
            "max(param_version_end - param_version_start): versions that passed while a trajectory was generated"),
    PeerKey("verl", "fully_async/partial/partial_ratio", None, _VERL_FA,
            "share of trajectories resumed under newer weights (end > start): a share, not a staleness"),
    PeerKey("verl", "fully_async/partial/total_partial_num", None, _VERL_FA,
            "count of resumed trajectories, not a staleness"),
    PeerKey("verl", "fully_async/count/stale_samples_processed", None, _VERL_FA,
            "cumulative count of stale samples the trainer used (trained, not dropped)"),
    PeerKey("verl", "fully_async/count/stale_trajectory_processed", None, _VERL_FA,
            "cumulative count of stale trajectories the trainer used (trained, not dropped)"),
    PeerKey("verl", "fully_async/count/dropped_stale_samples", None, _VERL_FA,
            "cumulative over the run; staleness/sample/dropped is per ship window "
            "(the cumulative count is the counter rl_staleness_samples_dropped_total)"),
    PeerKey("verl", "fully_async/count/current_param_version", None, _VERL_FA,
            "the trainer's parameter version, not a staleness"),
    # -- SkyRL -------------------------------------------------------------------------------------
    PeerKey("skyrl", "async/staleness_mean", "staleness/rollout/mean", _SKYRL,
            "global_step - global_step_when_scheduled per group = T - dispatch version; groups have equal "
            "size, so the group mean is the rollout mean, and without per-token versions R = T - dispatch"),
    PeerKey("skyrl", "async/staleness_max", "staleness/rollout/max", _SKYRL,
            "T - dispatch version, maximum over groups"),
    PeerKey("skyrl", "async/staleness_min", None, _SKYRL, _NO_MINIMA),
    PeerKey("skyrl", "async/staleness_ratio", None, _SKYRL,
            "share of groups with staleness > 0, not a mean lag"),
    PeerKey("skyrl", "max_staleness_steps", None, _SKYRL,
            "a scheduling bound (capacity, so nothing is ever dropped); max_staleness masks and drops at ship time"),
    # -- AReaL -------------------------------------------------------------------------------------
    PeerKey("areal", "max_head_offpolicyness", None, _AREAL_STALE,
            "bounds admissions before generation ((bound + version + 1) x batch); max_staleness masks and drops "
            "what arrives too old"),
    PeerKey("areal", "behave_imp_weight", None, _AREAL_ACTOR,
            "behaviour importance weight over all tokens: a policy mismatch, not a staleness "
            "(see staleness/mismatch/*, SPEC 11)", segment=True),
    PeerKey("areal", "behave_approx_kl", None, _AREAL_ACTOR,
            "approximate KL to the behaviour policy over all tokens: a mismatch, not a staleness "
            "(see staleness/mismatch/*, SPEC 11)", segment=True),
    # -- NeMo-RL -----------------------------------------------------------------------------------
    PeerKey("nemo-rl", "train/avg_trajectory_age", None, _NEMO,
            "steps since each prompt group's generation weight version, averaged over groups; NeMo-RL itself "
            "tells this generation age from the policy age, and its step/version convention could not be "
            "checked against SPEC 2 in the stored source"),
    # -- ROLL --------------------------------------------------------------------------------------
    PeerKey("roll", "async_generation_ratio", None, _ROLL,
            "how many steps generation may run ahead (an integer named a ratio): a bound on generation lead, "
            "not on the age of the data trained"),
    # -- PipelineRL --------------------------------------------------------------------------------
    PeerKey("pipelinerl", "stats/lag", None, _PIPELINE,
            f"last broadcast version - oldest actor version in the batch; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/min_actor_version", None, _PIPELINE, f"a version, not a staleness; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/max_actor_version", None, _PIPELINE, f"a version, not a staleness; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/samples_too_old_to_queue", None, _PIPELINE,
            f"cumulative count of samples refused before queueing; {_PIPELINE_UNIT}"),
    PeerKey("pipelinerl", "stats/samples_too_old_to_train", None, _PIPELINE,
            f"cumulative count over the run (staleness/sample/dropped is per ship window); {_PIPELINE_UNIT}"),
)  # fmt: skip

PEERS: tuple[str, ...] = ("verl", "skyrl", "areal", "nemo-rl", "roll", "pipelinerl")


def peer_keys(peer: str) -> tuple[PeerKey, ...]:
    """The table rows of one peer (``ValueError`` for a peer the table does not know)."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; known: {', '.join(PEERS)}")
    return tuple(row for row in PEER_KEYS if row.peer == peer)
