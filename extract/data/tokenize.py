"""Conversations -> (input_ids, loss_mask) with the target's own chat template.

The loss mask covers exactly what the target generated: the content of each assistant
turn plus the end-of-turn token(s) that stopped it (e.g. `<|im_end|>`), and nothing of the
template around it (role headers, Qwen3's empty `<think>` block, the newline after
`<|im_end|>`). A reply cut by the token limit never emitted its end-of-turn token, so
there the end token is rendered but not trained on.

How: the conversation is rendered twice, once as is and once with every assistant
content replaced by a unique marker. The marker rendering cuts the text into template
pieces; the real rendering must be those pieces with the contents in between, which
gives the exact character span of every assistant content whatever the template does
around it. The text is then tokenized piece by piece, so every token belongs to one
piece and the mask follows from the pieces. Rendering prefixes and diffing token ids
does not work for every template: Qwen3 renders a past assistant turn differently (no
think block) from the last one, so a prefix of a conversation is not a prefix of its
rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.errors import UserError
from extract.data.problems import RowError

_PROBE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


class MissingChatTemplate(UserError):
    """The target's tokenizer has no usable chat template: no conversation can be rendered."""


class ChatTokenizer:
    """The target's tokenizer plus chat template, rendering conversations into training samples."""

    def __init__(self, model_dir: str | Path, chat_template_kwargs: dict[str, Any] | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.template_kwargs = dict(chat_template_kwargs or {})
        if not self.tokenizer.chat_template:
            raise MissingChatTemplate(
                f"{model_dir}: the tokenizer has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json); conversations cannot be rendered for this target"
            )
        self.end_of_turn = self._end_of_turn_ids()

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
            )
        except Exception as err:  # jinja raises for conversations a template rejects (e.g. role order)
            raise RowError("chat template error", str(err)) from err

    def prompt_length(self, messages: list[dict[str, str]]) -> int:
        """Tokens of the prompt the server sees when asked to continue `messages`."""
        return len(self._encode(self.render(messages, add_generation_prompt=True)))

    def encode(self, messages: list[dict[str, str]], finished: list[bool]) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of a conversation; `finished[k]`: assistant turn k ended by itself."""
        text, spans = self._render_with_spans(messages)
        if len(finished) != len(spans):
            raise ValueError(f"{len(spans)} assistant turns but {len(finished)} finished flags")
        ids: list[int] = []
        mask: list[int] = []
        pos = 0
        for k, (start, end) in enumerate(spans):
            piece_start = len(ids)
            self._append(ids, mask, text[pos:start], 0)
            if k > 0 and finished[k - 1]:
                self._mark_end_of_turn(ids, mask, piece_start)
            self._append(ids, mask, text[start:end], 1)
            pos = end
        piece_start = len(ids)
        self._append(ids, mask, text[pos:], 0)
        if spans and finished[-1]:
            self._mark_end_of_turn(ids, mask, piece_start)
        return ids, mask

    def _render_with_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character span of every assistant content in it."""
        markers, marked = [], []
        for m in messages:
            if m["role"] == "assistant":
                markers.append(f"\ue000dspark-reply-{len(markers)}\ue001")  # private-use chars: never in data
                m = {**m, "content": markers[-1]}
            marked.append(m)
        text = self.render(messages)
        pieces = _split_on(self.render(marked), markers)
        spans, pos = [], 0
        for k, piece in enumerate(pieces[:-1]):
            if not text.startswith(piece, pos):
                raise _not_verbatim(k)
            start = pos + len(piece)
            nxt = pieces[k + 1]
            end = len(text) - len(nxt) if k + 1 == len(pieces) - 1 else text.find(nxt, start)
            if end < start or not text.startswith(nxt, end):
                raise _not_verbatim(k)
            spans.append((start, end))
            pos = end
        if pos + len(pieces[-1]) != len(text):
            raise _not_verbatim(len(spans))
        return text, spans

    def _mark_end_of_turn(self, ids: list[int], mask: list[int], start: int) -> None:
        n = len(self.end_of_turn)
        if n and ids[start : start + n] == self.end_of_turn:
            mask[start : start + n] = [1] * n

    def _append(self, ids: list[int], mask: list[int], piece: str, value: int) -> None:
        piece_ids = self._encode(piece)
        ids.extend(piece_ids)
        mask.extend([value] * len(piece_ids))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _end_of_turn_ids(self) -> list[int]:
        """The special tokens the template puts right after an assistant reply (what the model emits to stop)."""
        try:
            text, spans = self._render_with_spans(_PROBE)
        except RowError as err:
            raise MissingChatTemplate(
                f"the chat template cannot render a plain user/assistant exchange: {err}"
            ) from err
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        }
        end = []
        for token in self._encode(text[spans[0][1] :]):
            if token not in special:
                break
            end.append(token)
        return end


def _split_on(text: str, markers: list[str]) -> list[str]:
    """`text` cut at each marker, which must appear once and in order."""
    pieces, pos = [], 0
    for k, marker in enumerate(markers):
        at = text.find(marker, pos)
        if at < 0 or text.count(marker) != 1:
            raise _not_verbatim(k)
        pieces.append(text[pos:at])
        pos = at + len(marker)
    pieces.append(text[pos:])
    return pieces


def _not_verbatim(turn: int) -> RowError:
    return RowError(
        "assistant turn not in rendered template",
        f"assistant turn {turn}: the chat template does not render it as plain text between template pieces",
    )
