"""Does an anchor on another env's recorded episodes hold that env still while DISTILL-V2 cells train? Paired runs.

    python evaluate.py --base-only --preset cpu --games liars_dice --episodes 64 --opponent random --seed 9400 \
        --temperature 1 --context-strategy full --output-dir OUTPUT/anchor-liars_dice
    python -m bench.distill_anchor --output-dir OUTPUT --anchor-episodes OUTPUT/anchor-liars_dice/episodes.jsonl

OUTPUT holds the cells of `bench.distill_learning` (cells-train/, cells-held-out/; its --resume-cells run). The same
recipe (`--steps` AdamW steps on the LoRA, `--cells-per-step` training cells a step, the same seeded draws) runs
from the same start: `off`, the cells alone, and `on`, the anchor (ppo_affine/anchor.py) in the same optimizer
step, on the first (1 - held_out_share) of the recorded episodes, once per `--anchor-coef` (a comma list sweeps
the coefficient: `on@0.5` in run-on-coef0.5/). Then, for the base and each run:
- the held-out cells' DISTILL-V2 score (paired by cell with the base's);
- `--games` games of the trained game (leduc_poker) and of the anchored game against a random opponent at
  temperature 0, the same seeds for every model (the score paired by seed with the base's);
- the drift: on each held-out recorded episode of the anchored env (never anchored on), the mean over its reply
  tokens of the exact KL(trained || base) over the vocabulary, paired by episode between `on` and `off`.

Every part measured is saved as it is done (base.json, run-*/result.json) and skipped when it is there, every run's
cells and drift before any game; a training run saves after each step (run-*/state.pt), so `--stop-after-minutes`
(a lock's share) stops it between steps or parts and the same command continues it. A run's folder keeps the recipe
it was trained with: continuing or reusing it under another recipe stops with one line. OUTPUT/summary.json holds
the comparison once every run asked for is evaluated: per run the gains over the base, per anchored run its
difference from `off`, paired.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import torch

import evaluate
from bench.distill_learning import GAME, held_out_scores
from ppo_affine.anchor import AnchorTraining, read_anchor_episodes, split_held_out
from ppo_affine.config import AnchorConfig, load_config
from ppo_affine.distill import read_cells, render_rollout
from ppo_affine.distill.training import accumulate_cell_gradients
from ppo_affine.model_files import pick_device
from ppo_affine.policy import load_policy
from ppo_affine.report import mean_interval

RUNS = ("off", "on")


def run_names(runs: list[str], coefs: list[float]) -> list[str]:
    """--runs and --anchor-coef as run names, in order: `off`, and `on@<coef>` for each coef."""
    names = []
    for run in runs:
        names += ["off"] if run == "off" else [f"on@{coef:g}" for coef in coefs]
    return names


def run_folder(output_dir: Path, name: str) -> Path:
    return output_dir / ("run-off" if name == "off" else f"run-on-coef{name.removeprefix('on@')}")


def claim_folder(folder: Path, recipe: dict) -> None:
    """A folder's results hold for one recipe: recorded at its first use, and a later use under another recipe
    (a continued run with other steps, a rerun with other games) refused in one line rather than mixed."""
    path = folder / "recipe.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved != recipe:
            changed = sorted(k for k in saved.keys() | recipe.keys() if saved.get(k) != recipe.get(k))
            raise SystemExit(f"{folder}: measured with {', '.join(f'{k}={saved.get(k)}' for k in changed)}, asked "
                             f"{', '.join(f'{k}={recipe.get(k)}' for k in changed)}: use another --output-dir")
        return
    if any(folder.glob("*")):
        raise SystemExit(f"{folder}: holds results without a recipe.json (an older bench's): move it away or write "
                         f"the recipe it was run with into {path}")
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=1))


class OutOfTime(Exception):
    """--stop-after-minutes passed: what is done is saved."""


def reply_logprobs(policy, messages) -> torch.Tensor:
    """[n, V]: the log-softmax over the vocabulary at each position that predicts a reply token, given the recorded
    context; the LM head runs at those positions only."""
    rendered = render_rollout(messages, policy.tokenizer)
    ids = torch.tensor([rendered.input_ids], device=policy.device)
    at = torch.tensor(rendered.loss_mask[1:], device=policy.device).bool()  # position t predicts token t + 1
    model = policy.model.get_base_model()
    with torch.no_grad(), policy.evaluating():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, :-1][at]
        return torch.log_softmax(model.get_output_embeddings()(hidden).float(), -1)


def base_reply_logprobs(policy, drift_set, path: Path) -> list[torch.Tensor]:
    """The base's `reply_logprobs` of every drift episode (the LoRA switched off), computed once and kept in `path`."""
    if not path.exists():
        with policy.base():
            torch.save([reply_logprobs(policy, e.messages) for e in drift_set], path)
    return torch.load(path)


def drift_kl(policy, drift_set, base: list[torch.Tensor]) -> list[float]:
    """Per episode: the mean over its reply tokens of KL(policy || base), exact over the vocabulary."""
    kls = []
    for episode, base_logprobs in zip(drift_set, base):
        mine = reply_logprobs(policy, episode.messages)
        kls.append(float((mine.exp() * (mine - base_logprobs)).sum(-1).mean()))
    return kls


def play(config, policy, game: str, games: int, seed: int, path: Path) -> list[float]:
    """`games` games of `game` against a random opponent by the policy as it stands; the scores in task order."""
    tasks = evaluate.game_tasks(game, games, seed, "random", "openspiel")
    specs = evaluate.eval_env_specs(config, {"openspiel"})
    # an adapter folder named: the policy given plays as it stands (not with its LoRA switched off)
    records = asyncio.run(evaluate.evaluate(config, tasks, specs, Path("in-memory"), False, path, policy=policy))
    return [float(r["score"]) for r in records]


# what is compared for one model, in the order measured: the cheap and decisive parts before the games
PARTS = ("held_out_cells", "drift_kl", "trained_game", "anchored_game")


def measure(config, policy, args, anchored_game: str, held_cells, drift_set, folder: Path, path: Path,
            parts: tuple[str, ...], deadline: float) -> dict:
    """The `parts` of one model's measurement missing from `path` (a JSON object), each saved as it is done."""
    done = json.loads(path.read_text()) if path.exists() else {}
    for part in parts:
        if part in done:
            continue
        if time.monotonic() > deadline:
            raise OutOfTime(f"{path.parent.name}: {part} not measured yet")
        if part == "held_out_cells":
            done[part] = {str(k): v for k, v in held_out_scores(policy, held_cells).items()}
        elif part == "drift_kl":
            done[part] = drift_kl(policy, drift_set, base_reply_logprobs(policy, drift_set,
                                                                         args.output_dir / "base-replies.pt"))
        else:
            game = GAME if part == "trained_game" else anchored_game
            done[part] = play(config, policy, game, args.games, args.games_seed, folder / f"games-{game}.jsonl")
        path.write_text(json.dumps(done, indent=1))
    return done


def train(policy, args, run: str, train_cells, anchor_settings: AnchorConfig | None, max_grad_norm: float,
          folder: Path, deadline: float) -> list[dict]:
    """The recipe of bench.distill_learning (same seed, same draws), with the anchor in the step when given;
    saved after every step (LoRA, optimizer, draws), continued from there."""
    trainable = [p for name, p in policy.named_parameters() if p.requires_grad and "lora_" in name]
    optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate)
    draws = random.Random(args.seed)
    anchor = AnchorTraining(anchor_settings, seed=args.seed) if anchor_settings is not None else None
    state_path, curve = folder / "state.pt", []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        with torch.no_grad():
            for p, saved in zip(trainable, state["lora"]):
                p.copy_(saved)
        optimizer.load_state_dict(state["optimizer"])
        draws.setstate(state["draws"])
        if anchor is not None:
            anchor.load_state_dict(state["anchor"])
        curve = state["curve"]
    with policy.evaluating():  # dropout off: both passes of a cell see the same model
        while len(curve) < args.steps:
            if time.monotonic() > deadline:
                raise OutOfTime(f"run {run}: {len(curve)} of {args.steps} steps")
            optimizer.zero_grad(set_to_none=True)
            chosen = draws.sample(train_cells, min(args.cells_per_step, len(train_cells)))
            result = accumulate_cell_gradients(policy, chosen)
            anchored = anchor.accumulate(policy) if anchor is not None else {}
            torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm)
            optimizer.step()
            curve.append({"cells_score": round(result.score, 4), **{k: round(v, 5) for k, v in anchored.items()}})
            print(f"run {run} step {len(curve)}: {curve[-1]}", flush=True)
            torch.save({"lora": [p.detach().clone() for p in trainable], "optimizer": optimizer.state_dict(),
                        "draws": draws.getstate(), "anchor": anchor.state_dict() if anchor else None,
                        "curve": curve}, folder / "state.tmp")
            (folder / "state.tmp").replace(state_path)
    return curve


def paired(after: list[float], before: list[float]) -> dict:
    differences = [a - b for a, b in zip(after, before)]
    mean, ci95 = mean_interval(differences)
    return {"mean": mean, "ci95": ci95, "up": sum(d > 0 for d in differences),
            "down": sum(d < 0 for d in differences), "n": len(differences)}


def compare(base: dict, runs: dict[str, dict]) -> dict:
    """Per run: the gains over the base, paired; per anchored run: its difference from `off` in every measure,
    paired (by cell, by game seed, by held-out episode)."""
    cells = sorted(base["held_out_cells"])
    summary = {}
    for run, result in runs.items():
        summary[run] = {
            "held_out_cells_gain": paired([result["held_out_cells"][c] for c in cells],
                                          [base["held_out_cells"][c] for c in cells]),
            "trained_game_change": paired(result["trained_game"], base["trained_game"]),
            "trained_game_mean": mean_interval(result["trained_game"]),
            "anchored_game_change": paired(result["anchored_game"], base["anchored_game"]),
            "anchored_game_mean": mean_interval(result["anchored_game"]),
            "drift_kl": mean_interval(result["drift_kl"]),
        }
    summary["base"] = {"trained_game_mean": mean_interval(base["trained_game"]),
                       "anchored_game_mean": mean_interval(base["anchored_game"]),
                       "held_out_cells_mean": mean_interval([base["held_out_cells"][c] for c in cells])}
    off = runs.get("off")
    for run, result in runs.items():
        if run == "off" or off is None:
            continue
        summary[f"{run}_minus_off"] = {
            "drift_kl": paired(result["drift_kl"], off["drift_kl"]),
            "held_out_cells": paired([result["held_out_cells"][c] for c in cells],
                                     [off["held_out_cells"][c] for c in cells]),
            "trained_game": paired(result["trained_game"], off["trained_game"]),
            "anchored_game": paired(result["anchored_game"], off["anchored_game"]),
        }
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="holds cells-train/ and cells-held-out/; "
                        "every result goes here")
    parser.add_argument("--anchor-episodes", type=Path, required=True, help="the base's recorded episodes of the "
                        "anchored game (evaluate.py's episodes.jsonl)")
    parser.add_argument("--anchor-coef", default="0.2", help="anchor.coef; a comma list runs `on` once per coef, "
                        "each in run-on-coef<coef>/ (default 0.2, as the config's)")
    parser.add_argument("--anchor-per-step", type=int, default=4, help="anchor.per_step (default 4)")
    parser.add_argument("--held-out-share", type=float, default=0.375, help="anchor.held_out_share: these episodes "
                        "measure the drift (default 0.375)")
    parser.add_argument("--steps", type=int, default=32, help="optimizer steps (default 32)")
    parser.add_argument("--cells-per-step", type=int, default=4, help="training cells per step (default 4)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW on the LoRA (default 5e-4)")
    parser.add_argument("--seed", type=int, default=9300, help="the LoRA's init and the draws, as "
                        "bench.distill_learning's (default 9300)")
    parser.add_argument("--games", type=int, default=32, help="games of each game per model (default 32)")
    parser.add_argument("--games-seed", type=int, default=9500, help="the games' seeds (default 9500)")
    parser.add_argument("--runs", default="off,on", help="which runs, in order (default off,on)")
    parser.add_argument("--stop-after-minutes", type=float, default=None, help="stop (saved) after this long; the "
                        "same command continues (default: no limit)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config overrides on the cpu preset (default none)")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    if not set(runs) <= set(RUNS):
        parser.error(f"--runs: expected names from {RUNS}, got {args.runs!r}")
    try:
        coefs = [float(c) for c in args.anchor_coef.split(",") if c]
    except ValueError:
        parser.error(f"--anchor-coef: expected numbers separated by commas, got {args.anchor_coef!r}")
    if not coefs or any(c <= 0 for c in coefs):
        parser.error(f"--anchor-coef: expected coefficients above 0, got {args.anchor_coef!r}")
    # everything read before the model loads
    anchor_settings = {f"on@{coef:g}": AnchorConfig(episodes=[str(args.anchor_episodes)], coef=coef,
                                                    per_step=args.anchor_per_step,
                                                    held_out_share=args.held_out_share) for coef in coefs}
    measured_with = {"games": args.games, "games_seed": args.games_seed, "held_out_share": args.held_out_share}
    trained_with = {**measured_with, "steps": args.steps, "cells_per_step": args.cells_per_step,
                    "learning_rate": args.learning_rate, "seed": args.seed}
    anchored, held_out = split_held_out(read_anchor_episodes("--anchor-episodes", args.anchor_episodes),
                                        args.held_out_share)
    if len(anchored) != 1:
        parser.error(f"--anchor-episodes: expected the episodes of one game, got {sorted(anchored)}")
    [anchored_game] = anchored
    drift_set = held_out[anchored_game]
    train_cells = read_cells(args.output_dir / "cells-train")
    held_cells = read_cells(args.output_dir / "cells-held-out")
    config = load_config(presets=["cpu"], overrides=["generation.temperature=0", "generation.context_strategy=full",
                                                     "generation.backend=local", f"run.seed={args.seed}", *args.set])
    deadline = time.monotonic() + 60 * args.stop_after_minutes if args.stop_after_minutes is not None \
        else float("inf")
    started = time.perf_counter()

    def fresh_policy():
        torch.manual_seed(args.seed)  # the LoRA's init of bench.distill_learning
        return load_policy(config.train.model, config.train.lora, pick_device(config.train.run.device))

    base_path = args.output_dir / "base.json"
    results = {}
    try:
        claim_folder(args.output_dir / "base", measured_with)
        if not all(part in (json.loads(base_path.read_text()) if base_path.exists() else {}) for part in PARTS):
            measure(config, fresh_policy(), args, anchored_game, held_cells, drift_set, args.output_dir / "base",
                    base_path, PARTS, deadline)
        base = json.loads(base_path.read_text())
        # each run trained and its cells and drift measured, then the games of every run
        for parts in (PARTS[:2], PARTS[2:]):
            for run in run_names(runs, coefs):
                folder = run_folder(args.output_dir, run)
                anchor = anchor_settings.get(run)
                claim_folder(folder, {**trained_with, "anchor": None if anchor is None else
                                      {"coef": anchor.coef, "per_step": anchor.per_step}})
                result_path = folder / "result.json"
                measured = json.loads(result_path.read_text()) if result_path.exists() else {}
                if all(part in measured for part in parts):
                    continue
                policy = fresh_policy()
                curve = train(policy, args, run, train_cells, anchor, config.train.ppo.max_grad_norm,
                              folder, deadline)
                measured = measure(config, policy, args, anchored_game, held_cells, drift_set, folder, result_path,
                                   parts, deadline)
                result_path.write_text(json.dumps({**measured, "training_curve": curve}, indent=1))
                del policy
        results = {run: json.loads((run_folder(args.output_dir, run) / "result.json").read_text())
                   for run in run_names(runs, coefs)}
    except OutOfTime as stop:
        print(f"stopped after --stop-after-minutes ({stop}); the same command continues", flush=True)
        return None
    summary = {"command": "python -m bench.distill_anchor " + " ".join(sys.argv[1:] if argv is None else argv),
               "anchored_game": anchored_game, "drift_episodes": len(drift_set),
               "anchor_episodes": len(anchored[anchored_game]), "cells": {"train": len(train_cells),
                                                                           "held_out": len(held_cells)},
               **compare(base, results), "seconds_this_invocation": round(time.perf_counter() - started, 1)}
    (args.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
