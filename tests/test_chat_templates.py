"""Assistant targets on published chat templates (issue 36), against an oracle that is not mop: each
template's copy with `{% generation %}` around what the model writes, read through transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` (`chat_cases` names the templates,
their sources and the conversations). Token ids and targets equal transformers' token by token, with
each tokenizer's real special flags and with every flag flipped; a template with generation blocks
is used as it marks them; and each template's targets on the tool conversation read as written here."""

import hashlib
import json

import numpy as np
import pytest

import chat_cases
from mop.data.conversations import conversation
from mop.data.errors import ConversationError, DataError
from mop.data.prepared import ChatSettings
from mop.data.templates import Conversation


CONVERSATIONS = chat_cases.ROOT / "mop" / "data" / "corpus" / "conversations.jsonl"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-templates")
    return lambda name, flipped=False: chat_cases.tokenizer_folder(name, root, flipped)


def oracle(folder, messages, tools, template: str):
    """transformers' ids and assistant mask for `template` (None where it refuses the conversation)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, chat_template=template)
    except Exception:  # noqa: BLE001 - the template's own raise_exception or a Jinja error: a refused conversation
        return None
    return out["input_ids"], np.asarray(out["assistant_masks"], dtype=bool)


def mop_encoding(template, messages, tools):
    try:
        return template.encode(Conversation(messages, tools))
    except ConversationError:
        return None


def assert_equal_to_the_oracle(name: str, folder, template):
    generation = chat_cases.generation_text(name)
    for label, (messages, tools) in chat_cases.conversations(name).items():
        expected, mine = oracle(folder, messages, tools, generation), mop_encoding(template, messages, tools)
        assert expected is not None, f"{name} {label}: transformers refuses the conversation"
        assert mine is not None, f"{name} {label}: mop refuses the conversation"
        real = oracle(folder, messages, tools, chat_cases.template_text(name))
        assert real[0] == expected[0], f"{name} {label}: the generation copy renders other text"
        assert mine[0].tolist() == expected[0], f"{name} {label}: token ids"
        assert mine[1].tolist() == expected[1].tolist(), f"{name} {label}: targets"


def test_the_templates_are_the_published_ones():
    for name in chat_cases.TEMPLATES:
        text = chat_cases.template_text(name).encode("utf-8")
        assert hashlib.sha256(text).hexdigest() == chat_cases.SHA256[name], name


@pytest.mark.parametrize("name", chat_cases.TEMPLATES)
def test_ids_and_targets_equal_the_generation_marked_oracle(name, folders):
    folder = folders(name)
    assert_equal_to_the_oracle(name, folder, ChatSettings(str(folder)).template())


@pytest.mark.parametrize("name", chat_cases.TEMPLATES)
def test_random_conversations_train_what_the_oracle_marks(name, folders):
    """40 drawn conversations and, with tools, 10 agent traces per template (`chat_cases`): equal, or
    refused by both."""
    folder = folders(name)
    template, generation = ChatSettings(str(folder)).template(), chat_cases.generation_text(name)
    drawn = [chat_cases.random_conversation(name, seed) for seed in range(40)]
    if name not in chat_cases.NO_TOOLS:
        drawn += [chat_cases.agent_conversation(name, seed) for seed in range(10)]
    for seed, (messages, tools) in enumerate(drawn):
        expected, mine = oracle(folder, messages, tools, generation), mop_encoding(template, messages, tools)
        assert (expected is None) == (mine is None), f"{name} seed {seed}: one side refuses the conversation"
        if expected is not None:
            assert mine[0].tolist() == expected[0] and mine[1].tolist() == expected[1].tolist(), f"{name} seed {seed}"


@pytest.mark.parametrize("name", chat_cases.TEMPLATES)
def test_targets_do_not_depend_on_which_tokens_are_flagged_special(name, folders):
    folder = folders(name, flipped=True)
    assert_equal_to_the_oracle(name, folder, ChatSettings(str(folder)).template())


@pytest.mark.parametrize("name", chat_cases.TEMPLATES)
def test_a_template_with_generation_blocks_is_used_as_it_marks_them(name, folders, tmp_path):
    marked = tmp_path / "generation.jinja"
    marked.write_text(chat_cases.generation_text(name), encoding="utf-8")
    folder = folders(name)
    template = ChatSettings(str(folder), chat_template=str(marked)).template()
    assert template.marks_generation
    assert_equal_to_the_oracle(name, folder, template)


@pytest.mark.parametrize("name", sorted(chat_cases.SHIPPED))
def test_the_shipped_conversations_train_what_the_oracle_marks(name):
    """All 439 shipped conversations (system prompts, tools, reasoning, several turns) through the two
    templates mop ships."""
    from transformers import AutoTokenizer

    folder = chat_cases.SHIPPED[name]
    template, tokenizer = ChatSettings(str(folder)).template(), AutoTokenizer.from_pretrained(str(folder))
    generation = chat_cases.generation_text(name)
    with CONVERSATIONS.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            row = conversation(line)
            ids, targets = template.encode(row)
            out = tokenizer.apply_chat_template(row.messages, tools=row.tools, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True, chat_template=generation)
            assert (ids.tolist(), targets.tolist()) == (out["input_ids"], [bool(m) for m in out["assistant_masks"]]), \
                f"conversation {number}"


# What each template trains of the tool conversation (`chat_cases.TOOL_CONVERSATION`): a system
# prompt, a tool call with numbers and its result, a tool call with strings and its result, the
# answer, a second user turn and its answer, every assistant turn with reasoning. Each entry is one
# run of consecutive targets, decoded. Notes: DeepSeek-V3's template writes a tool call only when
# the message's content is None, which transformers drops, so its tool-call turns are empty; Qwen3,
# GLM-4.5, Kimi-K2-Thinking and gpt-oss drop reasoning before the last user turn (gpt-oss keeps the
# last turn's); GLM-4.5 closes no turn itself: its turns end with the next message's role token, the
# token generation stops on, and the last turn has none; gpt-oss writes the first tool call alone.
# Qwen3-2507 Thinking's and Nemotron-3-Nano's generation prompts open a think block (`<think>\n`),
# which is never trained: Qwen3-2507 drops earlier turns' reasoning, Nemotron-3-Nano renders it
# closed and empty, `<think></think>`, whose `</think>` the model writes after the prompt's `<think>`.
# DeepSeek-R1 (January 2025) writes a second tool-calling message with no header, straight after the
# tool output: the turn starts where the output ends.
TOOL_TARGETS = {
    "deepseek-v3": [
        "<｜end▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<｜end▁of▁sentence｜>",
        "2 + 2 = 4.<｜end▁of▁sentence｜>"],
    "deepseek-v3.1": [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>multiply<｜tool▁sep｜>{"a": 6, "b": 7}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Zürich", "unit": "°C"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<｜end▁of▁sentence｜>",
        "2 + 2 = 4.<｜end▁of▁sentence｜>"],
    "kimi-k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.multiply:0<|tool_call_argument_begin|>"
        '{"a": 6, "b": 7}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0<|tool_call_argument_begin|>"
        '{"city": "Zürich", "unit": "°C"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "2 + 2 = 4.<|im_end|>"],
    "kimi-k2-thinking": [
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>call00001<|tool_call_argument_begin|>"
        '{"a": 6, "b": 7}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>call00002<|tool_call_argument_begin|>"
        '{"city": "Zürich", "unit": "°C"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "<think></think>6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "<think></think>2 + 2 = 4.<|im_end|>"],
    "glm-4.5": [
        "\n<think></think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>6</arg_value>\n<arg_key>b</arg_key>\n"
        "<arg_value>7</arg_value>\n</tool_call><|observation|>",
        "\n<think></think>\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"
        "<arg_key>unit</arg_key>\n<arg_value>°C</arg_value>\n</tool_call><|observation|>",
        "\n<think></think>\n6 × 7 = 42. Zürich: sonnig, 21 °C.<|user|>",
        "\n<think>Easy.</think>\n2 + 2 = 4."],
    "gpt-oss": [
        ' to=functions.multiply<|channel|>commentary json<|message|>{"a": 6, "b": 7}<|call|>',
        ' to=functions.weather<|channel|>commentary json<|message|>{"city": "Zürich", "unit": "°C"}<|call|>',
        "<|channel|>final<|message|>6 × 7 = 42. Zürich: sonnig, 21 °C.<|end|>",
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"],
    "qwen3": [
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich", "unit": "°C"}}\n</tool_call><|im_end|>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "<think>\nEasy.\n</think>\n\n2 + 2 = 4.<|im_end|>"],
    "mistral-nemo": [
        '[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 6, "b": 7}, "id": "call00001"}]</s>',
        '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Zürich", "unit": "°C"}, "id": "call00002"}]</s>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.</s>",
        "2 + 2 = 4.</s>"],
    "llama-3.1": [
        '{"name": "multiply", "parameters": {"a": 6, "b": 7}}<|eot_id|>',
        '{"name": "weather", "parameters": {"city": "Zürich", "unit": "°C"}}<|eot_id|>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|eot_id|>",
        "2 + 2 = 4.<|eot_id|>"],
    "qwen3-thinking-2507": [
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich", "unit": "°C"}}\n</tool_call><|im_end|>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "Easy.\n</think>\n\n2 + 2 = 4.<|im_end|>"],
    "nemotron-3-nano": [
        "</think>\n<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n"
        "</function>\n</tool_call>\n<|im_end|>",
        "</think>\n<tool_call>\n<function=weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=unit>\n°C\n"
        "</parameter>\n</function>\n</tool_call>\n<|im_end|>",
        "</think>\n6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "Easy.\n</think>\n2 + 2 = 4.<|im_end|>"],
    "qwen3-coder": [
        "<tool_call>\n<function=multiply>\n<parameter=a>\n6\n</parameter>\n<parameter=b>\n7\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>",
        "<tool_call>\n<function=weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=unit>\n°C\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>",
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|im_end|>",
        "2 + 2 = 4.<|im_end|>"],
    "deepseek-r1": [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{"a": 6, "b": 7}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{"city": "Zürich", "unit": "°C"}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<｜end▁of▁sentence｜>",
        "2 + 2 = 4.<｜end▁of▁sentence｜>"],
    "llama-4": [
        '<|python_start|><|python_end|>{"name": "multiply", "parameters": {"a": 6, "b": 7}}<|eot|>',
        '<|python_start|><|python_end|>{"name": "weather", "parameters": {"city": "Zürich", "unit": "°C"}}<|eot|>',
        "6 × 7 = 42. Zürich: sonnig, 21 °C.<|eot|>",
        "2 + 2 = 4.<|eot|>"],
}


@pytest.mark.parametrize("name", sorted(TOOL_TARGETS))
def test_the_tool_conversation_trains_what_the_model_writes(name, folders):
    template = ChatSettings(str(folders(name))).template()
    messages, tools = chat_cases.conversations(name)["tools"]
    ids, targets = template.encode(Conversation(messages, tools))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], targets.astype(int), [0]])))
    runs = [template.tokenizer.decode(ids[a:b], special=True) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == TOOL_TARGETS[name]


def test_mixtral_trains_the_space_its_answers_start_with(folders):
    template = ChatSettings(str(folders("mixtral"))).template()
    messages, _ = chat_cases.conversations("mixtral")["chat"]
    ids, targets = template.encode(Conversation(messages))
    edges = np.flatnonzero(np.diff(np.concatenate([[0], targets.astype(int), [0]])))
    runs = [template.tokenizer.decode(ids[a:b], special=True) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == [" Gut, danke — und dir? 😊</s>", " Red\nBlue</s>", "  Green.</s>"]


# Two template shapes no test template above has, each with its copy marking what the model writes:
# a generation prompt that opens a think block earlier turns do not show (DeepSeek-R1's, Qwen3-2507
# Thinking's), and a template that needs a system prompt (so its probes must give it one).
FORCED_THINK = ("{% for m in messages %}{% if m.role == 'user' %}<U>{{ m.content }}"
                "{% elif m.role == 'system' %}<S>{{ m.content }}{% else %}{{ '<A>' }}{% generation %}"
                "{{ m.content.split('</think>')[-1] + '<E>' }}{% endgeneration %}"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<A><think>\n{% endif %}")
NEEDS_SYSTEM = ("{% if messages[0].role != 'system' %}{{ raise_exception('a system prompt first') }}{% endif %}"
                "{% for m in messages %}{% if m.role == 'assistant' %}{{ '### Answer:\n' }}{% generation %}"
                "{{ m.content + '\n### End' }}{% endgeneration %}{{ '\n\n' }}{% else %}### {{ m.role }}:\n"
                "{{ m.content }}\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Answer:\n{% endif %}")
# And one that numbers every message after its text, so that a short prefix rendering (`turns._prefixes`)
# ends unlike the whole and the full prefix is rendered instead.
NUMBERED = ("{% for m in messages %}{% if m.role == 'assistant' %}A: {% generation %}{{ m.content }} "
            "[{{ loop.index }}]{% endgeneration %}{{ '\\n' }}"
            "{% else %}{{ m.role }}: {{ m.content }} [{{ loop.index }}]\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}A: {% endif %}")
# And a generation prompt that opens a think block which earlier turns render closed and empty
# (Nemotron-3-Nano's), or leave out after the last user turn: the prompt's `<think>` is never a target.
THINK_CLOSED = ("{% set ns = namespace(last=-1) %}{% for m in messages if m.role == 'user' %}{% set ns.last = "
                "loop.index0 %}{% endfor %}{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user\n"
                "{{ m.content }}<|im_end|>\n{% elif m.role == 'system' %}<|im_start|>system\n{{ m.content }}<|im_end|>\n"
                "{% elif loop.index0 < ns.last %}<|im_start|>assistant\n<think>{% generation %}</think>"
                "{{ m.content.split('</think>')[-1] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
                "{% else %}<|im_start|>assistant\n{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
                "{{ '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
# And a generation prompt with text before the header earlier turns show.
PREFIXED = ("{% for m in messages %}{% if m.role == 'assistant' %}<A>{% generation %}{{ m.content + '<E>' }}"
            "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}(be brief)<A>{% endif %}")
# And the two shapes of issue 64. A template that writes the next assistant header and an opening `<think>\n`
# after every conversation, whether or not the generation prompt is asked, dropping the reasoning of its turns
# (with ChatML's shared header opening `<|im_start|>`, and with a role token of its own per header, written as
# plain text here):
ALWAYS_THINK = ("{% for m in messages %}<|im_start|>{{ m.role + '\\n' }}{% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content.split('</think>')[-1] + '<|im_end|>' }}{% endgeneration %}"
                "{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{{ '<|im_start|>assistant\\n<think>\\n' }}")
ALWAYS_THINK_ROLES = ("{% for m in messages %}<|{{ m.role }}|>{{ '\\n' }}{% if m.role == 'assistant' %}"
                      "{% generation %}{{ m.content.split('</think>')[-1] + '<|end|>' }}{% endgeneration %}"
                      "{% else %}{{ m.content + '<|end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
                      "{{ '<|assistant|>\\n<think>\\n' }}")
# And one that ends an unprompted rendering with the tokenizer's eos token, the model ending each turn with
# its own `<|end|>` (Phi-3.5's):
EOS_UNPROMPTED = ("{% for m in messages %}<|{{ m.role }}|>{{ '\\n' }}{% if m.role == 'assistant' %}{% generation %}"
                  "{{ m.content + '<|end|>' }}{% endgeneration %}{% else %}{{ m.content + '<|end|>' }}{% endif %}"
                  "{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
                  "{{ eos_token }}{% endif %}")
SHAPE_CONVERSATION = [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Line one\nLine two: what is 2+2?"},
                      {"role": "assistant", "content": "<think>\nAdd.\n</think>4"},
                      {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<b>6</b>"},
                      {"role": "user", "content": "4+4?"}, {"role": "assistant", "content": "<think>8"},
                      {"role": "user", "content": ""}, {"role": "assistant", "content": "10"},
                      {"role": "user", "content": "5+5?"}, {"role": "assistant", "content": "<t>10</t>"}]
# A single turn, and an empty turn in the middle and at the end (its end-of-turn text is still the model's).
SHORT_CONVERSATIONS = [SHAPE_CONVERSATION[:2] + [{"role": "assistant", "content": "4"}],
                       [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": "Again?"}, {"role": "assistant", "content": ""}]]


@pytest.mark.parametrize("generation", [FORCED_THINK, THINK_CLOSED, NEEDS_SYSTEM, NUMBERED, PREFIXED, ALWAYS_THINK,
                                        ALWAYS_THINK_ROLES, EOS_UNPROMPTED],
                         ids=["forced-think", "think-closed", "needs-system", "numbered", "prefixed", "always-think",
                              "always-think-roles", "eos-unprompted"])
def test_template_shapes_train_what_the_marked_copy_marks(generation, tmp_path):
    from transformers import AutoTokenizer

    plain = tmp_path / "plain.jinja"
    plain.write_text(generation.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    folder = chat_cases.SHIPPED["qwen3"]
    template = ChatSettings(str(folder), chat_template=str(plain)).template()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    needs_system = generation is NEEDS_SYSTEM
    for messages in [SHAPE_CONVERSATION] + [SHAPE_CONVERSATION[:1] + m if needs_system else m
                                            for m in SHORT_CONVERSATIONS]:
        ids, targets = template.encode(Conversation(messages))
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, chat_template=generation)
        assert ids.tolist() == out["input_ids"], len(messages)
        assert targets.tolist() == [bool(m) for m in out["assistant_masks"]], tokenizer.decode(
            [i for i, m in zip(ids.tolist(), targets.tolist()) if m])
        assert targets.sum() > 0


def test_a_generation_block_whose_place_cannot_be_told_is_refused(tmp_path):
    for inside in ("{% macro turn(m) %}{% generation %}{{ m.content }}{% endgeneration %}{% endmacro %}"
                   "{% for m in messages %}{{ turn(m) }}{% endfor %}",
                   "{% for m in messages %}{% set text %}{% generation %}{{ m.content }}{% endgeneration %}{% endset %}"
                   "{{ text }}{% endfor %}"):
        path = tmp_path / "inside.jinja"
        path.write_text(inside)
        with pytest.raises(DataError, match=r"data\.chat_template: .*inside\.jinja has a \{% generation %\} block "
                                            r"inside a macro or a set, filter or call block"):
            ChatSettings(str(chat_cases.SHIPPED["qwen3"]), chat_template=str(path)).template()


@pytest.mark.parametrize("name", chat_cases.TEMPLATES)
def test_finding_turns_renders_a_bounded_number_of_messages_per_turn(name, folders, monkeypatch):
    """Twice the turns, at most about twice the messages rendered: each turn is found from renderings
    of a short conversation (`mop.data.turns._prefixes`), whatever the template checks."""
    template = ChatSettings(str(folders(name))).template()
    rendered = []
    render = template.render
    monkeypatch.setattr(template, "render", lambda conversation, prompt=False, messages=None, **kw: (
        rendered.append(len(conversation.messages if messages is None else messages)),
        render(conversation, prompt, messages, **kw))[1])
    counts = []
    for rounds in (20, 40):
        rendered.clear()
        template.encode(Conversation([m for k in range(rounds) for m in (
            {"role": "user", "content": f"Question {k}?"}, {"role": "assistant", "content": f"Answer {k}."})]))
        counts.append(sum(rendered))
    assert counts[1] <= 2.2 * counts[0], counts



@pytest.mark.parametrize("generation, summary, marked", [
    (ALWAYS_THINK, "generation prompt '<|im_start|>assistant\\n<think>\\n', written after every conversation (not "
                   "trained after the last message)",
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n⟦4<|im_end|>⟧\n<|im_start|>user\nAgain?<|im_end|>\n"
     "<|im_start|>assistant\n⟦6<|im_end|>⟧\n<|im_start|>assistant\n<think>"),
    (EOS_UNPROMPTED, "generation prompt '<|assistant|>\\n'; '<|im_end|>' written after the last message without it "
                     "(not trained)",
     "<|user|>\nHi<|end|>\n<|assistant|>\n⟦4<|end|>⟧\n<|user|>\nAgain?<|end|>\n<|assistant|>\n⟦6<|end|>⟧\n"
     "<|im_end|>")], ids=["always-think", "eos-unprompted"])
def test_inspect_shows_what_each_shape_trains(generation, summary, marked, tmp_path, capsys):
    from mop.cli import main

    plain = tmp_path / "plain.jinja"
    plain.write_text(generation.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "4"},
                                               {"role": "user", "content": "Again?"},
                                               {"role": "assistant", "content": "6"}]}) + "\n")
    assert main(["data", "inspect", str(source), "--tokenizer", str(chat_cases.SHIPPED["qwen3"]),
                 "--chat-template", str(plain), "--color", "never"]) == 0
    head, _, text = capsys.readouterr().out.partition("\n\n")
    assert head == f"── chat template {plain}: {summary}"
    assert text.split("\n", 1)[1] == marked + "\n\n"
