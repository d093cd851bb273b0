"""Issue 40: `mop train` fits the settings left automatic to `train.memory_budget` (`mop.settle.fit`),
and the per-token memory the fit relies on: RMSNorm saving its input and inverse rms only.

The fit's choices are real configs (resolved as `mop train` checks them) whose predicted need fits
the budget; a setting written by the user is kept; "off" and the fsdp2 baseline keep the plain
rules; nothing fitting is one line naming the budget. Exactness of every chosen setting is the
layouts' own tests' (each setting is an ordinary option)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mop.config import Config, ConfigError, TrainConfig, load_config
from mop.cost.memory import estimate
from mop.models.layers import RMSNorm
from mop.settle import MemoryBudget, MemoryLimits, settle

GIB = 2**30
ANCHOR = ["--model.vocab_size=32000", "--model.hidden=256", "--model.layers=4", "--model.heads=8",
          "--model.kv_heads=2", "--model.head_dim=32", "--model.experts=16", "--model.top_k=2",
          "--model.expert_intermediate=256", "--train.device=cpu", "--train.dtype=float32", "--parallel.nproc=2",
          "--train.global_batch=1"]


def _resolve(*settings: str):
    return settle(load_config(None, [*ANCHOR, *settings]))


def _need(config) -> int:
    memory = estimate(config, config.world, config.local_world)
    return memory.peak_device_bytes + sum(memory.host_bytes_per_rank.values())


def memory_budget(setting: str, local_ranks: int) -> MemoryLimits:
    return MemoryBudget.read(TrainConfig(memory_budget=setting, device="cpu")).limits(local_ranks)


def test_memory_budget_sizes_and_errors():
    assert memory_budget("off", 2).budget_bytes is None
    assert memory_budget("10GiB", 2).budget_bytes == 10 * GIB
    assert memory_budget("9.5GB", 2).budget_bytes == 9_500_000_000
    assert memory_budget("12e9", 2).budget_bytes == 12_000_000_000
    auto = memory_budget("auto", 2)
    one = memory_budget("auto", 1)
    assert 0 < auto.budget_bytes < one.budget_bytes and "host memory / 2 ranks" in auto.source
    for bad in ("lots", "-3GiB", "0", "nanGB"):
        with pytest.raises(ConfigError, match=r"^train.memory_budget: .* is not a size; use e.g."):
            memory_budget(bad, 2)
    with pytest.raises(ConfigError, match="train.memory_budget"):  # refused whatever the run
        _resolve("--train.memory_budget=plenty", "--parallel.strategy=fsdp2")


def test_a_run_that_fits_keeps_the_plain_layout():
    config = _resolve("--data.seq_len=2048")
    p, t = config.parallel, config.train
    assert (p.sequence, p.expert, p.vocab, p.attention_head_chunks, p.llep_chunks) == (2, 2, 2, 1, 1)
    assert (t.activation_checkpointing, t.offload_activations, t.micro_batch) == ("none", False, 1)
    assert config.fit.kept_default and config.fit.considered == 1
    assert config.fit.predicted_peak_bytes + config.fit.predicted_host_bytes == config.fit.predicted_need_bytes \
        == _need(config)  # on the CPU host bytes count against the budget
    off = _resolve("--data.seq_len=2048", "--train.memory_budget=off")
    assert off.fit is None and off.parallel == p and off.train.micro_batch == 1


def test_offload_asked_for_turns_automatic_checkpointing_on():
    config = _resolve("--data.seq_len=2048", "--train.offload_activations=true")
    assert config.train.activation_checkpointing == "full" and config.train.offload_activations is True


def test_the_plain_micro_batch_is_the_largest_divisor_up_to_four_and_a_ranks_8192_tokens():
    assert _resolve("--data.seq_len=256", "--train.global_batch=8", "--train.memory_budget=off").train.micro_batch == 4
    assert _resolve("--data.seq_len=256", "--train.global_batch=6", "--train.memory_budget=off").train.micro_batch == 3
    assert _resolve("--data.seq_len=256", "--train.global_batch=2", "--parallel.sequence=1",
                    "--train.memory_budget=off").train.micro_batch == 1
    # and no more than a rank's 8192 tokens per forward: a long sequence fills the device alone
    assert _resolve("--data.seq_len=8192", "--train.global_batch=8", "--parallel.sequence=2",
                    "--train.memory_budget=off").train.micro_batch == 2
    assert _resolve("--data.seq_len=16384", "--train.global_batch=8", "--parallel.sequence=2",
                    "--train.memory_budget=off").train.micro_batch == 1
    assert _resolve("--data.seq_len=16384", "--train.global_batch=8", "--parallel.nproc=4", "--parallel.sequence=4",
                    "--train.memory_budget=off").train.micro_batch == 2


def test_a_long_context_is_fitted_to_the_budget_and_the_fit_is_recorded():
    budget = 6 * GIB
    plain = _resolve("--data.seq_len=524288", "--train.memory_budget=off")
    assert _need(plain) > budget  # the plain layout does not fit: the fit must search
    config = _resolve("--data.seq_len=524288", f"--train.memory_budget={budget}")
    fit = config.fit
    assert not fit.kept_default and fit.considered > 10
    assert _need(config) == fit.predicted_need_bytes <= budget
    assert config.train.activation_checkpointing == "full" or config.parallel.llep_chunks > 1
    assert not config.train.offload_activations  # on the CPU it moves nothing out of the same memory
    assert fit.budget_bytes == budget and "parallel.llep_chunks" in fit.searched
    # the fitted config is one `mop train` accepts as it is, and resolves to itself
    again = settle(Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Config)}))
    assert again.parallel == config.parallel and again.train == config.train


def test_explicit_settings_are_kept_and_the_rest_fitted_around_them():
    config = _resolve("--data.seq_len=524288", "--train.memory_budget=6GiB", "--parallel.llep_chunks=8",
                      "--train.activation_checkpointing=full")
    assert config.parallel.llep_chunks == 8 and config.train.activation_checkpointing == "full"
    assert "parallel.llep_chunks" not in config.fit.searched
    assert "train.activation_checkpointing" not in config.fit.searched
    assert _need(config) <= 6 * GIB


def test_nothing_fits_is_one_line_naming_the_budget():
    with pytest.raises(ConfigError) as err:
        _resolve("--data.seq_len=1048576", "--train.memory_budget=1GiB")
    message = str(err.value)
    assert message.startswith("train.memory_budget: nothing fits 1.0 GiB per rank") and "\n" not in message
    assert "the closest layout (D 2 Ep 2" in message and "raise train.memory_budget" in message


def test_only_mop_runs_with_automatic_settings_are_fitted():
    assert _resolve("--data.seq_len=524288", "--train.memory_budget=6GiB", "--parallel.strategy=fsdp2",
                    "--parallel.sequence=2", "--parallel.expert=1", "--parallel.vocab=1").fit is None
    pinned = ["--parallel.sequence=2", "--parallel.expert=2", "--parallel.vocab=2", "--parallel.llep_chunks=1",
              "--parallel.attention_head_chunks=1", "--train.activation_checkpointing=none",
              "--train.offload_activations=false", "--train.micro_batch=1", "--parallel.vocab_logits=recompute"]
    assert _resolve("--data.seq_len=524288", "--train.memory_budget=6GiB", *pinned).fit is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_autograds_graph_of_the_same_arithmetic_and_saves_input_and_rstd_only(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 5, 64, dtype=dtype, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    got = (y.detach(), x.grad, norm.weight.grad)
    x.grad, norm.weight.grad = None, None
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    expected.backward(grad)
    for a, b in zip(got, (expected.detach(), x.grad, norm.weight.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(3, 5, 1), (3, 5, 64), (64,)]  # rstd (fp32), the input, the weight


def test_on_a_cpu_the_fit_computes_at_the_rate_the_ranks_probe_measured():
    """Issue 50: a CPU rank's limits carry its matmul probe (with its share of the cores), and the
    fit's roofline computes at that rate: twice the probe, about twice the predicted tokens/s of a
    compute-bound choice. No budget, no probe."""
    limits = memory_budget("6GiB", 2)
    assert limits.compute_flops > 0 and memory_budget("off", 2).compute_flops == 0
    config = load_config(None, [*ANCHOR, "--data.seq_len=524288"])
    fitted = [settle(config, limits=dataclasses.replace(limits, compute_flops=rate)).fit
              for rate in (10**10, 2 * 10**10)]
    assert fitted[0].layout == fitted[1].layout and not fitted[0].kept_default
    assert 1.5 < fitted[1].predicted_tokens_per_s / fitted[0].predicted_tokens_per_s <= 2.0


def test_the_heap_keeps_what_it_frees_only_while_the_need_leaves_room_for_its_holes():
    """`train.keep_freed_host_memory` "auto" (issue 50): on while the predicted need is at most half
    the budget, off beyond it; a value written by the user is kept; without a budget, on."""
    roomy = _resolve("--data.seq_len=2048", "--train.memory_budget=8GiB")
    tight = _resolve("--data.seq_len=131072", "--train.memory_budget=6GiB")
    assert roomy.train.keep_freed_host_memory is True and _need(roomy) <= 4 * GIB
    assert tight.train.keep_freed_host_memory is False and tight.fit.predicted_need_bytes > 3 * GIB
    pinned = _resolve("--data.seq_len=131072", "--train.memory_budget=6GiB", "--train.keep_freed_host_memory=true")
    assert pinned.train.keep_freed_host_memory is True
    assert _resolve("--data.seq_len=131072", "--train.memory_budget=off").train.keep_freed_host_memory is True
