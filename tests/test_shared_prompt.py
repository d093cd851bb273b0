"""A preference pair packed with its prompt once (issue 39): `[prompt | chosen]` one document, then
the rejected response as a branch over the prompt (`mop.models.documents`), its positions continuing
the prompt's. The prompt's last token opens each response (its logit predicts the response's first
token), so the branch is `[prompt[-1], rejected]` over the first len(prompt) - 1 tokens.

Oracle: the same pair unshared, prompt+chosen and prompt+rejected as two sequences of the same
model: every response token's logits, and the gradient of the responses' summed log-probs with
respect to every parameter (the prompt, computed once, gathers both responses' gradients).
"""

import pytest
import torch
from torch.testing import assert_close

from mop.models.config import ModelConfig
from mop.models.transformer import MoETransformer

PROMPT, CHOSEN, REJECTED = 40, 9, 13
SHAPE = dict(vocab_size=97, hidden=32, layers=2, experts=4, top_k=2, expert_intermediate=16)
FAMILIES = {
    "qwen3_moe": dict(heads=4, kv_heads=2, head_dim=8),
    # multi-head latent attention (values narrower than q and k), a dense block, q/kv low-rank
    "deepseek_v3": dict(heads=2, kv_heads=2, head_dim=12, dense_layers=1, shared_expert_intermediate=16,
                        options={"qk_rope_head_dim": 4, "kv_lora_rank": 8, "q_lora_rank": 8, "v_head_dim": 8}),
}


def model(family: str) -> MoETransformer:
    torch.manual_seed(0)
    net = MoETransformer(ModelConfig(family=family, **SHAPE, **FAMILIES[family]))
    for param in net.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return net


def response_logprobs(logits, tokens, positions):
    """Summed log-probs of `tokens` predicted at `positions` of a `[1, S, V]` logit row."""
    return logits[0, positions].log_softmax(-1).gather(-1, tokens[:, None]).sum()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_pair_with_its_prompt_once_equals_the_pair_run_as_two_sequences(family):
    g = torch.Generator().manual_seed(1)
    prompt, chosen, rejected = (torch.randint(0, 97, (n,), generator=g) for n in (PROMPT, CHOSEN, REJECTED))
    net = model(family)

    def grads(loss):
        net.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}

    # unshared: two sequences, each response predicted from the prompt's last token on
    with_chosen, with_rejected = torch.cat([prompt, chosen])[None], torch.cat([prompt, rejected])[None]
    logits_c, logits_r = net(with_chosen), net(with_rejected)
    from_prompt = PROMPT - 1
    unshared = grads(response_logprobs(logits_c, chosen, torch.arange(from_prompt, from_prompt + CHOSEN))
                     + response_logprobs(logits_r, rejected, torch.arange(from_prompt, from_prompt + REJECTED)))
    # shared: [prompt | chosen] [prompt[-1] | rejected], the branch over the first PROMPT - 1 tokens
    ids = torch.cat([prompt, chosen, prompt[-1:], rejected])[None]
    first, second = PROMPT + CHOSEN, 1 + REJECTED
    document_ids = torch.tensor([0] * first + [1] * second)[None]
    prefix_lengths = torch.tensor([0] * first + [PROMPT - 1] * second)[None]
    logits = net(ids, document_ids=document_ids, prefix_lengths=prefix_lengths)
    assert_close(logits[0, from_prompt:first - 1], logits_c[0, from_prompt:-1], atol=1e-5, rtol=1e-5)
    assert_close(logits[0, first:-1], logits_r[0, from_prompt:-1], atol=1e-5, rtol=1e-5)
    shared = grads(response_logprobs(logits, chosen, torch.arange(from_prompt, from_prompt + CHOSEN))
                   + response_logprobs(logits, rejected, torch.arange(first, first + REJECTED)))
    assert shared.keys() == unshared.keys()
    for name in shared:
        assert_close(shared[name], unshared[name], atol=1e-5, rtol=1e-4, msg=name)


def test_gpt_oss_refuses_a_branch_it_cannot_attend():
    from mop.models.documents import Documents
    from mop.models.gpt_oss.attention import SinkWindowCore

    documents = Documents.from_ids(torch.tensor([[0] * 6 + [1] * 4]), torch.tensor([[0] * 6 + [3] * 4]))
    q = torch.randn(1, 10, 2, 8)
    with pytest.raises(NotImplementedError, match="branches"):
        SinkWindowCore(None, 4)(q, q, q, documents, torch.zeros(2))
