"""bench/paired.py: B − A over the episodes both files played, by game, task id and seed."""
import json

import pytest

from bench import paired


def write(path, scores):
    path.write_text("".join(json.dumps({"model": "adapter", "game": "leduc_poker", "task_id": 7, "seed": seed,
                                        "score": score, "error": error}) + "\n"
                            for seed, (score, error) in scores.items()))
    return path


def test_the_difference_is_b_minus_a_over_the_shared_seeds_without_errors(tmp_path):
    a = write(tmp_path / "a.jsonl", {1: (0.0, None), 2: (1.0, None), 3: (0.5, None), 4: (1.0, "lost")})
    b = write(tmp_path / "b.jsonl", {1: (1.0, None), 2: (1.0, None), 3: (0.0, None), 4: (0.0, None), 5: (1.0, None)})
    result = paired.main([str(a), str(b)])["leduc_poker"]
    assert result["pairs"] == 3 and result["changed"] == 2  # seed 4 had an error in A, seed 5 only B played
    assert result["score_diff"] == pytest.approx((1.0 + 0.0 - 0.5) / 3)
