"""Several models evaluated on the same seeds, each run searching every opponent move and then again with
a file of recorded opponent moves (EnvSpec.opponent_moves): each run's wall seconds, the searches the file
took in, whether the two ways played the same games, and the teacher's replay of the last model's games
(`--teacher-moves`, DAgger) with and without the file. Prints one JSON document and a table.

    python -m bench.opponent_replay --games leduc_poker --episodes 64 --search exact --checkpoints \\
        runs/dagger-cli/out/dagger-2/checkpoints/checkpoint-83 runs/dagger-cli/ppo/ppo/checkpoints/checkpoint-20

Every evaluation is `python evaluate.py --preset cpu` in a process of its own, as a user runs it, the
runs of one model back to back (searched, then with the file), so that both meet the same machine.
The file starts empty: the first model's run records, each later one replays where its games repeat
an earlier model's and searches (and records) where they leave them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ppo_affine.envs.opponent_moves import OpponentMoves
from ppo_affine.experts import expert_kind
from ppo_affine.warm_start.config import WarmStartConfig
from ppo_affine.warm_start.expert_play import OpponentSetup
from ppo_affine.warm_start.relabel import relabel

ROOT = Path(__file__).resolve().parent.parent


def evaluate_run(checkpoint: str, args: argparse.Namespace, output_dir: Path, moves_file: Path | None) -> dict:
    command = [sys.executable, str(ROOT / "evaluate.py"), "--preset", "cpu", "--checkpoint", checkpoint,
               "--games", args.games, "--episodes", str(args.episodes), "--output-dir", str(output_dir)]
    for item in args.set + ([f"env.envs.openspiel.opponent_moves={json.dumps(str(moves_file))}"] if moves_file
                            else []):
        command += ["--set", item]
    before = len(OpponentMoves(moves_file)) if moves_file else 0
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    games = [json.loads(line) for line in (output_dir / "episodes.jsonl").read_text().splitlines()]
    return {"seconds": seconds, "games": games,
            "moves_searched": (len(OpponentMoves(moves_file)) - before) if moves_file else None}


def same_games(a: list[dict], b: list[dict]) -> bool:
    def key(record):
        return record["task_id"], record["seed"], record["score"], json.dumps(record["conversation"])
    return sorted(map(key, a)) == sorted(map(key, b))


def relabel_seconds(games: list[dict], args: argparse.Namespace, moves_file: Path | None) -> tuple[float, list]:
    teachers = WarmStartConfig(workers=args.workers)  # each game's default teacher, ID-only replies, every turn
    setup = OpponentSetup(search=args.search, moves=moves_file and str(moves_file))
    sources = [{**g, "source": f"task {g['task_id']} seed {g['seed']}"} for g in games]
    started = time.perf_counter()
    records = relabel(sources, teachers, setup, None, "--teacher-moves")
    return time.perf_counter() - started, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, help="adapters evaluated in this order")
    parser.add_argument("--games", default="leduc_poker")
    parser.add_argument("--episodes", type=int, default=64, help="evaluate.py --episodes (held-out seeds per game)")
    parser.add_argument("--workers", type=int, default=2, help="processes for the teacher's replay")
    parser.add_argument("--search", choices=("fast", "exact"), default="fast",
                        help="the MCTS opponent's implementation (EnvSpec.opponent_search) of every game played")
    parser.add_argument("--set", action="append", default=[], help="config overrides for every evaluate.py run")
    args = parser.parse_args()
    args.set.append(f"env.envs.openspiel.opponent_search={args.search}")

    work = Path(tempfile.mkdtemp(prefix="opponent-replay-"))
    moves_file = work / "opponent-moves.sqlite"
    runs = []
    for index, checkpoint in enumerate(args.checkpoints):
        searched = evaluate_run(checkpoint, args, work / f"searched-{index}", None)
        replayed = evaluate_run(checkpoint, args, work / f"replayed-{index}", moves_file)
        runs.append({"checkpoint": checkpoint, "searched_seconds": searched["seconds"],
                     "replayed_seconds": replayed["seconds"], "moves_searched_into_file": replayed["moves_searched"],
                     "same_games": same_games(searched["games"], replayed["games"]), "games": len(searched["games"]),
                     "mean_score": sum(g["score"] for g in searched["games"]) / len(searched["games"])})
        print(f"{checkpoint}: {searched['seconds']:.0f} s searched, {replayed['seconds']:.0f} s with the file "
              f"({replayed['moves_searched']} moves searched), same games: {runs[-1]['same_games']}", file=sys.stderr)
        last_games = searched["games"]
    plain_seconds, plain = relabel_seconds(last_games, args, None)
    file_seconds, from_file = relabel_seconds(last_games, args, moves_file)
    games = sorted({g["game"] for g in last_games})
    result = {"games": args.games, "episodes": args.episodes, "search": args.search, "set": args.set, "runs": runs,
              "teacher_replay": {"teachers": {g: expert_kind(g, None) for g in games},
                                 "searched_seconds": plain_seconds, "replayed_seconds": file_seconds,
                                 "same_records": plain == from_file},
              "recorded_moves": len(OpponentMoves(moves_file))}
    print(json.dumps(result, indent=1))
    print("\n| model | searched s | with the file s | ratio | moves searched into the file | same games |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run['checkpoint']} | {run['searched_seconds']:.0f} | {run['replayed_seconds']:.0f} "
              f"| {run['searched_seconds'] / run['replayed_seconds']:.2f} | {run['moves_searched_into_file']} "
              f"| {run['same_games']} |")
    replay = result["teacher_replay"]
    print(f"| teacher's replay of the last model's games | {plain_seconds:.0f} | {file_seconds:.0f} "
          f"| {plain_seconds / file_seconds:.2f} | | {replay['same_records']} |")


if __name__ == "__main__":
    main()
