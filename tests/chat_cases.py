"""Published chat templates and conversations to hold mop's assistant targets to (issue 36).

Every template in `TEMPLATES` is a verbatim copy of a published one (`tests/assets/chat_templates/
README.md` names each source; Qwen3's and gpt-oss's ship with mop in `mop/data/assets`). Beside each
lies `generation.jinja`, the same template with `{% generation %}` blocks around what the model
writes: read through transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` it
is the oracle for the targets.

`tokenizer_folder` makes a Hugging Face tokenizer folder for a template: the tiny byte-level BPE of
mop's shipped chat assets followed by the model's own added tokens with its real special flags
(`special_tokens.json`), or with every flag flipped; the chat template in `tokenizer_config.json`.

`conversations(name)` gives the test conversations in the form each template reads (tool-call
arguments as objects or JSON strings, tool-call ids of nine characters for Mistral's), leaving out
those a template cannot render by design (Mixtral and Phi-3.5 have no tools, Llama 3.1 one tool call per message,
Mistral's and Mixtral's a conversation that does not alternate user and assistant turns, most
templates content parts).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets" / "chat_templates"
SHIPPED = {"qwen3": ROOT / "mop" / "data" / "assets" / "qwen3", "gpt-oss": ROOT / "mop" / "data" / "assets" / "gpt-oss"}
BASE_TOKENIZER = SHIPPED["qwen3"] / "tokenizer.json"
TEMPLATES = ["deepseek-v3", "deepseek-v3.1", "kimi-k2", "kimi-k2-thinking", "glm-4.5", "gpt-oss", "qwen3",
             "mistral-nemo", "mixtral", "llama-3.1", "qwen3-thinking-2507", "nemotron-3-nano", "qwen3-coder",
             "deepseek-r1", "llama-4", "phi-3.5-moe", "glm-4.7", "qwen3.5", "ling-3.0", "minimax-m2"]
NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# sha256 of each published template's bytes (tests/assets/chat_templates/README.md), so that none is edited.
SHA256 = {
    "deepseek-v3": "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea",
    "deepseek-v3.1": "45690185067ea25c073bff2d3e425a45ee2564d2bbf6cdf7d885e139d460b8e0",
    "kimi-k2": "9fcc72b7c248a72020c81f70bb652f3094d18a750c93ca35dfcb3cf5fe23ff53",
    "kimi-k2-thinking": "833d0c375531149a922a0f2addf9a66cce8e4503c500fe4ca6a95e9d1ed3c75a",
    "glm-4.5": "c5b4f04ea931bbf75997887958997737ca053fc040d6090907b16447440c22e1",
    "gpt-oss": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
    "qwen3": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    "mistral-nemo": "e4676cb56dffea7782fd3e2b577cfaf1e123537e6ef49b3ec7caa6c095c62272",
    "mixtral": "796853172235ab3aaa4810013ddfe2eab481bda3306dad4f700c00d436eed596",
    "llama-3.1": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "qwen3-thinking-2507": "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
    "nemotron-3-nano": "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862",
    "qwen3-coder": "672e747c77e990320152343b0a4951222e40de5645297905d89afba05586d827",
    "deepseek-r1": "3a3036eeb96ca0e48565fc1f19b4d7d3fa17ada32bb1b3d5ed539ae74cf22923",
    "llama-4": "01a91bfb2e84c8055bf7b635898fef3cae0b69e42ac5634c212d308e0e9091bd",
    "phi-3.5-moe": "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90",
    "glm-4.7": "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375",
    "qwen3.5": "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    "ling-3.0": "b4ab3a1c8f748e6f874d9aea102333efe7ab82528e8ab81c2eb155851e8705c6",
    "minimax-m2": "55beae30a60db5cef958f81f8f503df667a495675e560df6c364a9fb0ccba654",
}

# How each template wants a conversation: tool-call arguments as JSON strings (DeepSeek's templates
# concatenate them), no tools at all (Mixtral, Phi-3.5), one tool call per message (Llama 3.1), an opening
# user turn (Mistral's and Mixtral's alternation checks).
JSON_ARGUMENTS = {"deepseek-v3", "deepseek-v3.1", "deepseek-r1"}
NO_TOOLS = {"mixtral", "phi-3.5-moe"}
ONE_CALL_PER_MESSAGE = {"llama-3.1"}
USER_FIRST = {"mistral-nemo", "mixtral"}  # they also refuse two assistant turns in a row
CONTENT_PARTS = {"kimi-k2", "kimi-k2-thinking", "glm-4.5", "glm-4.7", "qwen3.5",
                 "minimax-m2"}  # the templates that read a list of content parts


def template_text(name: str) -> str:
    if name in SHIPPED:
        folder = SHIPPED[name]
        if (folder / "chat_template.jinja").is_file():
            return (folder / "chat_template.jinja").read_text(encoding="utf-8")
        return json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    return (ASSETS / name / "chat_template.jinja").read_text(encoding="utf-8")


def generation_text(name: str) -> str:
    return (ASSETS / name / "generation.jinja").read_text(encoding="utf-8")


def special_tokens(name: str) -> dict:
    """`{bos_token, eos_token, pad_token, unk_token, added_tokens: [[content, special], ...]}`."""
    if name not in SHIPPED:
        return json.loads((ASSETS / name / "special_tokens.json").read_text(encoding="utf-8"))
    config = json.loads((SHIPPED[name] / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = json.loads((SHIPPED[name] / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    return {**{key: config.get(key) for key in NAMED_TOKENS},
            "added_tokens": [[token["content"], token["special"]] for token in added]}


def tokenizer_folder(name: str, root: Path, flipped: bool = False) -> Path:
    """A tokenizer folder for template `name` under `root` (the module docstring)."""
    folder = root / (f"{name}-flipped" if flipped else name)
    if folder.is_dir():
        return folder
    folder.mkdir(parents=True)
    base = json.loads(BASE_TOKENIZER.read_text(encoding="utf-8"))
    size = len(base["model"]["vocab"])
    tokens = special_tokens(name)
    base["added_tokens"] = [{"id": size + k, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": special != flipped}
                            for k, (content, special) in enumerate(tokens["added_tokens"])]
    (folder / "tokenizer.json").write_text(json.dumps(base, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **{key: tokens[key] for key in NAMED_TOKENS if tokens.get(key)}, "chat_template": template_text(name)}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _result(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


TOOLS = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
    "type": "object", "properties": properties, "required": list(properties)}}}
    for name, description, properties in (
        ("multiply", "Multiply two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
        ("weather", "Today's weather in a city.", {"city": {"type": "string"}, "unit": {"type": "string"}}))]

SYSTEM = {"role": "system", "content": "You are a careful assistant. Réponds brièvement."}

# A system prompt; two tool calls in a row, each with its result (the first with numbers only, the
# second with strings), reasoning on every assistant turn; a final answer; a second user turn.
TOOL_CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "What is 6 × 7? Then the weather in Zürich."},
    {"role": "assistant", "content": "", "reasoning_content": "Multiply first.",
     "tool_calls": [_call("call00001", "multiply", {"a": 6, "b": 7})]},
    _result("call00001", "multiply", "42"),
    {"role": "assistant", "content": "", "reasoning_content": "Now the weather.",
     "tool_calls": [_call("call00002", "weather", {"city": "Zürich", "unit": "°C"})]},
    _result("call00002", "weather", "Sonnig, 21 °C"),
    {"role": "assistant", "content": "6 × 7 = 42. Zürich: sonnig, 21 °C.", "reasoning_content": "Both answered."},
    {"role": "user", "content": "Danke! Und 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "Easy."},
]

# Several tool calls in one assistant turn, then their results and the answer.
PARALLEL_CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo and in 東京?"},
    {"role": "assistant", "content": "",
     "tool_calls": [_call("call00003", "weather", {"city": "Oslo", "unit": "C"}),
                    _call("call00004", "weather", {"city": "東京", "unit": "C"})]},
    _result("call00003", "weather", "Rain, 8 C"),
    _result("call00004", "weather", "Clear, 18 C"),
    {"role": "assistant", "content": "Oslo: rain, 8 C. 東京: clear, 18 C."},
]

# Several plain turns with a system prompt, non-ASCII, several lines and a leading space.
CHAT_CONVERSATION = [
    SYSTEM,
    {"role": "user", "content": "Grüß dich! Wie geht's?"},
    {"role": "assistant", "content": "Gut, danke — und dir? 😊"},
    {"role": "user", "content": "List two colours."},
    {"role": "assistant", "content": "Red\nBlue"},
    {"role": "user", "content": "And one more?"},
    {"role": "assistant", "content": " Green.", "reasoning_content": "One more colour."},
]

# An assistant turn that opens the conversation, and an empty one.
OPENING_CONVERSATION = [
    {"role": "assistant", "content": "Welcome! How can I help?"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": ""},
    {"role": "user", "content": "Still there?"},
    {"role": "assistant", "content": "Yes."},
]
EMPTY_CONVERSATION = OPENING_CONVERSATION[1:]

# Reasoning inside the content, which Qwen3's, DeepSeek-V3.1's and GLM-4.5's templates cut out of it.
INLINE_REASONING_CONVERSATION = [
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "<think>\nSmall sum.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "<think>\nAlso small.\n</think>\n\nIt is 6."},
]


# The same call twice, without arguments, each with an empty result: turns and results that write no
# string, between which only the template's own text tells one turn from the next.
RETRY_CONVERSATION = [
    {"role": "user", "content": "Clean up, twice."},
    {"role": "assistant", "content": "", "tool_calls": [_call("call00005", "cleanup", {})]},
    _result("call00005", "cleanup", ""),
    {"role": "assistant", "content": "", "tool_calls": [_call("call00006", "cleanup", {})]},
    _result("call00006", "cleanup", ""),
    {"role": "assistant", "content": "Done."},
]
RETRY_TOOLS = [{"type": "function", "function": {"name": "cleanup", "description": "Clean up.", "parameters": {
    "type": "object", "properties": {}, "required": []}}}]

# Two assistant messages in a row, and reasoning of several lines with newlines around it (which
# Qwen3's template strips, so its values cannot be read off markers).
CONSECUTIVE_CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "First part.", "reasoning_content": "\nGreet.\nThen continue.\n"},
    {"role": "assistant", "content": "Second part."},
    {"role": "user", "content": "Ok"},
    {"role": "assistant", "content": "Bye.", "reasoning_content": "\nDone.\n"},
]

# A user turn of content parts.
PARTS_CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "the sea."}]},
    {"role": "assistant", "content": "Blue and wide."},
]


def conversations(name: str) -> dict[str, tuple[list[dict], list[dict] | None]]:
    """The test conversations for template `name`: `{label: (messages, tools)}` (the module docstring)."""
    cases = {"chat": (CHAT_CONVERSATION, None), "empty": (EMPTY_CONVERSATION, None),
             "inline": (INLINE_REASONING_CONVERSATION, None)}
    if name not in USER_FIRST:
        cases["opening"] = (OPENING_CONVERSATION, None)
        cases["consecutive"] = (CONSECUTIVE_CONVERSATION, None)
    if name not in NO_TOOLS:
        cases["tools"] = (TOOL_CONVERSATION, TOOLS)
        cases["retry"] = (RETRY_CONVERSATION, RETRY_TOOLS)
        if name not in ONE_CALL_PER_MESSAGE:
            cases["parallel"] = (PARALLEL_CONVERSATION, TOOLS)
    if name in CONTENT_PARTS:
        cases["parts"] = (PARTS_CONVERSATION, None)
    return {label: (_for_template(name, messages), tools) for label, (messages, tools) in cases.items()}


def _for_template(name: str, messages: list[dict]) -> list[dict]:
    messages = copy.deepcopy(messages)
    if name in JSON_ARGUMENTS:
        for message in messages:
            for call in message.get("tool_calls", ()):
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"], ensure_ascii=False)
    return messages


_PIECES = ["ok", "Hi", "yes", "42", "", " ", "Grüße", "東京", "a\nb", "<think>\nx\n</think>\n\ny", "same", "same", "\n",
           "Done."]


def random_conversation(name: str, seed: int) -> tuple[list[dict], list[dict] | None]:
    """A conversation drawn from `seed`, in the form template `name` reads: 1-5 user turns, each
    answered by one or two assistant messages (text drawn from short pieces, empty, repeated,
    non-ASCII, with newlines or a think block; reasoning sometimes; tool calls with no, numeric or
    string arguments and their results sometimes), a system prompt and a closing user turn sometimes.
    Some the template refuses (gpt-oss content and reasoning beside a tool call, Mistral's and
    Mixtral's alternation): mop must refuse them too."""
    r = random.Random(seed)

    def text() -> str:
        return r.choice(_PIECES) + (r.choice(_PIECES) if r.random() < 0.3 else "")

    messages = [{"role": "system", "content": text() or "Be brief."}] if r.random() < 0.4 else []
    calls = 0
    for _ in range(r.randint(1, 5)):
        messages.append({"role": "user", "content": text()})
        for _ in range(r.choice([1, 1, 1, 2])):
            answer = {"role": "assistant", "content": text()}
            if r.random() < 0.4:
                answer["reasoning_content"] = text()
            messages.append(answer)
            if name in NO_TOOLS or r.random() >= 0.35:
                continue
            count = 1 if name in ONE_CALL_PER_MESSAGE else r.choice([1, 1, 2])
            ids = [f"call{calls + k + 1:05d}" for k in range(count)]
            calls += len(ids)
            answer["tool_calls"] = [_call(i, r.choice(["weather", "cleanup"]), r.choice(
                [{}, {"a": r.randint(0, 9)}, {"city": text()}, {"a": 1, "city": text()}])) for i in ids]
            messages += [_result(i, "weather", text()) for i in ids]
    if messages[-1]["role"] == "assistant" and r.random() < 0.3:
        messages.append({"role": "user", "content": text()})
    tools = TOOLS + RETRY_TOOLS if calls else None
    return _for_template(name, messages), tools


def agent_conversation(name: str, seed: int) -> tuple[list[dict], list[dict]]:
    """An agent trace drawn from `seed`: a task, then 3-25 tool-calling turns (short content, or none
    and reasoning sometimes, one or two calls with no, numeric or string arguments) each followed by its
    results, a user's nudge now and then, and a final answer; long enough that turns are found from
    short prefix renderings (`mop.data.turns._prefixes`)."""
    r = random.Random(seed)

    def text() -> str:
        return r.choice(_PIECES) + (r.choice(_PIECES) if r.random() < 0.3 else "")

    messages = [{"role": "system", "content": "You are an agent."}] if r.random() < 0.5 else []
    messages.append({"role": "user", "content": "Do it." + text()})
    calls = 0
    for _ in range(r.randint(3, 25)):
        turn = {"role": "assistant", "content": "" if r.random() < 0.6 else text()}
        if not turn["content"] and r.random() < 0.5:  # reasoning or content beside a call, as gpt-oss reads them
            turn["reasoning_content"] = text() or "Think."
        count = 1 if name in ONE_CALL_PER_MESSAGE else r.choice([1, 1, 2])
        ids = [f"call{calls + k + 1:05d}" for k in range(count)]
        calls += len(ids)
        turn["tool_calls"] = [_call(i, "weather", r.choice([{}, {"a": r.randint(0, 99)}, {"city": text()},
                                                             {"a": 3, "city": text()}])) for i in ids]
        messages += [turn, *(_result(i, "weather", text()) for i in ids)]
        if r.random() < 0.1:
            messages.append({"role": "user", "content": text() or "Go on."})
    messages.append({"role": "assistant", "content": text() or "Done."})
    return _for_template(name, messages), TOOLS + RETRY_TOOLS

