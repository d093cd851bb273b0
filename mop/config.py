"""Training configuration: nested dataclasses, loaded from TOML, overridden as `--section.key=value`.

Every field carries its docstring (the string literal under it); `mop train --help` prints them.
The dataclass defaults are the embedded default run (the tiny debug model on the shipped corpus);
`configs/debug.toml` spells the same values out.

A model family's own hyper-parameters are the table `[model.options]` (`--model.options.KEY=VALUE`),
read once `model.family` is known: a key the family does not take is an error naming it.

Loading is strict: an unknown section or key (with a did-you-mean) or a value of the wrong type
raises `ConfigError`, whose one-line message names the key and the fix; the command line turns it
into exit code 2. The loaded settings are raw: `mop.settle.settle` decides the automatic ones for
the world and the device, runs the range and cross-field checks (each technique its own) and
returns the one frozen config a run uses. What follows from settings alone, with no decision to
make, is here with them (a settled config's `compute_dtype`, `storage_dtype`, `data_groups`,
`micro_batches_per_step`). This module depends on no other part of mop but the model's shape
(`mop.models.config`) and its adapters (`mop.models.lora`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad setting; `str(err)` is one line that names the key and how to fix it."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["reference", "mop", "fsdp2"] = "mop"
    """"reference": one process, no sharding (the ground truth); "mop": the mixture of parallelisms;
    "fsdp2": the baseline built from torch's own pieces (FSDP2, standard EP, Ulysses, full logits)."""
    nproc: int = 0
    """Local ranks to launch when not started by torchrun (ignored under torchrun), one per GPU on CUDA;
    0: 1 for the reference strategy, else the visible GPUs on CUDA (see train.device), 2 on the CPU."""
    sequence: int = 0
    """D: ranks that share one sequence (Ulysses sequence parallelism); divides the world size. 0: under
    "mop" the largest that divides the ranks of one node, model.heads and data.seq_len; 1 otherwise.
    (Automatic degrees keep every group inside a node; set one explicitly to cross nodes.)"""
    expert: int = 0
    """Ep: ranks the experts are partitioned over; divides the world size and model.experts. 0: under
    "mop" the largest that divides the ranks of one node and model.experts; 1 otherwise."""
    vocab: int = 0
    """P: ranks the output projection's rows are sharded over; divides the world size. 0: under "mop"
    the ranks of one node (1 with tied embeddings); 1 otherwise."""
    expert_balance: Literal["auto", "ep", "llep"] = "auto"
    """Token placement for expert parallelism (parallel.expert > 1): "ep" computes every expert on its
    owner; "llep" spills an overloaded owner's tokens (and ships the expert's weights) to the
    least-loaded ranks (plain EP while the load is balanced, see llep_gate). "auto": llep under
    "mop", ep otherwise."""
    llep_gate: float = 1.3
    """LLEP's λ: when max/mean expert load is below it the step uses plain EP (the paper's default 1.3)."""
    llep_alpha: float = 1.0
    """LLEP's α: a rank is full at α x (routed tokens / parallel.expert) tokens (the paper's default 1.0)."""
    llep_min_chunk: int = 1024
    """LLEP's m: the smallest token chunk worth spilling to a helper rank (one efficient GEMM); the paper
    uses 1024 at 16-32K tokens per GPU, lower it for small batches."""
    vocab_logits: Literal["auto", "keep", "recompute"] = "auto"
    """The vocabulary projection's memory trade, with any number of vocabulary ranks. "keep": the
    forward's fp32 logits stay for the backward (a rank's [tokens, vocab]: its full logits at
    parallel.vocab = 1, every shard's tiles of its own tokens on the ring, kept after their
    exponential), so the backward runs two GEMMs; "recompute": only one tile of
    parallel.vocab_token_block tokens is live at a time and the backward forms each tile again (one
    GEMM more; at parallel.vocab = 1 the head runs in checkpointed token blocks). "auto": "keep", or
    what the fit chooses when train.memory_budget needs it."""
    vocab_token_block: int = 0
    """Tokens per logit tile of the vocabulary projection: of the ring (parallel.vocab > 1) and of one
    rank's recomputed head (parallel.vocab_logits = "recompute"). 0 picks the size that makes one fp32
    [tokens, vocab / parallel.vocab] tile about 64 MiB."""
    llep_chunks: int = 0
    """> 1: route each MoE layer's tokens in this many pipelined chunks and recompute the experts' gate
    and up projections in backward (memory-efficient EP/LLEP: about one chunk's buffers live at a
    time; with full activation checkpointing no more expert FLOPs than unchunked). 0: automatic, 1
    unless the run's layout is fitted to train.memory_budget."""
    attention_head_chunks: int = 0
    """With parallel.sequence > 1: exchange and attend the heads of a rank in this many chunks, so that
    only one chunk's head-sharded Q/K/V/output is live at a time (recomputed per chunk in backward).
    0: automatic, 1 unless the run's layout is fitted to train.memory_budget."""
    fsdp_cpu_offload: bool = False
    """With parallel.strategy=fsdp2: FSDP2's CPUOffloadPolicy keeps the parameter and gradient shards in host
    memory and torch.optim.AdamW steps there (mop's own offload is optim.offload)."""
    timeout_s: int = 600
    """Seconds any collective may wait for the other ranks before the run stops with an error naming the
    operation and the group (a rank died or hangs). Raise it when one step legitimately keeps ranks
    apart longer (a very slow checkpoint save on a shared file system)."""


@dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"
    """"builtin" (the shipped corpus) or a path to a .txt/.jsonl/.parquet/.bin file or a directory of them; with
    data.format = "chat" or "preference", a .jsonl/.parquet file of conversations or preference pairs, a folder of
    them, a datasets save_to_disk folder, or a folder written by `mop data prepare` (it has a manifest.json)."""
    tokenizer: str = "byte"
    """"byte" (built-in byte-level) or a path to a Hugging Face tokenizer.json (or its directory).
    Checkpoints record it and carry a copy (step_<N>/tokenizer); resuming with another one is an
    error (see checkpoint.allow_tokenizer_change)."""
    seq_len: int = 256
    """Tokens per packed training sequence."""
    text_field: str = "text"
    """Field of a .jsonl object / column of a .parquet file holding the document text."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of pre-tokenised .bin token files."""
    eos_token: str = ""
    """The document separator of a Hugging Face tokenizer ("" : its tokenizer_config.json's eos_token,
    else a conventional end-of-text token it defines). Plain preference responses end with the tokenizer's
    own EOS instead, as TRL's do."""
    format: Literal["text", "chat", "preference", "rollouts"] = "text"
    """"text": documents concatenated and cut every seq_len tokens, every token a target; "chat":
    conversations (`messages` or ShareGPT `conversations`) rendered with the tokenizer's chat template,
    each packed whole into one sequence, the loss on data.loss_on (mop.data.templates); "preference":
    TRL's preference pairs (`prompt`/`chosen`/`rejected` message lists or strings; the prompt may be
    implicit), each pair packed whole, its prompt once (data.shared_prompt), the targets its responses'
    (data.loss_on; mop.data.preference); "rollouts": recorded RL rollouts (prompt and
    completion token ids or messages, the engine's sampling log-probs, advantages or rewards with groups, routed
    experts), each packed whole, the targets its generated tokens ([rl]; mop.data.rollouts)."""
    chat_template: str = ""
    """With data.format = "chat" or "preference": a Jinja template file used instead of data.tokenizer's chat
    template (plain-text preference pairs need none)."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """With data.format = "chat": the targets, what the model writes in each assistant turn (its reasoning, content
    and tool calls through the turn's end; `mop data inspect` shows them) or every token. With "preference": the
    responses' assistant targets or, with "all", every token after the prompt (TRL's rule: for Qwen3 also the
    newline after <|im_end|>); plain-text responses are all targets either way."""
    overlong: Literal["drop", "truncate"] = "drop"
    """With data.format = "chat": a conversation longer than seq_len is left out, or cut after the last assistant
    turn that ends within seq_len (left out when none does). With "preference": a pair longer than seq_len is left
    out, or its prompt cut from the left to fit (left out when not one prompt token fits). Both are counted in the
    start line and records."""
    skip_invalid: bool = False
    """With data.format = "chat" or "preference": count and skip a conversation or pair that cannot be used (no
    assistant turn, an unknown role, a template that fails on it, a missing field, an empty prompt, a prompt whose
    tokens do not begin prompt + response's) instead of stopping with a one-line error naming its row."""
    shared_prompt: bool = True
    """With data.format = "preference": pack a pair as [prompt | chosen] and the rejected response as a branch
    over that prompt, computed once; false packs prompt+chosen and prompt+rejected as two documents, the unshared
    computation the exactness tests and `mop bench dpo` compare against."""


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    """Optimizer steps to run."""
    seed: int = 0
    """Seeds the initialisation and the data order; no other randomness is used."""
    global_batch: int = 8
    """Sequences per optimizer step, the same for every layout."""
    micro_batch: int = 0
    """Sequences per forward pass of one data-parallel group; gradients accumulate to global_batch.
    0: automatic, the largest divisor of a group's share of the global batch up to 4, and up to as many
    sequences as keep a rank's tokens per forward within 8192 (a forward of that many fills a GPU:
    more only costs memory; one at least), or less when the run's layout is fitted to
    train.memory_budget."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype: "bfloat16" runs forward/backward in bf16 (autocast) with fp32 gradient reductions.
    With the host optimizer (optim.offload) the device then holds bf16 working weights (2 bytes per
    parameter) of the fp32 masters in host memory; with torch AdamW weights and moments stay fp32."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    max_skipped_steps: int = 10
    """A step whose gradients are not finite is skipped (the state is left as it was); after this many
    consecutive skipped steps the run stops with an error, keeping its last good checkpoint."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto" picks CUDA when available (one GPU per local rank), else the CPU."""
    keep_freed_host_memory: Literal["auto", True, False] = "auto"
    """Each rank's host heap keeps the blocks it frees for its next allocations (glibc's mallopt: no
    mmap threshold, no trimming) instead of handing them back to the kernel and faulting fresh pages
    in at the next one. On a CPU device every activation is such a block, and the page faults cost a
    step seconds (1.32x at 16K on a 2-core VM, issue 50). The price: the heap's holes stay resident,
    up to 1.75x the memory model's need measured at 128K. "auto": on, unless the fit's predicted
    need is more than half of train.memory_budget."""
    activation_checkpointing: Literal["auto", "none", "full"] = "auto"
    """"full": keep only each block's input for the backward and recompute the block's activations there.
    "auto": "none" unless the run's layout is fitted to train.memory_budget."""
    offload_activations: Literal["auto", True, False] = "auto"
    """With full activation checkpointing: keep the saved block inputs in host memory until the backward.
    "auto": false unless the run's layout is fitted to train.memory_budget (never on the CPU, where host
    and device are one memory)."""
    memory_budget: str = "auto"
    """Memory one rank may use, which the settings left automatic are fitted to (under parallel.strategy
    = "mop"): the degrees, head and LLEP chunks, activation checkpointing and offload, the micro-batch.
    A size ("70GiB", "9.5GB", "12e9" bytes); "auto": on CUDA the smallest visible GPU's memory, on the
    CPU the host's memory shared by the node's ranks, each x 0.95 less 1 GiB (the CUDA context, NCCL,
    the interpreter and allocator slack); "off": no fit, every automatic setting takes its plain rule.
    Today's layout (the largest degrees, no chunks, no checkpointing, 4 sequences per micro-batch) is
    kept while `mop plan`'s memory model says it fits; else the fastest layout the model says fits is
    run (`mop.settle.fit`), printed at the start and recorded in the run's config.json."""
    finetune: Literal["full", "lora"] = "full"
    """"full": every parameter trains. "lora": low-rank adapters train over a frozen base kept at its
    published precision (the [lora] settings; `mop.models.lora`)."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype a step computes in: bf16 under `dtype = "bfloat16"` (autocast, FSDP2's gathered
        weights), else fp32."""
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    """Linear warm-up steps from 0 to lr."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norm weights)."""
    offload: Literal["auto", True, False] = "auto"
    """Keep fp32 master weights and moments in host memory and update them during the backward
    (mop's host optimizer). "auto": on under "mop", off otherwise."""
    speculative: bool = True
    """With the host optimizer: update each shard during the backward, before the global gradient norm is
    known, keeping a rollback copy of its master and moments (12 host bytes per parameter; restored when
    clipping applies). false: update once the norm is known, overlapped with the next forward only, without
    the copies (what `mop plan` picks when host memory is the limit)."""


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: only the final one, see `final`)."""
    final: bool = True
    """Save a checkpoint after the last step (so every finished run can be resumed or exported)."""
    keep: int = 3
    """Keep the newest this many checkpoints."""
    dir: str = ""
    """Checkpoint directory; empty means `<log.run_dir>/checkpoints`."""
    stop_grace_s: int = 120
    """After SIGTERM or SIGINT every rank finishes its step and saves a checkpoint; mop's launcher kills
    ranks still running after this many seconds (under torchrun: TORCH_ELASTIC_SHUTDOWN_TIMEOUT). Keep a
    step plus a save below the scheduler's notice (Slurm: --signal=TERM@<seconds>). On a torch whose
    launcher has no such setting (torch 2.11) the grace is torch's fixed 30 s and this one is not used."""
    resume: str = ""
    """Empty: start fresh. "latest": resume from the newest complete checkpoint in checkpoint.dir
    (start fresh if there is none). A path: resume from that step_<N> directory, saved by any
    layout or world size; a checkpoint without optimizer state (`mop convert from-hf`) starts
    the optimizer fresh."""
    init: str = ""
    """Start from the weights of a checkpoint (a step_<N> directory of any run, layout or world size, or
    `mop convert from-hf`'s), at step 0 with a fresh optimizer and this run's data from its start: the next
    stage of fine-tuning (RL after SFT), not a resume. Ignored when checkpoint.resume finds a checkpoint."""
    allow_tokenizer_change: bool = False
    """Resume even though data.tokenizer is not the tokenizer the checkpoint was trained with (another
    fingerprint of tokenizer.json, or byte vs HF): the checkpoint's ids then stand for other tokens,
    so only for a deliberate change of vocabulary. A resumed run's data stream must still match."""


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate the loss on held-out sequences every this many steps and after the last step (0: never).
    Under any layout it equals the loss the reference strategy computes on the same sequences."""
    source: str = ""
    """The held-out corpus (the forms data.source takes; read with data.tokenizer, packed to data.seq_len);
    empty: hold out the last eval.fraction of data.source's packed sequences instead."""
    fraction: float = 0.05
    """With eval.source empty: the share of data.source's packed sequences (its last ones) held out and never
    trained on (a document crossing the boundary is split between the two)."""
    sequences: int = 16
    """Sequences each evaluation reads: the first ones of the held-out split, the same every time; a multiple
    of the data-parallel groups x train.micro_batch."""


@dataclass(frozen=True)
class LogConfig:
    run_dir: str = ""
    """Where metrics.jsonl, TensorBoard events and plots go; empty means runs/<UTC timestamp>."""
    overwrite: bool = False
    """Allow writing into a run_dir that already holds a run's metrics (they are replaced)."""
    tensorboard: bool = True
    """Write TensorBoard event files into run_dir."""
    wandb: bool = False
    """Also log every scalar TensorBoard gets to Weights & Biases (the optional extra: pip install 'mop[wandb]'):
    online when wandb is logged in and reachable, else offline into run_dir/wandb (upload later with wandb sync)."""
    wandb_project: str = "mop"
    """The Weights & Biases project."""
    wandb_name: str = ""
    """The Weights & Biases run name; empty: the run directory's name."""
    plot: bool = True
    """Write loss.png (loss and throughput curves) into run_dir at the end."""
    progress: bool = True
    """Show progress on rank 0: a bar on a terminal, else a plain line every log.progress_every steps."""
    progress_every: int = 10
    """Steps between the plain progress lines written when stderr is not a terminal."""
    profile_step: int = 0
    """Record this step (numbered as the records number them: 1 is the first) with torch.profiler and
    split its time into attention, experts, the vocabulary projection and the rest, each with its
    collectives' part (`mop.profiling`; the step's record gets `time_<phase>_s`, worst rank); 0: none.
    The profiler slows the step it records."""
    dead_expert_window: int = 50
    """Steps over which an expert given no token counts as dead (the records' experts/dead, and a warning line when
    experts join them; the window restarts on resume); 0: not tracked."""


@dataclass(frozen=True)
class DpoConfig:
    beta: float = 0.1
    """DPO's beta (IPO's tau): the strength of the pull towards the reference; rewards are beta x the
    log-ratio of policy to reference."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """"sigmoid": DPO, -log sigmoid(beta x margin); "ipo": (margin' - 1 / (2 beta))^2 with each
    response's log-ratio divided by its target count (TRL's IPO)."""
    label_smoothing: float = 0.0
    """With loss = "sigmoid", in [0, 0.5): the probability that a pair's labels are flipped (conservative
    DPO: -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m))."""
    nll_alpha: float = 0.0
    """RPO's alpha: adds alpha x the mean negative log-likelihood of the chosen responses' target tokens
    (TRL's loss_type ["sigmoid", "sft"] with weights [1, alpha])."""
    reference: Literal["auto", "base", "precomputed"] = "auto"
    """Where the reference log-probs come from: "base", the frozen base with the adapters off, in the
    same step and layout (train.finetune = "lora" only); "precomputed", one pass over the data with the
    starting weights before the first step, stored in dpo.reference_dir. "auto": base with LoRA, else
    precomputed."""
    reference_dir: str = ""
    """Where precomputed reference log-probs are stored and read ("": <run directory>/reference); they
    are fingerprinted to the starting weights and the data, and another start refuses them."""


@dataclass(frozen=True)
class RlConfig:
    """Policy-gradient training on recorded rollouts (data.format = "rollouts"); TRL 1.16's GRPOConfig names
    and defaults (mop.objectives.policy_gradient)."""

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo"] = "dapo"
    """The loss and its aggregation: "grpo" each rollout's token mean, then the mean over rollouts; "dapo" and
    "bnpo" the mean over the step's generated tokens; "dr_grpo" the sum over rollouts x max_completion_length;
    "cispo" the clipped importance weight, stopped, times the log-prob, over the step's tokens."""
    epsilon: float = 0.2
    """The ratio's lower clip 1 - epsilon."""
    epsilon_high: float = 0.0
    """The ratio's upper clip 1 + epsilon_high (CISPO: the ratio's cap); 0: epsilon."""
    delta: float = 0.0
    """Two-sided clipping: the unclipped ratio capped at delta (> 1 + epsilon_high); 0: none."""
    beta: float = 0.0
    """The k3 KL to the reference's coefficient (0: no KL, no reference forward)."""
    kl_bias_correction: bool = True
    """Weigh the KL by the importance ratio (TRL's use_bias_correction_kl)."""
    max_completion_length: int = 512
    """Dr. GRPO's normaliser: the engine's completion length limit."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """The ratio per token, or per rollout from its tokens' mean log-ratio (GSPO: with loss_type "grpo")."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """With rewards in the rollouts: advantages (reward - group mean) divided by the group's std + 1e-4, by the
    source's, or by nothing."""
    correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    """The train-inference correction against the engine's sampling log-probs (TRL's vllm_importance_sampling_mode):
    exp(old - sampling) per token or summed over the rollout, truncated to [correction_min, correction_max] or
    zeroed outside it; "none": no correction."""
    correction_min: float = 0.0
    """The correction's lower bound (0: none)."""
    correction_max: float = 3.0
    """The correction's upper bound (0: none)."""
    updates_per_batch: int = 1
    """Optimizer steps on each global batch of rollouts (TRL's num_iterations): the first step's forward gives the
    old log-probs (and, with replay "old", the routes) every later step of the batch uses; checkpoint.every must
    be a multiple of it."""
    replay: Literal["auto", "rollout", "old", "off"] = "auto"
    """Routing replay (the experts forced, the router's weights for them live): "rollout" (R3) the experts the
    engine recorded in the rollouts' routed_experts, on every forward; "old" (R2) those the batch's first step
    ran, on its later steps; "off" routes freely (TRL has no replay: its loss with several updates per batch); "auto":
    "rollout" when the rollouts carry routes, else "old" with updates_per_batch > 1, else "off" (config.json records
    the mode chosen)."""
    reference: Literal["auto", "base", "precomputed", "none"] = "auto"
    """The KL's reference (with beta > 0): "base", the frozen base with the adapters off, its forward in every step
    (train.finetune = "lora" only); "precomputed", each generated token's log-prob under the starting weights, one
    pass over the data before the first step, stored in rl.reference_dir; "auto": base with LoRA, else precomputed,
    and "none" without beta."""
    reference_dir: str = ""
    """Where precomputed reference log-probs are stored and read ("": <run directory>/reference); they are
    fingerprinted to the starting weights and the packed data, and another start refuses them."""
    prompts: str = ""
    """The RL loop (`mop rl`, mop.rl.loop): a jsonl of prompts, each row a `prompt` (text, or a list of messages
    rendered with the chat template and its generation prompt) and the `answer` the reward compares with; each
    batch the engine samples rl.group completions of rl.prompts_per_batch of them with the current weights, the
    reward scores them and the batch trains on them. "": train on recorded rollouts (data.source) instead."""
    reward: str = "exact_match"
    """The RL loop's reward of a completion's text and its prompt's answer: a shipped one (exact_match,
    boxed_number, think_answer_format; mop.rl.rewards) or an importable module:function."""
    group: int = 8
    """Completions sampled per prompt (TRL's num_generations): the group whose rewards give the advantages."""
    prompts_per_batch: int = 8
    """Prompts per batch of the RL loop; their prompts_per_batch x group rollouts are packed into
    train.global_batch sequences of data.seq_len (padded with empty ones)."""
    engine: Literal["transformers", "vllm", "sglang"] = "transformers"
    """The RL loop's inference engine (mop.rl.engine): "transformers", generate on the CPU from a folder the
    weights are written to; "vllm" or "sglang", a running server at rl.engine_url, the weights pushed each batch
    (rl.sync; vLLM's API needs VLLM_SERVER_DEV_MODE=1, and --enable-return-routed-experts for routing replay)."""
    engine_url: str = ""
    """With rl.engine "vllm" or "sglang": the server's base URL (e.g. http://10.0.0.5:8000)."""
    engine_model: str = ""
    """With rl.engine "vllm": the served model's name ("": the server's only one)."""
    sync: Literal["auto", "broadcast", "folder"] = "auto"
    """How a server takes the weights (mop.rl.senders): "broadcast", its weight-update API over a group its
    workers join at rl.sync_address (vLLM's NCCL group needs --weight-transfer-config '{"backend":"nccl"}' and
    CUDA on both sides); "folder", written as safetensors to rl.sync_folder, which vLLM reloads in place
    (/collective_rpc reload_weights: its CPU build's way); "auto": folder for vLLM from a CPU trainer, else
    broadcast."""
    sync_folder: str = ""
    """With rl.sync "folder": where the weights are written for the server to read ("": <run dir>/engine); on
    a file system the server shares."""
    sync_dtype: Literal["auto", "bfloat16", "float32", "published"] = "auto"
    """The form the weights are sent in: "published", each tensor as the Hugging Face checkpoint the run's
    weights came from publishes it (fp8 blocks with their scales, MXFP4 experts: what a server of that
    checkpoint holds and loads; mop.rl.weights); "auto": published for a server when that checkpoint is
    quantized, else bfloat16 for a server (what vLLM and SGLang compute in: half fp32's bytes) and the run's dtype
    for the CPU engine."""
    sync_address: str = "127.0.0.1:29700"
    """With rl.sync "broadcast": host:port of the trainer's rank 0 where the server's workers join the weight
    group (a free port they can reach)."""
    sync_bucket_mb: int = 512
    """The weight sync's bucket: the most MiB of checkpoint tensors gathered on rank 0 before they are sent."""
    off_policy: bool = False
    """One-step-off-policy: the engine samples batch k + 1 with the weights batch k starts from while the trainer
    trains on batch k (sampled one update earlier), overlapping generation with training; False: each batch is
    sampled with the weights it trains."""


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture of the MoE transformer."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Rank layout and parallel strategy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and packing."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, batch and precision."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    log: LogConfig = field(default_factory=LogConfig)
    """Metrics and plots."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA fine-tuning (with train.finetune = "lora")."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """Preference optimisation (with data.format = "preference")."""
    rl: RlConfig = field(default_factory=RlConfig)
    """Policy-gradient training on recorded rollouts (with data.format = "rollouts")."""

    @property
    def adapters(self) -> LoraConfig | None:
        """The LoRA settings the model is built with, None for full fine-tuning."""
        return self.lora if self.train.finetune == "lora" else None

    # What follows from a settled config's values (`mop.settle`: no "auto" or 0 left in them).

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype a step computes in (`TrainConfig.compute_dtype`)."""
        return self.train.compute_dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype parameters are stored in on the device: bf16 working weights when the fp32
        masters live in the host optimizer and the run computes in bf16, else fp32."""
        return torch.bfloat16 if self.train.dtype == "bfloat16" and self.optim.offload else torch.float32

    @property
    def reference_forward(self) -> bool:
        """Whether each step also runs the frozen base's forward (adapters off, no gradient) for a
        reference: DPO's, or the KL's of policy-gradient training, under LoRA."""
        return ((self.data.format == "preference" and self.dpo.reference == "base")
                or (self.data.format == "rollouts" and self.rl.reference == "base"))

    def data_groups(self, world: int) -> int:
        """The data-parallel groups of `world` ranks: the ranks of a sequence group share sequences."""
        return world // self.parallel.sequence

    def micro_batches_per_step(self, world: int) -> int:
        """Forward passes per optimizer step on each of `world` ranks: its data group's share of the
        global batch in micro-batches."""
        return self.train.global_batch // self.data_groups(world) // self.train.micro_batch


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass and of the dataclasses it extends, read from
    their source."""
    docs = {}
    for owner in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        previous = None
        for node in ast.parse(inspect.getsource(owner)).body[0].body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                previous = node.target.id
            elif previous and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                docs[previous] = " ".join(str(node.value.value).split())
                previous = None
    return docs


@functools.cache
def sections() -> dict[str, type]:
    return {f.name: hints(Config)[f.name] for f in dataclasses.fields(Config)}


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The field types of a config dataclass (evaluated once: the planner applies thousands of configs)."""
    return typing.get_type_hints(cls)


def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid: {', '.join(sorted(options))}"


def _coerce(key: str, value: Any, kind) -> Any:
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    is_integer = isinstance(value, int) and not isinstance(value, bool)
    if kind is float and is_integer:
        return float(value)
    if kind is int and not is_integer or not isinstance(value, kind):
        raise ConfigError(key, f"expects {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def apply(config: Config, values: dict[str, Any]) -> Config:
    """A copy of `config` with `{section: {key: value}}` set, type-checked; unknown names raise."""
    known = sections()
    for section, entries in values.items():
        if section not in known:
            raise ConfigError(section, f"unknown section; {_did_you_mean(section, known)}")
        if not isinstance(entries, dict):
            raise ConfigError(section, "is a section: set its keys, e.g. --train.steps=10")
        target = getattr(config, section)
        types = hints(type(target))
        changes = {}
        for key, value in entries.items():
            name = f"{section}.{key}"
            if key not in types:
                raise ConfigError(name, f"unknown key; {_did_you_mean(key, types)}")
            if section != "model" or key != "options":  # the options are the family's: read once it is known
                changes[key] = _coerce(name, value, types[key])
        target = dataclasses.replace(target, **changes)
        if section == "model" and "options" in entries:
            target = dataclasses.replace(target, options=_family_options(target, entries["options"]))
        config = dataclasses.replace(config, **{section: target})
    return config


def _family_options(model: ModelConfig, table: Any):
    """`model`'s options with the `[model.options]` table set: only keys its family takes, type-checked."""
    from mop.models.families import (  # the model's layers: only a config that sets options needs them
        FAMILIES,
        unknown_family,
    )

    if model.family not in FAMILIES:
        raise ConfigError("model.family", unknown_family(model.family))
    kind = FAMILIES[model.family].options
    if not isinstance(table, dict):
        raise ConfigError("model.options", "is a table of the family's keys: set them, e.g. --model.options.KEY=VALUE")
    types = hints(kind) if kind else {}
    for key in table:
        if key not in types:
            others = [name for name, family in FAMILIES.items() if family.options and key in hints(family.options)]
            hint = f"it is a key of model.family={others[0]!r}" if others else _did_you_mean(key, types) if types else \
                "it takes no options"
            raise ConfigError(f"model.options.{key}", f"model.family={model.family!r} does not take it; {hint}")
    if kind is None:  # an empty table
        return None
    base = model.options if isinstance(model.options, kind) else kind()
    return dataclasses.replace(base, **{key: _coerce(f"model.options.{key}", value, types[key])
                                        for key, value in table.items()})


def parse_override(arg: str) -> tuple[str, str, str]:
    """`--section.key=value` -> (section, key, value text)."""
    name, sep, text = arg.removeprefix("--").partition("=")
    section, dot, key = name.partition(".")
    if not (arg.startswith("--") and sep and dot and section and key):
        raise ConfigError(arg, "overrides look like --section.key=value, e.g. --train.steps=20")
    return section, key, text


def _override_value(target: Any, key: str, text: str) -> Any:
    """Read the text as TOML (numbers, booleans); string-valued keys of `target` take it verbatim,
    quotes optional."""
    kind = hints(type(target)).get(key)
    if typing.get_origin(kind) is Literal and text in ("true", "false") and True in typing.get_args(kind):
        return text == "true"
    if kind is str or typing.get_origin(kind) is Literal:
        return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def read_toml(path: str | Path) -> dict:
    """The sections of a TOML config file; a missing or invalid file raises ConfigError naming it."""
    path = Path(path)
    if not path.is_file() and "=" in path.name:
        raise ConfigError(str(path), "is not a config file; settings look like --section.key=value, e.g. --train.steps=20")
    if not path.is_file():
        raise ConfigError(str(path), "config file not found; pass an existing .toml file, e.g. configs/debug.toml")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:  # TOML is UTF-8 text
        raise ConfigError(str(path), f"is not valid TOML ({err})") from None


def load_model_config(path: str | Path) -> ModelConfig:
    """The `[model]` section of a TOML config alone, validated (the other sections are not read:
    a config written for another cluster's layout still describes its model)."""
    model = apply(Config(), {"model": read_toml(path).get("model", {})}).model
    for key, message in model.validate():
        raise ConfigError(f"model.{key}", message)
    return model


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then the command-line overrides, type-checked: the raw settings.
    What depends on the world, the device or a technique is decided and checked once, where those
    are known (`mop.settle.settle`)."""
    config = Config()
    if path is not None:
        config = apply(config, read_toml(path))
    for arg in overrides:
        section, key, text = parse_override(arg)
        target = getattr(config, section, None)
        if section == "model" and key.startswith("options."):  # --model.options.KEY=VALUE: the family's
            option = key.removeprefix("options.")
            value = {"options": {option: _override_value(target.options, option, text)}}
        else:
            value = {key: _override_value(target, key, text)}
        config = apply(config, {section: value})
    return config


def check_fields(config: Config) -> None:
    """Each resolved setting's own range: counts >= 1, rates and coefficients >= 0 (the model's
    shape: `ModelConfig.validate`; the cross-field checks belong to the parts that use them)."""
    positive(config, ["parallel.nproc", "parallel.attention_head_chunks", "parallel.llep_min_chunk",
                      "train.max_skipped_steps", "log.progress_every", "parallel.timeout_s", "checkpoint.stop_grace_s",
                      "eval.sequences", "parallel.llep_chunks", "data.seq_len", "train.steps", "train.global_batch",
                      "train.micro_batch", "checkpoint.keep"])
    at_least_zero(config, ["train.seed", "train.grad_clip", "optim.lr", "optim.warmup_steps", "optim.weight_decay",
                           "optim.eps", "checkpoint.every", "eval.every", "log.profile_step"])


def lookup(config: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(config, section), key)


def positive(config: Config, keys: list[str]) -> None:
    for key in keys:
        if lookup(config, key) < 1:
            raise ConfigError(key, f"must be >= 1, got {lookup(config, key)}")


def at_least_zero(config: Config, keys: list[str]) -> None:
    for key in keys:
        if lookup(config, key) < 0:
            raise ConfigError(key, f"must be >= 0, got {lookup(config, key)}")


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(config)
