"""The repository's Markdown names only files and folders that exist: a module moved or
renamed, a record moved out of the README (`docs/measurements/`), leaves no stale pointer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("services", "shared", "engine", "transfer_engine", "bench", "tests", "docs",
             "deploy", "examples", ".ci")
# A repository path in backticks (`services/conductor/planner.py`), or a Markdown link's
# relative target ([text](docs/measurements/engine.md)).
_TOP = "|".join(re.escape(name) for name in TOP_LEVEL)
QUOTED = re.compile(rf"`((?:{_TOP})/[A-Za-z0-9_./-]*)`")
LINKED = re.compile(r"\]\(([^)#\s]+)\)")


def documents() -> list[Path]:
    found = {*ROOT.glob("*.md"), *ROOT.glob("*/README.md"), *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "deploy").rglob("*.md")}
    # Not a tool's own folder (`.pytest_cache/README.md`): only what the repository holds.
    return sorted(path for path in found if path.is_file()
                  and not any(part.startswith(".") for part in path.relative_to(ROOT).parts))


def named_paths(text: str) -> set[str]:
    links = {target for target in LINKED.findall(text) if "://" not in target}
    return {path.rstrip("/") for path in {*QUOTED.findall(text), *links}}


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document: Path) -> None:
    missing = sorted(path for path in named_paths(document.read_text())
                     if not (ROOT / path).exists() and not (document.parent / path).exists())
    assert not missing, f"{document.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_check_sees_quoted_and_linked_paths() -> None:
    text = ("see `engine/attention.py` and [the record](docs/measurements/engine.md), "
            "not `--flag/--no-flag` nor [a site](https://example.com/x)")
    assert named_paths(text) == {"engine/attention.py", "docs/measurements/engine.md"}
