#!/usr/bin/env python3
"""Print docs/RELIABILITY.md's matrix of bad inputs from the test table (tests/test_e2e_inputs.py).

python scripts/reliability_matrix.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_e2e_inputs import MATRIX  # noqa: E402


def main() -> None:
    rows: dict[tuple[str, str | None, str], list[str]] = {}
    for case, model, protocol, code, message in MATRIX:
        rows.setdefault((case, code, message), []).append(f"{model} {protocol}")
    print(
        f"{len(MATRIX)} requests ({len(rows)} cases), each followed by a known-good request that must equal its reference.\n"
    )
    print("| case | sent to | answer | message (regex) |")
    print("|---|---|---|---|")
    for (case, code, message), routes in rows.items():
        answer = f"`[{code}]`" if code else "Triton's own check"
        pattern = message.replace("|", "\\|")
        print(f"| {case} | {', '.join(routes)} | {answer} | `{pattern}` |")


if __name__ == "__main__":
    main()
