"""PPO math on token tensors: log-probs, masked statistics, GAE, group baselines, losses, KL.

Pure functions of tensors (no I/O, no model). Conventions shared by every function:
- Batches are `[B, T]`: row = one episode's tokens, `mask` is 1 (or True) on the generated
  tokens that are trained on and 0 elsewhere. Masks are 0/1, not weights.
- Means over tokens are means over all valid tokens of the batch (token-level, not per row).
- An empty mask never produces NaN: means and variances are 0 there.
- Log-softmax, entropies and losses are computed in fp32 whatever the logits' dtype.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

# A chunk of rows holds about this many logits (128 MiB in fp32), so the fp32 temporaries of
# log-softmax never cover the whole vocabulary of the whole batch at once.
CHUNK_ELEMENTS = 2**25
# Log-ratios beyond this are clamped before exp: e^20 is already a meaningless ratio.
LOG_RATIO_LIMIT = 20.0
WHITEN_EPS = 1e-8
KL_KINDS = ("k1", "k2", "k3", "abs")


def _map_row_chunks(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, *per_row: torch.Tensor, chunk_size: int | None
) -> torch.Tensor:
    """Apply `fn(logits_rows, *per_row_rows) -> [n, ...]` over chunks of the flattened rows of `logits`."""
    vocab = logits.shape[-1]
    rows = chunk_size or max(1, CHUNK_ELEMENTS // vocab)
    flat_logits = logits.reshape(-1, vocab)  # [B*T, V]
    flat_per_row = [t.reshape(-1) for t in per_row]  # [B*T] each
    # Without checkpointing, autograd would keep each chunk's fp32 copy / softmax until backward,
    # i.e. the full-vocab tensor we avoid here; recomputing one chunk in backward is cheap.
    recompute = torch.is_grad_enabled() and logits.requires_grad
    outputs = []
    for start in range(0, flat_logits.shape[0], rows):
        args = (flat_logits[start : start + rows], *(t[start : start + rows] for t in flat_per_row))
        outputs.append(checkpoint(fn, *args, use_reentrant=False) if recompute else fn(*args))
    if not outputs:
        return logits.new_zeros(logits.shape[:-1], dtype=torch.float32)
    merged = torch.cat(outputs)
    return merged.view(*logits.shape[:-1], *merged.shape[1:])


def _label_logprob(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()  # [n, V]
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [n]
    return label_logits - torch.logsumexp(logits, dim=-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float()  # [n, V]
    log_partition = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    probs = (logits - log_partition).exp_()
    # H = log Z - sum_v p_v z_v; vecdot avoids another [n, V] product tensor
    return log_partition.squeeze(-1) - torch.linalg.vecdot(probs, logits)


def _label_logprob_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.float()  # [n, V]
    log_partition = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1], shared by both
    label_logprob = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_partition.squeeze(-1)
    entropy = log_partition.squeeze(-1) - torch.linalg.vecdot((logits - log_partition).exp_(), logits)
    return torch.stack([label_logprob, entropy], dim=-1)  # [n, 2]


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """fp32 log-probability of each label: logits [B, T, V], labels [B, T] -> [B, T].

    `chunk_size` is rows per chunk (default: about CHUNK_ELEMENTS logits per chunk).
    """
    return _map_row_chunks(_label_logprob, logits, labels, chunk_size=chunk_size)


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both per-token log-probability of the label and entropy, in one pass over the vocabulary:
    logits [B, T, V], labels [B, T] -> ([B, T], [B, T])."""
    both = _map_row_chunks(_label_logprob_and_entropy, logits, labels, chunk_size=chunk_size)  # [B, T, 2]
    return both[..., 0], both[..., 1]


def logprobs_from_hidden(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, *, temperature: float = 1.0,
    with_entropy: bool = False, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probability of each label (and the entropy of its distribution) from the hidden states that
    predict it: hidden [N, H], labels [N] -> ([N], [N] or None). `head` (the LM head, [H] -> [V]) runs on one chunk
    of rows at a time and, with gradients, again in backward: the [N, V] logits never exist at once, so their memory
    is one chunk's whatever N is (a 64 k-token episode would need 64 GB of fp32 logits at a 248 k vocabulary).
    `temperature` (> 0, not 1) divides the logits: the distribution that was sampled from. The numbers are those of
    the full logits through `logprobs_from_logits` / `logprobs_and_entropy_from_logits`."""
    vocab = head.weight.shape[0]
    rows = chunk_size or max(1, CHUNK_ELEMENTS // vocab)
    scaled = temperature > 0 and temperature != 1.0

    def chunk_terms(hidden_rows: torch.Tensor, label_rows: torch.Tensor) -> torch.Tensor:
        logits = head(hidden_rows)  # [n, V] in the head's dtype, as the whole model's forward makes them
        if scaled:
            logits = logits / temperature
        if with_entropy:
            return _label_logprob_and_entropy(logits, label_rows)  # [n, 2]
        return _label_logprob(logits, label_rows)  # [n]

    # checkpoint keeps only each chunk's input rows for backward and recomputes its logits there
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    outputs = [checkpoint(chunk_terms, hidden[start: start + rows], labels[start: start + rows], use_reentrant=False)
               if recompute else chunk_terms(hidden[start: start + rows], labels[start: start + rows])
               for start in range(0, hidden.shape[0], rows)]
    if not outputs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    merged = torch.cat(outputs)
    return (merged[:, 0], merged[:, 1]) if with_entropy else (merged, None)


def entropy_from_logits(
    logits: torch.Tensor, mask: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """Masked mean entropy (nats) of softmax(logits) over valid tokens: [B, T, V], [B, T] -> 0-dim."""
    token_entropy = _map_row_chunks(_entropy, logits, chunk_size=chunk_size)  # [B, T]
    return masked_mean(token_entropy, mask)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is set (along `dim`, or all); 0 where none is set."""
    valid = mask.bool()
    # where, not x * mask: padding may hold inf/NaN, and 0 * inf is NaN
    total = torch.where(valid, x, 0).sum(dim=dim)
    count = valid.sum(dim=dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid entries of `x` (0-dim); 0 when there are fewer than 2 (unbiased) or none."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.bool().sum()
        var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), 0)
    return var


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    global_sum: Callable[[torch.Tensor], torch.Tensor] = _unchanged,
) -> torch.Tensor:
    """Scale the valid entries to unit (unbiased) variance and, with `shift_mean`, zero mean.

    Without `shift_mean` the valid entries keep their mean. Masked positions are 0 in the output.
    When `x` is one part of a batch split over ranks, `global_sum` sums a tensor over every part, so
    the mean and variance are the whole batch's (the default: `x` is the whole batch).
    """
    valid = mask.bool()
    # two passes (mean, then squared deviations), each summed in float64 over every part of the batch
    total, count = global_sum(torch.stack([torch.where(valid, x.double(), 0).sum(), valid.sum().double()]))
    mean = (total / count.clamp(min=1)).to(x.dtype)
    squares = global_sum(torch.where(valid, (x - mean).double() ** 2, 0).sum().reshape(1))[0]
    var = torch.where(count > 1, squares / (count - 1).clamp(min=1), 0).to(x.dtype)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0)


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns (= advantages + values), each [B, T].

    Each row is one episode's generated tokens in order (across turns). Masked positions are
    skipped: padding after the last valid token, and any gap (e.g. prompt tokens between turns),
    so the last valid token bootstraps from 0 and a gap neither breaks nor discounts the chain.
    Masked positions get advantage 0 and return 0. A nonzero reward on a masked position raises
    ValueError, since it would be silently lost: put each turn's reward on its last generated token.
    No whitening here.
    """
    valid = mask.bool()  # [B, T]
    if torch.any(torch.where(valid, 0, rewards) != 0):
        raise ValueError(
            "compute_gae: nonzero reward on a masked position would be lost; "
            "place each turn's reward on its last generated (mask=1) token"
        )
    # returns are regression targets: no gradient may flow back into the value head through them
    values = values.detach()
    rewards = rewards.detach()
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])  # [B], value of the next valid token; 0 after the episode
    next_advantage = torch.zeros_like(values[:, 0])  # [B]
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid[:, t], advantage, 0)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    returns = torch.where(valid, advantages + values, 0)
    return advantages, returns


def group_advantages(
    returns: torch.Tensor, group_ids: torch.Tensor | Sequence[int], eps: float = 1e-6
) -> torch.Tensor:
    """(R - group mean) / (group sample std + eps) per episode, [N] -> [N].

    Episodes with equal `group_ids` form a group. A group of one, or whose returns are all
    equal, gets advantage 0 (no learning signal, and no NaN).
    """
    ids = torch.as_tensor(group_ids, device=returns.device)
    if returns.dim() != 1 or ids.shape != returns.shape:
        raise ValueError(
            f"group_advantages expects 1-D returns and group_ids of the same length, "
            f"got shapes {tuple(returns.shape)} and {tuple(ids.shape)}"
        )
    _, group_of, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # [N], [G]
    n_groups = counts.numel()
    x = returns.detach().double()  # [N]; float64 so the group statistics don't round away small spreads
    group_sum = x.new_zeros(n_groups).index_add_(0, group_of, x)
    centered = x - (group_sum / counts)[group_of]
    squares = x.new_zeros(n_groups).index_add_(0, group_of, centered**2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))  # [G], sample std
    # exact test for "all equal" (covers singletons): rounding could leave centered ~1e-17, not 0
    group_max = x.new_full((n_groups,), -torch.inf).scatter_reduce_(0, group_of, x, "amax")
    group_min = x.new_full((n_groups,), torch.inf).scatter_reduce_(0, group_of, x, "amin")
    constant = (group_max == group_min)[group_of]
    advantages = torch.where(constant, 0.0, centered / (std[group_of] + eps))
    return advantages.to(returns.dtype)


def softmax_advantage_preference(nll_per_token: torch.Tensor, tau_floor: float = 0.0) -> torch.Tensor:
    """DISTILL-V2's preference over a cell's rollouts, p = softmax(-c / tau), [N] -> [N] float64.

    c is each rollout's mean NLL per loss token, tau the population std of the c's, differentiated through: the
    score is scale-free in c, and holding tau constant would reward spreading the c's apart (making weak rollouts
    unlikely) rather than ranking them. No spread (one rollout, equal c's) is no preference: uniform p.
    `tau_floor` > 0 keeps tau off 0 for training; the env's own score uses 0.
    """
    c = nll_per_token.double()
    variance = ((c - c.mean()) ** 2).mean()
    if tau_floor > 0:
        tau = variance.clamp(min=tau_floor**2).sqrt()
    elif variance.item() <= 0:
        return torch.full_like(c, 1 / c.numel()) + 0 * c  # uniform; keeps the graph, with a zero gradient
    else:
        tau = variance.sqrt()
    return torch.softmax(-c / tau, dim=0)


def softmax_advantage_score(nll_per_token: torch.Tensor, advantages: torch.Tensor, tau_floor: float = 0.0
                            ) -> torch.Tensor:
    """DISTILL-V2's cell score S = sum_i p_i * a_i (p: `softmax_advantage_preference`, a: within-cell advantages)."""
    preference = softmax_advantage_preference(nll_per_token, tau_floor)
    return (preference * advantages.to(preference)).sum()


def softmax_advantage_gradient(nll_per_token: torch.Tensor, advantages: torch.Tensor, tau_floor: float = 0.0
                               ) -> tuple[float, torch.Tensor]:
    """The cell score and dS/dc_i, [N] -> (S, [N] float64), from c's values alone (no model graph).

    A cell's rollouts may not fit one micro-batch, so training takes two passes: the c's without gradients, then
    each rollout's own backward of g_i * c_i, which sums to the gradient of S through the whole cell.
    """
    c = nll_per_token.detach().double().requires_grad_(True)
    score = softmax_advantage_score(c, advantages.detach(), tau_floor)
    (gradient,) = torch.autograd.grad(score, c)
    return score.item(), gradient


def weighted_mean(x: torch.Tensor, weights: torch.Tensor, total_weight: float | None = None) -> torch.Tensor:
    """sum(weights * x) / total_weight (default: the sum of the weights); 0 where every weight is 0."""
    # where, not x * weights alone: padding may hold inf/NaN, and 0 * inf is NaN
    total = torch.where(weights != 0, x * weights, 0).sum()
    if total_weight is None:
        return total / weights.sum().clamp(min=1e-12)
    return total / max(total_weight, 1e-12)


def truncated_importance_weights(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, cap: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """min(pi_trainer / pi_sampler, cap) per token sampled by another process (vLLM), and where the cap bit:
    [R], [R] -> ([R], [R] bool). A token whose sampler log-prob is unknown (NaN) weighs 1."""
    known = ~torch.isnan(sampler_logprobs)
    ratio = torch.exp(torch.clamp(trainer_logprobs - sampler_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    capped = known & (ratio > cap)
    return torch.where(known, torch.clamp(ratio, max=cap), 1.0), capped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    cliprange: float,
    total_weight: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate PPO loss, all inputs [B, T]: the `weights`-weighted mean over tokens (a 0/1
    mask gives the plain token mean), divided by `total_weight` instead when the batch is one
    micro-batch of a larger minibatch. `importance_weights` (e.g. `truncated_importance_weights`) scale
    each token's surrogate and carry no gradient. Stats are plain means over the tokens with weight > 0."""
    mask = weights != 0
    log_ratio = logprobs - old_logprobs  # [B, T]
    clamped_log_ratio = torch.clamp(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(clamped_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    # where, not maximum: on ties the gradient goes whole to the unclipped term
    clip_selected = clipped > unclipped
    surrogate = torch.where(clip_selected, clipped, unclipped)  # [B, T]
    if importance_weights is not None:
        surrogate = surrogate * importance_weights.detach()
    loss = weighted_mean(surrogate, weights.float(), total_weight)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean(clip_selected.float(), mask).item(),
            "approx_kl_k1": masked_mean(-log_ratio, mask).item(),
            "approx_kl_k3": masked_mean((ratio - 1.0) - clamped_log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            # ratios are > 0, so a 0 at padding never wins; an empty mask gives 0
            "ratio_max": torch.where(mask, ratio, 0).max().item() if ratio.numel() else 0.0,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    weights: torch.Tensor,
    cliprange_value: float,
    total_weight: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * weighted mean of max((V - R)^2, (V_clipped - R)^2), V_clipped within ±c of the old value;
    `weights` and `total_weight` as in `policy_loss`."""
    mask = weights != 0
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2  # [B, T]
    clipped_error = (clipped_values - returns) ** 2
    clip_selected = clipped_error > unclipped_error
    loss = 0.5 * weighted_mean(torch.where(clip_selected, clipped_error, unclipped_error), weights.float(),
                               total_weight)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clip_selected.float(), mask).item(),
            "value_mean": masked_mean(values, mask).item(),
        }
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens; 0.0 when Var[R] is 0 (undefined)."""
    with torch.no_grad():
        returns_var = masked_var(returns, mask)
        if returns_var.item() == 0.0:
            return 0.0
        return (1.0 - masked_var(returns - values, mask) / returns_var).item()


def explained_variance_moments(values: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """[n, sum R, sum R^2, sum (R - V), sum (R - V)^2] of 1-D values and returns, in float64: moments of several
    parts (micro-batches, ranks) add up to the whole's."""
    returns = returns.double()
    errors = returns - values.double()
    count = torch.tensor(float(returns.numel()), dtype=torch.float64, device=returns.device)  # on the GPU too
    return torch.stack([count, returns.sum(), (returns**2).sum(), errors.sum(), (errors**2).sum()])


def explained_variance_from_moments(moments: torch.Tensor) -> float | None:
    """1 - Var[R - V] / Var[R] from `explained_variance_moments` (summed); 0.0 when Var[R] is 0, None under 2 values."""
    n, r, r2, e, e2 = moments.tolist()
    if n < 2:
        return None
    returns_var = (r2 - r * r / n) / (n - 1)
    errors_var = (e2 - e * e / n) / (n - 1)
    return 1.0 - errors_var / returns_var if returns_var > 1e-12 else 0.0


def pearson_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors; 0.0 when either is constant or has fewer than 2 entries."""
    x, y = x.double().flatten(), y.double().flatten()
    if x.numel() < 2 or x.shape != y.shape:
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    scale = torch.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / scale) if scale > 0 else 0.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens' log-probs, [B, T] -> [B, T].

    k1 = logp - ref, k2 = 0.5 (logp - ref)^2, k3 = exp(ref - logp) - 1 - (ref - logp), abs = |logp - ref|.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        ref_over_policy = torch.clamp(-log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return torch.exp(ref_over_policy) - 1.0 - ref_over_policy
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL penalty kind {kind!r}; expected one of {KL_KINDS}")


class AdaptiveKLController:
    """KL coefficient that moves the measured KL towards `target` (proportional control, ±20% error cap).

    The trainer measures KL per generated token, so one target fits replies of any length and games
    of any number of turns; `horizon` is in episodes."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs init_kl_coef >= 0, target > 0 and horizon > 0, "
                f"got {init_kl_coef}, {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by 1 + clip(KL/target - 1, ±0.2) * n_steps / horizon."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController:
    """Constant KL coefficient with the adaptive controller's interface."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
