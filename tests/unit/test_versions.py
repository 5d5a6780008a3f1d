"""``hybridtrain/versions.py``: a library older than the tested range (or missing) is an error naming what to
install, a newer one a note; the range matches ``pyproject.toml``'s dependencies."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridtrain.versions import TESTED, version_problems

ROOT = Path(__file__).resolve().parents[2]
CURRENT = {name: lowest for name, (lowest, _) in TESTED.items()}


def test_the_tested_versions_pass():
    assert version_problems(CURRENT) == ([], [])


def test_an_older_transformers_is_refused_naming_the_install():
    errors, notes = version_problems({**CURRENT, "transformers": "5.17.0"})
    assert errors == ["transformers 5.17.0 is older than hybridtrain supports (>= 5.24.0, the version CI tests); "
                      "install it with: pip install 'transformers>=5.24.0,<5.26'"] and notes == []


def test_a_missing_deepspeed_is_refused():
    errors, _ = version_problems({**CURRENT, "deepspeed": None})
    assert errors == ["deepspeed is not installed; install it with: pip install 'deepspeed>=0.19.8'"]


def test_a_newer_release_is_a_note():
    errors, notes = version_problems({**CURRENT, "transformers": "5.30.1"})
    assert errors == [] and len(notes) == 1 and notes[0].startswith(
        "transformers 5.30.1 is newer than the releases CI tests (>= 5.24.0, < 5.26)")


@pytest.mark.parametrize("name", sorted(TESTED))
def test_pyproject_states_the_same_lower_bound(name):
    text = (ROOT / "pyproject.toml").read_text()
    bound = re.search(rf'"{name}>=([0-9.]+)"', text).group(1)
    assert TESTED[name][0].startswith(bound), (name, bound, TESTED[name])
