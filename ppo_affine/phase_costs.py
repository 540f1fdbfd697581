"""What a step's phases cost in memory, beside what the memory plan says they should: the resident memory each phase
adds at its peak, and the plan's arithmetic for the same phase at the sizes the step really had.

Linux keeps a process's resident high-water mark (VmHWM in /proc/self/status) and resets it on a write of "5" to
/proc/self/clear_refs, so a phase's own peak is read without sampling: reset at the phase's start, read at its end.
Where that reset is refused (not Linux, a kernel without it), no phase peak is logged: a lifetime peak would blame
one phase for another's.

The plan's figures (`ppo_affine/memory_plan.py`) compare with the rise of a phase's peak above the memory resident at
its start, which already holds the weights, the adapter and its optimizer state: for an update, the activations of
the largest pass and the LM head's chunk at the step's longest sequence; for a rollout, the keys and values of the
most tokens the decode caches held at once (perf/kv_peak_tokens) and the folded adapter's copy of each weight it
adapts. Only a CPU run's resident memory is what the plan describes: on an accelerator these figures are the host's,
so the plan is not put beside them there. What the plan leaves out on a CPU (docs/benchmarks.md, "An agent episode's
cost on the CPU"): the first rollout pages in the weights mapped from their file, and glibc's heap keeps freed
buffers of an update's passes resident (allocator.training_allocations keeps those under 16 MB in it, for speed).
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def resident_bytes() -> int | None:
    """The process's resident memory now (VmRSS); None off Linux."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """The process's resident high-water mark since start or since the last `reset_peak` (VmHWM); None off Linux."""
    return _status_bytes("VmHWM")


def reset_peak() -> bool:
    """Start the resident high-water mark again from the current resident memory; False where it cannot be."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


@contextlib.contextmanager
def phase_peak(metrics: dict, phase: str, enabled: bool = True) -> Iterator[None]:
    """Record in `metrics` the phase's peak resident memory (perf/<phase>_peak_rss_bytes) and its rise above the
    memory resident at the phase's start (perf/<phase>_rss_rise_bytes). Not `enabled` (two phases overlap, as
    under async_steps) or where the high-water mark cannot be reset, nothing is recorded."""
    start = resident_bytes() if enabled and reset_peak() else None
    yield
    peak = peak_resident_bytes() if start is not None else None
    if peak is not None:
        metrics[f"perf/{phase}_peak_rss_bytes"] = float(peak)
        metrics[f"perf/{phase}_rss_rise_bytes"] = float(max(0, peak - start))


class PlannedPhases:
    """The memory plan's figures for one run's phases; its activation probe (one layer at the model's width) runs at
    the first update that asks, with the global random state left as it was."""

    def __init__(self, model_config, train_cfg):
        from ppo_affine.memory_plan import RunShape

        self.config = model_config
        self.shape = RunShape.of(train_cfg, gpu=False)
        self._per_kind: dict[str, float] | None = None
        self._model = None

    def update_bytes(self, lengths: list[int], micro_batch_tokens: int) -> float:
        """Activations + the LM head's memory of the largest pass of a step whose sequences have `lengths` tokens, in
        micro-batches of `micro_batch_tokens`: the longest sequence (alone in its pass when longer than a
        micro-batch), or a full micro-batch where the step's tokens fill one (the plan's worst case for a run is a
        full micro-batch: a step of fewer tokens never holds one)."""
        from ppo_affine.memory_plan import activation_bytes, head_bytes, meta_model, probe_activations

        if self._per_kind is None:
            with torch.random.fork_rng(devices=[]):  # the probe seeds torch: the run's draws must not move
                self._per_kind = probe_activations(self.config, self.shape)
            self._model = meta_model(self.config)
        longest = max(lengths)
        shape = dataclasses.replace(self.shape, micro_batch_tokens=min(micro_batch_tokens, sum(lengths)),
                                    context_tokens=longest, longest_sequence=longest)
        vocab = self._model.get_output_embeddings().weight.shape[0]
        hidden = self.config.get_text_config().hidden_size
        return activation_bytes(self.config, shape, self._per_kind) + head_bytes(shape, self._per_kind, vocab, hidden)



def planned_against_measured(metrics: dict, phase: str, planned: float) -> None:
    """perf/<phase>_planned_bytes, and perf/<phase>_planned_over_measured where the phase's rise was measured."""
    metrics[f"perf/{phase}_planned_bytes"] = float(planned)
    rise = metrics.get(f"perf/{phase}_rss_rise_bytes")
    if rise:
        metrics[f"perf/{phase}_planned_over_measured"] = planned / rise


@dataclass
class GenerationTime:
    """Where a rollout's local generation spent its time. `step_seconds` is the wall time with a decode-loop step in
    flight (the rest of the rollout is the envs' and harnesses' own time: perf/env_seconds); within the steps,
    `prefill_seconds` ran joining rows' prompts and `decode_seconds` the running rows' next token. On a CPU a step
    computes as it runs, so these are its compute times; on an accelerator they are launch times and the device's
    work is in `step_seconds` only. `decode_tokens` counts the tokens decode steps sampled, `prefill_rows` the rows a
    prefill started (each samples its next reply token there): their sum is every token the rollout generated."""
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    step_seconds: float = 0.0
    decode_tokens: int = 0
    prefill_rows: int = 0

    def metrics(self) -> dict[str, float]:
        return {"perf/generation_seconds": self.step_seconds, "perf/prefill_seconds": self.prefill_seconds,
                "perf/decode_seconds": self.decode_seconds, "perf/decode_tokens": float(self.decode_tokens),
                "perf/prefill_rows": float(self.prefill_rows)}
