"""Import boundaries from STYLE.md, checked on the source (no imports executed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


FORBIDDEN = {
    "shared": ("services", "engine", "transfer_engine", "torch"),
    "services/gateway": ("engine", "torch", "transfer_engine"),
    "services/conductor": ("engine", "torch", "transfer_engine"),
    "engine": ("nats", "services", "aiohttp", "bench", "transfer_engine"),
    # A standalone library: bytes, segments and peers; never requests, layers or models.
    "transfer_engine": ("services", "engine", "bench", "aiohttp", "opentelemetry"),
    "services": ("bench",),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_what_it_must_not(package: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources(package)
        for name in imported_modules(path)
        if name.split(".")[0] in FORBIDDEN[package]
        or any(name.startswith(f"{f}.") or name == f for f in FORBIDDEN[package])
    ]
    assert offenders == []


# A subject built or spelt out: `f"halfmoon.{...` or `"halfmoon.<cluster>.v1...`. Span
# attribute keys (`"halfmoon.request_id"`) are not subjects.
_SUBJECT = re.compile(r'f?"halfmoon\.(\{|[A-Za-z0-9_-]+\.v\d)')


def test_subject_strings_appear_only_in_subjects_module() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("services", "shared", "engine", "transfer_engine")
        for path in sources(package)
        if path.name != "subjects.py" and _SUBJECT.search(path.read_text())
    ]
    assert offenders == []


def test_the_subject_check_catches_a_built_subject() -> None:
    assert _SUBJECT.search('nc.publish(f"halfmoon.{cluster}.v1.abort", data)')
    assert _SUBJECT.search('"halfmoon.default.v1.requests"')
    assert not _SUBJECT.search('span.set_attribute("halfmoon.request_id", rid)')
