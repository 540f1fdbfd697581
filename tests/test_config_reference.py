"""docs/configuration.md is what tools/config_reference.py prints from the config models."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_committed_config_reference_matches_the_models():
    printed = subprocess.run([sys.executable, str(ROOT / "tools" / "config_reference.py")], capture_output=True,
                             text=True, check=True).stdout
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert printed == committed, "docs/configuration.md is stale: python tools/config_reference.py > docs/configuration.md"


def test_every_config_field_has_a_description():
    from tools.config_reference import document

    rows = [line for line in document().splitlines() if line.startswith("| `")]
    assert len(rows) > 80
    assert [row for row in rows if row.endswith("|  |")] == []
