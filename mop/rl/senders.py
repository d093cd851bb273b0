"""Senders of the trainer's weight buckets (`mop.rl.weights.weight_buckets`, rank 0's) to a running
inference engine through its own weight-update API, as SGLang 0.5.23 and vLLM 0.33.0 document it
(read from their sources; PROTOCOLS.md here has the reading). Both keep the tensors off the HTTP
connection: a control request per bucket names its tensors, and the tensors follow over a
communication group that joins the trainer (rank 0, the only sender) to the engine's workers (ranks
1 ... N), one broadcast per tensor in the request's order.

- `SGLangSender`: `POST /init_weights_update_group` once (`master_address`, `master_port`,
  `rank_offset` 1, `world_size` 1 + the engine's tensor-parallel ranks, `group_name`, `backend`), the
  trainer joining the same torch.distributed group (a TCP rendezvous at that address, its store under
  the group's name: the engine builds its side the same way); then for each sync `POST
  /begin_weight_update`, per bucket `POST /update_weights_from_distributed` (`names`, `dtypes`,
  `shapes`, `group_name`, `flush_cache` on the last bucket only, `weight_version` with it) while the
  trainer broadcasts the bucket's tensors, then `POST /end_weight_update`. Replies are `{"success",
  "message"}`; a failure is one line naming the request and the engine's message.
- `VLLMSender`: `POST /init_weight_transfer_engine` once (`{"init_info": {master_address, master_port,
  rank_offset: 1, world_size, packed: false}}`; the server runs with `--weight-transfer-config
  '{"backend":"nccl"}'` and `VLLM_SERVER_DEV_MODE=1`), the trainer joining vLLM's own NCCL group
  (`vllm.distributed.weight_transfer.nccl_common.trainer_init`: vLLM's stateless group, which a torch
  group cannot join; vLLM must be importable on the trainer's rank 0); then for each sync `POST
  /start_weight_update`, per bucket `POST /update_weights` (`{"update_info": {names, dtype_names,
  shapes}}`) while the trainer broadcasts, then `POST /finish_weight_update` (`weight_version`).

A control request blocks until the engine has received its tensors, so it runs in a thread while the
trainer broadcasts. Names are the checkpoint's (the engine's `load_weights` re-fuses and re-quantizes
them per layer), dtypes torch's names ("bfloat16", "float8_e4m3fn").

Tested here against a stand-in engine that serves these endpoints as documented and receives over a
gloo group (`tests/test_rl_senders.py`); not against a real vLLM or SGLang (they need GPUs, and their
wheels pull CUDA builds): the NCCL path and vLLM's group are untested.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from mop.rl.weights import Bucket

GROUP_NAME = "weight_update_group"  # SGLang's default


class EngineError(RuntimeError):
    """The engine refused or failed a request: one line naming it."""


class EngineClient:
    """JSON requests to an engine's HTTP server."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def post(self, path: str, body: dict | None = None) -> dict | list:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
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
    """What both senders share: the rendezvous beside its control request, each bucket's control request
    beside its broadcasts."""

    def __init__(self, client: EngineClient, device: torch.device):
        self.client, self.device = client, device
        self.threads = ThreadPoolExecutor(1)

    def _beside(self, path: str, body: dict | None, work: Callable[[], None]) -> dict:
        """POST `path` in a thread while `work` runs here (the engine answers once both sides are done)."""
        reply = self.threads.submit(self.client.post, path, body)
        try:
            work()
        finally:
            answer = reply.result()
        return answer

    def close(self) -> None:
        self.threads.shutdown(wait=True)


class SGLangSender(_Sender):
    """SGLang's update_weights_from_distributed (module docstring)."""

    def __init__(self, url: str, master_address: str, master_port: int, engine_ranks: int, backend: str = "nccl",
                 device: torch.device | None = None, group_name: str = GROUP_NAME, timeout_s: float = 600.0):
        super().__init__(EngineClient(url, timeout_s), device or torch.device("cpu"))
        self.group_name, self.group = group_name, None
        self.init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                     "world_size": 1 + engine_ranks, "group_name": group_name, "backend": backend}
        self.timeout = timedelta(seconds=timeout_s)

    def connect(self) -> None:
        init = self.init

        def join() -> None:
            self.group = custom_group(init["backend"], init["master_address"], init["master_port"],
                                      init["world_size"], 0, self.group_name, self.timeout)

        self._beside("/init_weights_update_group", init, join)

    def send(self, buckets: Iterable[Bucket], weight_version: str | None = None) -> None:
        self.client.post("/begin_weight_update", {})
        for bucket, last in _with_last(buckets):
            names, dtypes, shapes = _metadata(bucket)
            body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                    "flush_cache": last, **({"weight_version": weight_version} if last and weight_version else {})}
            self._beside("/update_weights_from_distributed", body, lambda bucket=bucket: self._broadcast(bucket))
        self.client.post("/end_weight_update", {})

    def _broadcast(self, bucket: Bucket) -> None:
        for _, tensor in bucket:
            dist.broadcast(tensor.to(self.device), src=0, group=self.group)

    def close(self) -> None:
        super().close()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


class VLLMSender(_Sender):
    """vLLM's weight transfer engine, NCCL backend, unpacked (module docstring). `communicator`: makes the
    group from the init info (None: vLLM's `trainer_init`); it broadcasts with `broadcast(tensor, src=0)`."""

    def __init__(self, url: str, master_address: str, master_port: int, engine_ranks: int,
                 device: torch.device | None = None, communicator: Callable[[dict], object] | None = None,
                 timeout_s: float = 600.0):
        super().__init__(EngineClient(url, timeout_s), device or torch.device("cuda"))
        self.init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
                     "world_size": 1 + engine_ranks, "packed": False}
        self.make_communicator, self.communicator = communicator or _vllm_communicator, None

    def connect(self) -> None:
        def join() -> None:
            self.communicator = self.make_communicator(self.init)

        self._beside("/init_weight_transfer_engine", {"init_info": self.init}, join)

    def send(self, buckets: Iterable[Bucket], weight_version: str | None = None) -> None:
        self.client.post("/start_weight_update")
        for bucket in buckets:
            names, dtypes, shapes = _metadata(bucket)
            body = {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}
            self._beside("/update_weights", body, lambda bucket=bucket: self._broadcast(bucket))
        self.client.post("/finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def _broadcast(self, bucket: Bucket) -> None:
        for _, tensor in bucket:
            self.communicator.broadcast(tensor.to(self.device), src=0)


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
