"""``docs/errors.md`` cannot rot: every entry names a test that exists and a message fragment that
the test or the code still contains, and the catalogue keeps at least 25 entries."""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
FIELDS = ("Message", "Cause", "Fix", "Test")


def entries() -> list[dict]:
    """The ``###`` entries of docs/errors.md with their ``- Field: value`` lines."""
    out, current = [], None
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            current = {"title": line[4:].strip()}
            out.append(current)
        elif current is not None and (m := re.match(r"- (\w+): (.*)$", line)):
            current[m.group(1)] = m.group(2).strip()
        elif line.startswith("## "):
            current = None
    return out


def _code(value: str) -> str:
    m = re.fullmatch(r"`(.+)`", value)
    assert m, f"expected one `quoted` value, got {value!r}"
    return m.group(1)


@lru_cache(maxsize=None)
def _code_text() -> str:
    """Every source and config file a message can come from."""
    files = [*sorted((ROOT / "hybridtrain").rglob("*.py")), *sorted((ROOT / "conf").rglob("*.yaml"))]
    return "\n".join(p.read_text() for p in files)


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{n.name}" for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {n for n in names if n.split("::")[-1].startswith("test_")}


ENTRIES = entries()


def test_catalogue_has_at_least_25_distinct_entries():
    titles = [e["title"] for e in ENTRIES]
    assert len(titles) >= 25, f"{len(titles)} entries"
    assert len(set(titles)) == len(titles), "duplicate titles"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["title"] for e in ENTRIES])
def test_entry_names_a_real_test_and_a_live_message(entry):
    missing = [f for f in FIELDS if not entry.get(f)]
    assert not missing, f"{entry['title']}: missing {missing}"
    node = _code(entry["Test"])
    m = re.fullmatch(r"(tests/[\w/]+\.py)::([\w:]+)(?:\[([^\]]+)\])?", node)
    assert m, f"{entry['title']}: {node!r} is not a pytest node id tests/FILE.py::TEST[ID]"
    path, func, param = ROOT / m.group(1), m.group(2), m.group(3)
    assert path.exists(), f"{entry['title']}: {path} does not exist"
    assert func in _test_functions(path), f"{entry['title']}: no test {func} in {m.group(1)}"
    source = path.read_text()
    if param is not None:  # a parametrize id: written out in the test module (ids= or the case table)
        assert param in source, f"{entry['title']}: parameter id {param!r} not in {m.group(1)}"
    fragment = _code(entry["Message"])
    assert fragment in source or fragment in _code_text(), (
        f"{entry['title']}: the message fragment {fragment!r} is neither in {m.group(1)} nor in hybridtrain/ or conf/")
