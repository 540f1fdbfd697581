"""The trainer's scores of the played tokens: old and reference log-probs, values and the rollout policy's
entropy (`score_sequences`), and how they compare with the log-probs of the process that sampled them
(`sampler_gap`, `correct_for_the_sampler`). Of the step before the update, only this module runs the
policy; the sequences and their micro-batches come from `batching.py`, and `advantages.py` takes over.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ppo_affine.batching import TrainSequence, micro_batches
from ppo_affine.oom_recovery import blamed_on
from ppo_affine.policy import Policy, common_prefix_length
from ppo_affine.prefixes import padded_cost
from ppo_affine.ppo import truncated_importance_weights
from ppo_affine.token_trees import TreeRows, paths, unique_token_count


def batch_cost(input_ids: torch.Tensor, tree: TreeRows | None = None) -> int:
    """Tokens a [B, T] right-padded micro-batch puts through the model (a shared prefix counted once; with tree
    rows, as far as every row is one chain)."""
    rows, width = input_ids.shape
    shared = common_prefix_length(input_ids)
    if tree is not None:
        shared = min(shared, tree.shared_prefix_limit())
    return padded_cost(rows, shared, width)


@torch.no_grad()
def score_sequences(policy: Policy, sequences: list[TrainSequence], token_budget: int, temperature: float,
                    with_values: bool) -> dict[str, float]:
    """Old and reference log-probs, values and the rollout policy's entropy of every reply token,
    by the training model; returns token counts (padding included) of this pass."""
    processed = 0
    with policy.evaluating():
        for batch in micro_batches(sequences, token_budget, policy.tokenizer.pad_token_id, policy.device):
            processed += batch_cost(batch.input_ids, batch.tree)
            mask = batch.response_mask.bool()
            with blamed_on(batch):  # out of memory names the episode of its longest sequence
                scored = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree,
                                      with_values=with_values, with_entropy=True, temperature=temperature)
                with policy.reference():
                    ref = policy.score(batch.input_ids, None, batch.response_mask, tree=batch.tree, with_values=False,
                                       temperature=temperature)
            for row, sequence in enumerate(batch.sequences):
                sequence.old_logprobs = scored.logprobs[row][mask[row]].cpu()
                sequence.ref_logprobs = ref.logprobs[row][mask[row]].cpu()
                sequence.entropy = scored.entropy[row][mask[row]].cpu()
                sequence.old_values = (scored.values[row][mask[row]].cpu() if scored.values is not None
                                       else torch.zeros(sequence.response_len))
    unique = unique_tokens(sequences)
    # processed < unique where micro-batches share prefixes, > unique where rows are padded
    return {"perf/tokens_processed": float(processed), "perf/unique_tokens": float(unique),
            "perf/processed_over_unique": processed / unique if unique else 0.0}


def unique_tokens(sequences: list[TrainSequence]) -> int:
    """The tokens of each episode's prefix tree over its sequences, counted once: the least a pass must compute,
    whether the sequences are scored one by one or as trees (the same number either way)."""
    by_episode: dict[int, list[list[int]]] = {}
    for sequence in sequences:
        members = (paths(sequence.input_ids, sequence.parents) if sequence.parents is not None
                   else [sequence.input_ids])
        by_episode.setdefault(sequence.episode, []).extend(members)
    return sum(unique_token_count(members) for members in by_episode.values())


def sampler_gap(sequences: list[TrainSequence],
                global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> float | None:
    """Mean |trainer - sampler| log-prob on the sampled tokens (over every rank's with `global_sum`); large
    values mean the sampler runs other weights (a server without the adapter, a fold that lost it)."""
    gaps = [abs(float(o) - s) for sequence in sequences if sequence.sampler_logprobs
            for o, s in zip(sequence.old_logprobs, sequence.sampler_logprobs) if not math.isnan(s)]
    total, count = global_sum(torch.tensor([sum(gaps), len(gaps)], dtype=torch.float64)).tolist()
    return total / count if count else None


def correct_for_the_sampler(sequences: list[TrainSequence], cap: float,
                            global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
    """Truncated importance weights min(pi_trainer_old / pi_sampler, cap) on every reply token (1 where the sampler
    reported no log-probs), and their mean and the fraction the cap bit over the tokens that came with the
    sampler's log-probs (vLLM's, or local generation's own; over every rank's with `global_sum`); no statistics
    when there are none."""
    weight_sum, capped, count = 0.0, 0.0, 0.0
    for sequence in sequences:
        if sequence.sampler_logprobs is None:
            sequence.importance_weights = torch.ones(sequence.response_len)
            continue
        sampler = torch.tensor(sequence.sampler_logprobs, dtype=sequence.old_logprobs.dtype)
        sequence.importance_weights, bit = truncated_importance_weights(sequence.old_logprobs, sampler, cap)
        known = ~torch.isnan(sampler)
        weight_sum += float(sequence.importance_weights[known].sum())
        capped += float(bit.sum())
        count += float(known.sum())
    weight_sum, capped, count = global_sum(torch.tensor([weight_sum, capped, count], dtype=torch.float64)).tolist()
    if not count:
        return {}
    return {"tis/weight_mean": weight_sum / count, "tis/clip_fraction": capped / count}
