"""The commands the documentation shows: extracted from the fenced code blocks of ``README.md`` and
``docs/*.md`` so that ``tests/dist/test_docs_commands.py`` can run each as written (issue 28.13).

What counts as a command (:func:`extract`):

- In a block fenced as ``bash``, ``sh``, ``shell`` or ``console`` or unlabelled that holds ``$ `` prompts,
  the lines after ``$ `` are commands and the lines between them are their shown output (a command whose
  output says ``config error:`` or ``export error:`` is shown failing on purpose: exit 2).
- In a ``bash``/``sh``/``shell`` block without prompts every line is a command, except comments and blank
  lines. A block that starts with ``#!`` shows a script's text (e.g. the rendered sbatch script), not
  commands to type; an unlabelled block without prompts is output or a diagram.
- A trailing ``\\`` continues the command on the next line; a trailing ``# comment`` outside quotes is dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SHELL_LANGS = ("bash", "sh", "shell", "console")
"""Fence labels whose blocks hold commands."""

FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
PROMPT = re.compile(r"^\s*\$ (.*)$")
FAILING = ("config error:", "export error:")
"""Output fragments that show a command failing on purpose (hybridtrain's exit-2 messages)."""


@dataclass
class Command:
    """One documented command: where it is written, its text (continuations joined, comment dropped) and the
    output the page shows after it (prompted blocks only)."""

    page: str
    line: int
    text: str
    output: list[str] = field(default_factory=list)
    heading: str = ""
    """The title of the page section the command is in (its nearest heading above)."""

    @property
    def expected_exit(self) -> int:
        """The exit code the page implies: 2 where the shown output is a config or export error, else 0."""
        return 2 if any(f in line for line in self.output for f in FAILING) else 0

    @property
    def where(self) -> str:
        """``page:line``, for messages."""
        return f"{self.page}:{self.line}"


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` at the start or after whitespace, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _blocks(text: str):
    """Yield ``(label, first_line_number, lines, heading)`` for every fenced block of a Markdown page."""
    lines = text.split("\n")
    i, heading = 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("#"):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        fence, label, start = m.group(1), m.group(2).lower(), i + 2
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1
        yield label, start, body, heading


def _join(body: list[str], start: int, page: str, prompted: bool) -> list[Command]:
    """The commands of one block (see the module docstring)."""
    commands: list[Command] = []
    n = 0
    while n < len(body):
        raw, first = body[n], n
        n += 1
        if prompted:
            m = PROMPT.match(raw)
            if not m:
                if commands and raw.strip():
                    commands[-1].output.append(raw)
                continue
            part = m.group(1).strip()
        else:
            part = raw.strip()
            if not part or part.startswith("#"):
                continue
        parts = [part]
        while parts[-1].endswith("\\") and n < len(body):  # a line continuation
            parts[-1] = parts[-1][:-1].strip()
            parts.append(body[n].strip())
            n += 1
        text = strip_comment(" ".join(p for p in parts if p)).strip()
        if text:
            commands.append(Command(page, start + first, text))
    return commands


def extract_page(text: str, page: str) -> list[Command]:
    """The commands of one Markdown page's text, in page order."""
    found: list[Command] = []
    for label, start, body, heading in _blocks(text):
        prompted = any(PROMPT.match(line) for line in body)
        if label not in SHELL_LANGS and not (label == "" and prompted):
            continue
        first = next((line for line in body if line.strip()), "")
        if not prompted and first.strip().startswith("#!"):
            continue  # a script's text, shown
        for cmd in _join(body, start, page, prompted):
            cmd.heading = heading
            found.append(cmd)
    return found


def pages(repo: Path) -> list[Path]:
    """The pages whose commands must run: ``README.md`` and ``docs/*.md``."""
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def extract(repo: Path) -> list[Command]:
    """Every documented command of the repository at ``repo``, page by page in page order."""
    out: list[Command] = []
    for path in pages(repo):
        out += extract_page(path.read_text(), str(path.relative_to(repo)))
    return out
