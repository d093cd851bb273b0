"""DPO's pieces (issue 39): per-response sums from packed pairs, the losses against their formulas,
the LoRA reference (the base with adapters off).

Oracle for the sums: each response's log-probs from the full logits of prompt+response run alone.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from mop.config import DpoConfig
from mop.models.config import ModelConfig
from mop.models.lora import LoraConfig, adapters_disabled
from mop.models.transformer import IGNORE_INDEX, MoETransformer
from mop.objectives.preference.loss import StepTotals, pair_losses, preference_loss, record_sums

SHAPE = dict(family="qwen3_moe", vocab_size=61, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4,
             top_k=2, expert_intermediate=16)


def model(**extra) -> MoETransformer:
    torch.manual_seed(0)
    net = MoETransformer(ModelConfig(**SHAPE), **extra)
    for param in net.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return net


def pairs(count: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count, 3), generator=g).tolist()
    return [tuple(torch.randint(0, 61, (n,), generator=g) for n in three) for three in lengths]


def packed_row(row_pairs, seq_len: int) -> dict:
    """Pairs packed shared, `[P | C] [P[-1] | R]` each, then padding: the layout of issue 39."""
    ids, labels, docs, prefix, response, positions = [], [], [], [], [], []
    for j, (p, c, r) in enumerate(row_pairs):
        for side, (tokens, resp, start, pre) in enumerate(((torch.cat([p, c]), c, 0, 0),
                                                           (torch.cat([p[-1:], r]), r, len(p) - 1, len(p) - 1))):
            n, first = len(tokens), len(tokens) - len(resp) - 1  # the token predicting the response's first
            ids += tokens.tolist()
            labels += [IGNORE_INDEX] * first + resp.tolist() + [IGNORE_INDEX]
            response += [-1] * first + [2 * j + side] * len(resp) + [-1]
            docs += [2 * j + side] * n
            prefix += [pre] * n
            positions += list(range(start, start + n))
    pad = seq_len - len(ids)
    columns = {"input_ids": ids + [0] * pad, "labels": labels + [IGNORE_INDEX] * pad,
               "document_ids": docs + [docs[-1] + 1] * pad, "prefix_lengths": prefix + [0] * pad,
               "response_ids": response + [-1] * pad, "position_ids": positions + list(range(pad)),
               "padding": [False] * len(ids) + [True] * pad}
    return {key: torch.tensor(values) for key, values in columns.items()}


def alone(net, prompt, response) -> torch.Tensor:
    """The response's summed log-probs with its prompt run alone (full logits)."""
    logits = net(torch.cat([prompt, response])[None])[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(-1, response[:, None]).sum()


def test_response_sums_of_pairs_packed_with_their_prompt_once_equal_each_run_alone():
    net = model()
    rows = [pairs(3, seed=1), pairs(1, seed=2)]
    batch = {key: torch.stack([packed_row(r, 80)[key] for r in rows]) for key in packed_row(rows[0], 80)}
    terms = net.preference_terms(batch["input_ids"], batch["labels"], batch["response_ids"], 3, batch["position_ids"],
                                 batch["document_ids"], batch["padding"], batch["prefix_lengths"])
    slots = [(b, j) for b in range(2) for j in range(3)]
    expected = torch.zeros(6, 2, dtype=torch.float64)
    counts = torch.zeros(6, 2, dtype=torch.float64)
    for slot, (b, j) in enumerate(slots):
        if j < len(rows[b]):
            p, c, r = rows[b][j]
            expected[slot] = torch.stack([alone(net, p, c), alone(net, p, r)]).double()
            counts[slot] = torch.tensor([len(c), len(r)], dtype=torch.float64)
    assert_close(terms.logps, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(terms.targets, counts) and terms.reference is None
    # the gradient of a DPO loss over them is that of the pairs run alone
    reference = expected.detach() + torch.randn(6, 2, dtype=torch.float64)
    totals = StepTotals(pairs=4, chosen_targets=int(counts[:, 0].sum()), sequences=2)
    net.zero_grad()
    sum(preference_loss(terms.logps, reference, terms.targets, totals, DpoConfig(), 1)).backward()
    shared = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad()
    sum(preference_loss(expected, reference, counts, totals, DpoConfig(), 1)).backward()
    for name, param in net.named_parameters():
        if param.grad is not None:
            assert_close(shared[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_reference_sums_ride_along_with_the_policy_sums():
    net = model()
    batch = packed_row(pairs(2), 48)
    reference = torch.zeros(48, dtype=torch.float64)
    starts = [int((batch["response_ids"] == k).nonzero()[0]) for k in range(4)]
    reference[starts] = torch.tensor([-3.5, -7.25, -1.0, -2.0], dtype=torch.float64)
    rows = {key: value[None] for key, value in batch.items()}
    terms = net.preference_terms(rows["input_ids"], rows["labels"], rows["response_ids"], 2, rows["position_ids"],
                                 rows["document_ids"], rows["padding"], rows["prefix_lengths"], reference[None])
    assert torch.equal(terms.reference, torch.tensor([[-3.5, -7.25], [-1.0, -2.0]], dtype=torch.float64))


def test_the_losses_follow_their_formulas():
    g = torch.Generator().manual_seed(3)
    policy, reference = -torch.rand(5, 2, generator=g) * 20, -torch.rand(5, 2, generator=g) * 20
    targets = torch.randint(1, 9, (5, 2), generator=g).float()
    beta, e = 0.3, 0.2
    margin = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    assert_close(pair_losses(policy, reference, targets, DpoConfig(beta=beta)), -F.logsigmoid(beta * margin))
    smoothed = -(1 - e) * F.logsigmoid(beta * margin) - e * F.logsigmoid(-beta * margin)
    assert_close(pair_losses(policy, reference, targets, DpoConfig(beta=beta, label_smoothing=e)), smoothed)
    ratios = (policy - reference) / targets
    ipo = (ratios[:, 0] - ratios[:, 1] - 1 / (2 * beta)) ** 2
    assert_close(pair_losses(policy, reference, targets, DpoConfig(beta=beta, loss="ipo")), ipo)
    # a slot without targets counts nowhere; the nll is the chosen targets' mean
    targets[4] = 0
    totals = StepTotals(pairs=4, chosen_targets=int(targets[:4, 0].sum()), sequences=1)
    dpo, nll = preference_loss(policy, reference, targets, totals, DpoConfig(beta=beta), copies=2)
    assert_close(dpo, -F.logsigmoid(beta * margin[:4]).sum() / 8)
    assert_close(nll, -policy[:4, 0].sum() / (2 * totals.chosen_targets))
    records = record_sums(policy, reference, targets, beta, 1 / 4)
    rewards = beta * (policy[:4] - reference[:4]).double()
    assert_close(records, torch.stack([rewards[:, 0].mean(), rewards[:, 1].mean(),
                                       (rewards[:, 0] > rewards[:, 1]).double().mean(),
                                       (rewards[:, 0] - rewards[:, 1]).mean(), policy[:4, 0].double().mean(),
                                       policy[:4, 1].double().mean()]))


@pytest.mark.parametrize("targets", ["attention,routed_experts", "attention"])
def test_adapters_off_compute_the_frozen_base(targets):
    lora = LoraConfig(rank=4, targets=targets)
    net = model(lora=lora)
    adapters = {n: p for n, p in net.named_parameters() if "lora_" in n}
    ids = torch.randint(0, 61, (2, 24))
    with adapters_disabled(net):
        base = net(ids)
    with torch.no_grad():
        for name, param in adapters.items():
            if name.endswith("lora_B"):
                param.zero_()
    assert_close(base, net(ids), atol=0, rtol=0)
    with torch.no_grad():
        next(p for n, p in adapters.items() if n.endswith("lora_B")).fill_(0.5)
    assert not torch.allclose(base, net(ids))  # the adapters are back on after the block
