"""The configurations the repository ships follow its own documented advice: every config/presets/*.json file
(each on top of the base files, as `--preset NAME` reads it) and the base files alone."""
from pathlib import Path

import pytest

from ppo_affine.config import CONFIG_DIR, PRESET_DIR, load_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ["(base files)", *sorted(p.stem for p in PRESET_DIR.glob("*.json"))]


def shipped(name: str):
    return load_config(presets=[] if name == "(base files)" else [name]).train


def trains_on_a_gpu(train) -> bool:
    return train.run.device != "cpu"


@pytest.mark.parametrize("name", SHIPPED)
def test_vllm_on_a_gpu_has_the_sampler_correction_on(name):
    """README 'Training on a GPU with vLLM': bf16 kernels put the log-prob gap at 1e-3 to 1e-2, the correction is
    recommended there (ppo.sampler_correction's own help says so too)."""
    train = shipped(name)
    if trains_on_a_gpu(train) and train.generation.backend == "vllm":
        assert train.ppo.sampler_correction, f"{name}: vLLM on a GPU without ppo.sampler_correction"


@pytest.mark.parametrize("name", SHIPPED)
def test_a_gpu_run_converses_as_the_validators_do(name):
    """docs/training.md: generation.context_strategy 'full' is the validators' conversation, the one evaluate.py
    plays; only the cpu preset's CPU demo uses 'last'."""
    train = shipped(name)
    if trains_on_a_gpu(train):
        assert train.generation.context_strategy == "full", name


@pytest.mark.parametrize("name", SHIPPED)
def test_a_gpu_run_saves_at_least_every_30_minutes_and_every_50_steps(name):
    """README 'Checkpoints and resume': a crash no signal announces costs at most 30 minutes plus a step."""
    checkpointing = shipped(name).checkpointing
    if trains_on_a_gpu(shipped(name)):
        assert checkpointing.save_every <= 50, name
        assert checkpointing.save_every_minutes is not None and checkpointing.save_every_minutes <= 30, name


@pytest.mark.parametrize("name", SHIPPED)
def test_sampling_stays_untruncated_for_training(name):
    """generation.top_p / top_k: keep 1 and 0 for training (the update scores the full distribution)."""
    generation = shipped(name).generation
    assert (generation.top_p, generation.top_k) == (1.0, 0) and generation.temperature > 0, name


def test_every_shipped_file_is_checked():
    files = {p.stem for p in PRESET_DIR.glob("*.json")}
    assert files <= set(SHIPPED) and {"cpu", "trace", "warm_start"} <= files
    assert (CONFIG_DIR / "train_config.json").is_file()


def test_the_readme_says_what_a_crash_can_cost():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "checkpointing.save_every_minutes" in text and "a crash" in text
