"""Chat sources (issue 29): conversations read from jsonl, parquet and `datasets` folders encode alike
(and like transformers' `apply_chat_template` on the rows as read), ShareGPT rows like their messages,
bad rows are one-line errors naming file and row (or counted and skipped, never leaving nothing to
train on), and `mop data prepare` writes what `encode_source` computes, whole or not at all, into a
folder that a run with another tokenizer or template refuses.

Everything uses the shipped Qwen3 assets (`mop/data/assets/qwen3`: its real template, a tiny vocabulary).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import mop
from mop.cli import main
from mop.config import DataConfig
from mop.data import ByteTokenizer, ChatDataset, DataError, load_dataset, load_tokenizer, source_options
from mop.data.conversations import chat_files, conversation, iter_rows
from mop.data.kinds import encode_source, open_prepared, prepare
from mop.data.prepared import MANIFEST, ChatSettings

ASSETS = Path(mop.__file__).parent / "data" / "assets"
QWEN3, GPT_OSS = str(ASSETS / "qwen3"), str(ASSETS / "gpt-oss")
SETTINGS = ChatSettings(QWEN3)

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Apply one operation to two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                    "op": {"type": "string", "enum": ["add", "multiply"]}},
                   "required": ["a", "b", "op"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def rows(n: int = 0) -> list[dict]:
    """Conversations with a system prompt, tool calls (arguments as objects) and their results, a
    `tools` column, reasoning under each of its names and in the content, several turns; `n` (> 0)
    more plain ones after them. The first row has every column: pyarrow's `Table.from_pylist` and
    `datasets.Dataset.from_list` take a table's columns from its first row and drop the others."""
    out = [
        {"messages": [{"role": "system", "content": "You are a calculator."},
                      {"role": "user", "content": "What is (2 + 3) * 4?"},
                      {"role": "assistant", "content": "", "tool_calls": [call("calculator", a=2, b=3, op="add")]},
                      {"role": "tool", "content": "5"},
                      {"role": "assistant", "content": "", "tool_calls": [call("calculator", a=5, b=4, op="multiply"),
                                                                          call("calculator", a=4, b=5, op="multiply")]},
                      {"role": "tool", "content": "20"}, {"role": "tool", "content": "20"},
                      {"role": "assistant", "content": "(2 + 3) * 4 = 20", "reasoning_content": "Both said 20."}],
         "tools": [CALCULATOR]},
        {"messages": [{"role": "user", "content": "What is 7 - 4?"}, {"role": "assistant", "content": "3"}]},
        {"messages": [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "Blue.", "thinking": "Any colour will do."},
                      {"role": "user", "content": "Another one?"},
                      {"role": "assistant", "content": "Green.", "thinking": "Not blue again."}]},
        {"messages": [{"role": "user", "content": "Say hi."},
                      {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHi!"}]},
    ]
    return out + [{"messages": [{"role": "user", "content": f"What is {k} + {k}?"},
                                {"role": "assistant", "content": f"{k} + {k} = {2 * k}"}]} for k in range(n)]


# ------------------------------------------------------------------------------ writers and helpers

def write_jsonl(path: Path, table: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in table), encoding="utf-8")
    return path


def write_parquet(path: Path, table: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(table), path, row_group_size=2)  # several batches
    return path


def write_dataset(path: Path, table: list[dict]) -> Path:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(table).save_to_disk(str(path))
    return path


def write_dataset_dict(path: Path, table: list[dict]) -> Path:
    datasets = pytest.importorskip("datasets")
    held_out = [{"messages": [{"role": "user", "content": "Held out?"}, {"role": "assistant", "content": "Yes."}]}]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(table),
                          "test": datasets.Dataset.from_list(held_out)}).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": lambda d, t: write_jsonl(d / "c.jsonl", t),
           "parquet": lambda d, t: write_parquet(d / "c.parquet", t),
           "datasets": lambda d, t: write_dataset(d / "saved", t),
           "dataset_dict": lambda d, t: write_dataset_dict(d / "saved_dict", t)}


def arrays(corpus) -> tuple:
    return tuple(np.asarray(a).tolist() for a in (corpus.tokens, corpus.targets.astype(bool), corpus.offsets))


def rows_as_read(source: Path) -> list[dict]:
    return [row for path in chat_files(str(source)) for _, row in iter_rows(path)]


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(QWEN3)


def transformers_ids(tokenizer, row: dict) -> list[int]:
    return list(tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True,
                                              return_dict=False))


# ------------------------------------------------------------------------ 1. the same conversations

@pytest.fixture(scope="module")
def from_jsonl(tmp_path_factory):
    return encode_source(str(write_jsonl(tmp_path_factory.mktemp("jsonl") / "c.jsonl", rows())), SETTINGS)


@pytest.mark.parametrize("form", ["parquet", "datasets", "dataset_dict"])
def test_every_form_encodes_like_jsonl(tmp_path, form, from_jsonl, hf_tokenizer):
    source = WRITERS[form](tmp_path, rows())
    corpus = encode_source(str(source), SETTINGS)
    assert arrays(corpus) == arrays(from_jsonl)
    assert len(corpus.offsets) == len(rows()) + 1 and corpus.skipped == 0 and corpus.targets.any()
    # tool calls and tools came back as structs (a key a message lacks as None), rendered alike
    read = rows_as_read(source)
    assert read[0]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 3, "op": "add"}
    assert read[0]["messages"][1]["tool_calls"] is None and read[1]["tools"] is None
    for k, row in enumerate(read):
        assert corpus.tokens[corpus.offsets[k]:corpus.offsets[k + 1]].tolist() == transformers_ids(hf_tokenizer, row)


def test_jsonl_tokens_equal_transformers(from_jsonl, hf_tokenizer):
    for k, row in enumerate(rows()):
        assert from_jsonl.tokens[from_jsonl.offsets[k]:from_jsonl.offsets[k + 1]].tolist() == \
            transformers_ids(hf_tokenizer, row)


def test_reasoning_in_the_content_is_masked_like_reasoning_content(tmp_path, hf_tokenizer):
    """Qwen3's template splits a `<think>` block off the content, and the perturbation's opening
    marker with it: the turn is still found (the renderings differ by an insertion only)."""
    def conversation_with(first: dict, last: dict) -> dict:
        return {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", **first},
                             {"role": "user", "content": "Again?"}, {"role": "assistant", **last}]}

    inline = conversation_with({"content": "<think>\nA greeting.\n</think>\n\nHi!"},
                               {"content": "<think>\nStill one.\n</think>\n\nHi again!"})
    fields = conversation_with({"content": "Hi!", "reasoning_content": "A greeting."},
                               {"content": "Hi again!", "reasoning_content": "Still one."})
    corpus = encode_source(str(write_jsonl(tmp_path / "c.jsonl", [inline, fields])), SETTINGS)
    (tokens, targets), end = ((np.asarray(corpus.tokens), corpus.targets), corpus.offsets[1])
    assert tokens[:end].tolist() == tokens[end:].tolist() == transformers_ids(hf_tokenizer, inline)
    assert targets[:end].tolist() == targets[end:].tolist()
    # the earlier turn's reasoning is not rendered; the last turn's think block is the model's own
    assert hf_tokenizer.decode(tokens[:end][targets[:end]].tolist()) == \
        "Hi!<|im_end|><think>\nStill one.\n</think>\n\nHi again!<|im_end|>"


def test_a_dataset_dict_is_read_through_its_train_split(tmp_path):
    source = write_dataset_dict(tmp_path / "saved_dict", rows())
    assert chat_files(str(source)) == chat_files(str(source / "train"))
    shutil.rmtree(source / "train")
    with pytest.raises(DataError, match=r"data\.source: .*saved_dict is a DatasetDict without a 'train' split"):
        encode_source(str(source), SETTINGS)


def test_struct_columns_give_every_row_the_union_of_keys(tmp_path, hf_tokenizer):
    """Tool calls whose arguments have different keys (and tools whose parameters do), in parquet or
    Arrow, come back with every key of the column, None where a row had none: the template then
    renders them as `null`, as transformers does on the rows as read, unlike the jsonl rows. Arguments
    and tools stored as JSON strings keep each row's own keys (conversations.py's docstring)."""
    table = [{"messages": [{"role": "user", "content": "Add 2 and 3."},
                           {"role": "assistant", "content": "", "tool_calls": [call("calculator", a=2, b=3, op="add")]},
                           {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5."}],
              "tools": [CALCULATOR, SEARCH]},
             {"messages": [{"role": "user", "content": "Find cats."},
                           {"role": "assistant", "content": "", "tool_calls": [call("search", query="cats")]},
                           {"role": "tool", "content": "Cats purr."}, {"role": "assistant", "content": "They purr."}],
              "tools": [CALCULATOR, SEARCH]}]
    jsonl = encode_source(str(write_jsonl(tmp_path / "c.jsonl", table)), SETTINGS)
    parquet = write_parquet(tmp_path / "c.parquet", table)
    read = rows_as_read(parquet)
    assert read[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == \
        {"a": None, "b": None, "op": None, "query": "cats"}
    assert read[1]["tools"][1]["function"]["parameters"]["properties"]["a"] is None
    reordered = [{"args": {"a": 1, "b": 2}}, {"args": {"b": 3, "a": 4.5}}]  # one key order, one type per key
    assert [json.dumps(r["args"]) for r in rows_as_read(write_parquet(tmp_path / "r.parquet", reordered))] == \
        ['{"a": 1.0, "b": 2}', '{"a": 4.5, "b": 3}']
    corpus = encode_source(str(parquet), SETTINGS)
    for k, row in enumerate(read):
        assert corpus.tokens[corpus.offsets[k]:corpus.offsets[k + 1]].tolist() == transformers_ids(hf_tokenizer, row)
    assert arrays(corpus) != arrays(jsonl)
    rendered = hf_tokenizer.decode(corpus.tokens[corpus.offsets[1]:corpus.offsets[2]].tolist())
    assert '"arguments": {"a": null, "b": null, "op": null, "query": "cats"}' in rendered
    # the remedy: JSON strings, which the template writes as they are
    as_strings = [{"messages": [dict(m, tool_calls=[{"type": "function", "function": {
                      "name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                      for c in m["tool_calls"]]) if "tool_calls" in m else m for m in row["messages"]],
                   "tools": json.dumps(row["tools"])} for row in table]
    assert arrays(encode_source(str(write_parquet(tmp_path / "s.parquet", as_strings)), SETTINGS)) == arrays(jsonl)


# ----------------------------------------------------------------------------------------- 2. ShareGPT

def test_sharegpt_rows_encode_like_their_messages(tmp_path):
    share = [{"conversations": [{"from": "system", "value": "Answer briefly."}, {"from": "human", "value": "Hi?"},
                                {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "And 1 + 1?"},
                                {"from": "gpt", "value": "2"}]},
             {"conversations": [{"from": "human", "value": "Name a fruit."}, {"from": "gpt", "value": "A pear."}]}]
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    messages = [{"messages": [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]}
                for row in share]
    expected = arrays(encode_source(str(write_jsonl(tmp_path / "m.jsonl", messages)), SETTINGS))
    assert arrays(encode_source(str(write_jsonl(tmp_path / "s.jsonl", share)), SETTINGS)) == expected
    assert arrays(encode_source(str(write_parquet(tmp_path / "s.parquet", share)), SETTINGS)) == expected
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [share[0], messages[1]])
    assert arrays(encode_source(str(mixed), SETTINGS)) == expected


# -------------------------------------------------------------------------------------- 3. bad input

GOOD = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]}
LAST = {"messages": [{"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Bye."}]}


@dataclass(frozen=True)
class Bad:
    name: str
    row: dict
    reason: str  # a regex of what the message says is wrong with the row


BAD_ROWS = [
    Bad("no_messages", {"text": "a document, not a conversation"},
        r"it has no 'messages' or 'conversations' \(fields: 'text'\)"),  # parquet's null 'messages' not named
    Bad("unknown_role", {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hi"}]},
        r"message 1 has role 'bot'; roles are system, developer, user, assistant, tool"),
    Bad("unknown_from", {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Hi"}]},
        r"conversations entry 1 is from 'robot'; ShareGPT roles are human"),
    Bad("no_assistant", {"messages": [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}]},
        r"it has no assistant turn"),
    Bad("tools_not_a_list", {**GOOD, "tools": {"type": "function", "function": {"name": "f"}}},
        r"its 'tools' is not a list of JSON schemas"),
]


def write_with_bad(directory: Path, form: str, bad: dict) -> tuple[Path, str]:
    """A source of [GOOD, bad, LAST] and where its bad row is said to be."""
    if form == "jsonl":
        path = write_jsonl(directory / "bad.jsonl", [GOOD, bad, LAST])
        return path, f"{path} row 2"
    keys = {**GOOD, **bad, **LAST}  # the first row has every column (see `rows`)
    path = write_parquet(directory / "bad.parquet", [{k: GOOD.get(k) for k in keys}, bad, LAST])
    return path, f"{path} row 2"


@pytest.fixture(scope="module")
def good_only(tmp_path_factory):
    return arrays(encode_source(str(write_jsonl(tmp_path_factory.mktemp("good") / "g.jsonl", [GOOD, LAST])), SETTINGS))


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
@pytest.mark.parametrize("bad", BAD_ROWS, ids=lambda b: b.name)
def test_a_bad_row_is_one_line_naming_it_or_skipped(tmp_path, form, bad, good_only):
    source, where = write_with_bad(tmp_path, form, bad.row)
    with pytest.raises(DataError) as excinfo:
        encode_source(str(source), SETTINGS)
    assert re.fullmatch(rf"data\.source: {re.escape(where)}: {bad.reason}.*; fix the row, or set "
                        r"data\.skip_invalid = true to count and skip such rows", one_line_error(excinfo))
    corpus = encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True))
    assert corpus.skipped == 1 and arrays(corpus) == good_only


def test_every_bad_kind_in_one_file_is_counted(tmp_path, good_only):
    source = write_jsonl(tmp_path / "bad.jsonl", [GOOD, *(b.row for b in BAD_ROWS), LAST])
    corpus = encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True))
    assert corpus.skipped == len(BAD_ROWS) and arrays(corpus) == good_only


def test_a_sharegpt_from_that_is_no_string(tmp_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"conversations": [{"from": ["human"], "value": "Hi"},
                                                                           {"from": "gpt", "value": "Hi"}]}])
    with pytest.raises(DataError, match=r"bad\.jsonl row 2: conversations entry 0 is from \['human'\]; ShareGPT roles"):
        encode_source(str(source), SETTINGS)
    assert encode_source(str(source), ChatSettings(QWEN3, skip_invalid=True)).skipped == 1


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_a_source_of_bad_rows_only_is_still_an_error(tmp_path, form):
    only_bad = write_jsonl(tmp_path / "only.jsonl", [b.row for b in BAD_ROWS]) if form == "jsonl" else \
        write_parquet(tmp_path / "only.parquet", [BAD_ROWS[3].row, BAD_ROWS[3].row])
    with pytest.raises(DataError) as excinfo:
        encode_source(str(only_bad), ChatSettings(QWEN3, skip_invalid=True))
    count = len(BAD_ROWS) if form == "jsonl" else 2
    assert re.fullmatch(rf"data\.source = '{re.escape(str(only_bad))}' holds no usable conversation \({count} "
                        rf"skipped, e\.g\. {re.escape(str(only_bad))} row 1: .*\); point it at conversations "
                        "with assistant turns", one_line_error(excinfo))


def test_a_template_that_fails_to_render(tmp_path):
    template = tmp_path / "boom.jinja"
    template.write_text("{{ raise_exception('boom') }}")
    source = write_jsonl(tmp_path / "c.jsonl", [GOOD, LAST])
    with pytest.raises(DataError) as excinfo:
        encode_source(str(source), ChatSettings(QWEN3, chat_template=str(template)))
    assert re.fullmatch(rf"data\.source: {re.escape(str(source))} row 1: the chat template {re.escape(str(template))} "
                        r"fails to render it \(boom\); fix the row, or set data\.skip_invalid = true .*",
                        one_line_error(excinfo))
    with pytest.raises(DataError, match=r"holds no usable conversation \(2 skipped, e\.g\. .*c\.jsonl row 1: the chat "
                                        r"template .*boom\.jinja fails to render it \(boom\)\)"):
        encode_source(str(source), ChatSettings(QWEN3, chat_template=str(template), skip_invalid=True))


def test_a_template_with_a_syntax_error(tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{% for message in messages %}{{ message.content }}\n")
    with pytest.raises(DataError) as excinfo:
        encode_source(str(write_jsonl(tmp_path / "c.jsonl", [GOOD])), ChatSettings(QWEN3, chat_template=str(template)))
    assert re.fullmatch(rf"data\.chat_template: {re.escape(str(template))} is not a valid Jinja template "
                        r"\(.*'endfor'.*, line \d+\); fix the template", one_line_error(excinfo))
    with pytest.raises(DataError, match=r"data\.chat_template: .*missing\.jinja is not a file"):
        encode_source(str(tmp_path / "c.jsonl"), ChatSettings(QWEN3, chat_template=str(tmp_path / "missing.jinja")))


def test_a_tokenizer_folder_without_a_chat_template(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(ASSETS / "qwen3" / "tokenizer.json", folder)
    with pytest.raises(DataError) as excinfo:
        encode_source(str(write_jsonl(tmp_path / "c.jsonl", [GOOD])), ChatSettings(str(folder)))
    assert re.fullmatch(rf"data\.tokenizer: {re.escape(str(folder))} has no chat template .*; set data\.chat_template "
                        "to a template file", one_line_error(excinfo))
    # its own template file makes it usable
    template = tmp_path / "t.jinja"
    template.write_text(json.loads((ASSETS / "qwen3" / "tokenizer_config.json").read_text())["chat_template"])
    own = ChatSettings(str(folder), chat_template=str(template))
    assert encode_source(str(tmp_path / "c.jsonl"), own).targets.any()


def test_missing_and_unreadable_sources(tmp_path):
    with pytest.raises(DataError) as excinfo:
        encode_source(str(tmp_path / "nowhere.jsonl"), SETTINGS)
    assert re.fullmatch(rf"data\.source: {re.escape(str(tmp_path / 'nowhere.jsonl'))} does not exist; point "
                        r"data\.source at .*", one_line_error(excinfo))
    (tmp_path / "c.jsonl").write_text(json.dumps(GOOD) + "\n{oops\n")
    with pytest.raises(DataError, match=r"data\.source: .*c\.jsonl row 2: it is not valid JSON"):
        encode_source(str(tmp_path / "c.jsonl"), SETTINGS)
    assert encode_source(str(tmp_path / "c.jsonl"), ChatSettings(QWEN3, skip_invalid=True)).skipped == 1
    (tmp_path / "c.txt").write_text("text")
    with pytest.raises(DataError, match=r"data\.source: .*c\.txt has extension '\.txt'"):
        encode_source(str(tmp_path / "c.txt"), SETTINGS)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data\.source: .*empty holds no \.jsonl/\.parquet files"):
        encode_source(str(tmp_path / "empty"), SETTINGS)


def test_tools_as_a_string(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{**GOOD, "tools": json.dumps([CALCULATOR])}])
    assert arrays(encode_source(str(good), SETTINGS)) == \
        arrays(encode_source(str(write_jsonl(tmp_path / "dict.jsonl", [{**GOOD, "tools": [CALCULATOR]}])), SETTINGS))
    for tools, reason in (("[{oops", r"its 'tools' is not JSON"), (json.dumps({"a": 1}), r"its 'tools' is not a list")):
        with pytest.raises(DataError, match=rf"bad\.jsonl row 1: {reason}"):
            encode_source(str(write_jsonl(tmp_path / "bad.jsonl", [{**GOOD, "tools": tools}])), SETTINGS)


def test_the_byte_tokenizer_cannot_read_chat(tmp_path):
    source = str(write_jsonl(tmp_path / "c.jsonl", [GOOD]))
    options = source_options(DataConfig(source=source, format="chat"))
    with pytest.raises(DataError) as excinfo:
        load_dataset(source, ByteTokenizer(), 64, 0, **options)
    assert re.fullmatch(r"data\.tokenizer: chat data needs a Hugging Face tokenizer folder .*; set data\.tokenizer "
                        "to one", one_line_error(excinfo))


# ------------------------------------------------------------------------------------ 4. prepared

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A source of 150 conversations (3 chunks of the workers') with one bad row, prepared with 2 workers
    into an existing empty folder, and the same source encoded in this process."""
    root = tmp_path_factory.mktemp("prepared")
    table = rows(146)
    table.insert(100, {"messages": [{"role": "user", "content": "No answer."}]})
    source = write_jsonl(root / "src" / "c.jsonl", table)
    settings = ChatSettings(QWEN3, skip_invalid=True)
    (root / "out").mkdir()
    manifest = prepare(str(source), settings, str(root / "out"), workers=2, progress=False)
    return root / "out", manifest, encode_source(str(source), settings)


def test_prepare_writes_what_encode_source_computes(prepared):
    out, manifest, encoded = prepared
    assert json.loads((out / MANIFEST).read_text()) == manifest
    corpus = open_prepared(str(out), SETTINGS)
    assert isinstance(corpus.tokens, np.memmap) and corpus.tokens.dtype == np.uint16
    assert arrays(corpus) == arrays(encoded)
    assert corpus.skipped == encoded.skipped == manifest["skipped"] == 1
    assert manifest["skipped_examples"] == [f"{out.parent / 'src' / 'c.jsonl'} row 101: it has no assistant turn"]
    lengths = np.diff(encoded.offsets)
    assert manifest["conversations"] == len(lengths) == 150
    assert manifest["tokens"] == len(encoded.tokens) and manifest["targets"] == int(encoded.targets.sum())
    assert manifest["longest"] == lengths.max() and sum(manifest["length_histogram"].values()) == 150
    assert sorted(p.name for p in out.parent.iterdir()) == ["out", "src"]  # no partial folder left


def test_a_prepared_folder_trains_as_chat_only(prepared):
    out, manifest, _ = prepared
    tok = load_tokenizer(QWEN3)
    dataset = load_dataset(str(out), tok, 512, 0, chat=SETTINGS)
    assert isinstance(dataset, ChatDataset) and dataset.stats["data_conversations"] == manifest["conversations"]
    assert dataset.stats["data_skipped_invalid"] == 1
    with pytest.raises(DataError) as excinfo:
        load_dataset(str(out), tok, 512, 0, chat=None)
    assert re.fullmatch(rf"data\.source: {re.escape(str(out))} is a prepared chat folder; set data\.format = 'chat'",
                        one_line_error(excinfo))


def test_a_prepared_folder_refuses_other_settings(prepared, tmp_path):
    out, _, _ = prepared
    template = json.loads((ASSETS / "qwen3" / "tokenizer_config.json").read_text())["chat_template"]
    same, changed = tmp_path / "same.jinja", tmp_path / "changed.jinja"
    same.write_text(template)
    changed.write_text(template.replace("<|im_start|>assistant\\n", "<|im_start|>assistant \\n"))
    assert open_prepared(str(out), ChatSettings(QWEN3, chat_template=str(same))).targets.any()  # same text: accepted
    for settings, what, setting in ((ChatSettings(GPT_OSS), "tokenizer", "data.tokenizer"),
                                    (ChatSettings(QWEN3, chat_template=str(changed)), "chat template",
                                     "data.chat_template")):
        with pytest.raises(DataError) as excinfo:
            open_prepared(str(out), settings)
        assert re.fullmatch(rf"data\.source: {re.escape(str(out))} was prepared with another {what} than this run's "
                            rf"{re.escape(setting)} \(.* there, .* here\); set {re.escape(setting)} to the one it was "
                            "prepared with, or prepare the source again", one_line_error(excinfo))


def test_a_folder_prepared_with_the_earlier_targets_is_refused(prepared, tmp_path):
    out, manifest, _ = prepared
    earlier = tmp_path / "earlier"
    shutil.copytree(out, earlier)
    old = {key: value for key, value in manifest.items() if key != "targets_version"}  # issue 29's manifests
    (earlier / MANIFEST).write_text(json.dumps(old))
    with pytest.raises(DataError) as excinfo:
        open_prepared(str(earlier), SETTINGS)
    assert re.fullmatch(rf"data\.source: {re.escape(str(earlier))} was prepared with mop's earlier assistant targets "
                        r"\(version 1, now 4: tool calls from their opening text, turns found without special tokens; no token of a "
                        r"generation prompt that opens a think block is trained; no text a template writes after the last "
                        r"turn's end \(an eos token, the next header\) is trained\); prepare it again with mop data prepare",
                        one_line_error(excinfo))


def test_prepare_never_writes_into_a_non_empty_folder(tmp_path):
    source = write_jsonl(tmp_path / "src" / "c.jsonl", [GOOD])
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError) as excinfo:
        prepare(str(source), SETTINGS, str(out), workers=1, progress=False)
    assert re.fullmatch(rf"--out: {re.escape(str(out))} exists and is not empty; choose a new folder .*",
                        one_line_error(excinfo))
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_the_cli_prepares(tmp_path, capsys):
    source = write_jsonl(tmp_path / "src" / "c.jsonl", rows())
    out = tmp_path / "out"
    assert main(["data", "prepare", str(source), "--tokenizer", QWEN3, "--out", str(out), "--workers", "1",
                 "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert re.fullmatch(r"mop: prepared 4 conversations \(\d+ tokens, \d+ targets, 0 skipped\) in "
                        rf"{re.escape(str(out))} in [\d.]+ s \(\d+ tokens/s\); train on it with --data\.format=chat "
                        rf"--data\.source={re.escape(str(out))} --data\.tokenizer={re.escape(QWEN3)}\n", captured.out)
    assert arrays(open_prepared(str(out), SETTINGS)) == arrays(encode_source(str(source), SETTINGS))


def test_the_cli_stops_at_a_bad_row_leaving_nothing(tmp_path, capsys):
    """The bad row is in the second chunk, so the first was already written to the partial folder."""
    table = rows(70)
    table.insert(70, {"messages": [{"role": "robot", "content": "beep"}]})
    source = write_jsonl(tmp_path / "src" / "c.jsonl", table)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(source), "--tokenizer", QWEN3, "--out", str(out), "--workers", "1",
                 "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(rf"mop: error: data\.source: {re.escape(str(source))} row 71: message 0 has role 'robot'; .*; fix "
                        r"the row, or set data\.skip_invalid = true to count and skip such rows\n", captured.err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # neither --out nor its partial folder


def trained_by_training(tmp_path, row: dict, seq_len: int, overlong: str = "drop", loss_on: str = "assistant"):
    """What training does with one conversation: its labels' count and the tokens it keeps."""
    source = write_jsonl(tmp_path / "alone" / "c.jsonl", [row])
    dataset = ChatDataset(encode_source(str(source), SETTINGS), seq_len, overlong, seed=0, pad_id=0, loss_on=loss_on)
    labels = sum(int((dataset[i]["labels"] != -100).sum()) for i in range(len(dataset)))
    return labels, int(dataset.packing.lengths.sum())


def without_summary(shown: str) -> str:
    """`mop data inspect`'s output less its first block, the line on the chat template."""
    assert shown.startswith("── chat template ")
    return shown.split("\n\n", 1)[1]


def test_inspect_shows_rows_as_training_sees_them(tmp_path, capsys):
    source = write_jsonl(tmp_path / "c.jsonl", [GOOD, {"messages": [{"role": "user", "content": "No answer."}]},
                                                 LAST])
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--rows", "2", "--seq-len", "64"]) == 0
    shown = capsys.readouterr().out
    count, tokens = trained_by_training(tmp_path, GOOD, 64)
    assert shown == (f"── chat template {QWEN3}/tokenizer_config.json: generation prompt '<|im_start|>assistant\\n'\n\n"
                     f"── {source} row 1: {tokens} tokens, {count} trained ({count / tokens:.0%}), fits seq_len 64\n"
                     "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n"
                     "⟦<think>\n\n</think>\n\nHello.<|im_end|>⟧\n\n"
                     f"── {source} row 2: cannot be used: it has no assistant turn\n\n")
    with pytest.raises(SystemExit) as excinfo:
        main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--rows", "0"])
    assert excinfo.value.code == 2
    assert capsys.readouterr().err == ("mop: error: argument --rows: '0' is not a positive number of rows; see mop "
                                       "data inspect --help\n")


def test_inspect_says_what_happens_to_an_overlong_row_and_colours_on_request(tmp_path, capsys):
    row = {"messages": GOOD["messages"] + LAST["messages"]}
    source = write_jsonl(tmp_path / "c.jsonl", [row])
    ids, targets = SETTINGS.template().encode(conversation(row))
    first_end = int(np.flatnonzero(targets)[0]) + int(np.argmin(targets[np.flatnonzero(targets)[0]:]))
    seq_len = first_end + 2  # room for the first answer, not the second
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--seq-len", str(seq_len), "--overlong",
                 "truncate", "--color", "always"]) == 0
    header, text = without_summary(capsys.readouterr().out).split("\n", 1)
    count, kept = trained_by_training(tmp_path, row, seq_len, "truncate")
    assert kept == first_end
    assert header == (f"── {source} row 1: {len(ids)} tokens, {count} trained ({count / len(ids):.0%}), overlong "
                      f"({len(ids)} > seq_len {seq_len}): truncated to its first {kept} tokens (data.overlong = "
                      "truncate)")
    assert text.count("\x1b[1;32m") == 1 and "⟦" not in text  # the second answer is cut off: not trained
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--seq-len", str(seq_len)]) == 0
    assert "0 trained (0%), overlong" in capsys.readouterr().out.replace("): dropped (data.overlong = drop)", "")


def test_inspect_reads_a_prepared_folder_as_its_source(prepared, capsys):
    out, _, _ = prepared
    source = out.parent / "src" / "c.jsonl"
    assert main(["data", "inspect", str(source), "--tokenizer", QWEN3, "--rows", "3"]) == 0
    from_source = without_summary(capsys.readouterr().out).split("── ")[1:]
    assert main(["data", "inspect", str(out), "--tokenizer", QWEN3, "--rows", "3"]) == 0
    from_folder = without_summary(capsys.readouterr().out).split("── ")[1:]
    assert len(from_source) == len(from_folder) == 3
    for k, (shown, folder_shown) in enumerate(zip(from_source, from_folder)):
        assert folder_shown == shown.replace(f"{source} row {k + 1}:", f"{out} conversation {k + 1}:", 1)
    assert main(["data", "inspect", str(out), "--tokenizer", QWEN3, "--rows", "1", "--loss-on", "all",
                 "--seq-len", "4096"]) == 0
    header, text = without_summary(capsys.readouterr().out).split("\n", 1)
    count, tokens = trained_by_training(out.parent, json.loads(source.read_text().splitlines()[0]), 4096, loss_on="all")
    assert f"{tokens} tokens, {count} trained" in header and text.startswith("<|im_start|>⟦")
