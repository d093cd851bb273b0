"""Chat fine-tuning data: the shipped templates' token ids against transformers, their target masks
against hand-checked expectations, best-fit packing of whole conversations, and the loss of a packed
batch against the conversations run one at a time (reference and the full mop layout on 4 ranks)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from mop.config import load_config
from mop.data import DataError, count_targets
from mop.data.chat.packing import ChatDataset
from mop.data.conversations import conversation
from mop.data.kinds import encode_source
from mop.data.packing import best_fit_decreasing, fitted_lengths
from mop.data.prepared import ChatSettings, Corpus
from mop.data.templates import Conversation
from mop.models.moe import MoE
from mop.models.transformer import IGNORE_INDEX, build_model
from mop.objectives.next_token.objective import NextTokenLoss
from mop.parallel import DistLayout, Layout
from mop.parallel.checkpointing import canonical_name
from mop.runtime import Runtime
from mop.settle import settle
from mop.testing import run_distributed
from mop.train import forward_backward

QWEN3, GPT_OSS = "mop/data/assets/qwen3", "mop/data/assets/gpt-oss"
CONVERSATIONS = Path("mop/data/corpus/conversations.jsonl")

# A system prompt, two user turns, an answer, a tool call with reasoning, the tool's result, the final answer.
HAND = Conversation([
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
], [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}])

# The target runs of HAND, checked by hand against each template's rendering: the role headers
# (`<|im_start|>assistant\n`, `<|start|>assistant`) are not targets, what the model writes after them
# is, through the end-of-turn token. gpt-oss's template drops the reasoning of a tool call that a
# final answer follows; Qwen3's keeps it after the last user turn and opens an empty think block on
# the last turn.
HAND_TARGETS = {
    QWEN3: ['Hi!<|im_end|>',
            '<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
            '</tool_call><|im_end|>',
            '<think>\n\n</think>\n\nIt is 5.<|im_end|>'],
    GPT_OSS: ['<|channel|>final<|message|>Hi!<|end|>',
              ' to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>',
              '<|channel|>final<|message|>It is 5.<|return|>'],
}


def shipped_rows(count=None):
    with CONVERSATIONS.open() as f:
        return [json.loads(line) for line in f][:count]


def target_runs(template, ids, targets) -> list[str]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], targets.astype(int), [0]])))
    return [template.tokenizer._tok.decode(ids[a:b].tolist(), skip_special_tokens=False)
            for a, b in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("folder", [QWEN3, GPT_OSS])
def test_token_ids_equal_transformers_apply_chat_template(folder):
    from transformers import AutoTokenizer

    template, hf = ChatSettings(folder).template(), AutoTokenizer.from_pretrained(folder)
    conversations = [HAND, *(conversation(row) for row in shipped_rows())]
    for index, c in enumerate(conversations):
        ids, _ = template.encode(c)
        expected = hf.apply_chat_template(c.messages, tools=c.tools, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert ids.tolist() == list(expected), f"conversation {index}"


@pytest.mark.parametrize("folder", [QWEN3, GPT_OSS])
def test_targets_are_the_hand_checked_assistant_spans(folder):
    template = ChatSettings(folder).template()
    ids, targets = template.encode(HAND)
    assert target_runs(template, ids, targets) == HAND_TARGETS[folder]


@pytest.mark.parametrize("folder", [QWEN3, GPT_OSS])
def test_targets_of_multi_turn_and_non_ascii_answers(folder):
    answers = ["Grüße — 你好 ✓", "second\nline", " leading space"]
    messages = [m for answer in answers for m in ({"role": "user", "content": "go"},
                                                  {"role": "assistant", "content": answer})]
    template = ChatSettings(folder).template()
    runs = target_runs(template, *template.encode(Conversation(messages)))
    assert len(runs) == len(answers)
    for run, answer in zip(runs, answers):
        assert answer in run
        assert "user" not in run and "go" not in run


def test_loss_on_all_makes_every_token_a_target_and_truncates_at_assistant_turn_ends():
    corpus = encode_source(str(CONVERSATIONS), ChatSettings(QWEN3))
    everything = ChatDataset(corpus, 512, "truncate", seed=0, pad_id=7, loss_on="all")
    assistant = ChatDataset(corpus, 512, "truncate", seed=0, pad_id=7)
    assert everything.stats == assistant.stats and everything.stats["data_overlong_truncated"] > 0
    for i in range(len(everything)):
        item, masked = everything[i], assistant[i]
        real = ~item["padding"]
        last = torch.cat([item["document_ids"][1:] != item["document_ids"][:-1], torch.tensor([True])])
        expected = torch.where(real & ~last, item["input_ids"].roll(-1), IGNORE_INDEX)
        assert torch.equal(item["labels"], expected)  # every next token of the same conversation
        assert torch.equal(item["input_ids"], masked["input_ids"])
        assert ((masked["labels"] == IGNORE_INDEX) | (masked["labels"] == item["labels"])).all()


def corpus_of(lengths: list[int], turn_ends: dict[int, list[int]] | None = None) -> Corpus:
    """Conversations of the given lengths with token k of each = k; targets end at `turn_ends`."""
    tokens = np.concatenate([np.arange(n) for n in lengths])
    targets = np.zeros(len(tokens), dtype=bool)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    for k, ends in (turn_ends or {}).items():
        for end in ends:
            targets[offsets[k] + end - 2:offsets[k] + end] = True
    return Corpus(tokens, targets, offsets, "test")


def test_best_fit_decreasing_packs_every_conversation_whole_and_deterministically():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=300)
    items, bounds = best_fit_decreasing(lengths, 128, seed=3)
    assert sorted(items.tolist()) == list(range(300))  # each conversation exactly once, never split
    loads = np.add.reduceat(lengths[items], bounds[:-1])
    assert (loads <= 128).all()
    assert len(bounds) - 1 <= 2 * -(-lengths.sum() // 128)  # best fit never uses twice the minimum
    again = best_fit_decreasing(lengths, 128, seed=3)
    assert np.array_equal(items, again[0]) and np.array_equal(bounds, again[1])


def test_best_fit_decreasing_takes_the_fullest_sequence_that_fits():
    # 6 opens a sequence (room 4 left), 5 another (room 5); 4 fits both and goes where the room is
    # least (4: the first is full), then 3 into the second
    items, bounds = best_fit_decreasing(np.array([6, 5, 4, 3]), 10, seed=0)
    assert [sorted(items[a:b].tolist()) for a, b in zip(bounds[:-1], bounds[1:])] == [[0, 2], [1, 3]]


def test_overlong_conversations_are_dropped_or_cut_at_a_turn_end():
    corpus = corpus_of([10, 30, 40], {1: [12, 25, 30], 2: [35, 40]})
    kept, dropped, truncated = fitted_lengths(corpus, 28, "truncate")
    assert kept.tolist() == [10, 25, 0] and (dropped, truncated) == (1, 1)
    kept, dropped, truncated = fitted_lengths(corpus, 28, "drop")
    assert kept.tolist() == [10, 0, 0] and (dropped, truncated) == (2, 0)


def test_a_packed_sequence_keeps_targets_inside_their_conversation():
    corpus = encode_source(str(CONVERSATIONS), ChatSettings(QWEN3))
    dataset = ChatDataset(corpus, 512, "drop", seed=0, pad_id=7)
    p = dataset.packing
    for i in range(len(dataset)):
        item = dataset[i]
        ids, labels, documents = item["input_ids"], item["labels"], item["document_ids"]
        at = 0
        for number, k in enumerate(p.items[p.bounds[i]:p.bounds[i + 1]]):
            start, n = corpus.offsets[k], corpus.offsets[k + 1] - corpus.offsets[k]
            assert ids[at:at + n].tolist() == corpus.tokens[start:start + n].tolist()
            assert (documents[at:at + n] == number).all()
            assert item["position_ids"][at:at + n].tolist() == list(range(n))
            expected = np.where(corpus.targets[start + 1:start + n], corpus.tokens[start + 1:start + n].astype(np.int64),
                                IGNORE_INDEX)
            assert labels[at:at + n - 1].tolist() == expected.tolist()
            assert labels[at + n - 1] == IGNORE_INDEX  # no target crosses the conversation's end
            at += n
        assert item["padding"].tolist() == [False] * at + [True] * (512 - at)
        assert (labels[at:] == IGNORE_INDEX).all() and (ids[at:] == 7).all()
        assert documents[at:].unique().numel() <= 1 and (documents[at:] > documents[at - 1]).all()


def test_router_statistics_count_real_tokens_only():
    from mop.models.config import ModelConfig

    moe = MoE(ModelConfig(vocab_size=32, hidden=16, layers=1, heads=2, kv_heads=2, head_dim=8, experts=4, top_k=2,
                          expert_intermediate=8))
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(2, 6, 16)
    padding = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    _, stats = moe(x, padding)
    _, alone = moe(x[:1, :4])
    _, full = moe(x[1:])
    assert_close(stats.assignments, torch.cat([alone.assignments, full.assignments]))
    assert_close(stats.prob_sum, torch.cat([alone.prob_sum, full.prob_sum]))
    assert stats.rows.tolist() == [4.0, 6.0]


# The debug model, smaller, on the tiny Qwen3 tokenizer; conversations packed into 4 sequences of 384.
CHAT = ["--model.vocab_size=584", "--model.hidden=32", "--model.layers=2", "--model.heads=4", "--model.kv_heads=2",
        "--model.head_dim=8", "--model.experts=4", "--model.top_k=2", "--model.expert_intermediate=16",
        "--model.dense_layers=1", "--model.dense_intermediate=24", "--model.aux_loss_coef=0",
        "--data.format=chat", f"--data.tokenizer={QWEN3}", "--data.seq_len=384", "--train.global_batch=4",
        "--train.micro_batch=1", "--optim.offload=false"]


def chat_source(tmp_path) -> str:
    """Shipped conversations of different lengths (tool calls and reasoning among them)."""
    rows = [row for row in shipped_rows() if 40 < len(json.dumps(row)) < 1400][:24:2]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def alone_batch(corpus: Corpus, k: int, seq_len: int, pad_id: int) -> dict:
    """Conversation k by itself in a sequence, padded and masked: the oracle's own construction."""
    start, end = corpus.offsets[k], corpus.offsets[k + 1]
    n = end - start
    ids = torch.full((1, seq_len), pad_id)
    ids[0, :n] = torch.as_tensor(corpus.tokens[start:end].astype(np.int64))
    labels = torch.full((1, seq_len), IGNORE_INDEX)
    targets = torch.as_tensor(np.asarray(corpus.targets[start + 1:end], dtype=bool))
    labels[0, :n - 1] = torch.where(targets, ids[0, 1:n], IGNORE_INDEX)
    documents = (torch.arange(seq_len) >= n).long().unsqueeze(0)
    positions = torch.cat([torch.arange(n), torch.arange(seq_len - n)]).unsqueeze(0)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "document_ids": documents,
            "padding": documents.bool()}


def one_at_a_time(config, dataset: ChatDataset, sequences: list[int]):
    """Loss and gradients of the step's conversations run one at a time in one process, each
    normalised by the step's global target count."""
    model = build_model(config.model, seed=config.train.seed)
    p = dataset.packing
    conversations = [int(k) for i in sequences for k in p.items[p.bounds[i]:p.bounds[i + 1]]]
    batches = [alone_batch(dataset.corpus, k, config.data.seq_len, dataset.pad_id) for k in conversations]
    targets = count_targets(batches)
    total = 0.0
    for batch in batches:
        loss, _, _ = NextTokenLoss(model, targets, len(sequences))(batch)
        loss.backward()
        total += loss.item()
    return total, {canonical_name(n): p.grad for n, p in model.named_parameters()}


def packed_step(rank, world, config):
    """The run's first step in its layout (`build_run`'s data and model, the trainer's
    forward_backward): the summed loss and every full gradient."""
    from mop.build import build_run

    p = config.parallel
    layout = DistLayout(Layout(world, p.sequence, p.expert, p.vocab), torch.device("cpu"))
    run = build_run(config, Runtime(rank, world, torch.device("cpu"), layout))
    sequences = run.data.stream.indices(0, config.train.global_batch)
    batches = run.rank_batches(sequences, run.data.dataset)
    targets = torch.tensor(float(count_targets(batches)))
    torch.distributed.all_reduce(targets)
    objective = NextTokenLoss(run.model, int(targets), config.train.global_batch)
    ce, aux = forward_backward(run.model, batches, objective, run.runtime).parts.tolist()
    loss = torch.tensor(ce + aux)
    torch.distributed.all_reduce(loss)
    grads = {canonical_name(n): full_gradient(run.views, q) for n, q in run.model.named_parameters()}
    return loss.item(), grads, sequences


def full_gradient(views, param) -> torch.Tensor:
    """The global gradient of `param` from every rank's rows of it (`views`: the run's
    `GlobalViews`); rows that several ranks hold (replicas) are averaged."""
    local = views.local(param, param.grad)
    first, shape = views.first_row(param), views.global_shape(param)
    total, holders = torch.zeros(shape), torch.zeros(shape[0])
    total[first:first + len(local)] = local
    holders[first:first + len(local)] = 1
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(holders)
    return total / holders.view(-1, *[1] * (len(shape) - 1))


def test_a_packed_batch_equals_its_conversations_one_at_a_time_in_the_reference(tmp_path):
    from mop.data import build_data

    config = settle(load_config(None, [*CHAT, f"--data.source={chat_source(tmp_path)}", "--parallel.strategy=reference"]), 1, fit_memory=False)
    data = build_data(config.data.source, config.data.tokenizer, config.data.seq_len, 0,
                      chat=ChatSettings(config.data.tokenizer))
    sequences = data.stream.indices(0, 4)
    packed = [data.dataset[i] for i in sequences]
    assert all(int(b["padding"].sum()) < 384 for b in packed) and max(int(b["document_ids"].max()) for b in packed) > 1
    model = build_model(config.model, seed=config.train.seed)
    batch = {key: torch.stack([b[key] for b in packed]) for key in packed[0]}
    loss, _, _ = NextTokenLoss(model, count_targets([batch]), 4)(batch)
    loss.backward()
    expected_loss, expected = one_at_a_time(config, data.dataset, sequences)
    assert_close(loss.detach(), torch.tensor(expected_loss), atol=1e-6, rtol=1e-5)
    for name, param in model.named_parameters():
        assert_close(param.grad, expected[canonical_name(name)], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_a_packed_batch_in_the_full_mop_layout_equals_its_conversations_one_at_a_time(tmp_path):
    layout = ["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=2", "--parallel.expert=2",
              "--parallel.vocab=2", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0",
              "--parallel.llep_min_chunk=4", "--parallel.llep_chunks=2", "--parallel.attention_head_chunks=2",
              "--train.activation_checkpointing=full", "--train.offload_activations=true"]
    config = settle(load_config(None, [*CHAT, f"--data.source={chat_source(tmp_path)}", *layout]), 4, fit_memory=False)
    results = run_distributed(packed_step, 4, config, timeout=600)
    sequences = results[0][2]
    from mop.data import build_data

    data = build_data(config.data.source, config.data.tokenizer, config.data.seq_len, 0,
                      chat=ChatSettings(config.data.tokenizer))
    expected_loss, expected = one_at_a_time(config, data.dataset, sequences)
    for loss, grads, _ in results:
        assert_close(torch.tensor(loss), torch.tensor(expected_loss), atol=1e-6, rtol=1e-5)
        assert grads.keys() == expected.keys()
        for name, grad in expected.items():
            assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_padding_is_left_out_of_the_router_statistics_in_the_full_mop_layout_as_in_the_reference(tmp_path):
    """With the load-balancing loss on, the packed batch in the mop layout (padding in one rank's slice
    of a sequence more than the other's) against the reference on the same sequences."""
    layout = ["--parallel.strategy=mop", "--parallel.nproc=4", "--parallel.sequence=2", "--parallel.expert=4",
              "--parallel.vocab=1", "--parallel.expert_balance=llep", "--parallel.llep_gate=1.0",
              "--parallel.llep_min_chunk=4"]
    settings = [*CHAT, f"--data.source={chat_source(tmp_path)}", "--model.aux_loss_coef=0.1"]
    config = settle(load_config(None, [*settings, *layout]), 4, fit_memory=False)
    results = run_distributed(packed_step, 4, config, timeout=600)
    from mop.data import build_data

    data = build_data(config.data.source, config.data.tokenizer, config.data.seq_len, 0,
                      chat=ChatSettings(config.data.tokenizer))
    packed = [data.dataset[i] for i in results[0][2]]
    assert any(item["padding"][:192].sum() != item["padding"][192:].sum() for item in packed)
    model = build_model(config.model, seed=config.train.seed)
    batches = [{key: value.unsqueeze(0) for key, value in item.items()} for item in packed]
    targets, total = count_targets(batches), 0.0
    for batch in batches:
        loss, _, _ = NextTokenLoss(model, targets, len(batches))(batch)
        loss.backward()
        total += loss.item()
    for loss, grads, _ in results:
        assert_close(torch.tensor(loss), torch.tensor(total), atol=1e-6, rtol=1e-5)
        for name, param in model.named_parameters():
            assert_close(grads[canonical_name(name)], param.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_chat_needs_conversations_that_fit(tmp_path):
    corpus = corpus_of([50, 60], {0: [50], 1: [60]})
    with pytest.raises(DataError, match="data.seq_len = 40"):
        ChatDataset(corpus, 40, "drop", seed=0, pad_id=0)


def test_a_chat_run_records_its_targets_data_and_held_out_conversations(tmp_path):
    """`mop train` on chat data (reference, 2 steps): the start line says the format and what was left
    out, each record has the target share, the data counts and tokens/s of real tokens only, and a
    chat eval.source is held out with the same masking."""
    from mop.cli import main
    from mop.metrics import read_metrics

    source = chat_source(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["train", *CHAT, f"--data.source={source}", "--parallel.strategy=reference", "--train.steps=2",
                 "--eval.every=2", f"--eval.source={source}", "--eval.sequences=4", "--log.tensorboard=false",
                 "--log.plot=false", f"--log.run_dir={run_dir}"]) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 2 and "eval_loss" in records[-1]
    for record in records:
        assert 0 < record["target_share"] < 1
        assert record["data_overlong_dropped"] > 0 and record["data_overlong_truncated"] == 0  # data.overlong = "drop"
        assert record["data_conversations"] + record["data_overlong_dropped"] == len(Path(source).read_text().splitlines())
        positions = record["targets"] / record["target_share"]
        assert positions == pytest.approx(4 * 384)
        real = record["tokens_per_s"] * record["step_time_s"]
        assert real == pytest.approx(positions * (1 - record["data_padding_share"]), rel=0.25)
        assert real < positions


@pytest.mark.parametrize("folder", [QWEN3, GPT_OSS])
def test_an_empty_assistant_turn_trains_its_end_and_an_opening_assistant_turn_is_one(folder):
    template = ChatSettings(folder).template()
    conversation = Conversation([{"role": "assistant", "content": "Welcome."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": ""}, {"role": "user", "content": "Still there?"},
                                 {"role": "assistant", "content": "Yes."}])
    runs = target_runs(template, *template.encode(conversation))
    assert runs == {QWEN3: ["Welcome.<|im_end|>", "<|im_end|>", "<think>\n\n</think>\n\nYes.<|im_end|>"],
                    GPT_OSS: ["<|channel|>final<|message|>Welcome.<|end|>", "<|channel|>final<|message|><|end|>",
                              "<|channel|>final<|message|>Yes.<|return|>"]}[folder]


def test_a_template_that_renders_nothing_between_turns_is_refused(tmp_path):
    run_on = tmp_path / "run-on.jinja"
    run_on.write_text("{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}")
    with pytest.raises(DataError, match=r"data\.chat_template: .*run-on\.jinja renders nothing between an assistant "
                                        r"turn and the next user turn"):
        ChatSettings(QWEN3, chat_template=str(run_on)).template()


def test_a_template_that_ends_turns_with_plain_text_finds_them_without_special_tokens(tmp_path):
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\nEND\n\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant: {% endif %}")
    template = ChatSettings(QWEN3, chat_template=str(plain)).template()
    conversation = Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                 {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}])
    assert target_runs(template, *template.encode(conversation)) == ["Hello.\nEND", "Bye.\nEND"]
