"""README.md's layout tables name every module of the tree, and only what is there."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ppo_affine"


def layout_names() -> dict[Path, list[str]]:
    """Folder -> the names the first column of its layout table lists."""
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    tables = {ROOT: layout.split("| in `ppo_affine/`", 1)[0], PACKAGE: layout.split("| in `ppo_affine/`", 1)[1]}
    return {folder: [name for row in re.findall(r"^\| (.*?) \|", text, re.M) for name in re.findall(r"`([^`]+)`", row)]
            for folder, text in tables.items()}


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
