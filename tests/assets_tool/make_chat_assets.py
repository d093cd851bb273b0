#!/usr/bin/env python3
"""Regenerate mop's shipped chat assets (issue 29): conversation and preference sets, two tiny tokenizers.

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
- ``mop/data/corpus/preferences.jsonl``: 300 preference pairs for DPO in TRL's explicit
  conversational form, ``{"prompt": [...], "chosen": [assistant], "rejected": [assistant],
  "tools": [...]?}``, drawn the same way (from their own seed, so the conversations do not move):
  the prompt is a conversation up to its last assistant turn (system prompts, earlier turns, tool
  calls and results; 10% hold whole documents), ``chosen`` the right answer or tool call and
  ``rejected`` a plausible wrong one (a wrong sum or count, a mis-sorted list, the wrong sentence,
  a wrong tool argument, reasoning that reaches a wrong result ...). Prompts carry no reasoning, so
  each prompt renders as a prefix of prompt + response under both templates. The pairs are not
  part of the tokenizers' training text.
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
PREFERENCES = ROOT / "mop" / "data" / "corpus" / "preferences.jsonl"
ASSETS = ROOT / "mop" / "data" / "assets"

# sha256 of the upstream template bytes (see mop/data/assets/README.md for where they come from).
QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
GPT_OSS_TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

SEED = 29
PREFERENCE_SEED = 2929  # its own stream, so the conversations do not change with the pairs
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
    return from_plan(PLAN, SEED, corpus)


def from_plan(plan, seed, corpus, check=lambda row: None):
    """The rows a plan of (builder, count, reasoning) makes, each checked, in an order drawn from `seed`."""
    rng = random.Random(seed)
    rows = []
    for builder, count, reasoning in plan:
        for _ in range(count):
            row = builder(rng, corpus, reasoning)
            check(row)
            rows.append(row)
    rng.shuffle(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# Preference pairs (DPO): prompt, a correct final answer and a plausible wrong one
# ---------------------------------------------------------------------------------------------

def pick_wrong(rng, answer, candidates):
    """One (wrong, wrong_reasoning) of the candidates whose text differs from the answer."""
    usable = [w for w in candidates if w[0] != answer]
    assert usable, answer
    return rng.choice(usable)


def cut_words(text, keep=2 / 3):
    """The first part of a text's words: a truncated copy."""
    ws = text.split()
    return " ".join(ws[:max(1, int(len(ws) * keep))])


def listing(ws):
    return ", ".join(f"{k + 1} {w}" for k, w in enumerate(ws))


def pair_first_sentence(rng, c):
    p = rng.choice(c.paragraphs)
    ss = sentences(p)
    s = ss[0]
    prompt = rng.choice(["Repeat the first sentence of this passage.\n\n{p}",
                         "{p}\n\nWhat is the first sentence of the passage above?",
                         "Here is a passage:\n\n{p}\n\nCopy its first sentence."]).format(p=p)
    two = " ".join(ss[:2])
    return prompt, s, f"The passage starts with: {s}", [
        (ss[1], f"The passage starts with: {ss[1]}"),
        (ss[-1], f"The sentence to copy is the last one: {ss[-1]}"),
        (two, f"The first sentence runs on: {two}"),
        (cut_words(s), f"The passage starts with: {cut_words(s)}")]


def pair_upper(rng, c):
    s = rng.choice(c.sentences)
    ws = s.split()
    n = rng.randint(2, min(6, len(ws)))
    i = rng.randint(0, len(ws) - n)
    words = [w.strip('",.;:!?()') for w in ws[i:i + n]]
    phrase = " ".join(words)
    prompt = rng.choice(["Write this phrase in capital letters: {x}",
                         "Uppercase the following: {x}",
                         "Make every letter a capital: {x}"]).format(x=phrase)
    why = f"Each letter of \"{phrase}\" becomes a capital."
    initials = " ".join(w[:1].upper() + w[1:] for w in words)
    most = " ".join([w.upper() for w in words[:-1]] + [words[-1]])
    more = ws[i:i + n + 1] if i + n < len(ws) else ws[i - 1:i + n]  # one word of the sentence too many
    return prompt, phrase.upper(), why, [
        (initials, "Each word starts with a capital."),
        (most, why),
        (phrase, "The phrase is already written correctly."),
        (" ".join(w.upper() for w in words[:-1]), why),
        (" ".join(w.strip('",.;:!?()').upper() for w in more), why)]


def pair_count_words(rng, c):
    s = rng.choice(c.sentences)
    ws = s.split()
    n = len(ws)
    prompt = rng.choice(["How many words are in this sentence? {s}",
                         "Count the words: {s}"]).format(s=s)
    j = rng.randrange(n)
    skipped = ws[:j] + ws[j + 1:]
    doubled = ws[:j + 1] + ws[j:]
    return prompt, f"{n} words.", f"Counting: {listing(ws)}. That is {n}.", [
        (f"{n - 1} words.", f"Counting: {listing(skipped)}. That is {n - 1}."),
        (f"{n + 1} words.", f"Counting: {listing(doubled)}. That is {n + 1}."),
        (f"{n + 2}", f"It looks like about {n + 2}."),
        (f"The sentence has {len(words_of(s)) + 3} words in it.",
         f"Counting them quickly gives {len(words_of(s)) + 3}.")]


def pair_reverse_list(rng, c):
    items = rng.sample(c.words, rng.randint(3, 6))
    prompt = rng.choice(["Reverse this list: {l}", "Write these in reverse order: {l}"]).format(
        l=", ".join(items))
    rev = items[::-1]
    return prompt, ", ".join(rev), f"The last item is {items[-1]}, so it goes first.", [
        (", ".join(items), f"The first item is {items[0]}, so it stays first."),
        (", ".join(sorted(items)), f"In order the first is {min(items)}."),
        (", ".join(items[1:] + items[:1]), f"The first item, {items[0]}, moves to the end."),
        (", ".join(rev[:-1]), f"The last item is {items[-1]}, so it goes first."),
        (", ".join(rev + rev[:1]), f"The last item is {items[-1]}, so it goes first and last.")]


def pair_sort_list(rng, c):
    items = rng.sample(c.words, rng.randint(3, 6))
    prompt = "Sort these words alphabetically: " + ", ".join(items)
    out = sorted(items)
    j = rng.randrange(len(out) - 1)
    swapped = out[:j] + [out[j + 1], out[j]] + out[j + 2:]
    by_length = sorted(items, key=lambda w: (len(w), w))
    candidates = [(", ".join(items), f"In alphabetical order the first is {items[0]}."),
                  (", ".join(swapped), f"In alphabetical order the first is {swapped[0]}."),
                  (", ".join(out[::-1]), f"In alphabetical order the first is {out[-1]}."),
                  (", ".join(by_length), f"The shortest word, {by_length[0]}, comes first."),
                  (", ".join(out[:-1]), f"In alphabetical order the first is {out[0]}.")]
    return prompt, ", ".join(out), f"In alphabetical order the first is {out[0]}.", candidates


def pair_last_word(rng, c):
    s = rng.choice(c.sentences)
    ws = words_of(s)
    last = ws[-1]
    return (f"What is the last word of this sentence? {s}", last, f"The sentence ends with \"{last}\".", [
        (ws[0], f"The sentence starts with \"{ws[0]}\"."),
        (ws[-2], f"The sentence ends with \"{ws[-2]}\"."),
        (" ".join(ws[-2:]), f"The sentence ends with \"{' '.join(ws[-2:])}\"."),
        (f"The last word is \"{ws[-2]}\".", f"The word before the full stop is \"{ws[-2]}\".")])


def pair_title(rng, c):
    title, body = rng.choice(c.titled)
    text = "\n\n".join([title] + body[:1])
    other, other2 = rng.sample([t for t, _ in c.titled if t != title], 2)
    first = sentences(body[0])[0]
    return (f"What is the title of this text?\n\n{text}", title, f"The first line, \"{title}\", is the title.", [
        (first, f"The text opens with \"{first}\", so that is the title."),
        (other, f"The first line, \"{other}\", is the title."),
        (cut_words(title, 1 / 2), f"The first words, \"{cut_words(title, 1 / 2)}\", are the title."),
        (f"The title of this text is \"{other2}\".", f"It reads like the text called \"{other2}\".")])


def pair_arith(rng, c):
    a, b, op, r = arithmetic(rng)
    sym, word, _ = OPS[op]
    prompt = rng.choice(["What is {a} {s} {b}?", "Compute {a} {s} {b}.", "{a} {s} {b} = ?"]).format(
        a=a, s=sym, b=b)
    d = rng.choice([1, -1, 10, -10, 2])
    other = rng.choice([o for o in sorted(OPS) if o != op])
    w_op = OPS[other][2](a, b)
    return prompt, f"{a} {sym} {b} = {r}", f"{a} {word} {b} is {r}.", [
        (f"{a} {sym} {b} = {r + d}", f"{a} {word} {b} is {r + d}."),
        (f"{a} {sym} {b} = {w_op}", f"{a} {OPS[other][1]} {b} is {w_op}."),
        (str(r + d), f"{a} {word} {b} is {r + d}."),
        (f"{a} {sym} {b} is {r - d}, if I have carried correctly.",
         f"{a} {word} {b}: carrying the tens gives {r - d}.")]


PAIR_TASKS = [pair_first_sentence, pair_upper, pair_count_words, pair_reverse_list, pair_sort_list,
              pair_last_word, pair_title, pair_arith]


def spoiled_turn(rng, c, reasoning, task=None):
    """A user turn, its correct answer and a plausible wrong one (as assistant messages)."""
    prompt, answer, why, candidates = (task or rng.choice(PAIR_TASKS))(rng, c)
    wrong, wrong_why = pick_wrong(rng, answer, candidates)
    return ({"role": "user", "content": prompt}, assistant(answer, why if reasoning else None),
            assistant(wrong, wrong_why if reasoning else None))


def pair(prompt, chosen, rejected, tools=None):
    row = {"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}
    if tools is not None:
        row["tools"] = tools
    return row


def pref_single(rng, c, reasoning=False):
    user, chosen, rejected = spoiled_turn(rng, c, reasoning)
    return pair(maybe_system(rng) + [user], chosen, rejected)


def pref_passage_turns(rng, c, reasoning=False):
    """Earlier turns about one passage in the prompt; the last question's answer is the pair."""
    p = rng.choice([q for q in c.paragraphs if len(q) <= 300])
    ss = sentences(p)
    s = ss[0]
    ws, n, t = words_of(s), len(s.split()), ss[1]
    turns = [("Here is a passage:\n\n" + p + "\n\nRepeat its first sentence.", s, None),
             ("Now write that sentence in capital letters.", s.upper(),
              [(t.upper(), "Every letter of the sentence becomes a capital."),
               (cut_words(s).upper(), "Every letter of the sentence becomes a capital."),
               (s, "The sentence is already written out.")]),
             ("How many words does it have?", f"{n} words.",
              [(f"{n + 1} words.", f"Splitting on spaces gives {n + 1} pieces."),
               (f"{len(t.split())} words.", f"Splitting on spaces gives {len(t.split())} pieces."),
               (f"It has {n - 1} words, counting each one once.", f"Splitting on spaces gives {n - 1} pieces.")]),
             ("What is its last word?", ws[-1],
              [(ws[0], f"It starts with \"{ws[0]}\"."), (words_of(t)[-1], f"It ends with \"{words_of(t)[-1]}\"."),
               (" ".join(ws[-3:]), f"It ends with \"{' '.join(ws[-3:])}\".")])]
    whys = ["", "Every letter of the sentence becomes a capital.", f"Splitting on spaces gives {n} pieces.",
            f"It ends with \"{ws[-1]}\"."]
    k = rng.randint(2, 4)
    msgs = maybe_system(rng)
    for q, a, _ in turns[:k - 1]:
        msgs += [{"role": "user", "content": q}, assistant(a)]
    q, a, candidates = turns[k - 1]
    wrong, wrong_why = pick_wrong(rng, a, candidates)
    msgs.append({"role": "user", "content": q})
    return pair(msgs, assistant(a, whys[k - 1] if reasoning else None),
                assistant(wrong, wrong_why if reasoning else None))


def pref_mixed_turns(rng, c, reasoning=False):
    """One to three answered tasks in the prompt, then the pair's task."""
    msgs = maybe_system(rng)
    for _ in range(rng.randint(1, 3)):
        prompt, answer, _ = rng.choice(SIMPLE_TASKS)(rng, c)
        msgs += [{"role": "user", "content": prompt}, assistant(answer)]
    user, chosen, rejected = spoiled_turn(rng, c, reasoning)
    return pair(msgs + [user], chosen, rejected)


def tools_for(rng, messages):
    """The schemas of the tools the messages call, or now and then all of them."""
    called = {m["tool_calls"][0]["function"]["name"] for m in messages if "tool_calls" in m}
    names = sorted(TOOLS) if not called or rng.random() < 0.3 else sorted(called)
    return [TOOLS[n] for n in names]


def answer_after_calculator(rng, reasoning):
    a, b, op, r = arithmetic(rng)
    word = OPS[op][1]
    q = rng.choice(["Use the calculator: what is {a} {w} {b}?",
                    "Please work out {a} {w} {b} with the calculator tool."]).format(a=a, w=word, b=b)
    d = rng.choice([1, -1, 10, -10])
    other = rng.choice([o for o in sorted(OPS) if o != op])
    w_op = OPS[other][2](a, b)
    flow = [{"role": "user", "content": q}, call_msg("calculator", {"a": a, "b": b, "op": op}),
            {"role": "tool", "content": str(r)}]
    return flow, (f"{a} {word} {b} is {r}.", f"The calculator returned {r}."), [
        (f"{a} {word} {b} is {r + d}.", f"The calculator returned {r + d}."),
        (f"{a} {word} {b} is {w_op}.", f"{a} {OPS[other][1]} {b} is {w_op}."),
        (f"{r + d}", f"The calculator returned {r + d}."),
        (f"The calculator returned {r}, but checking by hand, {a} {word} {b} is {r - d}.",
         f"The calculator may be wrong; by hand it is {r - d}.")]


def answer_after_two_steps(rng, reasoning):
    a, b, c3 = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    s, r = a + b, (a + b) * c3
    flow = [{"role": "user", "content": f"Compute ({a} + {b}) * {c3} with the calculator."},
            call_msg("calculator", {"a": a, "b": b, "op": "add"}), {"role": "tool", "content": str(s)},
            call_msg("calculator", {"a": s, "b": c3, "op": "multiply"}), {"role": "tool", "content": str(r)}]
    return flow, (f"({a} + {b}) * {c3} = {r}", f"{s} times {c3} is {r}."), [
        (f"({a} + {b}) * {c3} = {s}", f"The sum is {s}."),
        (f"({a} + {b}) * {c3} = {a + b * c3}", f"{b} times {c3} is {b * c3}, plus {a} is {a + b * c3}."),
        (f"{r + c3}", f"{s} times {c3} is {r + c3}."),
        (f"First {a} + {b} = {s}, then {s} * {c3} = {r - c3}, so the answer is {r - c3}.",
         f"{s} times {c3} is {r - c3}.")]


def answer_after_word_count(rng, c, reasoning):
    s = rng.choice(c.sentences)
    n = len(s.split())
    flow = [{"role": "user", "content": f"Count the words in this sentence with the word_count tool: {s}"},
            call_msg("word_count", {"text": s}), {"role": "tool", "content": str(n)}]
    return flow, (f"The sentence has {n} words.", f"The tool says {n}."), [
        (f"The sentence has {n + 1} words.", f"The tool says {n + 1}."),
        (f"{n - 1}", f"The tool says {n - 1}."),
        (f"The tool counted {n}, but the sentence really has {n + 2} words.",
         f"The tool says {n}, but I count {n + 2} myself.")]


def pref_tool_answer(rng, c, reasoning=False):
    """A tool-call flow in the prompt (calls and results); the pair is the final answer."""
    kind = rng.random()
    if kind < 0.45:
        flow, (answer, why), candidates = answer_after_calculator(rng, reasoning)
    elif kind < 0.7:
        flow, (answer, why), candidates = answer_after_two_steps(rng, reasoning)
    else:
        flow, (answer, why), candidates = answer_after_word_count(rng, c, reasoning)
    wrong, wrong_why = pick_wrong(rng, answer, candidates)
    msgs = maybe_system(rng, 0.4)
    if rng.random() < 0.3:  # a plain turn first, then the tool flow
        prompt, first, _ = rng.choice(SIMPLE_TASKS)(rng, c)
        msgs += [{"role": "user", "content": prompt}, assistant(first)]
    msgs += flow
    return pair(msgs, assistant(answer, why if reasoning else None),
                assistant(wrong, wrong_why if reasoning else None), tools_for(rng, msgs))


def swap_digits(x):
    """47 -> 74, 5 -> 6: a misread number that differs from x."""
    t = str(x)[::-1]
    return int(t) if t != str(x) else x + 1


def call_calculator(rng, c):
    a, b, op, r = arithmetic(rng)
    word = OPS[op][1]
    q = rng.choice(["Use the calculator: what is {a} {w} {b}?",
                    "Please work out {a} {w} {b} with the calculator tool."]).format(a=a, w=word, b=b)
    other = rng.choice([o for o in sorted(OPS) if o != op])
    why = f"I will call the calculator with a={a}, b={b}, op={op}."
    candidates = [(call_msg("calculator", {"a": a, "b": b, "op": other}),
                   f"I will call the calculator with a={a}, b={b}, op={other}."),
                  (call_msg("calculator", {"a": a, "b": swap_digits(b), "op": op}),
                   f"I will call the calculator with a={a}, b={swap_digits(b)}, op={op}."),
                  (assistant(f"{a} {word} {b} is {r + rng.choice([1, -1, 10])}."),
                   "This is easy enough to do without the tool.")]
    if op == "subtract" and a != b:
        candidates.append((call_msg("calculator", {"a": b, "b": a, "op": op}),
                           f"I will call the calculator with a={b}, b={a}, op={op}."))
    return [{"role": "user", "content": q}], call_msg("calculator", {"a": a, "b": b, "op": op}), why, candidates


def call_two_steps(rng, c):
    a, b, c3 = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    s = a + b
    msgs = [{"role": "user", "content": f"Compute ({a} + {b}) * {c3} with the calculator."}]
    if rng.random() < 0.5:  # the first call
        return msgs, call_msg("calculator", {"a": a, "b": b, "op": "add"}), "First add the two numbers.", [
            (call_msg("calculator", {"a": b, "b": c3, "op": "multiply"}), "Multiplication comes first."),
            (call_msg("calculator", {"a": a, "b": c3, "op": "add"}), "First add the two numbers."),
            (call_msg("calculator", {"a": a, "b": b, "op": "multiply"}), "First combine the two numbers.")]
    msgs += [call_msg("calculator", {"a": a, "b": b, "op": "add"}), {"role": "tool", "content": str(s)}]
    why = f"The sum is {s}; now multiply it by {c3}."
    return msgs, call_msg("calculator", {"a": s, "b": c3, "op": "multiply"}), why, [
        (call_msg("calculator", {"a": a, "b": c3, "op": "multiply"}), f"Now multiply {a} by {c3}."),
        (call_msg("calculator", {"a": s, "b": c3, "op": "add"}), f"The sum is {s}; now add {c3}."),
        (assistant(f"({a} + {b}) * {c3} = {s}"), f"The calculator returned {s}, which is the answer."),
        (call_msg("calculator", {"a": swap_digits(s), "b": c3, "op": "multiply"}),
         f"The sum is {swap_digits(s)}; now multiply it by {c3}.")]


def call_word_count(rng, c):
    s = rng.choice(c.sentences)
    other = rng.choice([x for x in c.sentences if x != s])
    n = len(s.split())
    why = "The word_count tool can count them."
    return ([{"role": "user", "content": f"Count the words in this sentence with the word_count tool: {s}"}],
            call_msg("word_count", {"text": s}), why, [
                (call_msg("word_count", {"text": cut_words(s)}), why),
                (call_msg("word_count", {"text": s, "unique": True}), "Count each word once."),
                (call_msg("word_count", {"text": other}), why),
                (assistant(f"The sentence has {n + 1} words."), "I can count these myself.")])


def pref_tool_call(rng, c, reasoning=False):
    """The pair is a tool call: the right call against one with a wrong argument (or a guess)."""
    kind = rng.random()
    if kind < 0.4:
        flow, chosen, why, candidates = call_calculator(rng, c)
    elif kind < 0.7:
        flow, chosen, why, candidates = call_two_steps(rng, c)
    else:
        flow, chosen, why, candidates = call_word_count(rng, c)
    rejected, wrong_why = rng.choice([w for w in candidates if w[0] != chosen])
    if reasoning:
        chosen = dict(chosen, reasoning_content=why, thinking=why)
        rejected = dict(rejected, reasoning_content=wrong_why, thinking=wrong_why)
    msgs = maybe_system(rng, 0.4)
    if rng.random() < 0.3:
        prompt, first, _ = rng.choice(SIMPLE_TASKS)(rng, c)
        msgs += [{"role": "user", "content": prompt}, assistant(first)]
    msgs += flow
    return pair(msgs, chosen, rejected, tools_for(rng, msgs + [chosen, rejected]))


def pref_long(rng, c, reasoning=False):
    """A whole document or two in the prompt (the conv_long style): a few hundred to ~1,500 tokens."""
    ndocs = rng.choice([1, 1, 2])
    while True:
        picks = rng.sample(c.titled, ndocs)
        size = sum(len(t) + sum(len(p) for p in body) for t, body in picks)
        if 800 <= size <= 2800 and len(picks[-1][1]) >= 2:
            break
    text = "\n\n".join("\n\n".join([t] + body) for t, body in picks)
    title, body = picks[-1]
    msgs = maybe_system(rng) + [{"role": "user", "content": f"{text}\n\nWhat is the title of the last text above?"}]
    if rng.random() < 0.4:
        other = picks[0][0] if ndocs == 2 else rng.choice([t for t, _ in c.titled if t != title])
        first = sentences(body[0])[0]
        answer, why = title, f"The last text starts with the line \"{title}\"."
        candidates = [(other, f"The text starts with the line \"{other}\"."),
                      (first, f"The last text starts with \"{first}\"."),
                      (cut_words(title, 1 / 2), f"The last text starts with \"{cut_words(title, 1 / 2)}\".")]
    else:
        msgs += [assistant(title), {"role": "user", "content": "Repeat the first sentence of its last paragraph."}]
        last = sentences(body[-1])
        answer, why = last[0], "The last paragraph is the one just before my question."
        candidates = [(sentences(body[0])[0], "The first paragraph comes right after the title."),
                      (sentences(body[-2])[0], "The last paragraph is the one just before my question."),
                      (cut_words(last[0]), "The last paragraph is the one just before my question."),
                      (" ".join(last[:2]), "The last paragraph is the one just before my question.")]
        if len(last) > 1:
            candidates.append((last[1], "The last paragraph is the one just before my question."))
    wrong, wrong_why = pick_wrong(rng, answer, candidates)
    return pair(msgs, assistant(answer, why if reasoning else None),
                assistant(wrong, wrong_why if reasoning else None))


PREFERENCE_PLAN = [  # (builder, count, with reasoning in the responses)
    (pref_single, 100, False),
    (pref_single, 30, True),
    (pref_passage_turns, 25, False),
    (pref_passage_turns, 5, True),
    (pref_mixed_turns, 20, False),
    (pref_mixed_turns, 5, True),
    (pref_tool_answer, 35, False),
    (pref_tool_answer, 10, True),
    (pref_tool_call, 30, False),
    (pref_tool_call, 10, True),
    (pref_long, 25, False),
    (pref_long, 5, True),
]


def build_preferences(corpus):
    """The preference pairs, TRL's explicit conversational form: prompt, chosen, rejected, tools?.

    Prompts hold no reasoning (gpt-oss's template drops earlier reasoning, so a prompt with it
    would not render as a prefix of prompt + response); the responses may carry it.
    """
    return from_plan(PREFERENCE_PLAN, PREFERENCE_SEED, corpus, check_pair)


def check_pair(row):
    assert row["prompt"][-1]["role"] in ("user", "tool"), row
    assert row["chosen"] != row["rejected"], row
    assert not any("reasoning_content" in m for m in row["prompt"]), row


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
    files = {CONVERSATIONS: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
             PREFERENCES: "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build_preferences(corpus))}

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
