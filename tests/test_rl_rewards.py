"""The shipped verifiable rewards and how a run names one (`mop.rl.rewards`)."""

import pytest

from mop.config import ConfigError
from mop.rl.rewards import boxed_number, exact_match, reward_function, think_answer_format


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42.", "42") == exact_match("4 2", "42") == 0.0


def test_boxed_number_reads_the_last_box_as_a_number():
    assert boxed_number("so \\boxed{3} or rather \\boxed{ 4.0 }", "4") == 1.0
    assert boxed_number("\\boxed{4} then \\boxed{5}", "4") == 0.0
    assert boxed_number("the answer is 4", "4") == boxed_number("\\boxed{four}", "4") == 0.0


def test_the_format_check_wants_think_then_answer():
    assert think_answer_format("<think>a\nb</think>\n<answer>7</answer>\n", "") == 1.0
    assert think_answer_format("<answer>7</answer>", "") == think_answer_format("<think>a</think> 7", "") == 0.0
    assert think_answer_format("<think>a</think><answer>7</answer> more", "") == 0.0


def test_a_reward_is_named_by_its_name_or_as_module_function():
    assert reward_function("exact_match") is exact_match
    assert reward_function("mop.rl.rewards:boxed_number") is boxed_number
    for bad, said in (("close_enough", "none of"), ("no.such.module:f", "cannot be imported"),
                      ("mop.rl.rewards:REWARDS", "not callable")):
        with pytest.raises(ConfigError, match=said):
            reward_function(bad)
