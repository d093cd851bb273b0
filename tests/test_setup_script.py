"""`./mop.sh` on a GPU machine: where `python3` already imports a CUDA build of torch, `.venv` uses it
and installs nothing but mop's other dependencies; without a package registry it stops with one
line naming the wheels to bring and how.

The GPU machine is played by a `python3` that imports a stand-in `torch` package reporting a CUDA
version (no GPU, no download), and the missing registry by pip's own `PIP_NO_INDEX=1` with an
empty `PIP_FIND_LINKS` folder.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_cuda_torch_of_python3_is_used_and_offline_set_up_is_one_line(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("mop.sh", "pyproject.toml"):
        shutil.copy2(ROOT / name, repo / name)
    site = tmp_path / "gpu-image-site"
    (site / "torch").mkdir(parents=True)
    (site / "torch/__init__.py").write_text("import types\n__version__ = '2.11.0'\nversion = types.SimpleNamespace(cuda='13.0')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python3.chmod(0o755)
    wheels = tmp_path / "no-wheels"
    wheels.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels),
           "PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([str(repo / "mop.sh"), "train"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    hint = done.stderr.strip().splitlines()[-1]
    assert hint.startswith("mop.sh: could not install mop's dependencies"), hint
    assert "pip download -d mop-wheels" in hint and "safetensors" in hint and "torch" not in hint.split("run:")[1]
    assert "PIP_NO_INDEX=1 PIP_FIND_LINKS=" in hint and hint.endswith("./mop.sh train")
    # .venv imports the image's torch (no torch of its own was installed) and keeps using it.
    venv_python = repo / ".venv/bin/python"
    found = subprocess.run([str(venv_python), "-c", "import torch; print(torch.__file__, torch.version.cuda)"],
                           capture_output=True, text=True, env={k: v for k, v in env.items() if k != "PYTHONPATH"})
    assert found.stdout.split() == [str(site / "torch/__init__.py"), "13.0"], found.stderr
    assert (repo / ".venv/.mop-system-torch").is_file()
