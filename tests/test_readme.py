"""docs/layout.md's tables name every module of the tree, and only what is there; README stays a newcomer's page."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ppo_affine"
LAYOUT = ROOT / "docs" / "layout.md"


def table_names(section: str) -> list[str]:
    """The backticked names of the first column of the table under the heading `section`."""
    text = LAYOUT.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [name for row in re.findall(r"^\| (.*?) \|", text, re.M) for name in re.findall(r"`([^`]+)`", row)]


def layout_names() -> dict[Path, list[str]]:
    """Folder -> the names its layout table lists."""
    return {ROOT: table_names("At the root"), PACKAGE: table_names("In `ppo_affine/`")}


def test_every_name_in_the_layout_tables_exists():
    missing = [str(folder / name) for folder, names in layout_names().items() for name in names
               if not (folder / name).exists()]
    assert missing == []


def test_every_module_and_code_folder_is_in_the_layout_tables():
    listed = {folder / name.rstrip("/") for folder, names in layout_names().items() for name in names}
    modules = [*ROOT.glob("*.py"), *(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"),
               *(p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()),
               *(ROOT / name for name in ("config", "bench", "tools", "tests", "docs"))]
    assert sorted(str(m.relative_to(ROOT)) for m in modules if m not in listed) == []


def test_readme_stays_within_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
