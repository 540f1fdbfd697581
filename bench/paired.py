"""The paired difference of two evaluations: `B − A` over the episodes both played (same game, task id and seed).

    python -m bench.paired eval-native/episodes.jsonl eval-through-evaluate/episodes.jsonl

Each file is an `evaluate.py` (or bench) episodes file; episodes with an error are left out of both sides. Per game
(and over all games when there are several): pairs, mean difference with its 95 % interval, how many pairs differ,
and how many pairs would decide it (report.py).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ppo_affine.report import paired_differences


def paired(first: Path, second: Path) -> dict:
    records = []
    for label, path in (("a", first), ("b", second)):
        with open(path) as lines:
            records += [{**json.loads(line), "model": label} for line in lines if line.strip()]
    return paired_differences(records, model="b", baseline="a")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("a", type=Path, help="episodes.jsonl of A")
    parser.add_argument("b", type=Path, help="episodes.jsonl of B (the difference is B − A)")
    args = parser.parse_args(argv)
    result = paired(args.a, args.b)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
