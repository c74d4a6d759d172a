#!/usr/bin/env bash
# The project's test command: environment, tiny checkpoints, lint and types, then the whole pytest suite.
#   scripts/test.sh [pytest args...]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash scripts/setup_env.sh
VENV=${MMSERVE_VENV:-$ROOT/.venv}
"$VENV/bin/python" -m mmserve_dev.tiny_models
# Lint and type-check first: fast (seconds), and a finding fails the run. Settings: pyproject.toml.
"$VENV/bin/ruff" check "$ROOT"
"$VENV/bin/ruff" format --check "$ROOT"
(cd "$ROOT" && "$VENV/bin/mypy")
# The adapters one at a time: each is a module named "model".
for adapter in "$ROOT"/model_repository/*/1/model.py "$ROOT"/model_repository_encoder/*/1/model.py; do
    (cd "$ROOT" && "$VENV/bin/mypy" --follow-imports=silent "$adapter")
done
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "scripts/test.sh: pytest collected no tests; a run that executes no test is not a pass" >&2
  exit 1
fi
exit $rc
