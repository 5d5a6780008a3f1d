"""``python -m hybridtrain.report RUN_DIR``: (re)write ``RUN_DIR/report.md`` and its plots."""
from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m hybridtrain.report RUN_DIR", file=sys.stderr)
        return 2
    from hybridtrain.report import write_report

    try:
        path = write_report(Path(sys.argv[1]))
    except FileNotFoundError as err:
        print(f"[hybridtrain] {err}", file=sys.stderr)
        return 2
    print(f"[hybridtrain] report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
