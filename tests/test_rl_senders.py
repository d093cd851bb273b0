"""The weight senders to a running engine (issue 48, `mop.rl.senders`), against a stand-in engine that
serves SGLang's and vLLM's weight-update endpoints as their sources document them (mop/rl/PROTOCOLS.md
and the senders' docstring: the request bodies' fields, the session's order, the group joined at
`rank_offset`, one broadcast per tensor in the request's order) and receives over a gloo group: every
tensor of every bucket arrives whole, under its name, in its dtype; the requests come in the
documented order with the documented fields; an engine's refusal is one line naming the request.
Not a real vLLM or SGLang: they need GPUs (NCCL), and their wheels pull CUDA builds."""

from __future__ import annotations

import base64
import io
import json
import multiprocessing as mp
import socket
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from mop.data.rollouts import RolloutRows, RouteShape, read_rollouts
from mop.data.tokenizer import ByteTokenizer
from mop.rl.engine import SGLangServer, VLLMServer
from mop.rl.senders import EngineError, SGLangSender, VLLMSender, custom_group

SGLANG_INIT = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
VLLM_INIT = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
             "packed_buffer_size_bytes", "packed_num_buffers"}
TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandIn:
    """The engine's side of both protocols, one worker (rank 1)."""

    def __init__(self, out: Path, shape: tuple[int, int, int] = (2, 4, 2)):
        self.out, self.group, self.session, self.received, self.log = out, None, False, {}, []
        self.layers, self.experts, self.top_k = shape
        self.version = 0

    def route(self, path: str, body: dict | None) -> dict:
        self.log.append([path, body])
        handler = {"/init_weights_update_group": self.sglang_init, "/begin_weight_update": self.begin,
                   "/update_weights_from_distributed": lambda b: self.receive(b, "dtypes"),
                   "/end_weight_update": self.end, "/init_weight_transfer_engine": self.vllm_init,
                   "/start_weight_update": self.begin, "/finish_weight_update": self.end,
                   "/update_weights": lambda b: self.receive(b["update_info"], "dtype_names"),
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
        self.join(body["backend"].replace("nccl", "gloo"), body)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

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
        for name, dtype, shape in zip(info["names"], info[dtypes], info["shapes"], strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=self.group)
            self.received[name] = tensor
        return {"success": True, "message": "Succeeded to update model weights."}

    def end(self, body) -> dict:
        self.session = False
        save_file(self.received, self.out / "received.safetensors")
        (self.out / "requests.json").write_text(json.dumps(self.log))
        return {"success": True, "message": "ok"}


def serve(port: int, out: str, shape: tuple[int, int, int]) -> None:
    engine = StandIn(Path(out), shape)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            data = json.dumps(engine.route(self.path, body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


@pytest.fixture
def engine(tmp_path):
    port = free_port()
    process = mp.get_context("spawn").Process(target=serve, args=(port, str(tmp_path), (2, 4, 2)), daemon=True)
    process.start()
    for _ in range(200):  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            process.join(0.05)
    yield f"http://127.0.0.1:{port}", tmp_path
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


def test_the_sglang_sender_speaks_update_weights_from_distributed(engine):
    url, out = engine
    sender = SGLangSender(url, "127.0.0.1", free_port(), engine_ranks=1, backend="gloo", timeout_s=60)
    sender.connect()
    sender.send(BUCKETS, weight_version="step-3")
    sender.close()
    requests = check_received(out)
    assert [path for path, _ in requests] == ["/init_weights_update_group", "/begin_weight_update",
                                             *["/update_weights_from_distributed"] * 3, "/end_weight_update"]
    updates = [body for path, body in requests if path == "/update_weights_from_distributed"]
    assert [u["flush_cache"] for u in updates] == [False, False, True]  # the cache flushed once, at the end
    assert updates[-1]["weight_version"] == "step-3" and "weight_version" not in updates[0]
    assert updates[1]["dtypes"] == ["bfloat16", "float32"] and updates[1]["shapes"] == [[6, 4], [1, 1]]
    assert requests[0][1]["rank_offset"] == 1 and requests[0][1]["world_size"] == 2


def test_the_vllm_sender_speaks_the_weight_transfer_engine(engine):
    url, out = engine
    port = free_port()

    class Gloo:  # the trainer's side of the group, where vLLM's own NCCL communicator would be
        def __init__(self, init):
            self.group = custom_group("gloo", init["master_address"], init["master_port"], init["world_size"], 0,
                                      "vllm", TIMEOUT)

        def broadcast(self, tensor, src):
            dist.broadcast(tensor, src=src, group=self.group)

    sender = VLLMSender(url, "127.0.0.1", port, engine_ranks=1, device=torch.device("cpu"), communicator=Gloo,
                        timeout_s=60)
    sender.connect()
    sender.send(BUCKETS, weight_version="step-3")
    sender.close()
    requests = check_received(out)
    assert [path for path, _ in requests] == ["/init_weight_transfer_engine", "/start_weight_update",
                                             *["/update_weights"] * 3, "/finish_weight_update"]
    assert requests[-1][1] == {"weight_version": "step-3"} and requests[1][1] is None
    assert requests[3][1]["update_info"]["dtype_names"] == ["bfloat16", "float32"]


def test_a_refused_request_is_one_line_naming_it(engine):
    url, _ = engine
    sender = SGLangSender(url, "127.0.0.1", free_port(), engine_ranks=1, backend="gloo", timeout_s=60)
    sender.client.post("/begin_weight_update", {})  # a session left open by someone else
    with pytest.raises(EngineError, match=r"/begin_weight_update: a weight update session is already open"):
        sender.send(BUCKETS)


def test_a_trainer_sends_its_weights_through_a_sender(engine, tmp_path):
    """`Trainer.send_weights`: rank 0's buckets of the export, every checkpoint tensor, to the engine."""
    from test_rl_loop import REFERENCE
    from test_rl_trainer import SETTINGS

    from mop.config import load_config
    from mop.trainer import Trainer

    url, out = engine
    trainer = Trainer(load_config(None, [*SETTINGS, *REFERENCE, f"--log.run_dir={tmp_path / 'run'}"]))
    sender = SGLangSender(url, "127.0.0.1", free_port(), engine_ranks=1, backend="gloo", timeout_s=60)
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
