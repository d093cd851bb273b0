"""mop's DPO equals TRL 1.16's at the first step (issue 39, item 7), on a tiny transformers Qwen3-MoE.

Why: mop packs each pair with its prompt once (`mop.data.preference.packing`) and sums response
log-probs per slot (`MoETransformer.preference_terms`); TRL runs every prompt + response as its own
padded row. The numbers a user compares across the two (loss, rewards, log-probs) must not depend on
that, nor on how each side splits a row into prompt and response tokens.

Setup: one tiny Qwen3-MoE in fp32 on the CPU with random O(1) weights W0, and W1 = W0 plus noise
(30% of each parameter's typical size), both saved as Hugging Face checkpoints. TRL trains W1
against `ref_model` W0; mop loads the same two directories (`load_hf`) as its policy and reference,
so rewards are not zero. The rows are shipped conversational pairs (single- and multi-turn prompts,
tools, a tool call and its result in a prompt, and one derived pair whose chosen response holds a
tool call, its result and the answer), or plain strings. mop reads them with `data.loss_on = "all"`
(TRL's rule: every token after the prompt is a target) and the prompt shared; TRL's trainer takes
all rows as one batch and `compute_loss` gives its first step (no optimizer, no shuffling). The MoE
load-balancing loss is off on both sides (`router_aux_loss_coef = 0`; it is compared elsewhere).

Compared (fp32, relative 1e-5): each pair's token split (prompt, chosen, rejected); each response's
summed log-probs under the policy and the reference (TRL's own `compute_ref_log_probs`); the loss for
TRL's ["sigmoid"], ["ipo"] and ["sigmoid", "sft"] with weights [1, alpha] (mop's `dpo.loss` and
`dpo.nll_alpha`); and TRL's metrics rewards/*, logps/* (mop's `record_sums`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mop
from mop.config import DpoConfig
from mop.data import build_data
from mop.data.prepared import ChatSettings
from mop.models.hf import load_hf
from mop.objectives.preference.loss import RECORDS, StepTotals, preference_loss, record_sums

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

DATA = Path(mop.__file__).parent / "data"
QWEN3 = str(DATA / "assets" / "qwen3")
SHIPPED = DATA / "corpus" / "preferences.jsonl"
# Lines of the shipped pairs: a one-turn prompt, a 7-message prompt, a 3-message one, and a prompt holding a
# tool call and its result, with tools (the largest, about 400 tokens: the tools' schemas).
LINES = (24, 156, 279, 236)
PLAIN = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, usually."},
    {"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 23"},
    {"prompt": "Name a fruit:", "chosen": " an apple, which is red or green.<|im_end|>", "rejected": " a rock."},
    {"prompt": "Sort these words: pear, apple, fig.", "chosen": " apple, fig, pear", "rejected": " pear, fig"},
]
SEQ_LEN = 512  # the tool pair (about 420 tokens) fills most of a sequence: the pairs span several
BETA, ALPHA = 0.1, 0.5
# name: TRL's loss_type and loss_weights, mop's DpoConfig
LOSSES = {
    "sigmoid": (["sigmoid"], None, DpoConfig(beta=BETA)),
    "ipo": (["ipo"], None, DpoConfig(beta=BETA, loss="ipo")),
    "rpo": (["sigmoid", "sft"], [1.0, ALPHA], DpoConfig(beta=BETA, nll_alpha=ALPHA)),
}
TOLERANCE = dict(rel=1e-5)  # relative only (pytest.approx adds no absolute slack when rel alone is given)


# ------------------------------------------------------------------------------------------ the rows

def conversational_rows() -> list[dict]:
    lines = SHIPPED.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(lines[k]) for k in LINES]
    tool = rows[-1]  # its prompt's tool call and result moved into the chosen response
    derived = {"prompt": tool["prompt"][:1], "chosen": tool["prompt"][1:] + tool["chosen"],
               "rejected": tool["rejected"], "tools": tool["tools"]}
    return rows + [derived]


ROWS = {"conversational": conversational_rows(), "plain": PLAIN}


def trl_dataset(rows: list[dict]):
    """The rows as a `datasets.Dataset`: tools as a JSON string (TRL parses it), so that Arrow does not
    merge their schemas into one struct, and None in every row without them (`from_list` takes its
    columns from the first row)."""
    table = [{**row, "tools": json.dumps(row["tools"])} if "tools" in row else row for row in rows]
    if any("tools" in row for row in rows):
        table = [{"tools": None, **row} for row in table]
    return datasets.Dataset.from_list(table)


# ----------------------------------------------------------------------------------------- the weights

@torch.no_grad()
def randomize(model, seed: int) -> None:
    """O(1) activations, norms away from one, routers wide enough that top-k picks vary by token."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if param.dim() == 1:
            param.copy_(1 + 0.2 * noise)
        else:
            scale = 2 if name.endswith(".mlp.gate.weight") else 1
            param.copy_(noise * scale / param.shape[-1] ** 0.5)


@torch.no_grad()
def perturb(model, seed: int, size: float) -> None:
    """W1 = W0 + noise of `size` relative to each parameter's typical value."""
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(size * param.abs().mean() * torch.randn(param.shape, generator=generator))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """The reference W0 and the policy W1, saved as Hugging Face checkpoints."""
    folder = tmp_path_factory.mktemp("dpo_trl")
    tok = transformers.AutoTokenizer.from_pretrained(QWEN3)
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, router_aux_loss_coef=0.01, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    randomize(hf, 0)
    hf.save_pretrained(folder / "w0")
    perturb(hf, 1, 0.3)
    hf.save_pretrained(folder / "w1")
    return folder / "w0", folder / "w1"


# ---------------------------------------------------------------------------------------------- mop

class MopPairs:
    """mop's side: each pair's tokens and per-response sums, in corpus (= row) order and in slot order."""

    def __init__(self, rows: list[dict], folder: Path, checkpoints: tuple[Path, Path]):
        source = folder / "pairs.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        data = build_data(str(source), QWEN3, SEQ_LEN, 0, chat=ChatSettings(QWEN3, kind="preference"),
                          overlong="drop", loss_on="all", shared_prompt=True)
        dataset = self.dataset = data.dataset
        assert dataset.stats["data_pairs"] == len(rows) and dataset.stats["data_overlong_dropped"] == 0
        assert dataset.stats["data_skipped_invalid"] == 0
        assert dataset.pairs_max > 1  # pairs share sequences (and the conversational ones span several)
        self.tokens = [self._split(dataset.corpus, k) for k in range(len(rows))]
        reference, policy = (load_hf(path) for path in checkpoints)
        self.slots = {}
        self.slots["policy"], self.slots["targets"] = self._slot_sums(policy)
        self.slots["reference"], _ = self._slot_sums(reference)
        # the corpus items in slot order (-1: an empty slot)
        order = torch.full((len(dataset), dataset.pairs_max), -1, dtype=torch.int64)
        for i in range(len(dataset)):
            items = torch.as_tensor(dataset.pairs_of(i), dtype=torch.int64)
            order[i, :len(items)] = items
        self.order = order.flatten()
        filled = self.order >= 0
        assert sorted(self.order[filled].tolist()) == list(range(len(rows)))  # every pair once
        self.pairs = {}  # name: [n, 2] in corpus order
        for name in ("policy", "reference", "targets"):
            pairs = torch.zeros(len(rows), 2, dtype=torch.float64)
            pairs[self.order[filled]] = self.slots[name][filled]
            self.pairs[name] = pairs
        assert (self.slots["targets"][~filled] == 0).all()

    @staticmethod
    def _split(corpus, k: int) -> tuple[list[int], list[int], list[int]]:
        ids, _, (p, c, r) = corpus.item(k)
        return ids[:p].tolist(), ids[p:p + c].tolist(), ids[p + c:].tolist()

    @torch.no_grad()
    def _slot_sums(self, net) -> tuple[torch.Tensor, torch.Tensor]:
        """`preference_terms` of every packed sequence: its sums and target counts, [sequences x pairs_max, 2]."""
        logps, targets = [], []
        for i in range(len(self.dataset)):
            item = {key: value[None] for key, value in self.dataset[i].items()}
            terms = net.preference_terms(item["input_ids"], item["labels"], item["response_ids"],
                                         self.dataset.pairs_max, item["position_ids"], item["document_ids"],
                                         item["padding"], item["prefix_lengths"])
            logps.append(terms.logps)
            targets.append(terms.targets)
        return torch.cat(logps), torch.cat(targets)

    def step(self, dpo: DpoConfig) -> tuple[float, dict[str, float]]:
        """The first step's loss (`dpo + nll_alpha x nll`) and records, over the slots as the trainer sees them."""
        policy, reference, targets = self.slots["policy"], self.slots["reference"], self.slots["targets"]
        pairs = int((targets > 0).all(-1).sum())
        totals = StepTotals(pairs=pairs, chosen_targets=int(targets[:, 0].sum()), sequences=len(self.dataset))
        dpo_share, nll_share = preference_loss(policy, reference, targets, totals, dpo, copies=1)
        records = record_sums(policy, reference, targets, dpo.beta, 1 / pairs)
        return float(dpo_share + dpo.nll_alpha * nll_share), dict(zip(RECORDS, records.tolist()))


@pytest.fixture(scope="module", params=sorted(ROWS))
def mop_pairs(request, tmp_path_factory, checkpoints) -> tuple[str, MopPairs]:
    kind = request.param
    return kind, MopPairs(ROWS[kind], tmp_path_factory.mktemp(f"mop_{kind}"), checkpoints)


# ---------------------------------------------------------------------------------------------- TRL

def trl_trainer(rows: list[dict], checkpoints: tuple[Path, Path], folder: Path, loss: str, monkeypatch):
    """TRL's DPOTrainer over the rows: policy W1, ref_model W0, fp32 on the CPU, no aux loss."""
    for name in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "CI"):
        monkeypatch.setenv(name, "1")
    loss_type, weights, _ = LOSSES[loss]
    reference, policy = (transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                           dtype=torch.float32)
                         for path in checkpoints)
    args = trl.DPOConfig(output_dir=str(folder), per_device_train_batch_size=len(rows), max_steps=1,
                         learning_rate=0.0, report_to=[], use_cpu=True, bf16=False, fp16=False,
                         gradient_checkpointing=False, save_strategy="no", beta=BETA, loss_type=loss_type,
                         loss_weights=weights, max_length=None, router_aux_loss_coef=0.0)
    tok = transformers.AutoTokenizer.from_pretrained(QWEN3)
    return trl.DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=trl_dataset(rows),
                          processing_class=tok)


def trl_batch(trainer) -> dict:
    """All rows as one collated batch, in row order."""
    ds = trainer.train_dataset
    return trainer.data_collator([ds[i] for i in range(len(ds))])


def trl_step(trainer) -> tuple[float, dict[str, float]]:
    """TRL's first-step loss and metrics (`compute_loss` on the whole batch)."""
    batch = trl_batch(trainer)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    return loss.item(), {key: values[-1] for key, values in trainer._metrics["train"].items()}


# -------------------------------------------------------------------------------------------- tests

def test_pairs_split_and_sum_as_trl_does(mop_pairs, checkpoints, tmp_path, monkeypatch):
    """Each row's prompt, chosen and rejected tokens, and each response's summed log-probs under the
    policy and the reference, are TRL's (its own per-sequence sums, `compute_ref_log_probs`)."""
    kind, ours = mop_pairs
    trainer = trl_trainer(ROWS[kind], checkpoints, tmp_path, "sigmoid", monkeypatch)
    ds = trainer.train_dataset
    for k in range(len(ds)):
        theirs = tuple(ds[k][f"{part}_ids"] for part in ("prompt", "chosen", "rejected"))
        assert ours.tokens[k] == theirs, k
    batch = trl_batch(trainer)
    trainer.model.eval()
    for name, net in (("policy", trainer.model), ("reference", trainer.ref_model)):
        theirs = torch.stack(trainer.compute_ref_log_probs(net, batch), dim=1)  # [rows, 2]
        assert ours.pairs[name].flatten().tolist() == pytest.approx(theirs.flatten().tolist(), **TOLERANCE), name
    counts = [[len(chosen), len(rejected)] for _, chosen, rejected in ours.tokens]
    assert ours.pairs["targets"].tolist() == counts  # every response token is a target
    assert (ours.pairs["policy"] != ours.pairs["reference"]).all()


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_first_step_loss_and_metrics_equal_trls(mop_pairs, checkpoints, tmp_path, monkeypatch, loss):
    """TRL's first-step loss and its rewards/* and logps/* metrics are mop's step loss (`preference_loss`:
    dpo + nll_alpha x nll, over the packed slots, empty ones included) and records (`record_sums`)."""
    kind, ours = mop_pairs
    trainer = trl_trainer(ROWS[kind], checkpoints, tmp_path, loss, monkeypatch)
    their_loss, metrics = trl_step(trainer)
    our_loss, records = ours.step(LOSSES[loss][2])
    assert our_loss == pytest.approx(their_loss, **TOLERANCE)
    for key in RECORDS:
        assert records[key] == pytest.approx(metrics[key], **TOLERANCE), key
    # not a trivial step: W1 differs from W0 enough that relative 1e-5 on the rewards means something
    assert 0 < records["rewards/accuracies"] < 1
    assert min(abs(records[key]) for key in ("rewards/chosen", "rewards/rejected", "rewards/margins")) > 0.05
