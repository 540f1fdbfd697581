"""The trainer's own update against the memory plan, in torch's bytes and in resident memory: `train_ppo.main` runs a
short run of a SmolLM2-shaped model (its 30 layers at full width, the test tokenizer's 1 024-token vocabulary, random
weights) on the embedded games, with torch's bytes alive at once (`LiveBytes`) counted around each step's
`Trainer.score_and_update`. Printed per step: that peak, the plan's figure the run logs (perf/update_planned_bytes) and
the resident rise it logs (perf/update_rss_rise_bytes).

    OMP_NUM_THREADS=1 python -m bench.update_live_bytes --set ppo.micro_batch_tokens=1024 \
        --set generation.max_new_tokens=64
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import train_ppo
    from ppo_affine.testing.live_bytes import LiveBytes
    from ppo_affine.testing.tiny import SMOLLM2_SHAPE, make_tiny_model_dir
    from test_train import metrics, tiny_args

    peaks = []
    score_and_update = train_ppo.Trainer.score_and_update

    def counted(trainer, episodes, group_ids):
        live = LiveBytes()
        with live.mode:
            result = score_and_update(trainer, episodes, group_ids)
        peaks.append(live.peak)
        return result

    train_ppo.Trainer.score_and_update = counted
    folder = Path(tempfile.mkdtemp(prefix="update-live-bytes-"))
    model_dir = make_tiny_model_dir(folder / "model", shape=SMOLLM2_SHAPE)
    if train_ppo.main(tiny_args(model_dir, folder, "--max-steps", "2", *sys.argv[1:])) != 0:
        raise SystemExit(f"the run failed; see {folder / 't' / 'train.log'}")
    for record, peak in zip(metrics(folder / "t"), peaks):
        planned, rise = record["perf/update_planned_bytes"], record["perf/update_rss_rise_bytes"]
        print(json.dumps({"step": record["step"], "final_tokens": record["perf/final_tokens"],
                          "torch_peak_gb": round(peak / 1e9, 3), "planned_gb": round(planned / 1e9, 3),
                          "planned_over_torch": round(planned / peak, 3), "rss_rise_gb": round(rise / 1e9, 3)}))


if __name__ == "__main__":
    main()
