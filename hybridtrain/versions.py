"""The library versions hybridtrain is tested with, checked by every command before it does anything.

hybridtrain runs transformers' own modules and calls some of their internal API (the masking utilities'
``create_causal_mask(..., cache=...)``, the attention interface, the experts switch), which moves between
minor releases: transformers 5.17 raises a ``TypeError`` in every block. So the range below is the one CI
runs, enforced with a one-line message naming what to install, instead of a traceback from inside a rank.
A newer release than the tested one is allowed with one line saying so: the self-checks (``verify``, the
auto family's tiny twin) are how to confirm it there. Versions are read from the installed distributions'
metadata, so the check imports none of the libraries.
"""
from __future__ import annotations

import sys
from importlib import metadata

TESTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.24.0", "5.26"),
    "deepspeed": ("0.19.8", "0.20"),
}
"""Distribution -> (lowest version supported, first version not tested). Below the first is refused; from the
second on is allowed with a note. Keep in step with ``pyproject.toml``'s dependencies."""


def version_problems(installed: dict[str, str | None] | None = None) -> tuple[list[str], list[str]]:
    """``(errors, notes)`` for the installed versions (``installed``: name -> version or None for missing;
    default: read from the environment's metadata)."""
    from packaging.version import Version

    errors, notes = [], []
    for name, (lowest, untested) in TESTED.items():
        found = installed.get(name) if installed is not None else _installed(name)
        if found is None:
            errors.append(f"{name} is not installed; install it with: pip install '{name}>={lowest}'")
        elif Version(found) < Version(lowest):
            errors.append(f"{name} {found} is older than hybridtrain supports (>= {lowest}, the version CI "
                          f"tests); install it with: pip install '{name}>={lowest},<{untested}'")
        elif Version(found) >= Version(untested):
            notes.append(f"{name} {found} is newer than the releases CI tests (>= {lowest}, < {untested}); "
                         f"`python -m hybridtrain.verify` checks a config against it")
    return errors, notes


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def require_tested_versions() -> None:
    """Exit with code 2 and one line per problem when a library is missing or older than supported; print a
    note for one newer than tested. Called first by each command's entry point."""
    errors, notes = version_problems()
    for line in notes:
        print(f"[hybridtrain] note: {line}", file=sys.stderr)
    if errors:
        for line in errors:
            print(f"[hybridtrain] error: {line}", file=sys.stderr)
        raise SystemExit(2)
