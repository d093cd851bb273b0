"""Senders of the trainer's weight buckets (`mop.rl.weights.weight_buckets`, rank 0's) to a running
inference engine through its own weight-update API, as SGLang 0.5.23 and vLLM 0.32-0.33 serve it
(read from their sources, PROTOCOLS.md here; vLLM's CPU build run by the engine tier,
`tests/test_engine_vllm.py`). Every sender has `connect()` (once), `send(buckets, weight_version)`
(each sync) and `close()`. Names are the checkpoint's and the engine's `load_weights` re-fuses them
per layer; it quantizes nothing: a server that loaded a pre-quantized checkpoint (fp8 blocks, MXFP4)
takes the tensors in that format (`weight_buckets(published=...)`), or it casts a bf16 weight into
its fp8 storage and leaves the unsent scale as it finds it (vLLM's layerwise reload:
`model_loader/reload/layerwise.py`, `meta.py`). The two broadcast senders keep the tensors off the
HTTP connection: a control request per bucket names its tensors, and the tensors follow over a
communication group that joins the trainer (rank 0, the only sender) to the engine's workers (ranks
1 ... N, N asked of the engine), one broadcast per tensor in the request's order.

- `SGLangSender`: at `connect`, `GET /server_info` (the group holds its tensor-parallel ranks only:
  `rank = rank_offset + tp_rank`, `weight_updater.py:124`; a server with pipeline stages or
  data-parallel replicas cannot join one and is refused), `POST /destroy_weights_update_group` (a
  group an earlier run left, which would fail the init) and `POST /init_weights_update_group`
  (`master_address`, `master_port`, `rank_offset` 1, `world_size` 1 + tp, `group_name`, `backend`),
  the trainer joining the same torch.distributed group (a TCP rendezvous at that address, its store
  under the group's name: the engine builds its side the same way); then for each sync `POST
  /begin_weight_update`, per bucket `POST /update_weights_from_distributed` (`names`, `dtypes`,
  `shapes`, `group_name`, `flush_cache` on the last bucket only, `weight_version` with it) while the
  trainer broadcasts the bucket's tensors, then `POST /end_weight_update`, which also closes a
  session a failed bucket left open (else every later begin fails). `close` destroys the group on
  both sides.
- `VLLMSender`: at `connect`, `GET /get_world_size` (every worker of every data-parallel replica
  joins: rank `offset + dp x TP x PP + rank`, `nccl_common.py:193-201`) and `POST
  /init_weight_transfer_engine` (`{"init_info": {master_address, master_port, rank_offset: 1,
  world_size, packed: false}}`; the server runs with `--weight-transfer-config
  '{"backend":"nccl"}'` and `VLLM_SERVER_DEV_MODE=1`), the trainer joining vLLM's own NCCL group
  (`vllm.distributed.weight_transfer.nccl_common.trainer_init`: vLLM's stateless group, which a torch
  group cannot join; vLLM must be importable on the trainer's rank 0); then for each sync `POST
  /start_weight_update`, per bucket `POST /update_weights` (`{"update_info": {names, dtype_names,
  shapes}}`) while the trainer broadcasts, `POST /finish_weight_update` (`weight_version`) and `POST
  /reset_prefix_cache`; `close` posts `/shutdown_weight_transfer_engine`.
- `VLLMFolderSender`: the buckets written as safetensors into a folder the server reads (the earlier
  sync's files replaced), then `POST /collective_rpc` `{"method": "reload_weights", "kwargs":
  {"weights_path": folder}}` (every worker reloads the model in place, layer by layer), `POST
  /reset_prefix_cache` and `POST /update_weight_version`: the path vLLM's CPU build supports (its
  NCCL group needs CUDA), and any server that shares a file system with the trainer's rank 0. The
  CPU build reloads MoE experts right only with mop's worker extension (`mop.rl.vllm_cpu`), which
  `connect` asks a CPU server for.

vLLM resets neither its prefix cache at `/finish_weight_update` nor at a reload
(`v1/engine/async_llm.py`, `v1/worker/gpu_model_runner.py`): cached prompt blocks would keep the old
weights' keys and values, so every vLLM sync ends with `POST /reset_prefix_cache`, which must say
`success` (SGLang's last bucket flushes its cache). A control request blocks until the engine has
received its tensors, so it runs in a thread while the trainer broadcasts in another; an engine that
refuses a request before receiving ends the send at once with its one line, never a broadcast
waiting on it (the group is then unusable: close the sender).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mop.rl.vllm_cpu import EXTENSION
from mop.rl.weights import Bucket, save_folder

GROUP_NAME = "weight_update_group"  # SGLang's default


class EngineError(RuntimeError):
    """The engine refused or failed a request: one line naming it."""


class EngineClient:
    """JSON requests to an engine's HTTP server."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def post(self, path: str, body: dict | None = None) -> dict | list:
        return self._request(path, "POST", body)

    def get(self, path: str) -> dict | list:
        return self._request(path, "GET", None)

    def _request(self, path: str, method: str, body: dict | None) -> dict | list:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            raise EngineError(f"{self.url}{path}: HTTP {err.code}: {err.read().decode()[:500]}") from None
        except OSError as err:
            raise EngineError(f"{self.url}{path}: {err}") from None
        reply = json.loads(text) if text.strip()[:1] in ("{", "[") else {"message": text}  # vLLM's LoRA: plain text
        if isinstance(reply, dict) and reply.get("success") is False:
            raise EngineError(f"{self.url}{path}: {reply.get('message', reply)}")
        return reply


def reset_prefix_cache(client: EngineClient) -> None:
    """vLLM's prefix cache emptied after a sync (module docstring); `success` false is an error (blocks still
    held by running requests: the loop syncs between batches, when none runs)."""
    if not client.post("/reset_prefix_cache").get("success"):
        raise EngineError(f"{client.url}/reset_prefix_cache: the server kept its prefix cache (requests still "
                          "running?), so its samples would use the old weights' cached keys and values")


def _with_last(buckets: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Each bucket and whether it is the last."""
    iterator = iter(buckets)
    current = next(iterator, None)
    while current is not None:
        following = next(iterator, None)
        yield current, following is None
        current = following


def _metadata(bucket: Bucket) -> tuple[list[str], list[str], list[list[int]]]:
    return ([key for key, _ in bucket], [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            [list(t.shape) for _, t in bucket])


class _Sender:
    """What both broadcast senders share: a control request beside the work it announces (the group's
    rendezvous, a bucket's broadcasts)."""

    def __init__(self, client: EngineClient, device: torch.device):
        self.client, self.device = client, device
        self.requests = ThreadPoolExecutor(1)

    def _beside(self, path: str, body: dict | None, work: Callable[[], None]) -> dict:
        """POST `path` while `work` runs (the engine answers once both sides are done); a refusal ends it at
        once, whatever `work` is still waiting for (in a daemon thread: it ends with its group's timeout or
        the process, never holding either up)."""
        reply, done = self.requests.submit(self.client.post, path, body), Future()

        def run() -> None:
            try:
                work()
                done.set_result(None)
            except BaseException as err:  # handed to the caller below
                done.set_exception(err)

        threading.Thread(target=run, daemon=True).start()
        while not done.done():
            wait([reply, done], return_when=FIRST_COMPLETED)
            if reply.done() and reply.exception() is not None:
                raise reply.exception()
        done.result()
        return reply.result()

    def close(self) -> None:
        self.requests.shutdown(wait=True)


class SGLangSender(_Sender):
    """SGLang's update_weights_from_distributed (module docstring)."""

    def __init__(self, url: str, master_address: str, master_port: int, backend: str = "nccl",
                 device: torch.device | None = None, group_name: str = GROUP_NAME, timeout_s: float = 600.0):
        super().__init__(EngineClient(url, timeout_s), device or torch.device("cpu"))
        self.group_name, self.group = group_name, None
        self.init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                     "group_name": group_name, "backend": backend}
        self.timeout = timedelta(seconds=timeout_s)

    def connect(self) -> None:
        init = {**self.init, "world_size": 1 + sglang_group_ranks(self.client)}
        try:
            self.client.post("/destroy_weights_update_group", {"group_name": self.group_name})
        except EngineError:
            pass  # "The group to be destroyed does not exist.": no earlier run left one

        def join() -> None:
            self.group = custom_group(init["backend"], init["master_address"], init["master_port"],
                                      init["world_size"], 0, self.group_name, self.timeout)

        self._beside("/init_weights_update_group", init, join)

    def send(self, buckets: Iterable[Bucket], weight_version: str | None = None) -> None:
        self.client.post("/begin_weight_update", {})
        try:
            for bucket, last in _with_last(buckets):
                names, dtypes, shapes = _metadata(bucket)
                body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                        "flush_cache": last, **({"weight_version": weight_version} if last and weight_version else {})}
                self._beside("/update_weights_from_distributed", body, lambda bucket=bucket: self._broadcast(bucket))
        finally:  # closes the session a failed bucket leaves open, which would refuse every later begin
            self.client.post("/end_weight_update", {})

    def _broadcast(self, bucket: Bucket) -> None:
        for _, tensor in bucket:
            dist.broadcast(tensor.to(self.device), src=0, group=self.group)

    def close(self) -> None:
        super().close()
        if self.group is not None:
            try:
                self.client.post("/destroy_weights_update_group", {"group_name": self.group_name})
            finally:
                dist.destroy_process_group(self.group)
                self.group = None


def sglang_group_ranks(client: EngineClient) -> int:
    """The engine ranks that join SGLang's weight-update group (module docstring), from `/server_info`."""
    info = client.get("/server_info")
    stages, replicas = info.get("pp_size", 1), info.get("dp_size", 1)
    if stages != 1 or replicas != 1:
        raise EngineError(f"{client.url}: SGLang's weight-update group holds tensor-parallel ranks only (rank = "
                          f"rank_offset + tp_rank), not this server's pp_size={stages}, dp_size={replicas}; serve "
                          "with tensor parallelism alone, one server per replica")
    return int(info["tp_size"])


class VLLMSender(_Sender):
    """vLLM's weight transfer engine, NCCL backend, unpacked (module docstring). `communicator`: makes the
    group from the init info (None: vLLM's `trainer_init`); it broadcasts with `broadcast(tensor, src=0)`."""

    def __init__(self, url: str, master_address: str, master_port: int, device: torch.device | None = None,
                 communicator: Callable[[dict], object] | None = None, timeout_s: float = 600.0):
        super().__init__(EngineClient(url, timeout_s), device or torch.device("cuda"))
        self.init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1, "packed": False}
        self.make_communicator, self.communicator = communicator or _vllm_communicator, None

    def connect(self) -> None:
        init = {**self.init, "world_size": 1 + int(self.client.get("/get_world_size")["world_size"])}

        def join() -> None:
            self.communicator = self.make_communicator(init)

        self._beside("/init_weight_transfer_engine", {"init_info": init}, join)

    def send(self, buckets: Iterable[Bucket], weight_version: str | None = None) -> None:
        self.client.post("/start_weight_update")
        for bucket in buckets:
            names, dtypes, shapes = _metadata(bucket)
            body = {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}
            self._beside("/update_weights", body, lambda bucket=bucket: self._broadcast(bucket))
        self.client.post("/finish_weight_update", {"weight_version": weight_version} if weight_version else None)
        reset_prefix_cache(self.client)

    def _broadcast(self, bucket: Bucket) -> None:
        for _, tensor in bucket:
            self.communicator.broadcast(tensor.to(self.device), src=0)

    def close(self) -> None:
        super().close()
        if self.communicator is not None:
            self.client.post("/shutdown_weight_transfer_engine")
            self.communicator = None


class VLLMFolderSender:
    """vLLM's in-place reload from a folder of safetensors (module docstring)."""

    def __init__(self, url: str, folder: str | Path, timeout_s: float = 600.0):
        self.client, self.folder = EngineClient(url, timeout_s), Path(folder).resolve()

    def connect(self) -> None:
        """A server on the CPU must run mop's reload fix (`mop.rl.vllm_cpu`): its build reloads MoE experts
        wrongly without it."""
        if "device_config=cpu" not in str(self.client.get("/server_info").get("vllm_config", "")):
            return
        try:
            self.client.post("/collective_rpc", {"method": "mop_reload_fix"})
        except EngineError:
            raise EngineError(f"{self.client.url}: vLLM's CPU build reloads MoE experts wrongly (their prepacking is "
                              f"skipped on a reload); start the server with --worker-extension-cls {EXTENSION} and "
                              "mop's directory on its PYTHONPATH (mop.rl.vllm_cpu)") from None

    def send(self, buckets: Iterable[Bucket], weight_version: str | None = None) -> None:
        for old in [*self.folder.glob("*.safetensors"), *self.folder.glob("*.safetensors.index.json")]:
            old.unlink()  # the loader reads every safetensors file of the folder
        save_folder(buckets, self.folder, None)
        self.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder)}})
        reset_prefix_cache(self.client)
        if weight_version:
            self.client.post("/update_weight_version", {"new_version": weight_version})

    def close(self) -> None:
        pass


def _vllm_communicator(init: dict):
    try:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
    except ImportError as err:
        raise EngineError(f"the vLLM sender joins vLLM's own NCCL group, which needs vllm on the trainer's rank 0 "
                          f"({err})") from None
    return trainer_init(init)


def custom_group(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
                 timeout: timedelta):
    """A torch.distributed group beside the run's own (none needed): a TCP rendezvous at `address:port`
    (rank 0 holds the store), its keys under `group_name`, the group made and registered by torch's own
    helper, as SGLang's engine makes its side (`init_custom_process_group`, PROTOCOLS.md)."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group
