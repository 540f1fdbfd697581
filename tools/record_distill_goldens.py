"""Record tests/data/distill_v2/golden.json by running affinetes' own DISTILL-V2 functions on the golden cells.

Run once per affinetes commit, in a side virtual environment holding the env's requirements (never the trainer's),
with the env's source checked out somewhere (nothing of it is copied here):

    python -m venv /tmp/side-distill && /tmp/side-distill/bin/pip install transformers==5.9.0 httpx pydantic \\
        pydantic-settings zstandard structlog orjson pyarrow pyyaml sentencepiece
    git -C affinetes archive COMMIT environments/distill-v2 | tar -x -C /tmp/affinetes-src
    /tmp/side-distill/bin/python tools/record_distill_goldens.py \\
        --env-src /tmp/affinetes-src/environments/distill-v2 --commit COMMIT --output tests/data/distill_v2/golden.json

The cells are `ppo_affine.testing.distill_cells.golden_cells()` written as shards; the tokenizer is the saved tiny
one in tests/data/distill_v2/tokenizer; the model is `fake_token_logprobs` fed through the env's own
conversion of a server's echo log-probs, so every number after the forward pass is the env's.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "distill_v2" / "tokenizer"
FULL_IDS_BELOW = 2000  # longer renderings are recorded by their digest, length and ends


def digest(values: list[int]) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def rendering(sample) -> dict:
    ids, mask = list(sample.input_ids), list(sample.loss_mask)
    record = {"length": len(ids), "loss_tokens": sum(mask), "ids_sha256": digest(ids), "mask_sha256": digest(mask)}
    if len(ids) < FULL_IDS_BELOW:
        record |= {"input_ids": ids, "loss_mask": mask}
    else:
        record |= {"head_ids": ids[:16], "tail_ids": ids[-16:]}
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--env-src", type=Path, required=True, help="affinetes' environments/distill-v2 folder")
    parser.add_argument("--commit", required=True, help="the affinetes commit that folder is from")
    parser.add_argument("--output", type=Path, required=True, help="the JSON file to write (the env logs to stdout)")
    args = parser.parse_args()
    sys.path[:0] = [str(args.env_src), str(ROOT)]

    import pyarrow.parquet as pq
    from distill_v2_eval import driver
    from distill_v2_eval.adapters.forward_engines.render import RenderConfig, render_rollout
    from distill_v2_eval.adapters.forward_engines.render_registry import build_renderer
    from distill_v2_eval.adapters.forward_engines.tokenizer_cache import _load
    from distill_v2_eval.adapters.forward_engines.vllm_logprob import _ce_from_logprobs
    from distill_v2_eval.adapters.scoring.registry import build_cell_scoring
    from distill_v2_eval.domain.models import StudentSubmission
    from distill_v2_eval.parquet_source import _table_to_rollouts

    from ppo_affine.testing.distill_cells import GOLDEN_CASES, fake_token_logprobs, golden_cells, write_cells

    class FakeEngine:  # the env's server engine with the server replaced by fake_token_logprobs
        from contextlib import nullcontext as session

        def compute_ce(self, samples):
            return [_ce_from_logprobs(token_logprobs=fake_token_logprobs(list(s.input_ids)),
                                      loss_mask=list(s.loss_mask), message_spans=list(s.message_spans))
                    for s in samples]

    tokenizer = _load(str(TOKENIZER))
    student = StudentSubmission(student_name="golden", revision="0", hf_repo=str(TOKENIZER), arch="qwen",
                                model_hash="golden", submitted_by="golden")
    cells = {cell["task_idx"]: cell for cell in golden_cells()}
    cases = {}
    with tempfile.TemporaryDirectory() as folder:
        write_cells(Path(folder), list(cells.values()))
        for name, task_idx, mask_reasoning, max_seq_len in GOLDEN_CASES:
            rows = _table_to_rollouts(pq.read_table(Path(folder) / f"tasks/{task_idx:08d}.parquet"))
            kept = driver._drop_harness_failures(rows)
            renderer = build_renderer("qwen", tokenizer,
                                      cfg=RenderConfig(mask_reasoning=mask_reasoning, max_seq_len=max_seq_len))
            snapshot = driver._score_cell(rollouts=kept, student=student, engine=FakeEngine(), renderer=renderer,
                                          scoring=build_cell_scoring("softmax_advantage"),
                                          cell=driver._cell_info(task_idx, kept))
            cases[name] = {
                "task_idx": task_idx, "mask_reasoning": mask_reasoning, "max_seq_len": max_seq_len,
                "kept_rollout_ids": [str(r.rollout_id) for r in kept], "harness_dropped": len(rows) - len(kept),
                "renderings": [rendering(render_rollout(r, student, renderer=renderer)) for r in kept],
                "mean_score": snapshot["mean_score"], "win_rate": snapshot["win_rate"],
                "per_rollout": snapshot["per_rollout"],
            }
    args.output.write_text(json.dumps({"affinetes_commit": args.commit, "env_path": "environments/distill-v2",
                                       "recorded_with": "tools/record_distill_goldens.py", "cases": cases},
                                      indent=1) + "\n")


if __name__ == "__main__":
    main()
