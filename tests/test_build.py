"""Building a run: shards only (never the full model on a rank), identical initial weights in every
layout, bf16 working weights with fp32 host masters, and host-optimizer checkpoints in place."""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from mop import checkpoint
from mop.build import build_model_shards, build_run
from mop.config import ConfigError, load_config
from mop.models.transformer import build_model
from mop.parallel import DistLayout, Layout
from mop.parallel.views import GlobalViews
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.testing.memory import ResidentGrowth
from test_train import TINY_RUN

# About 1.08 GiB of fp32 parameters: 2 MoE layers of 16 experts (2 x 100M), embedding and head (2 x 33.5M).
LARGE = ["--model.vocab_size=32768", "--model.hidden=1024", "--model.layers=2", "--model.heads=8",
         "--model.kv_heads=4", "--model.head_dim=128", "--model.experts=16", "--model.expert_intermediate=2048",
         "--parallel.strategy=mop", "--parallel.nproc=2"]


def _runtime(rank, world, config) -> Runtime:
    p = config.parallel
    return Runtime(rank, world, torch.device("cpu"), DistLayout(Layout(world, p.sequence, p.expert, p.vocab),
                                                              torch.device("cpu")))


def _construction_growth(rank, world, args):
    config = settle(load_config(None, args), world, fit_memory=False)
    runtime = _runtime(rank, world, config)
    with ResidentGrowth() as growth:
        model, views = build_model_shards(config, runtime)
    grown = growth.bytes
    full = sum(views.global_shape(p).numel() for p in model.parameters()) * 4
    local = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in model.parameters())
    return grown, full, local


@pytest.mark.slow
def test_construction_allocates_only_the_local_shards():
    """Built on the meta device and materialised shard by shard: each of 2 ranks grows by about
    half the model (its shards) plus one initialisation chunk, never by the full model."""
    for grown, full, local in run_distributed(_construction_growth, 2, LARGE, timeout=600):
        assert full >= 2**30
        assert local < 0.55 * full
        assert grown < 0.6 * full, f"resident memory grew by {grown / full:.2f} x the full model"


# (strategy, D, Ep, P) on 4 ranks; the last with bf16 working weights.
LAYOUTS = [("mop", 2, 2, 4, "float32"), ("mop", 4, 4, 2, "float32"), ("mop", 1, 2, 1, "float32"),
           ("fsdp2", 2, 2, 1, "float32"), ("mop", 2, 4, 4, "bfloat16")]
SMALL = [*TINY_RUN, "--model.heads=4", "--model.kv_heads=2", "--model.head_dim=8", "--model.vocab_size=301",
         "--train.micro_batch=1"]


def _layout_args(strategy, sequence, expert, vocab, dtype):
    host = "true" if strategy == "mop" else "false"
    return [*SMALL, f"--parallel.strategy={strategy}", "--parallel.nproc=4", f"--parallel.sequence={sequence}",
            f"--parallel.expert={expert}", f"--parallel.vocab={vocab}", f"--train.dtype={dtype}",
            f"--optim.offload={host}", "--parallel.expert_balance=ep"]


def _save_initial_weights(rank, world, base):
    for index, layout in enumerate(LAYOUTS):
        config = settle(load_config(None, _layout_args(*layout)), world, fit_memory=False)
        run = build_run(config, _runtime(rank, world, config))
        dcp.save({name: run.views.of(p) for p, name in ((p, run.views.names[id(p)]) for p in run.model.parameters())},
                 checkpoint_id=f"{base}/{index}")
        if run.optimizer.on_host:
            masters = {run.views.names[id(p)]: run.views.of(p, run.optimizer.master(p), host=True)
                       for p in run.model.parameters()}
            dcp.save(masters, checkpoint_id=f"{base}/{index}-masters")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the single-process load is the intent
def test_initial_weights_of_every_layout_equal_the_reference_bit_for_bit(tmp_path):
    run_distributed(_save_initial_weights, 4, str(tmp_path), timeout=300)
    config = load_config(None, _layout_args(*LAYOUTS[0]))
    reference = build_model(config.model, config.train.seed)
    for index, (*_, dtype) in enumerate(LAYOUTS):
        expected = {n: p.detach().to(getattr(torch, dtype)) for n, p in reference.named_parameters()}
        loaded = {n: torch.empty_like(p) for n, p in expected.items()}
        dcp.load(loaded, checkpoint_id=str(tmp_path / str(index)), no_dist=True)
        for name, value in expected.items():
            assert torch.equal(loaded[name], value), f"layout {LAYOUTS[index]}: {name}"
        if dtype == "bfloat16":  # the host masters hold the fp32 values the bf16 weights were rounded from
            masters = {n: torch.empty_like(p.detach()) for n, p in reference.named_parameters()}
            dcp.load(masters, checkpoint_id=str(tmp_path / f"{index}-masters"), no_dist=True)
            for name, param in reference.named_parameters():
                assert torch.equal(masters[name], param.detach()), f"master {name}"


def _host_round_trip(rank, world, base):
    args = [*SMALL, "--parallel.strategy=mop", "--parallel.nproc=2", "--optim.offload=true", "--train.dtype=bfloat16",
            "--train.steps=2", f"--log.run_dir={base}/run"]
    config = settle(load_config(None, args), world, fit_memory=False)
    run = build_run(config, _runtime(rank, world, config))
    from mop.train import train_step, update
    for step in range(2):
        run.optimizer.begin_step(1e-3)
        train_step(run, run.next_batches())
        update(run)
    run.optimizer.synchronize()
    params = list(run.model.parameters())
    host_tensors = [t for p in params for k, t in run.optimizer.moments(p).items() if k != "step"]
    # What a checkpoint holds of each: all but the vocabulary shard's padding rows.
    real_rows = [run.views.local(p, t) for p in params for k, t in run.optimizer.moments(p).items() if k != "step"]
    # Saving presents every host tensor on a CPU mesh, without a copy.
    state = checkpoint._state(run.model, run.optimizer, run.views, with_optimizer=True)
    presented = [*state["model"].values(), *(s[k] for s in state["optim"].values() for k in ("exp_avg", "exp_avg_sq"))]
    on_cpu_mesh = all(t.device_mesh.device_type == "cpu" for t in presented if isinstance(t, DTensor))
    shared = {t.to_local().data_ptr() if isinstance(t, DTensor) else t.data_ptr() for t in presented}
    no_copy = shared <= {t.data_ptr() for t in host_tensors}
    saved = checkpoint.save(Path(base) / "ckpt", 2, run.model, run.optimizer, run.views, {}, config, 1,
                            run.data.tokenizer)
    expected = [t.clone() for t in real_rows]
    pointers = [t.data_ptr() for t in host_tensors]
    for tensor in real_rows:
        tensor.fill_(7.0)  # overwritten by the load
    for param in params:
        (param.to_local() if isinstance(param, DTensor) else param).detach().fill_(3.0)
    checkpoint.load(saved, run.model, run.optimizer, run.views)
    in_place = [t.data_ptr() for t in host_tensors] == pointers
    restored = all(torch.equal(t, e) for t, e in zip(real_rows, expected))
    # The bf16 working weights are the loaded masters rounded.
    working = all(torch.equal(run.views.local(p), run.views.local(p, run.optimizer.master(p)).to(p.dtype))
                  for p in params)
    return on_cpu_mesh, no_copy, in_place, restored, working


def test_host_optimizer_checkpoint_saves_host_tensors_and_loads_into_them(tmp_path):
    for on_cpu_mesh, no_copy, in_place, restored, working in run_distributed(_host_round_trip, 2, str(tmp_path)):
        assert on_cpu_mesh and no_copy
        assert in_place and restored
        assert working


def _cpu_twin_of_a_cuda_mesh(rank, world):
    from torch.distributed.device_mesh import DeviceMesh

    from mop.parallel.views import GlobalViews
    views = GlobalViews(torch.nn.Linear(2, 2), None)
    twin = views._cpu_mesh(DeviceMesh("cuda", torch.arange(world), _init_backend=False))
    return twin.device_type, twin.mesh.tolist()


def test_host_tensors_of_a_cuda_mesh_are_presented_on_a_cpu_twin():
    assert run_distributed(_cpu_twin_of_a_cuda_mesh, 2) == [("cpu", [0, 1])] * 2


def _load_hf_import(rank, world, imported, base):
    from mop.models.hf import HFWeights

    requested = {}
    read_rows = HFWeights.rows

    def counting_rows(self, name, shape, first, count):
        requested[name] = requested.get(name, 0) + count
        return read_rows(self, name, shape, first, count)

    HFWeights.rows = counting_rows
    args = [*SMALL, "--parallel.strategy=mop", "--parallel.nproc=2", "--optim.offload=true", "--train.dtype=bfloat16"]
    config = settle(load_config(f"{imported}/model.toml", args), world, fit_memory=False)
    run = build_run(config, _runtime(rank, world, config))
    checkpoint.load(Path(imported), run.model, run.optimizer, run.views)
    views, params = run.views, list(run.model.parameters())
    masters = {views.names[id(p)]: views.of(p, run.optimizer.master(p), host=True) for p in params}
    dcp.save(masters, checkpoint_id=f"{base}/masters")
    own_rows_only = all(requested[views.names[id(p)]] == views.local(p).shape[0] for p in params)
    working = all(torch.equal(views.local(p), views.local(p, run.optimizer.master(p)).to(p.dtype))
                  for p in params)
    return own_rows_only, working


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_hugging_face_import_is_read_shard_by_shard(tmp_path):
    """`mop convert from-hf` copies no weights; each rank of a sharded layout reads only its own
    rows from the safetensors files, into its fp32 host masters, and they equal the HF weights."""
    from mop.cli import main
    from mop.models.config import ModelConfig
    from mop.models.hf import load_hf, save_hf

    cfg = ModelConfig(vocab_size=301, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4,
                      expert_intermediate=32)
    save_hf(build_model(cfg, seed=3), tmp_path / "hf", dtype=torch.float32)
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "imported"), "--tokenizer=byte"]) == 0
    assert not list((tmp_path / "imported").glob("*.distcp"))  # no copy of the weights
    for own_rows_only, working in run_distributed(_load_hf_import, 2, str(tmp_path / "imported"), str(tmp_path)):
        assert own_rows_only and working
    expected = dict(load_hf(tmp_path / "hf").named_parameters())
    loaded = {name: torch.empty_like(value.detach()) for name, value in expected.items()}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "masters"), no_dist=True)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value.detach()), name
    # The directory is read at every load: a changed one is refused, not silently trained.
    save_hf(build_model(dataclasses.replace(cfg, experts=8), seed=3), tmp_path / "hf", dtype=torch.float32)
    model = build_model(cfg, seed=0)
    with pytest.raises(ConfigError, match="has changed since it was imported"):
        checkpoint.load(tmp_path / "imported", model, None, GlobalViews(model, None))
