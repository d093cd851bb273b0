"""Preference data (issue 39): TRL's rows read and encoded (message lists and strings, explicit and
implicit prompts, tools as a list or a JSON string), bad rows named or counted, prepared folders, and
the packing contract the model side relies on (`mop.data.preference.packing`).

Oracles: TRL 1.16's tokenization written with transformers (the prompt rendered with the generation
prompt, prompt + response rendered, the response the tokens after the prompt; plain rows through the
tokenizer's own call, EOS text appended), on the shipped Qwen3 and gpt-oss templates; packed rows
rebuilt token by token from the corpus.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_chat_sources import write_jsonl, write_parquet

import mop
from mop.cli import main
from mop.config import DataConfig
from mop.data import (
    ByteTokenizer,
    DataError,
    PreferenceDataset,
    build_data,
    load_dataset,
    load_tokenizer,
)
from mop.data.loader import source_options
from mop.data.kinds import encode_source, open_prepared, prepare
from mop.data.preference.corpus import PreferenceCorpus
from mop.data.preference.rows import extract_prompt
from mop.data.prepared import MANIFEST, ChatSettings
from mop.data.templates import Conversation

ASSETS = Path(mop.__file__).parent / "data" / "assets"
QWEN3, GPT_OSS = str(ASSETS / "qwen3"), str(ASSETS / "gpt-oss")
PAIRS = ChatSettings(QWEN3, kind="preference")
IGNORE = -100

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Apply one operation to two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                    "op": {"type": "string", "enum": ["add", "multiply"]}},
                   "required": ["a", "b", "op"]}}}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **more) -> dict:
    return {"role": "assistant", "content": text, **more}


# A system prompt, a multi-turn prompt, reasoning, tool calls in a response and in a prompt. Each pair's
# responses differ in their first message, so their implicit form gives back the same prompt.
CONVERSATIONAL = [
    {"prompt": [user("What colour is the sky?")], "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, user("Name a colour."), assistant("Red."),
                user("Another one?")],
     "chosen": [assistant("Blue.", reasoning_content="Not red again.")], "rejected": [assistant("Red.")]},
    {"prompt": [{"role": "system", "content": "You are a calculator."}, user("What is 2 + 3?")],
     "chosen": [assistant("", tool_calls=[call("calculator", a=2, b=3, op="add")]), {"role": "tool", "content": "5"},
                assistant("2 + 3 = 5")],
     "rejected": [assistant("2 + 3 = 6")], "tools": [CALCULATOR]},
    {"prompt": [user("What is 2 * 4?"), assistant("", tool_calls=[call("calculator", a=2, b=4, op="multiply")]),
                {"role": "tool", "content": "8"}],
     "chosen": [assistant("8")], "rejected": [assistant("Nine.")], "tools": [CALCULATOR]},
]
PLAIN = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
         {"prompt": "Two and two make", "chosen": " four.<|im_end|>", "rejected": " 5."}]


def implicit(row: dict) -> dict:
    return {**{k: v for k, v in row.items() if k != "prompt"},
            "chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]}


def pairs_of(corpus: PreferenceCorpus) -> list[tuple[list[int], list[int], list[int]]]:
    """Each pair's (prompt, chosen, rejected) tokens."""
    out = []
    for k in range(len(corpus.parts)):
        ids, _, (p, c, r) = corpus.item(k)
        out.append((ids[:p].tolist(), ids[p:p + c].tolist(), ids[p + c:].tolist()))
    return out


def arrays(corpus) -> tuple:
    return tuple(np.asarray(a).tolist() for a in (corpus.tokens, corpus.targets.astype(bool), corpus.offsets,
                                                  corpus.parts))


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------ 1. TRL's rows

@pytest.mark.parametrize("folder", [QWEN3, GPT_OSS], ids=["qwen3", "gpt-oss"])
def test_conversational_rows_encode_as_trl_tokenizes_them(tmp_path, folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    settings = ChatSettings(folder, kind="preference")
    explicit = encode_source(str(write_jsonl(tmp_path / "explicit.jsonl", CONVERSATIONAL)), settings)
    for k, row in enumerate(CONVERSATIONAL):
        def render(messages, **options):
            return list(hf.apply_chat_template(messages, tools=row.get("tools"), tokenize=True, return_dict=False,
                                               **options))
        prompt = render(row["prompt"], add_generation_prompt=True)
        chosen, rejected = (render(row["prompt"] + row[name]) for name in ("chosen", "rejected"))
        assert chosen[:len(prompt)] == rejected[:len(prompt)] == prompt
        assert pairs_of(explicit)[k] == (prompt, chosen[len(prompt):], rejected[len(prompt):])
    # the implicit prompt and tools as a JSON string give the same arrays
    # every row with a tools column: a parquet table takes its columns from its first row
    as_strings = [{**row, "tools": json.dumps(row["tools"]) if "tools" in row else None} for row in CONVERSATIONAL]
    for table in ([implicit(row) for row in CONVERSATIONAL], as_strings):
        assert arrays(encode_source(str(write_jsonl(tmp_path / "other.jsonl", table)), settings)) == arrays(explicit)
    assert arrays(encode_source(str(write_parquet(tmp_path / "p.parquet", as_strings)), settings)) == arrays(explicit)


def test_plain_rows_encode_as_trl_tokenizes_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(QWEN3)
    explicit = encode_source(str(write_jsonl(tmp_path / "explicit.jsonl", PLAIN)), PAIRS)
    for k, row in enumerate(PLAIN):
        prompt = hf(row["prompt"]).input_ids
        full = [hf(row["prompt"] + row[name] + ("" if row[name].endswith(hf.eos_token) else hf.eos_token)).input_ids
                for name in ("chosen", "rejected")]
        assert pairs_of(explicit)[k] == (prompt, full[0][len(prompt):], full[1][len(prompt):])
    ids, targets, (p, c, r) = explicit.item(0)
    assert hf.decode(ids[:p]) == "The sky is" and hf.decode(ids[p:p + c]) == " blue.<|im_end|>"
    assert targets[p:].all() and not targets[:p].any()
    assert hf.decode(pairs_of(explicit)[1][1]) == " four.<|im_end|>"  # ending with the EOS text: not appended again
    # the implicit prompt: the common prefix, the space before the divergence going to the responses
    table = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
             {"chosen": "Two and two make four.<|im_end|>", "rejected": "Two and two make 5."}]
    assert arrays(encode_source(str(write_jsonl(tmp_path / "implicit.jsonl", table)), PAIRS)) == arrays(explicit)


@pytest.mark.parametrize("chosen, rejected, expected", [
    ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
    ("ab", "ac", ("a", "b", "c")),
    ("make four", "make five", ("make f", "our", "ive")),  # by character, whatever the words
    ("abc", "abcd", ("ab", "c", "cd")),  # one a prefix of the other: TRL's loop runs out
    ("abc", "abc", ("ab", "c", "c")),
    ("xbc", "abc", ("", "xbc", "abc")),
    ([1, 2, 3], [1, 2, 4], ([1, 2], [3], [4])),
    ([1, 2], [1, 2, 3], ([1], [2], [2, 3])),
])
def test_the_implicit_prompt_is_trls(chosen, rejected, expected):
    assert extract_prompt(chosen, rejected) == expected


def test_plain_rows_need_only_a_tokenizer(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q:", "chosen": " yes", "rejected": " no<|eos|>"}])
    corpus = encode_source(str(source), ChatSettings("byte", kind="preference"))
    assert pairs_of(corpus) == [(list(b"Q:"), [*b" yes", 257], [*b" no", 257])]
    with pytest.raises(DataError) as excinfo:
        encode_source(str(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONAL[:1])), ChatSettings("byte",
                                                                                                kind="preference"))
    assert re.fullmatch(r"data\.tokenizer: conversational preference rows are rendered with a chat template; set "
                        r"data\.tokenizer to a Hugging Face tokenizer folder with one, or data\.chat_template",
                        one_line(excinfo))


def test_response_targets_are_the_assistant_targets_of_the_response_alone(tmp_path):
    corpus = encode_source(str(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONAL)), PAIRS)
    template = PAIRS.template()
    tok = template.tokenizer
    for k, row in enumerate(CONVERSATIONAL):
        ids, targets, (p, c, r) = corpus.item(k)
        for name, span in (("chosen", slice(p, p + c)), ("rejected", slice(p + c, p + c + r))):
            full, full_targets = template.encode(Conversation(row["prompt"] + row[name], row.get("tools")))
            assert ids[span].tolist() == full[p:].tolist() and targets[span].tolist() == full_targets[p:].tolist()
    ids, targets, (p, c, r) = corpus.item(0)
    assert tok.decode(ids[p:p + c], special=True) == "<think>\n\n</think>\n\nBlue.<|im_end|>\n"
    assert tok.decode(ids[p:p + c][targets[p:p + c]], special=True) == "<think>\n\n</think>\n\nBlue.<|im_end|>"
    # packed: the targets' labels, or with loss_on = "all" every response token's (TRL's rule: the "\n" too)
    for loss_on, expected in (("assistant", targets), ("all", np.r_[np.zeros(p, bool), np.ones(c + r, bool)])):
        dataset = PreferenceDataset(corpus, 1024, "drop", 0, tok.pad_id, loss_on)
        chosen, rejected = trained_labels(dataset)[0]
        assert chosen == ids[p:p + c][expected[p:p + c]].tolist()
        assert rejected == ids[p + c:][expected[p + c:]].tolist()


# ---------------------------------------------------------------------------------------- 2. bad rows

GOOD = {"prompt": [user("Hi?")], "chosen": [assistant("Hi.")], "rejected": [assistant("Go away.")]}
LAST = {"prompt": "Say", "chosen": " yes", "rejected": " no"}
BAD = {
    "no_rejected": ({"prompt": "Q", "chosen": "A"}, r"it has no 'rejected' \(fields: 'prompt', 'chosen'\)"),
    "not_an_object": ("just text", r"it is a str, not an object with 'chosen' and 'rejected'"),
    "mixed": ({"prompt": "Q", "chosen": [assistant("A")], "rejected": [assistant("B")]},
              r"it mixes strings and message lists \(prompt: string, chosen: messages, rejected: messages\)"),
    "not_text": ({"prompt": "Q", "chosen": "A", "rejected": 3}, r"its 'rejected' is a int, not a string or a list"),
    "empty_prompt": ({"prompt": "", "chosen": "A", "rejected": "B"}, r"its 'prompt' is empty"),
    "empty_implicit_prompt": ({"chosen": "Yes.", "rejected": "No."},
                              r"its implicit prompt is empty \(chosen and rejected differ from the start\)"),
    "bad_role": ({**GOOD, "chosen": [{"role": "bot", "content": "A"}]}, r"message 0 has role 'bot'"),
    "no_assistant": ({"prompt": [user("Q")], "chosen": [user("A")], "rejected": [user("B")]},
                     r"prompt \+ chosen: it has no assistant turn"),
    # "t" then "he": BPE merges across the boundary, so the prompt's tokens do not begin prompt + chosen's
    "boundary_merged": ({"prompt": "Say t", "chosen": "he", "rejected": "he"},
                        r"its prompt's 3 tokens are not the first tokens of prompt \+ chosen \(they differ at token 2: "
                        r".*\); TRL would move the boundary, mop refuses the row"),
    # Qwen3 drops the reasoning of assistant turns before the last user turn, which chosen adds
    "rendered_otherwise": ({"prompt": [user("Q"), assistant("A", reasoning_content="R")],
                            "chosen": [user("Q2"), assistant("B")], "rejected": [user("Q2"), assistant("C")]},
                           r"its prompt's \d+ tokens are not the first tokens of prompt \+ chosen"),
    "template_kwargs": ({**GOOD, "chat_template_kwargs": {"enable_thinking": False}},
                        r"it has 'chat_template_kwargs', which mop does not pass to the template"),
    "bad_tools": ({**GOOD, "tools": "[{oops"}, r"its 'tools' is not JSON"),
}


@pytest.fixture(scope="module")
def good_only(tmp_path_factory):
    return arrays(encode_source(str(write_jsonl(tmp_path_factory.mktemp("good") / "g.jsonl", [GOOD, LAST])), PAIRS))


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_row_is_one_line_naming_it_or_skipped(tmp_path, name, good_only):
    row, reason = BAD[name]
    source = write_jsonl(tmp_path / "bad.jsonl", [GOOD, row, LAST])
    with pytest.raises(DataError) as excinfo:
        encode_source(str(source), PAIRS)
    assert re.fullmatch(rf"data\.source: {re.escape(str(source))} row 2: {reason}.*; fix the row, or set "
                        r"data\.skip_invalid = true to count and skip such rows", one_line(excinfo))
    corpus = encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True, kind="preference"))
    assert corpus.skipped == 1 and arrays(corpus) == good_only


def test_degenerate_pairs_are_counted_named_and_dropped_with_skip_invalid(tmp_path, good_only):
    """A pair whose responses are the same tokens (the same message, or strings equal after tokenization)
    is kept and counted (corpus, manifest, `PreferenceDataset.stats`), or dropped as an invalid row."""
    same = [{**GOOD, "rejected": GOOD["chosen"]}, {"prompt": "Say", "chosen": " yes", "rejected": " yes"}]
    source = write_jsonl(tmp_path / "same.jsonl", [GOOD, same[0], LAST, same[1]])
    corpus = encode_source(str(source), PAIRS)
    assert len(corpus.parts) == 4 and corpus.skipped == 0
    assert corpus.degenerate_pairs == 2 and corpus.degenerate_examples == [f"{source} row 2", f"{source} row 4"]
    dataset = PreferenceDataset(corpus, 256, "drop", 0, 0)
    assert dataset.stats["data_degenerate_pairs"] == 2
    out = tmp_path / "prepared"
    manifest = prepare(str(source), PAIRS, str(out), workers=1, progress=False)
    assert (manifest["degenerate_pairs"], manifest["degenerate_examples"]) == (2, corpus.degenerate_examples)
    assert open_prepared(str(out), PAIRS).degenerate_pairs == 2
    skipping = ChatSettings(QWEN3, skip_invalid=True, kind="preference")
    dropped = encode_source(str(source), skipping)
    assert dropped.skipped == 2 and dropped.degenerate_pairs == 0 and arrays(dropped) == good_only
    examples = prepare(str(source), skipping, str(tmp_path / "skipped"), workers=1, progress=False)["skipped_examples"]
    assert [re.fullmatch(rf"{re.escape(str(source))} row ([24]): its chosen and rejected responses are the same \d+ "
                         r"tokens \(a degenerate pair\)", e).group(1) for e in examples] == ["2", "4"]


def test_bad_parquet_rows_are_named_by_row_and_all_counted(tmp_path, good_only):
    table = [{"prompt": "Say", "chosen": " yes", "rejected": " no"}, {"prompt": "Q", "chosen": "A", "rejected": None},
             {"prompt": "", "chosen": "A", "rejected": "B"}, {"prompt": "Say", "chosen": " yes", "rejected": " no"}]
    source = write_parquet(tmp_path / "bad.parquet", table)
    with pytest.raises(DataError, match=rf"data\.source: {re.escape(str(source))} row 2: it has no 'rejected'"):
        encode_source(str(source), PAIRS)
    corpus = encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True, kind="preference"))
    assert corpus.skipped == 2 and len(corpus.parts) == 2
    source = write_jsonl(tmp_path / "all.jsonl", [GOOD, *(row for row, _ in BAD.values()), LAST])
    corpus = encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True, kind="preference"))
    assert corpus.skipped == len(BAD) and arrays(corpus) == good_only


def test_a_response_without_an_assistant_target_is_refused(tmp_path):
    """A template without a generation prompt lets a response be a user turn alone."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    row = {"prompt": [user("Q"), assistant("A")], "chosen": [user("More?")], "rejected": [assistant("B")]}
    with pytest.raises(DataError, match=r"c\.jsonl row 1: its chosen response has no assistant target"):
        encode_source(str(write_jsonl(tmp_path / "c.jsonl", [row])),
                      ChatSettings(QWEN3, chat_template=str(template), kind="preference"))


# ------------------------------------------------------------------------------------------ 3. packing

def random_corpus(seed: int, n: int = 300) -> PreferenceCorpus:
    """Pairs of random lengths, tokens and response targets (each response with at least one)."""
    rng = np.random.default_rng(seed)
    parts = np.stack([rng.integers(1, 40, n), rng.integers(1, 16, n), rng.integers(1, 16, n)], axis=1)
    lengths = parts.sum(1)
    tokens = rng.integers(0, 500, lengths.sum()).astype(np.uint16)
    targets = rng.random(lengths.sum()) < 0.7
    offsets = np.r_[0, np.cumsum(lengths)]
    for k, (p, c, r) in enumerate(parts):
        start = offsets[k]
        targets[start:start + p] = False
        targets[start + p] = targets[start + p + c] = True
    return PreferenceCorpus(tokens, targets, offsets, f"random{seed}", 0, parts=parts)


def kept_prompt(p: int, c: int, r: int, seq_len: int, shared: bool, overlong: str) -> int:
    """The prompt tokens a pair keeps (0: dropped), from the contract's formulas."""
    if (p + c + 1 + r if shared else 2 * p + c + r) <= seq_len:
        return p
    if overlong == "drop":
        return 0
    return max(seq_len - (c + 1 + r) if shared else (seq_len - c - r) // 2, 0)


def expected_row(corpus, items, seq_len: int, shared: bool, loss_on: str, overlong: str, pad_id: int) -> dict:
    """A packed row rebuilt token by token from the contract (the module docstring of mop.data.preference.packing)."""
    row = {key: [] for key in ("input_ids", "labels", "position_ids", "document_ids", "prefix_lengths",
                               "response_ids", "pair_starts")}
    document = 0
    for j, k in enumerate(items):
        p, c, r = (int(n) for n in corpus.parts[k])
        ids = corpus.tokens[corpus.offsets[k]:corpus.offsets[k + 1]].tolist()
        targets = corpus.targets[corpus.offsets[k]:corpus.offsets[k + 1]].tolist()
        kept = kept_prompt(p, c, r, seq_len, shared, overlong)
        prompt = ids[p - kept:p]
        documents = [(prompt, p, c, 0, 0, 2 * j)]  # lead tokens, response start and length, position, prefix, id
        documents.append((prompt[-1:], p + c, r, kept - 1, kept - 1, 2 * j + 1) if shared else
                         (prompt, p + c, r, 0, 0, 2 * j + 1))
        for lead, start, n, position, prefix, response in documents:
            tokens = lead + ids[start:start + n]
            for t, token in enumerate(tokens):
                predicts = len(lead) <= t + 1 < len(tokens)
                trained = predicts and (loss_on == "all" or targets[start + t + 1 - len(lead)])
                for key, value in (("input_ids", token), ("labels", tokens[t + 1] if trained else IGNORE),
                                   ("position_ids", position + t), ("document_ids", document),
                                   ("prefix_lengths", prefix), ("response_ids", response if predicts else -1),
                                   ("pair_starts", response % 2 == 0 and t + 1 == len(lead))):
                    row[key].append(value)
            document += 1
    pad = seq_len - len(row["input_ids"])
    for key, value in (("input_ids", [pad_id] * pad), ("labels", [IGNORE] * pad), ("position_ids", list(range(pad))),
                       ("document_ids", [document] * pad), ("prefix_lengths", [0] * pad), ("response_ids", [-1] * pad),
                       ("pair_starts", [False] * pad)):
        row[key] += value
    row["padding"] = [False] * (seq_len - pad) + [True] * pad
    return row


def trained_labels(dataset: PreferenceDataset) -> dict[int, tuple[list[int], list[int]]]:
    """Each packed pair's labelled chosen and rejected tokens, by corpus item."""
    out = {}
    for i in range(len(dataset)):
        item = dataset[i]
        labels, responses = item["labels"], item["response_ids"]
        labelled = labels != IGNORE
        assert (torch.diff(responses[labelled]) >= 0).all()  # pair after pair, chosen before rejected
        for j, k in enumerate(dataset.pairs_of(i).tolist()):
            out[k] = tuple(labels[labelled & (responses == 2 * j + side)].tolist() for side in (0, 1))
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "unshared"])
@pytest.mark.parametrize("seq_len, overlong, loss_on", [(64, "truncate", "assistant"), (48, "drop", "all")])
def test_packed_rows_follow_the_contract(shared, seq_len, overlong, loss_on):
    corpus = random_corpus(seq_len)
    dataset = PreferenceDataset(corpus, seq_len, overlong, seed=3, pad_id=999, loss_on=loss_on, shared=shared)
    kept = np.array([kept_prompt(*map(int, parts), seq_len, shared, overlong) for parts in corpus.parts])
    over = np.array([(p + c + 1 + r if shared else 2 * p + c + r) > seq_len for p, c, r in corpus.parts])
    assert over.any() and (dataset.stats["data_overlong_truncated"], dataset.stats["data_overlong_dropped"]) == \
        (int((over & (kept > 0)).sum()), int((kept == 0).sum()))
    packed = np.concatenate([dataset.pairs_of(i) for i in range(len(dataset))])
    assert sorted(packed.tolist()) == np.flatnonzero(kept).tolist() == sorted(set(packed.tolist()))
    assert dataset.stats["data_pairs"] == len(packed)
    assert dataset.pairs_max == max(len(dataset.pairs_of(i)) for i in range(len(dataset))) > 1
    for i in range(len(dataset)):
        item = {key: value.tolist() for key, value in dataset[i].items()}
        items = dataset.pairs_of(i).tolist()
        assert item == expected_row(corpus, items, seq_len, shared, loss_on, overlong, 999)
        assert_invariants(dataset[i], corpus, items, shared)


def assert_invariants(item: dict, corpus, items: list[int], shared: bool) -> None:
    """The contract's structural invariants, read off the row alone."""
    documents, prefix, positions, ids = item["document_ids"], item["prefix_lengths"], item["position_ids"], \
        item["input_ids"]
    assert documents.dtype == torch.int32 and item["padding"].dtype == torch.bool
    assert all(item[key].dtype == torch.int64 for key in ("input_ids", "labels", "position_ids", "prefix_lengths",
                                                          "response_ids"))
    assert documents[0] == 0 and set(torch.diff(documents).tolist()) <= {0, 1}
    starts = torch.nonzero(torch.diff(documents, prepend=torch.tensor([-1])))[:, 0].tolist() + [len(documents)]
    real = int((~item["padding"]).sum())
    assert not item["padding"][:real].any() and (real == len(documents) or starts[-2] == real)  # its own document
    for number, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        assert len(set(prefix[a:b].tolist())) == 1  # constant per document
        assert positions[a:b].tolist() == list(range(int(positions[a]), int(positions[a]) + b - a))
        assert item["labels"][b - 1] == IGNORE  # a document's last token predicts nothing
        if a >= real:
            continue
        p, c, r = (int(n) for n in corpus.parts[items[number // 2]])
        if number % 2 == 0 or not shared:  # [P | C] (or unshared [P | R]): positions from 0, no prefix
            assert int(positions[a]) == 0 and int(prefix[a]) == 0
        else:  # the branch, right after its [P | C]: [P[-1] | R] over the prompt's first p' - 1 tokens
            kept = a - starts[number - 1] - c
            assert b - a == 1 + r and 1 <= kept <= p
            assert int(prefix[a]) == int(positions[a]) == kept - 1 and ids[a] == ids[starts[number - 1] + kept - 1]
    assert (prefix[item["padding"]] == 0).all() and (item["response_ids"][item["padding"]] == -1).all()
    assert (item["labels"][item["padding"]] == IGNORE).all()


def test_shared_and_unshared_label_the_same_response_tokens_in_the_same_order():
    corpus = random_corpus(7)
    for loss_on in ("assistant", "all"):
        shared, unshared = (PreferenceDataset(corpus, 128, "drop", 5, 0, loss_on, shared=s) for s in (True, False))
        assert shared.fingerprint != unshared.fingerprint and len(shared) < len(unshared)
        labels = trained_labels(shared)
        assert labels == trained_labels(unshared) and len(labels) == len(corpus.parts)
        for k, (chosen, rejected) in labels.items():
            ids, targets, (p, c, r) = corpus.item(k)
            trained = np.ones(len(ids), bool) if loss_on == "all" else targets
            assert chosen == ids[p:p + c][trained[p:p + c]].tolist()
            assert rejected == ids[p + c:][trained[p + c:]].tolist()


def test_overlong_pairs_are_dropped_or_have_their_prompt_cut_from_the_left():
    parts = np.array([[5, 3, 4], [10, 3, 4], [30, 5, 5], [3, 10, 9], [4, 9, 9]])
    lengths = parts.sum(1)
    tokens = np.concatenate([np.arange(1000 * k, 1000 * k + n) for k, n in enumerate(lengths)]).astype(np.uint16)
    targets = np.concatenate([np.r_[np.zeros(p, bool), np.ones(c + r, bool)] for p, c, r in parts])
    corpus = PreferenceCorpus(tokens, targets, np.r_[0, np.cumsum(lengths)], "overlong", 0, parts=parts)
    # seq_len 20: shared units 13, 18, 41 (keeps 9), 23 (keeps 0), 23 (keeps 1); unshared 17, 27 (keeps 6),
    # 70 (keeps 5), 25 (keeps 0), 26 (keeps 1)
    for shared, kept, fitting, truncated in ((True, [5, 10, 9, 0, 1], [0, 1], 2), (False, [5, 6, 5, 0, 1], [0], 3)):
        dropped = PreferenceDataset(corpus, 20, "drop", 0, 0, shared=shared)
        assert dropped.stats["data_overlong_dropped"] == 5 - len(fitting)
        assert dropped.stats["data_overlong_truncated"] == 0
        assert sorted(np.concatenate([dropped.pairs_of(i) for i in range(len(dropped))]).tolist()) == fitting
        cut = PreferenceDataset(corpus, 20, "truncate", 0, 0, shared=shared)
        assert (cut.stats["data_overlong_dropped"], cut.stats["data_overlong_truncated"]) == (1, truncated)
        assert sorted(np.concatenate([cut.pairs_of(i) for i in range(len(cut))]).tolist()) == [0, 1, 2, 4]
        for i in range(len(cut)):
            row = cut[i]
            for j, k in enumerate(cut.pairs_of(i).tolist()):
                p, c, r = parts[k]
                first = int(torch.nonzero(row["response_ids"] == 2 * j)[0, 0])  # the prompt's last token
                start = first - kept[k] + 1
                assert row["input_ids"][start:first + 1].tolist() == list(range(1000 * k + p - kept[k], 1000 * k + p))
                assert row["position_ids"][start] == 0 and (start == 0 or row["document_ids"][start - 1] <
                                                            row["document_ids"][start])


def test_no_pair_that_fits_is_one_line():
    corpus = random_corpus(1, n=5)
    with pytest.raises(DataError) as excinfo:
        PreferenceDataset(corpus, 3, "truncate", 0, 0)
    assert re.fullmatch(r"data\.source: no preference pair fits data\.seq_len = 3 \(5 dropped as overlong\); raise "
                        r"data\.seq_len or set data\.overlong = 'truncate'", one_line(excinfo))


def test_reference_logps_sit_on_each_responses_first_token():
    corpus = random_corpus(11, n=60)
    for shared in (True, False):
        dataset = PreferenceDataset(corpus, 96, "drop", 0, 0, shared=shared)
        assert "reference_logps" not in dataset[0] and dataset.corpus_pairs == 60
        dataset.reference = np.random.default_rng(0).normal(size=(60, 2))
        for i in range(len(dataset)):
            item = dataset[i]
            reference, responses = item["reference_logps"], item["response_ids"]
            assert reference.dtype == torch.float64 and reference.shape == responses.shape
            expected = torch.zeros_like(reference)
            for j, k in enumerate(dataset.pairs_of(i).tolist()):
                for side in (0, 1):
                    first = int(torch.nonzero(responses == 2 * j + side)[0, 0])
                    expected[first] = dataset.reference[k, side]
                    assert reference[responses == 2 * j + side].sum() == dataset.reference[k, side]
            assert torch.equal(reference, expected)


# --------------------------------------------------------------------------------- 4. prepared folders

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """60 pairs and a bad row (two chunks of the workers'), prepared by the command line: the folder,
    the source and what the command said."""
    root = tmp_path_factory.mktemp("prepared")
    table = [*CONVERSATIONAL, *PLAIN] * 10
    table.insert(30, BAD["empty_prompt"][0])
    source = write_jsonl(root / "src" / "p.jsonl", table)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["data", "prepare", str(source), "--tokenizer", QWEN3, "--out", str(root / "out"), "--format",
                     "preference", "--skip-invalid", "--workers", "1", "--no-progress"]) == 0
    return root / "out", source, said.getvalue()


def test_the_cli_prepares_pairs_as_encode_source_does(prepared):
    out, source, said = prepared
    assert re.fullmatch(r"mop: prepared 60 pairs \(\d+ prompt and \d+ response tokens, 0 degenerate, \d+ targets, 1 skipped\) in "
                        rf"{re.escape(str(out))} in [\d.]+ s \(\d+ tokens/s\); train on it with "
                        rf"--data\.format=preference --data\.source={re.escape(str(out))} "
                        rf"--data\.tokenizer={re.escape(QWEN3)}\n", said)
    settings = ChatSettings(QWEN3, skip_invalid=True, kind="preference")
    encoded, corpus = encode_source(str(source), settings), open_prepared(str(out), settings)
    assert isinstance(corpus, PreferenceCorpus) and isinstance(corpus.tokens, np.memmap)
    assert arrays(corpus) == arrays(encoded) and corpus.skipped == encoded.skipped == 1
    manifest = json.loads((out / MANIFEST).read_text())
    parts = encoded.parts
    assert manifest["format"] == "mop-preference" and manifest["pairs"] == len(parts) == 60
    assert (manifest["prompt_tokens"], manifest["response_tokens"]) == (parts[:, 0].sum(), parts[:, 1:].sum())
    assert manifest["targets"] == encoded.targets.sum() and manifest["longest_unit"] == parts.sum(1).max() + 1
    assert sum(manifest["unit_length_histogram"].values()) == 60
    assert manifest["skipped_examples"] == [f"{source} row 31: its 'prompt' is empty"]


def test_one_prepared_folder_serves_every_seq_len(prepared):
    out, _, _ = prepared
    tok = load_tokenizer(QWEN3)
    options = source_options(DataConfig(source=str(out), tokenizer=QWEN3, format="preference"))
    short, long = (load_dataset(str(out), tok, seq_len, 0, **options) for seq_len in (512, 2048))
    assert isinstance(short, PreferenceDataset) and len(short) > len(long)
    assert trained_labels(short) == trained_labels(long) and len(trained_labels(short)) == 60
    unshared = load_dataset(str(out), tok, 2048, 0, **{**options, "shared_prompt": False})
    assert not unshared.shared and trained_labels(unshared) == trained_labels(long)


def test_a_folder_of_one_kind_is_refused_as_the_other(prepared, tmp_path):
    out, _, _ = prepared
    chat = tmp_path / "chat"
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": [user("Hi?"), assistant("Hi.")]}])
    prepare(str(source), ChatSettings(QWEN3), str(chat), workers=1, progress=False)
    tok = load_tokenizer(QWEN3)
    for folder, kind, settings in ((chat, "chat", PAIRS), (out, "preference", ChatSettings(QWEN3)),
                                   (out, "preference", None)):
        with pytest.raises(DataError) as excinfo:
            load_dataset(str(folder), tok, 256, 0, chat=settings)
        assert one_line(excinfo) == f"data.source: {folder} is a prepared {kind} folder; set data.format = '{kind}'"


def test_build_data_reads_pairs_with_the_byte_tokenizer(tmp_path):
    source = write_jsonl(tmp_path / "p.jsonl", PLAIN * 3)
    d = DataConfig(source=str(source), format="preference", seq_len=128, shared_prompt=False)
    data = build_data(d.source, "byte", d.seq_len, 0, **source_options(d))
    assert isinstance(data.tokenizer, ByteTokenizer) and isinstance(data.dataset, PreferenceDataset)
    assert not data.dataset.shared and data.stream.fingerprint == data.dataset.fingerprint
    assert data.dataset.stats["data_pairs"] == 6
    labelled = trained_labels(data.dataset)
    assert sorted(bytes(c[:-1]).decode() for c, _ in labelled.values()) == \
        sorted([" blue.", " four.<|im_end|>"] * 3)  # EOS is the byte tokenizer's own id: not the text


# -------------------------------------------------------------------------------------------- 5. inspect

def test_inspect_shows_a_pair_with_its_prompt_once(tmp_path, capsys):
    source = write_jsonl(tmp_path / "p.jsonl", [CONVERSATIONAL[0], BAD["empty_prompt"][0]])
    corpus = encode_source(str(write_jsonl(tmp_path / "one.jsonl", CONVERSATIONAL[:1])), PAIRS)
    p, c, r = corpus.parts[0]
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--format", "preference", "--seq-len", "64",
                 "--rows", "2", "--color", "never"]) == 0
    summary = f"── chat template {QWEN3}/tokenizer_config.json: generation prompt '<|im_start|>assistant\\n'\n\n"
    assert capsys.readouterr().out == summary + (
        f"── {source} row 1: pair, prompt {p} tokens, unit {p + c + 1 + r} tokens (the prompt once), fits seq_len 64\n"
        "▸ prompt\n<|im_start|>user\nWhat colour is the sky?<|im_end|>\n<|im_start|>assistant\n"
        f"▸ chosen: {c} tokens, {c - 1} trained\n⟦<think>\n\n</think>\n\nBlue.<|im_end|>⟧\n"
        f"▸ rejected: {r} tokens, {r - 1} trained\n⟦<think>\n\n</think>\n\nGreen.<|im_end|>⟧\n\n"
        f"── {source} row 2: cannot be used: its 'prompt' is empty\n\n")
    seq_len = c + r + 1 + 5  # five prompt tokens fit beside the responses and the branch's repeated token
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--format", "preference", "--seq-len",
                 str(seq_len), "--overlong", "truncate", "--loss-on", "all", "--rows", "1"]) == 0
    kept = load_tokenizer(QWEN3).decode(corpus.item(0)[0][p - 5:p], special=True).removesuffix("\n")
    assert capsys.readouterr().out.startswith(summary +
        f"── {source} row 1: pair, prompt {p} tokens, unit {p + c + 1 + r} tokens (the prompt once), overlong "
        f"({p + c + 1 + r} > seq_len {seq_len}): prompt cut to its last 5 tokens (data.overlong = truncate)\n"
        f"▸ prompt: its last 5 tokens\n{kept}\n▸ chosen: {c} tokens, {c} trained\n")
