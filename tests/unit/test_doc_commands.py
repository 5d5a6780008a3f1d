"""The extraction of documented commands (``tests/helpers/doc_commands.py``) that
``tests/dist/test_docs_commands.py`` runs (issue 28.13): prompts, shown output, continuations, comments,
scripts shown as text, and the exit code a page implies."""
from __future__ import annotations

from helpers.doc_commands import extract_page, strip_comment

PAGE = '''# A page

```bash
python -m hybridtrain +recipe=gpt_tiny    # a comment
python -m hybridtrain +recipe=gpt_tiny data.path='corpus/*.jsonl' \\
    parallel.tp=2 \\
    hydra.run.dir=runs/a   # continued twice

# a comment line
```

```console
$ python -m hybridtrain +recipe=gpt_tiny parallel.tp=abc
[hybridtrain] config error: parallel.tp: 'abc' is not an integer
$ ls runs/a
config.yaml  plan.json
```

```
[hybridtrain] output only: python -m hybridtrain is not a command here
```

```
$ python -m hybridtrain.export runs/a x
[hybridtrain] export error: runs/a is not a complete hybridtrain checkpoint
```

```bash
#!/bin/bash
#SBATCH --nodes=2
srun python -m hybridtrain.worker RUN_DIR
```

```python
print("not a shell block")
```
'''


def test_commands_prompts_output_and_continuations():
    found = extract_page(PAGE, "docs/x.md")
    assert [c.text for c in found] == [
        "python -m hybridtrain +recipe=gpt_tiny",
        "python -m hybridtrain +recipe=gpt_tiny data.path='corpus/*.jsonl' parallel.tp=2 hydra.run.dir=runs/a",
        "python -m hybridtrain +recipe=gpt_tiny parallel.tp=abc",
        "ls runs/a",
        "python -m hybridtrain.export runs/a x",
    ]
    assert [c.line for c in found] == [4, 5, 13, 15, 24]  # where each starts on the page
    assert found[2].output == ["[hybridtrain] config error: parallel.tp: 'abc' is not an integer"]
    assert found[3].output == ["config.yaml  plan.json"]
    assert {c.heading for c in found} == {"A page"}  # the section each is in


def test_the_exit_code_a_page_implies():
    """A command shown with a config or export error is shown failing on purpose (exit 2); others exit 0."""
    found = extract_page(PAGE, "docs/x.md")
    assert [c.expected_exit for c in found] == [0, 0, 2, 0, 2]


def test_comments_outside_quotes_only():
    assert strip_comment("python x.py  # note") == "python x.py"
    assert strip_comment("python -c 'print(\"# kept\")'  # dropped") == "python -c 'print(\"# kept\")'"
    assert strip_comment("echo a#b") == "echo a#b"  # a # inside a word is no comment
    assert strip_comment("# all comment") == ""


def test_scripts_shown_as_text_and_other_languages_are_not_commands():
    texts = [c.text for c in extract_page(PAGE, "docs/x.md")]
    assert not any("srun" in t or "SBATCH" in t or "print(" in t or "output only" in t for t in texts)
