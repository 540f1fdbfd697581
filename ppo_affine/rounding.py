"""Storing a merged float32 tensor in 16 bits without losing a small update: three ways to round it onto the bf16
grid, and the share of the update's effect on a layer's outputs the stored tensor keeps.

A bf16 weight W + ΔW rounded to nearest gives back W wherever |ΔW| is under half a bf16 step: a small PPO update is
mostly lost in the store. Stochastic rounding keeps it on average but adds noise larger than it; error feedback
(GPTQ's column-by-column update with the dtype's own grid) pushes each column's rounding error onto the columns not
yet rounded, weighted by the layer's input second moments (ppo_affine/calibration.py collects them from a run's
recorded episodes), so the stored layer's outputs on such inputs stay near the merged ones. `store` applies one of
them to a release tensor: a linear weight [out, in] or a fused expert weight [experts, ...] expert by expert.
"""
from __future__ import annotations

import torch

ROUNDINGS = ("nearest", "stochastic", "error-feedback")
DAMPING = 0.1  # error feedback's damping, a share of the second moment's mean diagonal: measured best of 0.01 and 0.1
ACT_ORDER = True  # error feedback takes the columns by input energy, largest first (GPTQ act-order): measured best


def round_stochastic(merged: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """bf16 of `merged` (float32) rounded up or down at random in proportion to its distance to each neighbour (an
    unbiased rounding: the expected stored value is `merged`), seeded by `generator`. bf16 keeps the top 16 bits of a
    float32, so a uniform 16-bit integer is added to the magnitude's bits before they are cut."""
    bits = merged.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32)
    return ((bits + noise) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def round_error_feedback(merged: torch.Tensor, second_moment: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         damping: float = 0.01, block: int = 128, act_order: bool = False) -> torch.Tensor:
    """`merged` ([out, in], float32) rounded to `dtype`'s grid column by column, each column's rounding error pushed
    onto the columns not yet rounded in proportion to how the layer's inputs correlate (GPTQ's update, with the
    rounding grid the dtype's own instead of a 4-bit one): it minimises the output error on inputs whose second
    moment E[x xᵀ] is `second_moment` ([in, in]). With uncorrelated inputs (a diagonal second moment) no error moves
    and it is round-to-nearest."""
    if act_order:  # GPTQ's act-order: the columns with the most input energy first, the rest absorb their errors
        order = torch.argsort(second_moment.diagonal(), descending=True, stable=True)
        stored = round_error_feedback(merged[:, order], second_moment[order][:, order], dtype, damping, block)
        return stored[:, torch.argsort(order)]
    weight = merged.float().clone()
    columns = weight.shape[1]
    hessian = second_moment.double().clone()
    hessian += damping * hessian.diagonal().mean() * torch.eye(columns, dtype=torch.float64)
    # the upper Cholesky factor of H⁻¹: row i gives how column i's error spreads onto the columns after it
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True).float()
    stored = torch.empty_like(weight)
    for start in range(0, columns, block):
        end = min(start + block, columns)
        chunk, errors = weight[:, start:end].clone(), torch.empty(weight.shape[0], end - start)
        for i in range(end - start):
            column = chunk[:, i]
            rounded = column.to(dtype).float()
            stored[:, start + i] = rounded
            error = (column - rounded) / inverse[start + i, start + i]
            chunk[:, i:] -= error.unsqueeze(1) * inverse[start + i, start + i:end].unsqueeze(0)
            errors[:, i] = error
        weight[:, end:] -= errors @ inverse[start:end, end:]
    return stored.to(dtype)


def output_kept_share(update: torch.Tensor, stored_error: torch.Tensor,
                      second_moment: torch.Tensor | None = None) -> float:
    """The share of an update's effect on a layer's outputs that the stored weight keeps, over inputs of second
    moment E[x xᵀ] = `second_moment` (None: uncorrelated inputs of unit variance, the identity): 1 −
    E|x·(stored − merged)ᵀ|² / E|x·updateᵀ|² (1: all of it; 0: as little as storing the base weight unchanged;
    below 0: the rounding moved the layer further than the update). An update of zero keeps all of itself. A fused
    expert weight [experts, out, in] takes one second moment per expert ([experts, in, in]) and sums its experts."""
    def energy(matrix: torch.Tensor) -> float:
        if second_moment is not None and second_moment.dim() == 3:
            return sum(_output_energy(m, s) for m, s in zip(matrix, second_moment))
        return _output_energy(matrix, second_moment)

    total = energy(update)
    if total == 0.0:
        return 1.0
    return 1.0 - energy(stored_error) / total


def _output_energy(matrix: torch.Tensor, second_moment: torch.Tensor | None) -> float:
    """E|x·matrixᵀ|² over inputs of second moment `second_moment` (None: the identity)."""
    matrix = matrix.double().reshape(-1, matrix.shape[-1])
    if second_moment is None:
        return float(matrix.pow(2).sum())
    return float(((matrix @ second_moment.double()) * matrix).sum())


def store(method: str, merged: torch.Tensor, dtype: torch.dtype, moment: torch.Tensor | None = None,
          generator: torch.Generator | None = None, as_linear: bool = True) -> torch.Tensor:
    """A merged float32 release tensor stored in `dtype` by `method` (one of ROUNDINGS). Only the 16-bit floats
    round: float32 is a plain cast, and stochastic rounding falls back to nearest outside bf16. Error feedback needs
    `moment`, the second moment of the layer's inputs: [in, in] for a weight [out, in] (`as_linear`; else it is
    stored [in, out]), [experts, in, in] for a fused expert weight [experts, ...], rounded expert by expert; an
    expert no calibration token reached (a zero moment) is rounded to nearest."""
    if method not in ROUNDINGS:
        raise ValueError(f"rounding {method!r} is not one of {ROUNDINGS}")
    if method == "nearest" or dtype not in (torch.bfloat16, torch.float16):
        return merged.to(dtype)
    if method == "stochastic":
        return round_stochastic(merged, generator) if dtype == torch.bfloat16 else merged.to(dtype)
    if moment is None:
        raise ValueError("error-feedback rounding needs the layer's input second moment")
    if merged.dim() == 3:
        return torch.stack([store(method, merged[e], dtype, moment[e], generator, as_linear)
                            for e in range(len(merged))])
    if not float(moment.diagonal().sum()) > 0:
        return merged.to(dtype)
    if not as_linear:
        return round_error_feedback(merged.T, moment, dtype, DAMPING, act_order=ACT_ORDER).T.contiguous()
    return round_error_feedback(merged, moment, dtype, DAMPING, act_order=ACT_ORDER)
