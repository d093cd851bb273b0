#!/usr/bin/env bash
# Set-up and entry point: `./mop.sh train [...]` trains, `./mop.sh test [...]` runs the test suite.
# The first call creates .venv in the repository root with the CPU build of torch 2.13.0 and
# installs mop into it (editable, with its test extras). A GPU user installs their CUDA build of
# torch into .venv first; it is then kept, since torch is only installed when missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$root/.venv"
stamp="$venv/.mop-installed"

if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e "$root[test]"
    touch "$stamp"
fi

case "${1:-}" in
    test)
        shift
        start=$(date +%s)
        status=0
        (cd "$root" && "$venv/bin/python" -m pytest "$@") || status=$?
        echo "test suite: $(( $(date +%s) - start )) s, exit code $status"
        exit "$status"
        ;;
    *)
        exec "$venv/bin/mop" "$@"
        ;;
esac
