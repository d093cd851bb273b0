"""Verifiable rewards for the RL loop: a completion's text and the prompt's reference answer ->
a reward in [0, 1]. A run names one (`reward_function`): a shipped one by its name, or any Python
callable `module:function` of the same signature.

- `exact_match`: 1 when the completion, stripped of surrounding whitespace, is the answer;
- `boxed_number`: 1 when the last `\\boxed{...}` of the completion holds the answer's number (as
  numbers: "0.50" is "1/2"'s 0.5 only if written as a decimal; fractions are not parsed);
- `think_answer_format`: 1 when the completion is `<think>...</think>` then `<answer>...</answer>`
  (whitespace between and around), the format check reasoning runs are started with.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

from mop.config import ConfigError

Reward = Callable[[str, str], float]
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def boxed_number(completion: str, answer: str) -> float:
    boxed = BOXED.findall(completion)
    if not boxed:
        return 0.0
    try:
        return float(float(boxed[-1].strip()) == float(answer.strip()))
    except ValueError:
        return 0.0


def think_answer_format(completion: str, answer: str) -> float:
    return float(THINK_ANSWER.fullmatch(completion) is not None)


REWARDS: dict[str, Reward] = {"exact_match": exact_match, "boxed_number": boxed_number,
                              "think_answer_format": think_answer_format}


def reward_function(name: str, setting: str = "rl.reward") -> Reward:
    """The reward a run names: a shipped one, or `module:function` (one-line `ConfigError` otherwise)."""
    if name in REWARDS:
        return REWARDS[name]
    module, _, function = name.partition(":")
    if not function:
        raise ConfigError(setting, f"{name!r} is none of {', '.join(REWARDS)} and not module:function")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise ConfigError(setting, f"{name!r} cannot be imported ({e}); name a shipped reward or an importable "
                          "module:function") from None
    if not callable(found):
        raise ConfigError(setting, f"{name!r} is not callable")
    return found
