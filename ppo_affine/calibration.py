"""A run's own recorded episodes as calibration for the bf16 merge: which episodes calibrate and which judge, and the
second moments E[x xᵀ] of the inputs of every adapted weight on them.

The episodes are samples.jsonl's (each model call's prompt and sampled ids: `logging.log_samples_every`). They are
split by their (step, episode) key, sorted: every other one calibrates (the error-feedback rounding's second
moments), the rest are held out to judge the stored model (the per-layer output kept share; the KL of
bench/merge_rounding.py), so no episode both tunes and judges the rounding.

The moments come from a forward of the adapter-on-base model (the trained model: the merged one should reproduce its
layers' outputs) over the episodes' token sequences, a hook on each adapted layer adding xᵀx of its inputs: one
[in, in] float32 sum per distinct adapted input (q/k/v share theirs, as gate/up do), and for routed experts one per
expert over only the tokens the router sent to it (its down projection's inputs recomputed from those tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_affine.config import ConfigError
from ppo_affine.decode_caches import free_memory_bytes
from ppo_affine.run_log import SAMPLES_FILE

HELD_OUT_EVERY = 2  # one episode in two judges the rounding


@dataclass(frozen=True)
class RecordedEpisode:
    """One recorded episode: its (step, episode) key and each model call's prompt + sampled ids."""

    key: tuple[int, int]
    sequences: tuple[tuple[int, ...], ...]
    response_starts: tuple[int, ...]  # where each sequence's sampled ids begin


def episodes_file(path: Path) -> Path:
    """A run folder's samples.jsonl, or the file itself."""
    path = Path(path)
    return path / SAMPLES_FILE if path.is_dir() else path


def read_episodes(path: Path) -> list[RecordedEpisode]:
    """The episodes recorded in `path` (a run folder or its samples.jsonl), sorted by (step, episode); a ConfigError
    in one line naming the file when it is missing, unreadable or holds no model call."""
    file = episodes_file(path)
    if not file.is_file():
        raise ConfigError(f"{file} does not exist: calibration reads a run's recorded episodes (a run records them "
                          "with logging.log_samples_every=N); pass --episodes RUN_FOLDER or --rounding nearest.")
    episodes = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            calls = record["calls"]
            sequences = tuple(tuple(call["prompt_ids"]) + tuple(call["token_ids"]) for call in calls)
            starts = tuple(len(call["prompt_ids"]) for call in calls)
            key = (int(record["step"]), int(record.get("episode", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{file} line {number} is not a recorded episode with model calls (prompt_ids, "
                              f"token_ids): {type(exc).__name__}: {exc}") from None
        if sequences:
            episodes.append(RecordedEpisode(key, sequences, starts))
    if not episodes:
        raise ConfigError(f"{file} records no model call: calibration needs a run's recorded episodes.")
    return sorted(episodes, key=lambda episode: episode.key)


def split_episodes(episodes: list[RecordedEpisode]) -> tuple[list[RecordedEpisode], list[RecordedEpisode]]:
    """(calibration, held out): in (step, episode) order every HELD_OUT_EVERY-th episode from the second on is held
    out, the others calibrate; a key recorded twice stays on one side. At least one episode on each side: a
    ConfigError when there are fewer than two."""
    keys = sorted({episode.key for episode in episodes})
    held_keys = set(keys[1::HELD_OUT_EVERY])
    calibration = [e for e in episodes if e.key not in held_keys]
    held_out = [e for e in episodes if e.key in held_keys]
    if not calibration or not held_out:
        raise ConfigError(f"{len(keys)} recorded episode(s): calibration and held-out need one each at least.")
    return calibration, held_out


def token_sequences(episodes: list[RecordedEpisode], max_tokens: int) -> list[list[int]]:
    """The episodes' call sequences in order, until `max_tokens` tokens are taken (the last one cut to fit)."""
    taken, sequences = 0, []
    for episode in episodes:
        for sequence in episode.sequences:
            if taken >= max_tokens:
                return sequences
            sequences.append(list(sequence[:max_tokens - taken]))
            taken += len(sequences[-1])
    return sequences


# ---------------------------------------------------------------------------------------------- the moments
def _experts_module(layer):
    """The routed-experts module under a peft parameter wrapper (None for a linear layer)."""
    if getattr(layer, "num_experts", 1) <= 1:
        return None
    return layer.get_base_layer()


def moment_bytes(layers: dict[str, object]) -> int:
    """An upper bound of the float32 bytes `collect_moments` holds: an [in, in] sum per adapted layer (layers sharing
    an input share it, not counted here), [experts, in, in] per routed-expert weight (transformers stores those as
    [experts, out, in])."""
    total = 0
    for layer in layers.values():
        experts = _experts_module(layer)
        if experts is None:
            total += layer.in_features ** 2 * 4
        else:
            shape = getattr(experts, layer.parameter_name).shape
            total += shape[0] * shape[-1] ** 2 * 4
    return total


def check_moment_memory(layers: dict[str, object]) -> None:
    """A ConfigError before the model loads when the two sets of moments (calibration and held out) would not fit
    in half the memory free now (routed experts adapted on a large MoE: one [in, in] per expert and layer)."""
    needed, free = 2 * moment_bytes(layers), free_memory_bytes(torch.device("cpu"))  # the sums live on the host
    if needed > free // 2:
        raise ConfigError(f"error feedback's input second moments would hold {needed / 2**30:.1f} GB (calibration and "
                          f"held out, float32, {len(layers)} adapted weights), more than half the {free / 2**30:.1f} "
                          "GB free: pass --rounding nearest (or merge on a host with more memory).")


@torch.no_grad()
def collect_moments(model, layers: dict[str, object], sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """E[x xᵀ] (float32) of each adapted layer's inputs (`layers`: loaded name -> peft layer, as
    release_files.adapted_layers names them) over every token of `sequences` run through `model` (the adapter on its
    base, eval mode): [in, in] for a linear layer, [experts, in, in] for a fused routed-expert weight, each expert's
    over the tokens routed to it only (an expert no token reached: zeros). Layers fed the same tensor share one sum."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}
    last: dict[str, object] = {}  # the last linear input seen and the layer whose sum took it
    aliases: set[str] = set()  # layers fed the same tensor as the one before (k/v after q, up after gate)

    def linear_hook(name: str):
        def record(module, args):
            if name in aliases:
                return
            if name not in sums:
                if last.get("input") is args[0]:
                    sums[name], counts[name] = sums[last["owner"]], counts[last["owner"]]
                    aliases.add(name)
                    return
                sums[name], counts[name] = torch.zeros(args[0].shape[-1], args[0].shape[-1]), torch.zeros(())
            inputs = args[0].reshape(-1, args[0].shape[-1]).float()
            sums[name] += (inputs.T @ inputs).cpu()
            counts[name] += len(inputs)
            last.update(input=args[0], owner=name)
        return record

    def experts_hook(names: dict[str, str]):  # parameter name -> loaded name
        def record(module, args, kwargs):
            hidden = (args[0] if args else kwargs["hidden_states"]).float()
            routed = args[1] if len(args) > 1 else kwargs["top_k_index"]
            for expert in range(module.num_experts):
                tokens = (routed == expert).any(dim=-1).nonzero().flatten()
                if not len(tokens):
                    continue
                inputs = hidden[tokens]
                _add(names.get("gate_up_proj"), expert, inputs, module.num_experts)
                if "down_proj" in names:
                    gate, up = torch.nn.functional.linear(inputs, module.gate_up_proj[expert].float()).chunk(2, -1)
                    _add(names["down_proj"], expert, module.act_fn(gate) * up, module.num_experts)
        return record

    def _add(name: str | None, expert: int, inputs: torch.Tensor, experts: int) -> None:
        if name is None:
            return
        if name not in sums:
            sums[name] = torch.zeros(experts, inputs.shape[1], inputs.shape[1])
            counts[name] = torch.zeros(experts)
        sums[name][expert] += (inputs.T @ inputs).cpu()
        counts[name][expert] += len(inputs)

    handles, by_experts = [], {}
    for name, layer in layers.items():
        experts = _experts_module(layer)
        if experts is None:
            handles.append(layer.register_forward_pre_hook(linear_hook(name)))
        else:
            by_experts.setdefault(experts, {})[layer.parameter_name] = name
    for experts, names in by_experts.items():
        handles.append(experts.register_forward_pre_hook(experts_hook(names), with_kwargs=True))
    device = next(model.parameters()).device
    try:
        for ids in sequences:
            last.clear()
            model(input_ids=torch.tensor([ids], device=device))
    finally:
        for handle in handles:
            handle.remove()
    moments, means = {}, {}  # means: one per distinct sum, so layers sharing an input share one moment
    for name in layers:
        if name not in sums:
            raise ConfigError(f"no calibration input reached {name}: the recorded episodes do not run through it")
        count = counts[name]
        if id(sums[name]) not in means:
            means[id(sums[name])] = sums[name] / count.clamp(min=1).reshape(-1, *([1, 1] if count.dim() else []))
        moments[name] = means[id(sums[name])]
    return moments


CALIBRATION_TOKENS = 32768  # tokens of calibration (and as many held out) run through the model at most


@dataclass
class Calibration:
    """The calibration and held-out moments of every adapted layer, and what they were computed from."""

    moments: dict[str, torch.Tensor]
    held_out: dict[str, torch.Tensor]
    calibration_tokens: int
    held_out_tokens: int
    episodes: tuple[int, int]  # (calibrating, held out)


def calibrate(model_cfg, adapter_dir: Path, episodes_path: Path, device: torch.device,
              max_tokens: int = CALIBRATION_TOKENS) -> Calibration:
    """The moments of `collect_moments` on the calibration and on the held-out episodes recorded in `episodes_path`,
    through the adapter in `adapter_dir` on the base model of `model_cfg` loaded in bf16 (the release's dtype: no
    float32 copy of the base; after a 4-bit run its NF4 weights dequantised to bf16) on `device`. The episodes are
    read and split before anything loads."""
    from ppo_affine.model_files import load_adapter_model, load_dequantised_base, model_source
    from ppo_affine.release_files import adapted_layers, adapter_on_skeleton

    calibration, held_out = split_episodes(read_episodes(episodes_path))
    check_moment_memory(adapted_layers(adapter_on_skeleton(model_source(model_cfg), Path(adapter_dir),
                                                           model_cfg.name_or_path, model_cfg.trust_remote_code)))
    base = load_dequantised_base(model_cfg.model_copy(update={"dtype": "bfloat16", "gradient_checkpointing": False}),
                                 device)
    model = load_adapter_model(base, Path(adapter_dir), model_cfg.name_or_path).eval()
    layers = adapted_layers(model)
    sequences = [token_sequences(part, max_tokens) for part in (calibration, held_out)]
    moments = [collect_moments(model, layers, part) for part in sequences]
    del model, base
    return Calibration(moments[0], moments[1], sum(map(len, sequences[0])), sum(map(len, sequences[1])),
                       (len(calibration), len(held_out)))
