"""The engine tier's vLLM (issue 63): its CPU build in an environment of its own (`.venv-vllm`, which
`./mop.sh test -m engine` makes), started by the tests beside mop: its OpenAI server on 127.0.0.1
(`vllm_server`, what `mop rl` samples from and syncs to) or its offline engine over a batch of model
folders (`offline_prompt_logprobs`, `vllm_side/prompt_logprobs.py`).

Every start gives vLLM 256 MiB of KV cache (`--kv-cache-memory-bytes`: without it the CPU backend asks
for 92% of the machine's memory and refuses to start beside the tests' other processes), the model's
eager forward in bf16, no download (`HF_HUB_OFFLINE`), and the server's development endpoints
(`VLLM_SERVER_DEV_MODE`: `/collective_rpc`, `/reset_prefix_cache`, `/server_info`), as an RL run needs
them, and mop's worker extension that makes its reloads load MoE experts right (`mop.rl.vllm_cpu`). A server is waited for until it answers or its process exits (`servers.wait_until_serving`) and
stopped with its whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from servers import free_port, wait_until_serving

from mop.rl.vllm_cpu import EXTENSION

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KV_CACHE_BYTES = 256 << 20
COMMON = ["--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "512", "--seed", "0"]
PROCESSED = ["--logprobs-mode", "processed_logprobs"]
"""The log-probs of the distribution sampled, as TRL runs vLLM (mop's requests set every sampling field, so
they equal the raw ones); the test of the sampling fields asks for it, to see a default the server fills."""


def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.skip("the engine tier needs vLLM's CPU build in .venv-vllm: ./mop.sh test -m engine makes it")
    return VLLM_PYTHON


def vllm_environment(**extra: str) -> dict:
    """The engine's environment: mop's directory on its path (its worker extension, which imports only vLLM)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT), **extra}


@contextmanager
def vllm_server(model: Path, logs: Path, *flags: str, extension: bool = True, **environment: str):
    """vLLM's OpenAI server on `model` (a Hugging Face folder) until the block ends: its URL; with `extension`,
    mop's reload fix for the CPU build (`mop.rl.vllm_cpu`). Its output goes to `logs/vllm.log`."""
    port = free_port()
    log = logs / "vllm.log"
    command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), *COMMON, "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
               *(["--worker-extension-cls", EXTENSION] if extension else []), *flags]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=vllm_environment(**environment))
    try:
        wait_until_serving(port, process, log, "/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> None:
    """The server and every process it started (its engine core and workers)."""
    for sent, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def offline_prompt_logprobs(jobs: list[dict], work: Path) -> list[dict]:
    """vLLM's offline engine on each job's folder in turn (`vllm_side/prompt_logprobs.py`): per job the prompt
    log-probs of its token ids, or the engine's error."""
    job_file, out = work / "vllm_jobs.json", work / "vllm_results.json"
    job_file.write_text(json.dumps(jobs))
    script = Path(__file__).parent / "vllm_side" / "prompt_logprobs.py"
    with open(work / "vllm_offline.log", "w") as log:
        done = subprocess.run([str(vllm_python()), str(script), str(job_file), str(out)], stdout=log,
                              stderr=subprocess.STDOUT, env=vllm_environment(), start_new_session=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's offline engine failed ({done.returncode}):\n"
                           f"{(work / 'vllm_offline.log').read_text()[-3000:]}")
    return json.loads(out.read_text())
