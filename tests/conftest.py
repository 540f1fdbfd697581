import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionstart(session):
    """Tests start programs in subprocesses, which import the installed package: it must be this checkout."""
    found = subprocess.run([sys.executable, "-c", "import ppo_affine; print(ppo_affine.__file__)"], cwd="/",
                           capture_output=True, text=True)
    if found.returncode != 0 or Path(found.stdout.strip()).parent != ROOT / "ppo_affine":
        where = found.stdout.strip() or found.stderr.strip().splitlines()[-1]
        pytest.exit(f"the tests need this checkout installed: run `pip install -e {ROOT}` (ppo_affine now: {where})",
                    returncode=4)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from ppo_affine.testing.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def tiny_policy(tiny_model_dir):
    from ppo_affine.testing.tiny import load_tiny_policy

    # CI has no GPU; on a CUDA machine `PPO_AFFINE_TEST_DEVICE=cuda pytest tests/test_token_trees.py` puts it there
    return load_tiny_policy(tiny_model_dir, os.environ.get("PPO_AFFINE_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def fake_vllm(tiny_model_dir):
    """One fake vLLM server (ppo_affine/testing/fake_vllm.py; about 15 s to start) that the runs of every test
    module share, as runs share a real one: each run loads adapters under names of its own and unloads them at exit,
    which the tests check (served_adapters)."""
    from test_train import _serve_fake_vllm

    yield from _serve_fake_vllm(tiny_model_dir)
