"""The weight senders to a running engine (issues 48 and 63, `mop.rl.senders`), against a stand-in engine
that serves SGLang's and vLLM's weight-update endpoints as their sources document them (mop/rl/PROTOCOLS.md
and the senders' docstring: the request bodies' fields, the session's order, the group joined at
`rank_offset` by the ranks the engine reports, one broadcast per tensor in the request's order) and
receives over a gloo group: every tensor of every bucket arrives whole, under its name, in its dtype;
the requests come in the documented order with the documented fields; an engine's refusal is one line
naming the request, and leaves nothing open. vLLM's CPU build runs the folder path and the sampling
for real (`tests/test_engine_vllm.py`); its NCCL group and SGLang (GPU-only) are this stand-in's.

The failure paths as the engines' code reads (issue 63, item 4): SGLang 0.5.23 keeps a weight-update
session open after a failed `/update_weights_from_distributed`, so the next `/begin_weight_update`
fails "a weight-update session is already open" (`srt/managers/scheduler_components/weight_updater.py`
187-230, 311-316) until `/end_weight_update` (323-335); its init of a group whose name exists fails
(torch's "The specified group name has already been created"), and `/destroy_weights_update_group` of
an unknown one says "The group to be destroyed does not exist." (`model_executor/model_runner_components/
weight_updater.py` 146-157); its group holds `rank_offset + tp_rank` (ibid. 124), so pipeline stages or
data-parallel replicas cannot join. vLLM 0.32 refuses a malformed `/update_weights` before any receive
(`distributed/weight_transfer/base.py` 441-459, `nccl_engine.py` 97-109) and its workers join at
`offset + dp x world_size + rank` (`nccl_common.py` 193-201), `world_size` of `/get_world_size`."""

from __future__ import annotations

import base64
import io
import json
import multiprocessing as mp
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from servers import free_port, wait_until_serving

from mop.data.rollouts.corpus import read_rollouts
from mop.data.rollouts.rows import RolloutRows, RouteShape
from mop.data.tokenizer import ByteTokenizer
from mop.rl.engine import SGLangServer, VLLMServer
from mop.rl.senders import EngineError, SGLangSender, VLLMFolderSender, VLLMSender, custom_group
from mop.rl.vllm_cpu import EXTENSION

SGLANG_INIT = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
VLLM_INIT = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
             "packed_buffer_size_bytes", "packed_num_buffers"}
TIMEOUT = timedelta(seconds=60)


class StandIn:
    """The engine's side of both protocols, one worker (rank 1). `server`: what it says of itself (SGLang's
    `/server_info` sizes); names in `fail` fail their bucket after it is received, names in `refuse` before."""

    def __init__(self, out: Path, shape: tuple[int, int, int] = (2, 4, 2), server: dict | None = None,
                 fail: tuple = (), refuse: tuple = ()):
        self.out, self.group, self.session, self.received, self.log = out, None, False, {}, []
        self.layers, self.experts, self.top_k = shape
        self.server = {"tp_size": 1, "pp_size": 1, "dp_size": 1, **(server or {})}
        self.fail, self.refuse = fail, refuse

    def route(self, path: str, body: dict | None) -> dict:
        self.log.append([path, body])
        (self.out / "requests.json").write_text(json.dumps(self.log))
        handler = {"/init_weights_update_group": self.sglang_init, "/begin_weight_update": self.begin,
                   "/update_weights_from_distributed": lambda b: self.receive(b, "dtypes"),
                   "/end_weight_update": self.end, "/destroy_weights_update_group": self.destroy,
                   "/server_info": lambda b: self.server, "/get_world_size": lambda b: {"world_size": 1},
                   "/init_weight_transfer_engine": self.vllm_init, "/start_weight_update": self.begin,
                   "/update_weights": lambda b: self.receive(b["update_info"], "dtype_names"),
                   "/finish_weight_update": self.end, "/reset_prefix_cache": lambda b: {"success": True},
                   "/shutdown_weight_transfer_engine": self.destroy, "/collective_rpc": self.rpc,
                   "/v1/completions": self.completions, "/generate": self.generate}[path]
        return handler(body)

    def completion(self, prompt: list[int], index: int, length: int) -> tuple[list[int], list[float], np.ndarray]:
        """A sample: `length - 1` bytes then the end of text, each with log-prob -5.5 (a uniform draw
        over 244 ids), and distinct experts per token and layer, all from the sample's index."""
        g = torch.Generator().manual_seed(index)
        tokens = torch.randint(0, 256, (length - 1,), generator=g).tolist() + [257]
        rows = len(prompt) + len(tokens) - 1
        routes = torch.rand(rows, self.layers, self.experts, generator=g).argsort(-1)[..., :self.top_k]
        return tokens, [-5.5] * len(tokens), routes.numpy()

    def completions(self, body: dict) -> dict:  # vLLM's /v1/completions, as PROTOCOLS.md reads it
        assert body["logprobs"] == 0 and body["return_token_ids"] and body["temperature"] == 1.0, body
        choices = []
        for p, prompt in enumerate(body["prompt"]):
            for j in range(body["n"]):
                index = p * body["n"] + j
                tokens, logps, routes = self.completion(prompt, body["seed"] + index, body["max_tokens"])
                buffer = io.BytesIO()
                np.save(buffer, routes.astype(np.uint8), allow_pickle=False)
                choices.append({"index": index, "text": "", "token_ids": tokens, "finish_reason": "stop",
                                "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logps},
                                "routed_experts": base64.b64encode(buffer.getvalue()).decode()})
        return {"choices": choices[::-1]}  # any order: the index says which

    def generate(self, body: dict) -> list:  # SGLang's /generate
        params = body["sampling_params"]
        assert body["return_logprob"] and body["logprob_start_len"] == -1 and params["top_k"] == -1, body
        outputs = []
        for p, prompt in enumerate(body["input_ids"]):
            for j in range(params["n"]):
                tokens, logps, routes = self.completion(prompt, 1000 + p * params["n"] + j, params["max_new_tokens"])
                routed = base64.b64encode(routes.astype("<i4").tobytes()).decode()
                outputs.append({"text": "", "output_ids": tokens, "meta_info": {
                    "finish_reason": {"type": "stop", "matched": 257}, "routed_experts": routed,
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(logps, tokens)]}})
        return outputs

    def sglang_init(self, body: dict) -> dict:
        assert set(body) == SGLANG_INIT, body
        if self.group is not None:
            return {"success": False, "message": "Failed to initialize custom process group: The specified group "
                    "name has already been created, please use a different group name."}
        self.join(body["backend"].replace("nccl", "gloo"), body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def rpc(self, body: dict) -> dict:  # vLLM's dev endpoint: the worker's methods, an extension's included
        if body["method"] == "mop_reload_fix" and self.server.get("extension"):
            return {"results": [self.server["extension"]]}
        return {"success": False, "message": f"AttributeError: 'CPUWorker' object has no attribute '{body['method']}'"}

    def destroy(self, body) -> dict:
        if self.group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(self.group)
        self.group = None
        return {"success": True, "message": "ok"}

    def vllm_init(self, body: dict) -> dict:
        init = body["init_info"]
        assert set(init) <= VLLM_INIT and not init["packed"], init
        self.join("gloo", init)
        return {"message": "Weight transfer initialized"}

    def join(self, backend: str, init: dict) -> None:
        self.group = custom_group(backend, init["master_address"], init["master_port"], init["world_size"],
                                  init["rank_offset"], init.get("group_name", "vllm"), TIMEOUT)

    def begin(self, body) -> dict:
        if self.session:
            return {"success": False, "message": "a weight update session is already open"}
        self.session = True
        return {"success": True, "message": "ok"}

    def receive(self, info: dict, dtypes: str) -> dict:
        if not self.session:
            return {"success": False, "message": "update_weights_from_distributed must run between "
                    "begin_weight_update() and end_weight_update()"}
        if set(info["names"]) & set(self.refuse):
            return {"success": False, "message": f"Invalid update_info: {sorted(set(info['names']) & set(self.refuse))}"}
        for name, dtype, shape in zip(info["names"], info[dtypes], info["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=self.group)
            self.received[name] = tensor
        if set(info["names"]) & set(self.fail):
            return {"success": False, "message": "Failed to update parameter online: partially updated"}
        return {"success": True, "message": "Succeeded to update model weights."}

    def end(self, body) -> dict:
        self.session = False
        save_file(self.received, self.out / "received.safetensors")
        return {"success": True, "message": "ok"}


def serve(port: int, out: str, shape: tuple[int, int, int], options: dict) -> None:
    engine = StandIn(Path(out), shape, **options)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.do_POST()

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            data = json.dumps(engine.route(self.path.split("?")[0], body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


def start_stand_in(out: Path, **options):
    """A stand-in engine in a process of its own, once it listens: its URL and process."""
    port = free_port()
    process = mp.get_context("spawn").Process(target=serve, args=(port, str(out), (2, 4, 2), options), daemon=True)
    process.start()
    wait_until_serving(port, process)
    return f"http://127.0.0.1:{port}", process


@pytest.fixture
def engine(tmp_path):
    url, process = start_stand_in(tmp_path)
    yield url, tmp_path
    process.kill()


BUCKETS = [[("model.embed_tokens.weight", torch.randn(7, 4)), ("model.norm.weight", torch.randn(4))],
           [("model.layers.0.mlp.experts.0.gate_proj.weight", torch.randn(6, 4).to(torch.bfloat16)),
            ("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv", torch.rand(1, 1))],
           [("model.layers.0.mlp.experts.gate_up_proj_blocks",
             torch.randint(0, 255, (2, 3, 1, 16), dtype=torch.uint8))]]


def check_received(out: Path) -> list:
    received = load_file(out / "received.safetensors")
    sent = [item for bucket in BUCKETS for item in bucket]
    assert sorted(received) == sorted(name for name, _ in sent)
    for name, tensor in sent:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    return json.loads((out / "requests.json").read_text())


class Gloo:
    """The trainer's side of vLLM's group over gloo, where vLLM's own NCCL communicator would be."""

    def __init__(self, init, timeout=TIMEOUT):
        self.group = custom_group("gloo", init["master_address"], init["master_port"], init["world_size"], 0, "vllm",
                                  timeout)

    def broadcast(self, tensor, src):
        dist.broadcast(tensor, src=src, group=self.group)


def test_the_sglang_sender_speaks_update_weights_from_distributed(engine):
    url, out = engine
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    sender.connect()
    sender.send(BUCKETS, weight_version="step-3")
    sender.close()
    requests = check_received(out)
    assert [path for path, _ in requests] == ["/server_info", "/destroy_weights_update_group",
                                             "/init_weights_update_group", "/begin_weight_update",
                                             *["/update_weights_from_distributed"] * 3, "/end_weight_update",
                                             "/destroy_weights_update_group"]
    updates = [body for path, body in requests if path == "/update_weights_from_distributed"]
    assert [u["flush_cache"] for u in updates] == [False, False, True]  # the cache flushed once, at the end
    assert updates[-1]["weight_version"] == "step-3" and "weight_version" not in updates[0]
    assert updates[1]["dtypes"] == ["bfloat16", "float32"] and updates[1]["shapes"] == [[6, 4], [1, 1]]
    assert requests[2][1]["rank_offset"] == 1 and requests[2][1]["world_size"] == 2


def test_the_vllm_sender_speaks_the_weight_transfer_engine(engine):
    url, out = engine
    port = free_port()
    sender = VLLMSender(url, "127.0.0.1", port, device=torch.device("cpu"), communicator=Gloo,
                        timeout_s=60)
    sender.connect()
    sender.send(BUCKETS, weight_version="step-3")
    group = sender.communicator.group
    sender.close()
    dist.destroy_process_group(group)
    requests = check_received(out)
    assert [path for path, _ in requests] == ["/get_world_size", "/init_weight_transfer_engine",
                                             "/start_weight_update", *["/update_weights"] * 3,
                                             "/finish_weight_update", "/reset_prefix_cache",
                                             "/shutdown_weight_transfer_engine"]
    assert requests[1][1]["init_info"]["world_size"] == 2  # the trainer and the one worker /get_world_size counts
    assert requests[6][1] == {"weight_version": "step-3"} and requests[2][1] is None
    assert requests[4][1]["update_info"]["dtype_names"] == ["bfloat16", "float32"]


def test_a_refused_request_is_one_line_naming_it(engine):
    url, _ = engine
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    sender.client.post("/begin_weight_update", {})  # a session left open by someone else
    with pytest.raises(EngineError, match=r"/begin_weight_update: a weight update session is already open"):
        sender.send(BUCKETS)


def test_a_failed_bucket_closes_sglangs_session_so_the_next_sync_goes_through(tmp_path):
    """SGLang keeps the session of a bucket that failed after it was received (module docstring): the
    sender ends it, and the next sync is taken whole."""
    url, process = start_stand_in(tmp_path, fail=("model.norm.weight",))
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    sender.connect()
    with pytest.raises(EngineError, match=r"/update_weights_from_distributed: Failed to update parameter online"):
        sender.send(BUCKETS)
    sender.send(BUCKETS[1:], weight_version="2")  # begins a new session: the failed one was ended
    sender.close()
    process.kill()
    paths = [path for path, _ in json.loads((tmp_path / "requests.json").read_text())]
    assert paths[3:] == ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
                         "/begin_weight_update", *["/update_weights_from_distributed"] * 2, "/end_weight_update",
                         "/destroy_weights_update_group"]


def test_a_resumed_run_replaces_the_group_an_earlier_run_left(engine):
    """A trainer that died without closing leaves SGLang's group, whose name the next init would fail on:
    the next run's sender destroys it first."""
    url, out = engine
    earlier = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    earlier.connect()
    dist.destroy_process_group(earlier.group)  # its process ended: the engine keeps its side
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    sender.connect()
    sender.send(BUCKETS)
    sender.close()
    check_received(out)


def test_sglang_with_pipeline_stages_is_refused_in_one_line(tmp_path):
    url, process = start_stand_in(tmp_path, server={"tp_size": 2, "pp_size": 2})
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    with pytest.raises(EngineError, match=r"tensor-parallel ranks only .* pp_size=2, dp_size=1"):
        sender.connect()
    process.kill()


def test_a_refusal_before_receiving_ends_the_send_at_once(tmp_path):
    """vLLM refuses a malformed update before its workers receive (module docstring): the trainer's send
    ends with the engine's line within a minute, not when its group's ten-minute timeout ends a broadcast
    nobody receives."""
    url, process = start_stand_in(tmp_path, refuse=("model.norm.weight",))
    sender = VLLMSender(url, "127.0.0.1", free_port(), device=torch.device("cpu"),
                        communicator=lambda init: Gloo(init, timedelta(minutes=10)), timeout_s=60)
    sender.connect()
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"/update_weights: Invalid update_info: \['model.norm.weight'\]"):
        sender.send(BUCKETS)
    assert time.monotonic() - start < 60
    group = sender.communicator.group
    sender.close()
    process.kill()
    dist.destroy_process_group(group)


@pytest.mark.parametrize("extension", [None, EXTENSION])
def test_a_cpu_vllm_without_mops_reload_fix_is_refused_in_one_line(tmp_path, extension):
    """vLLM's CPU build reloads MoE experts wrongly (`mop.rl.vllm_cpu`): the folder sender asks a CPU server for
    the fix's method and names the flag that loads it when the server has none."""
    url, process = start_stand_in(tmp_path, server={"vllm_config": "model='m', dtype=torch.bfloat16, quantization=None, "
                                                                    "device_config=cpu", "extension": extension})
    sender = VLLMFolderSender(url, tmp_path / "sync")
    if extension is None:
        with pytest.raises(EngineError, match=rf"start the server with --worker-extension-cls {EXTENSION}"):
            sender.connect()
    else:
        sender.connect()
    process.kill()


def test_a_trainer_sends_its_weights_through_a_sender(engine, tmp_path):
    """`Trainer.send_weights`: rank 0's buckets of the export, every checkpoint tensor, to the engine."""
    from test_rl_loop import REFERENCE
    from test_rl_trainer import SETTINGS

    from mop.config import load_config
    from mop.trainer import Trainer

    url, out = engine
    trainer = Trainer(load_config(None, [*SETTINGS, *REFERENCE, f"--log.run_dir={tmp_path / 'run'}"]))
    sender = SGLangSender(url, "127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    sender.connect()
    trainer.send_weights(sender, "v1", bucket_mb=1)
    sender.close()
    exported = {key: tensor for bucket in trainer.weights(bucket_mb=1) for key, tensor in bucket}
    trainer.close()
    received = load_file(out / "received.safetensors")
    assert sorted(received) == sorted(exported) and len(received) > 20
    for key, tensor in exported.items():
        assert torch.equal(received[key], tensor), key


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_server_engine_gives_rows_the_rollout_reader_takes(engine, tmp_path, kind):
    """Samples come back prompt-major whatever the reply's order, each with its end of text, its
    log-probs and its routes in the server's form (vLLM's .npy, SGLang's raw int32)."""
    url, _ = engine
    server = (VLLMServer(url, sender=None) if kind == "vllm" else SGLangServer(url, sender=None))
    prompts = [[51, 43, 52, 61], [49, 61]]
    rows = server.sample(prompts, group=3, max_new_tokens=5, seed=7)
    assert [row["prompt_ids"] for row in rows] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert all(row["completion_ids"][-1] == 257 and len(row["sampling_logps"]) == 5 for row in rows)
    assert len({tuple(row["completion_ids"]) for row in rows}) == 6
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({**row, "reward": float(k % 2), "group": str(k // 3)}) + "\n"
                              for k, row in enumerate(rows)))
    corpus = read_rollouts(str(source), RolloutRows(ByteTokenizer(), None, RouteShape(2, 0, 4, 2)), "group", False)
    assert len(corpus) == 6 and corpus.routes is not None


def test_the_loop_trains_on_a_servers_rollouts_and_pushes_it_each_batch(engine, tmp_path):
    """`mop rl --rl.engine=sglang`: each batch the weights go through the sender (a session per sync,
    versions 1, 2), the rows are the server's samples, and the loop trains on them."""
    from test_rl_loop import LOOP, REFERENCE

    from mop.cli import main
    from mop.metrics import read_metrics

    url, out = engine
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    run_dir = tmp_path / "run"
    assert main(["rl", *LOOP, *REFERENCE, f"--rl.prompts={prompts}", f"--log.run_dir={run_dir}", "--train.steps=2",
                 "--rl.engine=sglang", f"--rl.engine_url={url}", f"--rl.sync_address=127.0.0.1:{free_port()}"]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(r["rollouts"] == 12 for r in records)
    requests = json.loads((out / "requests.json").read_text())
    paths = [path for path, _ in requests]
    assert paths.count("/init_weights_update_group") == 1 and paths.count("/begin_weight_update") == 2
    versions = [body.get("weight_version") for path, body in requests if path == "/update_weights_from_distributed"]
    assert [v for v in versions if v] == ["1", "2"]
    assert len(load_file(out / "received.safetensors")) > 10
    rows = [json.loads(line) for line in (run_dir / "rollouts" / "batch_000001.jsonl").open()]
    assert all(row["completion_ids"][-1] == 257 and set(row["sampling_logps"]) == {-5.5} for row in rows)
