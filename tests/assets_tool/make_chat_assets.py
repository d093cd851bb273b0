#!/usr/bin/env python3
"""Regenerate mop's shipped chat assets (issue 29): a conversation set and two tiny tokenizer folders.

What it writes (byte for byte the shipped files; run it twice and nothing changes):

- ``mop/data/corpus/conversations.jsonl``: a few hundred short conversations, one JSON object a
  line, ``{"messages": [{"role", "content", ...}], "tools": [...]?}`` in the OpenAI / Hugging Face
  form. Every answer is a simple function of the prompt (repeat the first sentence of a passage
  from ``corpus.jsonl``, write a phrase in capitals, count words, reverse or sort a list, name a
  text's title, do a sum), so a tiny model's loss falls visibly in a few hundred steps. Some rows
  have a system prompt; some have 2-4 user turns; some call tools (assistant ``tool_calls`` in the
  HF form, then ``{"role": "tool"}`` results, then a final answer; the row carries the JSON
  schemas as a top-level ``tools`` list); some assistant turns carry reasoning in both
  ``reasoning_content`` (what Qwen3's template reads) and ``thinking`` (what gpt-oss's reads),
  with the same text. A few conversations hold whole documents (up to ~1,500 tokens).
- ``mop/data/assets/qwen3/{tokenizer.json, tokenizer_config.json}``: the Qwen3 layout, with the real
  Qwen3 chat template as ``chat_template`` in ``tokenizer_config.json``.
- ``mop/data/assets/gpt-oss/{tokenizer.json, tokenizer_config.json, chat_template.jinja}``: the
  gpt-oss layout, with the real harmony template in ``chat_template.jinja``.

The two tokenizers share one tiny vocabulary: a byte-level BPE (the 256-symbol byte alphabet plus
``N_MERGES`` merges learnt by the ``tokenizers`` library's BPE trainer on the conversations as the
two templates render them, their special tokens cut out)
followed by the model's special tokens as added tokens, in the model's own order and with its
special / non-special flags (Qwen3: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` ... special,
``<tool_call>``, ``<think>`` ... not; gpt-oss: ``<|startoftext|>`` ... ``<|endofprompt|>``, all
special, reserved slots included). The ids are small, not the real ones.

The chat templates are data copied verbatim from upstream (see ``mop/data/assets/README.md``),
not generated: this script reads them (by default from the shipped files themselves, or from
``--qwen3-template`` / ``--gpt-oss-template``, e.g. llama.cpp's ``models/templates/
Qwen-Qwen3-0.6B.jinja`` and ``openai-gpt-oss-120b.jinja``) and refuses any whose sha256 is not the
upstream one, so a template is never edited by accident.

Usage (from the repository root)::

    .venv/bin/python tests/assets_tool/make_chat_assets.py            # rewrite the shipped files
    .venv/bin/python tests/assets_tool/make_chat_assets.py --check    # exit 1 if any would change

Needs ``tokenizers`` (a mop dependency) and ``jinja2`` (installed with transformers, mop's ``test``
extra); nothing is downloaded.
"""

import argparse
import hashlib
import json
import os
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "mop" / "data" / "corpus" / "corpus.jsonl"
CONVERSATIONS = ROOT / "mop" / "data" / "corpus" / "conversations.jsonl"
ASSETS = ROOT / "mop" / "data" / "assets"

# sha256 of the upstream template bytes (see mop/data/assets/README.md for where they come from).
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
GPT_OSS_TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

SEED = 29
N_MERGES = 300

# Qwen3's added tokens (Qwen/Qwen3-30B-A3B tokenizer_config.json, ids 151643-151668), in id order.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
QWEN3_ADDITIONAL_SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
# gpt-oss's added tokens (openai/gpt-oss-120b tokenizer_config.json, ids 199998-200018), in id order.
GPT_OSS_ADDED = [
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>",
    "<|return|>", "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>",
    "<|call|>", "<|reserved_200013|>", "<|reserved_200014|>", "<|reserved_200015|>",
    "<|reserved_200016|>", "<|reserved_200017|>", "<|endofprompt|>",
]

TOOLS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Apply one operation to two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "integer", "description": "The second number."},
                    "op": {"type": "string", "enum": ["add", "subtract", "multiply"],
                           "description": "The operation."},
                },
                "required": ["a", "b", "op"],
            },
        },
    },
    "word_count": {
        "type": "function",
        "function": {
            "name": "word_count",
            "description": "Count the words in a text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": "The text to count."},
                    "unique": {"type": "boolean", "description": "Count repeated words once.",
                               "default": False},
                },
                "required": ["text"],
            },
        },
    },
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful assistant. Answer briefly and exactly.",
    "You are a text tool. Reply with the answer only.",
    "You help with short text tasks. Keep every answer to one line.",
]

OPS = {"add": ("+", "plus", lambda a, b: a + b), "subtract": ("-", "minus", lambda a, b: a - b),
       "multiply": ("*", "times", lambda a, b: a * b)}


# ---------------------------------------------------------------------------------------------
# Text pieces from the corpus
# ---------------------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r'(?<=[.!?])\s+(?=["A-Z])|(?<=[.!?]")\s+(?=["A-Z])')


def sentences(paragraph):
    return [s.strip() for s in _SENTENCE_END.split(paragraph.strip()) if s.strip()]


def words_of(text):
    return [w for w in re.findall(r"[A-Za-z]+", text)]


class Corpus:
    def __init__(self, path):
        self.docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip()]
        self.titled = []  # (title, body paragraphs)
        self.paragraphs = []
        for doc in self.docs:
            parts = [p.strip() for p in doc.split("\n\n") if p.strip()]
            first = parts[0]
            if len(parts) > 1 and len(first) < 80 and "\n" not in first and not first.endswith("."):
                self.titled.append((first, parts[1:]))
                body = parts[1:]
            else:
                body = parts
            self.paragraphs += [p for p in body if 100 <= len(p) <= 450 and len(sentences(p)) >= 2]
        self.sentences = [s for p in self.paragraphs for s in sentences(p)
                          if 4 <= len(s.split()) <= 24 and s.count('"') % 2 == 0]
        vocab = sorted({w.lower() for p in self.paragraphs for w in words_of(p) if 3 <= len(w) <= 9})
        self.words = vocab


# ---------------------------------------------------------------------------------------------
# Tasks: (prompt, answer, reasoning)
# ---------------------------------------------------------------------------------------------

def task_first_sentence(rng, c):
    p = rng.choice(c.paragraphs)
    s = sentences(p)[0]
    prompt = rng.choice(["Repeat the first sentence of this passage.\n\n{p}",
                         "{p}\n\nWhat is the first sentence of the passage above?",
                         "Here is a passage:\n\n{p}\n\nCopy its first sentence."]).format(p=p)
    return prompt, s, f"The passage starts with: {s}"


def task_upper(rng, c):
    s = rng.choice(c.sentences)
    ws = s.split()
    n = rng.randint(2, min(6, len(ws)))
    i = rng.randint(0, len(ws) - n)
    phrase = " ".join(w.strip('",.;:!?()') for w in ws[i:i + n])
    prompt = rng.choice(["Write this phrase in capital letters: {x}",
                         "Uppercase the following: {x}",
                         "Make every letter a capital: {x}"]).format(x=phrase)
    return prompt, phrase.upper(), f"Each letter of \"{phrase}\" becomes a capital."


def task_count_words(rng, c):
    s = rng.choice(c.sentences)
    n = len(s.split())
    prompt = rng.choice(["How many words are in this sentence? {s}",
                         "Count the words: {s}"]).format(s=s)
    listing = ", ".join(f"{k + 1} {w}" for k, w in enumerate(s.split()))
    return prompt, f"{n} words.", f"Counting: {listing}. That is {n}."


def task_reverse_list(rng, c):
    items = rng.sample(c.words, rng.randint(3, 6))
    prompt = rng.choice(["Reverse this list: {l}", "Write these in reverse order: {l}"]).format(
        l=", ".join(items))
    return prompt, ", ".join(reversed(items)), f"The last item is {items[-1]}, so it goes first."


def task_sort_list(rng, c):
    items = rng.sample(c.words, rng.randint(3, 6))
    prompt = "Sort these words alphabetically: " + ", ".join(items)
    out = ", ".join(sorted(items))
    return prompt, out, f"In alphabetical order the first is {sorted(items)[0]}."


def task_last_word(rng, c):
    s = rng.choice(c.sentences)
    last = words_of(s)[-1]
    return f"What is the last word of this sentence? {s}", last, f"The sentence ends with \"{last}\"."


def task_title(rng, c):
    title, body = rng.choice(c.titled)
    text = "\n\n".join([title] + body[:1])
    return (f"What is the title of this text?\n\n{text}", title,
            f"The first line, \"{title}\", is the title.")


def arithmetic(rng):
    op = rng.choice(list(OPS))
    a, b = rng.randint(2, 99), rng.randint(2, 99 if op != "multiply" else 30)
    return a, b, op, OPS[op][2](a, b)


def task_arith(rng, c):
    a, b, op, r = arithmetic(rng)
    sym = OPS[op][0]
    prompt = rng.choice(["What is {a} {s} {b}?", "Compute {a} {s} {b}.", "{a} {s} {b} = ?"]).format(
        a=a, s=sym, b=b)
    return prompt, f"{a} {sym} {b} = {r}", f"{a} {OPS[op][1]} {b} is {r}."


SIMPLE_TASKS = [task_first_sentence, task_upper, task_count_words, task_reverse_list,
                task_sort_list, task_last_word, task_title, task_arith]


def assistant(content, reasoning=None):
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
        m["thinking"] = reasoning
    return m


def tool_call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def call_msg(name, arguments, reasoning=None):
    m = {"role": "assistant", "content": "", "tool_calls": [tool_call(name, arguments)]}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
        m["thinking"] = reasoning
    return m


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

def maybe_system(rng, p=0.3):
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < p else []


def conv_single(rng, c, reasoning=False):
    prompt, answer, why = rng.choice(SIMPLE_TASKS)(rng, c)
    msgs = maybe_system(rng) + [{"role": "user", "content": prompt},
                                assistant(answer, why if reasoning else None)]
    return {"messages": msgs}


def conv_passage_turns(rng, c, reasoning=False):
    """2-4 user turns about one passage: each answer depends on the earlier ones."""
    p = rng.choice([q for q in c.paragraphs if len(q) <= 300])
    s = sentences(p)[0]
    turns = [("Here is a passage:\n\n" + p + "\n\nRepeat its first sentence.", s,
              "The first sentence ends at the first full stop."),
             ("Now write that sentence in capital letters.", s.upper(),
              "Every letter of the sentence becomes a capital."),
             ("How many words does it have?", f"{len(s.split())} words.",
              f"Splitting on spaces gives {len(s.split())} pieces."),
             ("What is its last word?", words_of(s)[-1], f"It ends with \"{words_of(s)[-1]}\".")]
    k = rng.randint(2, 4)
    msgs = maybe_system(rng)
    for i, (q, a, why) in enumerate(turns[:k]):
        msgs += [{"role": "user", "content": q},
                 assistant(a, why if reasoning and (i == k - 1 or rng.random() < 0.5) else None)]
    return {"messages": msgs}


def conv_mixed_turns(rng, c, reasoning=False):
    k = rng.randint(2, 4)
    msgs = maybe_system(rng)
    for i in range(k):
        prompt, answer, why = rng.choice(SIMPLE_TASKS)(rng, c)
        msgs += [{"role": "user", "content": prompt},
                 assistant(answer, why if reasoning and i == k - 1 else None)]
    return {"messages": msgs}


def tool_flow_calculator(rng, reasoning=False):
    a, b, op, r = arithmetic(rng)
    word = OPS[op][1]
    q = rng.choice(["Use the calculator: what is {a} {w} {b}?",
                    "Please work out {a} {w} {b} with the calculator tool."]).format(a=a, w=word, b=b)
    why = f"I will call the calculator with a={a}, b={b}, op={op}." if reasoning else None
    return [{"role": "user", "content": q},
            call_msg("calculator", {"a": a, "b": b, "op": op}, why),
            {"role": "tool", "content": str(r)},
            assistant(f"{a} {word} {b} is {r}.",
                      f"The calculator returned {r}." if reasoning else None)]


def tool_flow_two_steps(rng, reasoning=False):
    a, b, c3 = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    s = a + b
    r = s * c3
    why1 = "First add the two numbers." if reasoning else None
    why2 = f"The sum is {s}; now multiply it by {c3}." if reasoning else None
    return [{"role": "user", "content": f"Compute ({a} + {b}) * {c3} with the calculator."},
            call_msg("calculator", {"a": a, "b": b, "op": "add"}, why1),
            {"role": "tool", "content": str(s)},
            call_msg("calculator", {"a": s, "b": c3, "op": "multiply"}, why2),
            {"role": "tool", "content": str(r)},
            assistant(f"({a} + {b}) * {c3} = {r}",
                      f"{s} times {c3} is {r}." if reasoning else None)]


def tool_flow_word_count(rng, c, reasoning=False):
    s = rng.choice(c.sentences)
    n = len(s.split())
    why = "The word_count tool can count them." if reasoning else None
    return [{"role": "user", "content": f"Count the words in this sentence with the word_count tool: {s}"},
            call_msg("word_count", {"text": s}, why),
            {"role": "tool", "content": str(n)},
            assistant(f"The sentence has {n} words.",
                      f"The tool says {n}." if reasoning else None)]


def conv_tools(rng, c, reasoning=False):
    kind = rng.random()
    if kind < 0.45:
        flow = tool_flow_calculator(rng, reasoning)
    elif kind < 0.7:
        flow = tool_flow_two_steps(rng, reasoning)
    else:
        flow = tool_flow_word_count(rng, c, reasoning)
    msgs = maybe_system(rng, 0.4)
    if rng.random() < 0.3:  # a plain turn first, then the tool flow
        prompt, answer, _ = rng.choice(SIMPLE_TASKS)(rng, c)
        msgs += [{"role": "user", "content": prompt}, assistant(answer)]
    msgs += flow
    names = sorted(TOOLS) if rng.random() < 0.3 else sorted({m["tool_calls"][0]["function"]["name"]
                                                             for m in flow if "tool_calls" in m})
    return {"messages": msgs, "tools": [TOOLS[n] for n in names]}


def conv_tools_unused(rng, c, reasoning=False):
    """Tools are offered but the question needs none."""
    prompt, answer, why = rng.choice(SIMPLE_TASKS[:6])(rng, c)
    msgs = maybe_system(rng, 0.4) + [{"role": "user", "content": prompt},
                                     assistant(answer, why if reasoning else None)]
    return {"messages": msgs, "tools": [TOOLS[n] for n in sorted(TOOLS)]}


def conv_long(rng, c, reasoning=False):
    """A whole document or two: the conversations of up to ~1,500 tokens."""
    ndocs = rng.choice([1, 1, 2])
    while True:
        picks = rng.sample(c.titled, ndocs)
        if sum(len(t) + sum(len(p) for p in body) for t, body in picks) <= 2800:
            break
    text = "\n\n".join("\n\n".join([t] + body) for t, body in picks)
    title, body = picks[-1]
    last_para = body[-1]
    s = sentences(last_para)[0]
    msgs = maybe_system(rng) + [
        {"role": "user", "content": f"{text}\n\nWhat is the title of the last text above?"},
        assistant(title, f"The last text starts with the line \"{title}\"." if reasoning else None),
        {"role": "user", "content": "Repeat the first sentence of its last paragraph."},
        assistant(s, "The last paragraph is the one just before my question." if reasoning else None)]
    return {"messages": msgs}


PLAN = [  # (builder, count, with reasoning)
    (conv_single, 175, False),
    (conv_single, 50, True),
    (conv_passage_turns, 45, False),
    (conv_passage_turns, 15, True),
    (conv_mixed_turns, 35, False),
    (conv_mixed_turns, 10, True),
    (conv_tools, 55, False),
    (conv_tools, 25, True),
    (conv_tools_unused, 15, False),
    (conv_tools_unused, 5, True),
    (conv_long, 6, False),
    (conv_long, 3, True),
]


def build_conversations(corpus):
    rng = random.Random(SEED)
    rows = []
    for builder, count, reasoning in PLAN:
        for _ in range(count):
            rows.append(builder(rng, corpus, reasoning))
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------

def render_for_training(rows, templates):
    """The conversations as each template renders them, special tokens cut out: the BPE's input.

    Rendered with plain Jinja2 (the semantics transformers uses: trim_blocks, lstrip_blocks, a
    ``tojson`` that keeps non-ASCII text) and a fixed date for gpt-oss's ``strftime_now``, so the
    merges do not depend on the day; this text only trains the merges and is never shipped.
    """
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "2025-01-01"
    compiled = [env.from_string(t) for t in templates]
    added = sorted({t for t, _ in QWEN3_ADDED} | set(GPT_OSS_ADDED), key=lambda t: (-len(t), t))
    cut = re.compile("|".join(re.escape(t) for t in added))
    for row in rows:
        for template in compiled:
            text = template.render(messages=row["messages"], tools=row.get("tools"),
                                   add_generation_prompt=False)
            yield cut.sub("\n", text)


def train_bpe(rows, templates):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=256 + N_MERGES, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(list(render_for_training(rows, templates)), trainer)
    return tok


def with_added(base_json, added):
    """A copy of the trained tokenizer with (content, special) tokens appended in order."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(base_json)
    for content, special in added:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                       special=special)
        n = tok.add_special_tokens([t]) if special else tok.add_tokens([t])
        assert n == 1, content
    return tok


def decoder_entries(tok, added):
    out = {}
    for content, special in added:
        out[str(tok.token_to_id(content))] = {"content": content, "lstrip": False,
                                              "normalized": False, "rstrip": False,
                                              "single_word": False, "special": special}
    return out


def dump_json(obj):
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build_files(qwen3_template, gpt_oss_template):
    corpus = Corpus(CORPUS)
    rows = build_conversations(corpus)
    files = {CONVERSATIONS: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)}

    base = train_bpe(rows, [qwen3_template, gpt_oss_template]).to_str()

    q = with_added(base, QWEN3_ADDED)
    files[ASSETS / "qwen3" / "tokenizer.json"] = q.to_str(pretty=True) + "\n"
    files[ASSETS / "qwen3" / "tokenizer_config.json"] = dump_json({
        "add_prefix_space": False,
        "added_tokens_decoder": decoder_entries(q, QWEN3_ADDED),
        "additional_special_tokens": QWEN3_ADDITIONAL_SPECIAL,
        "bos_token": None,
        "chat_template": qwen3_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })

    g_added = [(t, True) for t in GPT_OSS_ADDED]
    g = with_added(base, g_added)
    files[ASSETS / "gpt-oss" / "tokenizer.json"] = g.to_str(pretty=True) + "\n"
    files[ASSETS / "gpt-oss" / "tokenizer_config.json"] = dump_json({
        "added_tokens_decoder": decoder_entries(g, g_added),
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
    files[ASSETS / "gpt-oss" / "chat_template.jinja"] = gpt_oss_template
    return files


def checked_template(data, sha, where, what):
    """The template text, if its bytes are the upstream ones."""
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        sys.exit(f"{where}: sha256 {got} is not the upstream {what} template's {sha}; "
                 "the templates are verbatim copies, never edited (see mop/data/assets/README.md)")
    return data.decode("utf-8")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped files, write nothing")
    ap.add_argument("--qwen3-template", help="the Qwen3 template file (default: the shipped one)")
    ap.add_argument("--gpt-oss-template", help="the gpt-oss template file (default: the shipped one)")
    args = ap.parse_args()

    if args.qwen3_template:
        where = Path(args.qwen3_template)
        data = where.read_bytes()
    else:  # Qwen ships its template inside tokenizer_config.json
        where = ASSETS / "qwen3" / "tokenizer_config.json"
        data = json.loads(where.read_text(encoding="utf-8"))["chat_template"].encode("utf-8")
    qwen3 = checked_template(data, QWEN3_TEMPLATE_SHA256, where, "Qwen3")
    where = Path(args.gpt_oss_template or ASSETS / "gpt-oss" / "chat_template.jinja")
    gpt_oss = checked_template(where.read_bytes(), GPT_OSS_TEMPLATE_SHA256, where, "gpt-oss")

    files = build_files(qwen3, gpt_oss)
    changed = []
    for path, text in files.items():
        data = text.encode("utf-8")
        if not path.exists() or path.read_bytes() != data:
            changed.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    for path in changed:
        print(("differs: " if args.check else "wrote: ") + str(path.relative_to(ROOT)))
    if args.check and changed:
        sys.exit(1)
    if not changed:
        print("all %d files up to date" % len(files))


if __name__ == "__main__":
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # one thread: the BPE trainer's counts in one order
    main()
