"""chat_template.render: transformers' keywords (add_generation_prompt,
continue_final_message, tools) and the client's own variables, which may
not replace the reserved names; conflicts are errors naming the field."""

from __future__ import annotations

import pytest

from deepserve.chat_template import MAX_TEMPLATE_KWARGS, RESERVED, render
from deepserve.errors import InvalidRequestError

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}"
            "{% if enable_thinking %}<think>{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, wor"}]


def test_generation_prompt_tools_and_kwargs():
    assert render(TEMPLATE, CHAT[:1], {}) == "<user>hi</user><assistant>"
    assert render(TEMPLATE, CHAT[:1], {}, add_generation_prompt=False) == "<user>hi</user>"
    assert render(TEMPLATE, CHAT[:1], {}, tools=[{"a": 1}, {"b": 2}],
                  template_kwargs={"enable_thinking": True}) == \
        "<user>hi</user>[2 tools]<think><assistant>"


def test_continue_final_message_leaves_the_last_message_open():
    text = render(TEMPLATE, CHAT, {}, add_generation_prompt=False, continue_final_message=True)
    assert text == "<user>hi</user><assistant>Hello, wor"
    with pytest.raises(InvalidRequestError) as info:
        render(TEMPLATE, CHAT, {}, add_generation_prompt=True, continue_final_message=True)
    assert info.value.param == "continue_final_message"


@pytest.mark.parametrize("kwargs", [{name: 1} for name in sorted(RESERVED)] + [
    {"not an identifier": 1}, {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}])
def test_reserved_or_too_many_kwargs_are_refused(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        render(TEMPLATE, CHAT[:1], {}, template_kwargs=kwargs)
    assert info.value.param == "chat_template_kwargs"


def test_kwargs_at_the_bound_pass():
    render(TEMPLATE, CHAT[:1], {}, template_kwargs={f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS)})
