"""Would the validators crown the candidate: their Pareto rule with tolerance, on per-env score tables.

Mirrors affine-cortex (commit c2d7ec8, 2026-07-24) `affine/src/scorer/comparator.py` as `scheduler/flow.py` calls
it, in our own code:
- per env, both models' means over the task ids both were scored on; a candidate with fewer of them than the
  env's sampling count is **worse** there;
- **dominant** when candidate > champion + margin (additive envs such as DISTILL-V2: + additive_margin);
  **not worse** when candidate >= champion * (1 - tolerance) (additive envs: >= champion - additive_margin,
  since their score crosses zero); else **worse** (both comparisons with the validators' 1e-9 slack);
- the candidate dethrones iff at least `min_dominant_envs` envs are dominant and none is worse
  (`min_dominant_envs` 0: strict Pareto, every env dominant).
Added here for a local run: an env the validators score that the run did not play is **unknown**, and a verdict
that hangs on an unknown env is "unknown", never "would dethrone". Pure: tables in, verdict out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ppo_affine.config import ValidatorRuleConfig

DOMINANT, NOT_WORSE, WORSE, UNKNOWN = "dominant", "not_worse", "worse", "unknown"
WOULD_DETHRONE, WOULD_NOT, VERDICT_UNKNOWN = "would dethrone", "would not", "unknown"
SLACK = 1e-9  # the validators' float slack on both comparisons

ScoreTable = dict[str, dict[object, float]]  # env -> task id -> score


@dataclass(frozen=True)
class EnvJudgement:
    env: str
    bucket: str  # DOMINANT | NOT_WORSE | WORSE | UNKNOWN
    reason: str  # one line a person reads
    candidate_mean: float | None  # over the shared task ids
    champion_mean: float | None
    shared_tasks: int  # task ids both models were scored on: the sample count the gate reads
    required_tasks: int  # the env's sampling count
    dominant_above: float | None  # the candidate mean must exceed this to be dominant
    not_worse_from: float | None  # ... and reach this to be not worse


@dataclass(frozen=True)
class Verdict:
    outcome: str  # WOULD_DETHRONE | WOULD_NOT | VERDICT_UNKNOWN
    reasons: list[str]
    envs: list[EnvJudgement] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outcome if not self.reasons else f"{self.outcome}, because " + "; ".join(self.reasons)


def thresholds(env: str, champion_mean: float, rule: ValidatorRuleConfig) -> tuple[float, float]:
    """(dominant above, not worse from) for a champion mean in one env."""
    if env in rule.additive_envs:
        return champion_mean + rule.additive_margin, champion_mean - rule.additive_margin
    return champion_mean + rule.margin, champion_mean * (1.0 - rule.not_worse_tolerance)


def bucket_of(env: str, candidate_mean: float, champion_mean: float, rule: ValidatorRuleConfig) -> str:
    """The bucket of a candidate mean against a champion mean (sample counts aside)."""
    dominant_above, not_worse_from = thresholds(env, champion_mean, rule)
    if candidate_mean > dominant_above + SLACK:
        return DOMINANT
    return NOT_WORSE if candidate_mean >= not_worse_from - SLACK else WORSE


def required_tasks(env: str, rule: ValidatorRuleConfig) -> int:
    return max(1, rule.sampling_counts.get(env, 1))


def judge_env(env: str, candidate: dict[object, float] | None, champion: dict[object, float] | None,
              rule: ValidatorRuleConfig) -> EnvJudgement:
    """One env's bucket; `None` for a side that did not play the env at all."""
    required = required_tasks(env, rule)
    if candidate is None and champion is None:
        return EnvJudgement(env, UNKNOWN, "not run here; the validators score it", None, None, 0, required,
                            None, None)
    shared = sorted(set(candidate or {}) & set(champion or {}), key=str)
    if not shared:
        only = "the candidate" if candidate else "the champion" if champion else "neither model"
        return EnvJudgement(env, WORSE, f"no task scored for both models (only {only} has scores)", None, None, 0,
                            required, None, None)
    candidate_mean = sum(candidate[t] for t in shared) / len(shared)
    champion_mean = sum(champion[t] for t in shared) / len(shared)
    dominant_above, not_worse_from = thresholds(env, champion_mean, rule)
    if len(shared) < required:
        bucket, reason = WORSE, f"too few samples: {len(shared)} < {required}"
    else:
        bucket = bucket_of(env, candidate_mean, champion_mean, rule)
        reason = {DOMINANT: f"{candidate_mean:.4f} > {dominant_above:.4f}",
                  NOT_WORSE: f"{not_worse_from:.4f} <= {candidate_mean:.4f} <= {dominant_above:.4f}",
                  WORSE: f"{candidate_mean:.4f} < {not_worse_from:.4f}"}[bucket]
    return EnvJudgement(env, bucket, reason, candidate_mean, champion_mean, len(shared), required, dominant_above,
                        not_worse_from)


def judge(candidate: ScoreTable, champion: ScoreTable, rule: ValidatorRuleConfig,
          envs: list[str] | None = None) -> Verdict:
    """The verdict over `envs` (default: every env either table has, then the envs the validators score)."""
    if envs is None:
        envs = list(dict.fromkeys([*candidate, *champion, *rule.sampling_counts]))
    judged = [judge_env(env, candidate.get(env), champion.get(env), rule) for env in envs]
    return Verdict(*decide(judged, rule.min_dominant_envs), envs=judged)


def decide(judged: list[EnvJudgement], min_dominant_envs: int) -> tuple[str, list[str]]:
    """(outcome, reasons) from the per-env buckets."""
    if not judged:
        return WOULD_NOT, ["no env to compare on"]
    worse = [j for j in judged if j.bucket == WORSE]
    unknown = [j for j in judged if j.bucket == UNKNOWN]
    dominant = [j for j in judged if j.bucket == DOMINANT]
    if worse:
        return WOULD_NOT, [f"{j.env} is worse ({j.reason})" for j in worse]
    if min_dominant_envs == 0:  # strict Pareto
        behind = [j for j in judged if j.bucket == NOT_WORSE]
        if behind:
            return WOULD_NOT, [f"{j.env} is not dominant ({j.reason})" for j in behind]
    elif not unknown and len(dominant) < min_dominant_envs:
        return WOULD_NOT, [f"dominant in {len(dominant)} env(s), {min_dominant_envs} needed"]
    if unknown:
        return VERDICT_UNKNOWN, [f"{j.env} was not run here and the validators score it" for j in unknown]
    return WOULD_DETHRONE, [f"dominant in {', '.join(j.env for j in dominant)}, not worse elsewhere"]


def buckets_across(judgement: EnvJudgement, difference_interval: list[float] | None,
                   rule: ValidatorRuleConfig) -> list[str]:
    """The buckets a candidate mean anywhere in the paired difference's 95 % interval (candidate - champion) would
    land in, lowest first: more than one means the run is too small to settle this env's bucket."""
    if difference_interval is None or judgement.champion_mean is None or judgement.bucket in (UNKNOWN,):
        return [judgement.bucket]
    if judgement.shared_tasks < judgement.required_tasks:
        return [WORSE]  # the sample gate, not the scores, decides it
    low, high = (judgement.champion_mean + end for end in difference_interval)
    order = [WORSE, NOT_WORSE, DOMINANT]
    first = order.index(bucket_of(judgement.env, low, judgement.champion_mean, rule))
    last = order.index(bucket_of(judgement.env, high, judgement.champion_mean, rule))
    return order[first:last + 1]
