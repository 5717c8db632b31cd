"""The authors' format term (reward.format = think_boxed) and prompt (EasyR1 math.jinja templates)."""

from __future__ import annotations

import pytest

# EasyR1 v0.3.2.dev0 examples/format_prompt/math.jinja, the authors' format prompt (one line of data)
MATH_JINJA = ("{{ content | trim }} You FIRST think about the reasoning process as an internal monologue and then "
              "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The "
              "final answer MUST BE put in \\boxed{}.\n")


def test_think_boxed_format_is_easyr1_format_reward():
    """reward.format = think_boxed: EasyR1 v0.3.2.dev0 examples/reward_function/math.py::format_reward applied after
    its whitespace normalisation re.sub(r"\\s*(<|>|/)\\s*", r"\\1", response)."""
    import re

    from laconic_nemo.rewards.format import think_boxed_format

    def easyr1(response):
        response = re.sub(r"\s*(<|>|/)\s*", r"\1", response)
        return 1.0 if re.fullmatch(re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL), response) else 0.0

    cases = [
        "<think>\nadd them</think>\nThe answer is \\boxed{5}.",
        "<think>a</think>\\boxed{5}",
        " < think >x< / think > so \\boxed{5}",       # spaces around the tags are normalised away
        "add them</think>\nThe answer is \\boxed{5}.",  # no opening tag (a chat template that opens <think>)
        "<think>x</think> The answer is 5.",            # no box
        "\\boxed{5}<think>x</think>",                    # box before the thinking
        "<think>x</think>\\boxed{}",                     # empty box: .* matches nothing
    ]
    got = [think_boxed_format(c) for c in cases]
    assert got == [easyr1(c) for c in cases]
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_reward_fn_think_boxed_weights_accuracy_and_format():
    from laconic_nemo.config import RewardConfig
    from laconic_nemo.rewards.format import build_reward_fn

    fn, grader = build_reward_fn(RewardConfig(num_workers=0, timeout_s=5.0, format_weight=0.1, format="think_boxed"),
                                 checker=lambda pred, golds: pred in golds)
    try:
        scores, metrics = fn(["<think>x</think>\\boxed{5}", "x</think>\\boxed{5}", "<think>x</think>\\boxed{4}",
                              "no answer"], ["5", "5", "5", "5"])
    finally:
        grader.close()
    assert scores == pytest.approx([1.0, 0.9, 0.1, 0.0])
    assert metrics["format"] == pytest.approx(0.5) and metrics["correct"] == 2
    with pytest.raises(ValueError, match="reward.format"):
        build_reward_fn(RewardConfig(num_workers=0, timeout_s=5.0, format="xml"))


@pytest.mark.parametrize("template", ["deepseek_r1_easyr1_math", "qwen3_easyr1_math", "qwen_math_easyr1_math"])
def test_easyr1_math_templates_put_math_jinja_in_the_user_turn(template):
    """The user turn is math.jinja rendered as EasyR1's RLHFDataset does (Template(text.strip()).render(content=...)),
    and the template writes it out between the chat markers."""
    jinja2 = pytest.importorskip("jinja2")
    from laconic_nemo.data.datasets import chat_messages, render

    problem = "  Find $x$ if $x^{2} = 4$ and x > 0.\n"
    user = jinja2.Template(MATH_JINJA.strip()).render(content=problem)
    assert chat_messages(template, problem)[-1] == {"role": "user", "content": user}
    text = render(template, problem)
    before, after = text.split(user)
    assert before.endswith(("<｜User｜>", "<|im_start|>user\n"))
    assert after in ("<｜Assistant｜><think>\n", "<|im_end|>\n<|im_start|>assistant\n")
