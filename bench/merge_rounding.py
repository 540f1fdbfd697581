"""How much of a LoRA update survives storing the merged model in bf16, by rounding method: round-to-nearest, seeded
stochastic rounding, and error feedback on the bf16 grid weighted by calibration inputs' second moments
(`release_files.ROUNDINGS`).

SmolLM2-135M (the cpu preset's weights) cast to bf16 is the release; the "trained" model is it + a random rank-16
update on every attention and MLP projection whose RMS is `--update` of the weight's RMS (1e-3: the small-update
regime of a PPO run), in float32. Chat prompts are split in two: calibration (the layers' input second moments, as a
run's own recorded episodes would give them) and held-out, whose replies (sampled from the trained model) are judged:
kept = 1 − mean KL(trained ‖ merged) / mean KL(trained ‖ base) over the reply tokens; and per layer, the share of the
update's effect on its outputs the stored weight keeps on the held-out inputs (its minimum and median).

    OMP_NUM_THREADS=1 python -m bench.merge_rounding --update 1e-3

With `--episodes RUN` it measures merge.py itself on a run's own recorded episodes: the release is SmolLM2 cast to
bf16, the adapter a checkpoint's (`--checkpoint CKPT`, a real PPO adapter) or a random rank-16 one whose update is
`--update` of each weight's RMS (a copy of the checkpoint's adapter with random factors), and each rounding is the
streaming merge's (`merge.merge` with the calibration of `ppo_affine.calibration`: the run's episodes split in a
calibration and a held-out part). Judged over the sampled tokens of the held-out episodes' model calls: kept = 1 −
mean KL(trained ‖ merged) / mean KL(trained ‖ base), trained = the bf16 base + the adapter in float32, and the
layers' output kept share on the held-out inputs as merge.py prints it.

    python -m bench.merge_rounding --episodes RUN --checkpoint RUN/checkpoints/checkpoint-60 --adapters checkpoint,random
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ppo_affine.calibration import CALIBRATION_TOKENS
from ppo_affine.config import load_config
from ppo_affine.model_files import load_tokenizer, model_source
from ppo_affine.prompts import PromptBuilder
from ppo_affine.rounding import ROUNDINGS, output_kept_share, round_error_feedback, round_stochastic

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GAMES = ("leduc_poker", "liars_dice", "goofspiel", "gin_rummy", "tic_tac_toe", "connect_four", "hex", "othello")
REPLY_TOKENS = 24


def prompts(tokenizer, per_game: int) -> list[list[int]]:
    builder = PromptBuilder(tokenizer, 10**6)
    return [builder.encode([{"role": "system", "content": f"You are playing {game} as Player {turn % 2}."},
                            {"role": "user", "content": f"Turn {turn}. Legal actions:\n0 -> Fold\n1 -> Call\n"
                                                        f"2 -> Raise\nExplain briefly, then reply with the action ID."}])
            for game in GAMES for turn in range(1, per_game + 1)]


def random_updates(layers: dict[str, torch.nn.Linear], relative: float, rank: int = 16) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    updates = {}
    for name, layer in layers.items():
        out_features, in_features = layer.weight.shape
        update = torch.randn(out_features, rank, generator=generator) @ torch.randn(rank, in_features,
                                                                                    generator=generator)
        updates[name] = update * (relative * layer.weight.pow(2).mean().sqrt() / update.pow(2).mean().sqrt())
    return updates


@torch.no_grad()
def second_moments(model, layers: dict[str, torch.nn.Linear], sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """E[x xᵀ] of each layer's inputs over every token of `sequences`."""
    sums = {name: torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64) for name, layer in layers.items()}
    count = 0

    def hook(name):
        def record(module, args):
            inputs = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] += inputs.T @ inputs
        return record

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    for ids in sequences:
        model(input_ids=torch.tensor([ids]))
        count += len(ids)
    for handle in handles:
        handle.remove()
    return {name: total / count for name, total in sums.items()}


@torch.no_grad()
def reply_logprobs(model, sequences: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Per (prompt, reply): the log-probs over the vocabulary at each reply token's position."""
    out = []
    for prompt, reply in sequences:
        logits = model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1:-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """mean over tokens of KL(reference ‖ other)."""
    total = sum(float((r.exp() * (r - o)).sum()) for r, o in zip(reference, other))
    return total / sum(len(r) for r in reference)


def set_weights(layers: dict[str, torch.nn.Linear], weights: dict[str, torch.Tensor]) -> None:
    for name, layer in layers.items():
        layer.weight.copy_(weights[name])


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", type=float, default=1e-3, help="the update's RMS over the weight's (default 1e-3)")
    parser.add_argument("--prompts-per-game", type=int, default=2,
                        help="prompts per game (8 games; half calibrate, half are judged; default 2)")
    parser.add_argument("--episodes", type=Path, help="a run folder: measure merge.py on its recorded episodes")
    parser.add_argument("--checkpoint", type=Path, help="with --episodes: the run's checkpoint (its adapter)")
    parser.add_argument("--adapters", default="checkpoint",
                        help="with --episodes: 'checkpoint' (its own adapter) and/or 'random' (random factors of "
                             "--update RMS), comma-separated (default checkpoint)")
    parser.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                        help="with --episodes: merge.py's cap")
    parser.add_argument("--variants", default="nearest,stochastic,error-feedback,error-feedback+act-order",
                        help="with --episodes: the roundings measured (error feedback's +act-order: the columns by "
                             "input energy, largest first)")
    parser.add_argument("--damping", type=float, help="with --episodes: error feedback's damping (rounding.DAMPING)")
    parser.add_argument("--dampings", default="0.01",
                        help="error feedback's damping(s), a share of the second moment's mean diagonal (default 0.01)")
    args = parser.parse_args()
    if args.episodes is not None:
        import ppo_affine.rounding
        from bench.merge_kept import measure

        if args.damping is not None:
            ppo_affine.rounding.DAMPING = args.damping
        relatives = [None if kind == "checkpoint" else args.update for kind in args.adapters.split(",")]
        measure(args.episodes, args.checkpoint, relatives, args.calibration_tokens, args.variants.split(","))
        return
    model_cfg = load_config(presets=["cpu"]).train.model
    tokenizer = load_tokenizer(model_cfg)
    model = AutoModelForCausalLM.from_pretrained(model_source(model_cfg), dtype=torch.bfloat16).float().eval()
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS}
    base = {name: layer.weight.detach().clone() for name, layer in layers.items()}  # bf16 values
    updates = random_updates(layers, args.update)
    merged = {name: base[name] + updates[name] for name in layers}

    set_weights(layers, merged)  # the trained model: base + update in float32
    all_prompts = prompts(tokenizer, args.prompts_per_game)
    calibration, held_out = all_prompts[0::2], all_prompts[1::2]
    torch.manual_seed(0)
    replies = [model.generate(torch.tensor([p]), max_new_tokens=REPLY_TOKENS, do_sample=True, top_k=0,
                              pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in held_out]
    judged = list(zip(held_out, replies))
    calibrating = [p + model.generate(torch.tensor([p]), max_new_tokens=REPLY_TOKENS, do_sample=True, top_k=0,
                                      pad_token_id=tokenizer.eos_token_id)[0, len(p):].tolist() for p in calibration]
    trained = reply_logprobs(model, judged)
    calibration_moments = second_moments(model, layers, calibrating)
    held_out_moments = {n: m.float() for n, m in second_moments(model, layers, [p + r for p, r in judged]).items()}
    set_weights(layers, base)
    kl_base = mean_kl(trained, reply_logprobs(model, judged))

    generator = torch.Generator().manual_seed(0)
    tokens = sum(map(len, calibrating))
    for method, damping in [(m, None) for m in ROUNDINGS[:2]] + [(ROUNDINGS[2], float(d))
                                                                 for d in args.dampings.split(",")]:
        stored = {}
        for name in layers:
            if method == "nearest":
                stored[name] = merged[name].bfloat16().float()
            elif method == "stochastic":
                stored[name] = round_stochastic(merged[name], generator).float()
            else:
                stored[name] = round_error_feedback(merged[name], calibration_moments[name], damping=damping).float()
        set_weights(layers, stored)
        kl_merged = mean_kl(trained, reply_logprobs(model, judged))
        shares = [output_kept_share(updates[n], stored[n] - merged[n], held_out_moments[n]) for n in layers]
        print(json.dumps({"model": "smollm2 (bf16)", "update_rms": args.update, "method": method, "damping": damping,
                          "calibration_tokens": tokens, "judged_tokens": sum(map(len, replies)),
                          "kept": round(1 - kl_merged / kl_base, 4), "kl_trained_merged": kl_merged,
                          "kl_trained_base": kl_base, "layer_kept_min": round(min(shares), 4),
                          "layer_kept_median": round(statistics.median(shares), 4),
                          "layers_below_90": sum(s < 0.9 for s in shares), "layers": len(shares)}), flush=True)


if __name__ == "__main__":
    main()
