"""The warm-start server's environment rule (``hybridtrain/warmstart.py`` ``Environment``): which requests it
serves, and why hybridtrain's own variables may differ (nothing reads them at import)."""
from __future__ import annotations

import ast
from pathlib import Path

from hybridtrain.warmstart import Environment

PACKAGE = Path(__file__).resolve().parents[2] / "hybridtrain"


def _import_time_environ_reads(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``os.environ`` / ``os.getenv`` where importing the module runs them: outside
    every function body (a class body or a default argument runs at import too; a default that is the mapping
    ``os.environ`` itself reads nothing until the call)."""
    tree = ast.parse(path.read_text())
    deferred: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for inner in node.body if isinstance(node.body, list) else [node.body]:
                deferred.update(id(n) for n in ast.walk(inner))
            deferred.update(id(d) for d in [*node.args.defaults, *node.args.kw_defaults]
                            if isinstance(d, ast.Attribute) and d.attr == "environ")
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and id(node) not in deferred]


def test_hybridtrain_reads_no_environment_variable_at_import():
    """What lets the server serve a run whose ``HYBRIDTRAIN_*`` variables differ from its own: the modules it
    imported read none of them (nor any other variable) while importing."""
    found = {str(p.relative_to(PACKAGE)): lines for p in sorted(PACKAGE.rglob("*.py"))
             if (lines := _import_time_environ_reads(p))}
    assert not found, found


def test_the_rule_sees_an_import_time_read(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nCACHE = os.environ.get('X')\n\ndef later(env=os.environ):\n    return os.environ['Y']\n"
                      "\n\ndef early(port=os.environ.get('P')):\n    pass\n")
    assert _import_time_environ_reads(module) == [2, 8]


def test_served_environments():
    started = {"PATH": "/bin", "HF_HUB_OFFLINE": "1", "HYBRIDTRAIN_WARM_START": "/s", "PYTEST_CURRENT_TEST": "a"}
    own = Environment(started, {**started, "TORCHINDUCTOR_CACHE_DIR": "/t"})
    assert own.serves(dict(started))
    assert own.serves({**started, "PYTEST_CURRENT_TEST": "b", "TORCHINDUCTOR_CACHE_DIR": "/t"})
    assert own.serves({**started, "HYBRIDTRAIN_CACHE": "/c", "HYBRIDTRAIN_PRELOAD": "0"})  # read at run time
    assert own.serves({k: v for k, v in started.items() if k != "HYBRIDTRAIN_WARM_START"})
    assert not own.serves({**started, "TORCHINDUCTOR_CACHE_DIR": "/other"})  # not what the imports set
    assert not own.serves({**started, "OMP_NUM_THREADS": "1"})  # one more variable a library may read
    assert not own.serves({k: v for k, v in started.items() if k != "HF_HUB_OFFLINE"})  # one fewer
    assert not own.serves({**started, "PATH": "/usr/bin"})
