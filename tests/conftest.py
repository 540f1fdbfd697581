import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def tiny_policy(tiny_model_dir):
    from tiny import load_tiny_policy

    return load_tiny_policy(tiny_model_dir)
