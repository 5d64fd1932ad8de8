"""Conversations -> (input_ids, loss_mask) with the target's own chat template.

The loss mask covers exactly what the target generated in each assistant turn: from the
end of the generation prompt the server would have rendered for that turn (so
`<|im_start|>assistant\n` and an empty think block the template adds are not scored) to
the end-of-turn token(s) that stopped it (e.g. `<|im_end|>`). That covers the turn's
reasoning as the template renders it (`<think>...</think>` with thinking on), its content,
and its tool calls. A reply cut by the token limit never emitted its end-of-turn token, so
there the end token is rendered but not trained on. Tool results and every other role are
context, never scored. With thinking on, a turn whose reasoning the template drops (Qwen3
drops it before the last user query) is not what the target emits in that mode: it stays
as context, unscored, and is counted. With thinking off, reasoning is removed.

How: the conversation is rendered twice, once as is and once with every assistant
content and reasoning replaced by a unique marker. The marker rendering cuts the text
into template pieces; the real rendering must be those pieces with the values in between,
which gives the exact character span of every value whatever the template does around
it. A turn starts where its generation prompt stops matching the rendering (cut back to
a token boundary of the prompt), and ends at the end-of-turn text after its last value.
The text is then tokenized piece by piece, so every token belongs to one piece and the
mask follows from the pieces. Rendering prefixes and diffing token ids does not work for
every template: Qwen3 renders a past assistant turn differently (no think block) from
the last one, so a prefix of a conversation is not a prefix of its rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.errors import UserError
from dspark.extract.data.problems import RowError

_PROBE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]


class MissingChatTemplate(UserError):
    """The target's tokenizer has no usable chat template: no conversation can be rendered."""


class ChatTokenizer:
    """The target's tokenizer plus chat template, rendering conversations into training samples."""

    def __init__(self, model_dir: str | Path, chat_template_kwargs: dict[str, Any] | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.template_kwargs = dict(chat_template_kwargs or {})
        # Reasoning is kept and scored only when the template's `enable_thinking` is true.
        self.thinking = self.template_kwargs.get("enable_thinking") is True
        if not self.tokenizer.chat_template:
            raise MissingChatTemplate(
                f"{model_dir}: the tokenizer has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json); conversations cannot be rendered for this target"
            )
        self.end_of_turn = self._end_of_turn_ids()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as err:  # jinja raises for conversations a template rejects (e.g. role order)
            raise RowError("chat template error", str(err)) from err

    def prompt_length(self, messages: list[dict], tools: list | None = None) -> int:
        """Tokens of the prompt the server sees when asked to continue `messages`."""
        return len(self._encode(self.render(messages, add_generation_prompt=True, tools=tools)))

    def prepare(self, message: dict[str, Any]) -> dict[str, Any]:
        """An assistant message with its reasoning as `reasoning_content` (thinking on) or without any (off).

        Reasoning inside the content (`<think>...</think>`, what a server without a reasoning
        parser returns) is split off the way Qwen3's template does it.
        """
        if message["role"] != "assistant":
            return message
        out = dict(message)
        content, reasoning = out["content"], out.pop("reasoning_content", None)
        if reasoning is None and "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        out["content"] = content
        if self.thinking and reasoning:
            out["reasoning_content"] = reasoning
        return out

    def encode(
        self, messages: list[dict], finished: list[bool], tools: list | None = None
    ) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of a conversation; `finished[k]`: assistant turn k ended by itself."""
        ids, mask, _ = self.encode_turns(messages, finished, tools)
        return ids, mask

    def encode_turns(
        self, messages: list[dict], finished: list[bool], tools: list | None = None
    ) -> tuple[list[int], list[int], int]:
        """(input_ids, loss_mask, assistant turns kept as unscored context)."""
        messages = [self.prepare(m) for m in messages]
        text, turns = self._scored_spans(messages, tools)
        if len(finished) != len(turns):
            raise ValueError(f"{len(turns)} assistant turns but {len(finished)} finished flags")
        ids: list[int] = []
        mask: list[int] = []
        pos, stopped = 0, False
        for span, done in zip(turns, finished):
            if span is None:
                continue
            start, end = span
            piece_start = len(ids)
            self._append(ids, mask, text[pos:start], 0)
            if stopped:
                self._mark_end_of_turn(ids, mask, piece_start)
            self._append(ids, mask, text[start:end], 1)
            pos, stopped = end, done
        piece_start = len(ids)
        self._append(ids, mask, text[pos:], 0)
        if stopped:
            self._mark_end_of_turn(ids, mask, piece_start)
        return ids, mask, sum(span is None for span in turns)

    def _scored_spans(self, messages: list[dict], tools: list | None) -> tuple[str, list[tuple[int, int] | None]]:
        """The rendered text and, per assistant turn, the character span it scores (None: context only)."""
        text, values = self._value_spans(messages, tools)
        eot = self.tokenizer.decode(self.end_of_turn) if self.end_of_turn else ""
        turns: list[tuple[int, int] | None] = []
        prev_end, k = 0, -1
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            k += 1
            if m.get("reasoning_content") and ("reasoning", k) not in values:
                turns.append(None)  # the template drops this turn's reasoning: not what the target emits
                continue
            own = [values[(kind, k)] for kind in ("reasoning", "content") if (kind, k) in values]
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            start = self._prompt_match(prompt, text)
            if start < prev_end:
                if not own:
                    raise _not_verbatim(k)
                start = own[0][0]
            if own:
                start = min(start, own[0][0])
            last = own[-1][1] if own else start
            later = [s for (kind, j), (s, _) in values.items() if j > k]
            end = text.find(eot, last) if eot else -1
            if end < 0 or (later and end > min(later)):
                end = last
            turns.append((start, end))
            prev_end = end
        return text, turns

    def _prompt_match(self, prompt: str, text: str) -> int:
        """Length of the generation prompt's longest prefix in `text`, cut back to a token boundary of the prompt."""
        n = 0
        limit = min(len(prompt), len(text))
        while n < limit and prompt[n] == text[n]:
            n += 1
        if n == len(prompt):
            return n
        offsets = self.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return max((end for _, end in offsets if end <= n), default=0)

    def _value_spans(
        self, messages: list[dict], tools: list | None
    ) -> tuple[str, dict[tuple[str, int], tuple[int, int]]]:
        """The rendered text and the span of every assistant reasoning/content the template rendered."""
        markers: dict[str, tuple[str, int]] = {}
        marked, k = [], -1
        for m in messages:
            if m["role"] == "assistant":
                k += 1
                m = dict(m)
                for kind, key in (("reasoning", "reasoning_content"), ("content", "content")):
                    if m.get(key):  # private-use chars: never in data
                        marker = f"\ue000dspark-{kind}-{k}\ue001"
                        markers[marker] = (kind, k)
                        m[key] = marker
            marked.append(m)
        text = self.render(messages, tools=tools)
        marked_text = self.render(marked, tools=tools)
        present = sorted((marked_text.find(mk), mk) for mk in markers if mk in marked_text)
        for mk, (kind, j) in markers.items():
            if kind == "content" and mk not in marked_text:
                raise _not_verbatim(j)
        pieces = _split_on(marked_text, [mk for _, mk in present])
        spans, pos = {}, 0
        for n, piece in enumerate(pieces[:-1]):
            key = markers[present[n][1]]
            if not text.startswith(piece, pos):
                raise _not_verbatim(key[1])
            start = pos + len(piece)
            nxt = pieces[n + 1]
            end = len(text) - len(nxt) if n + 1 == len(pieces) - 1 else text.find(nxt, start)
            if end < start or not text.startswith(nxt, end):
                raise _not_verbatim(key[1])
            spans[key] = (start, end)
            pos = end
        if pos + len(pieces[-1]) != len(text):
            raise _not_verbatim(k)
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
            text, spans = self._value_spans(_PROBE, None)
        except RowError as err:
            raise MissingChatTemplate(
                f"the chat template cannot render a plain user/assistant exchange: {err}"
            ) from err
        special = set(self.tokenizer.all_special_ids) | {
            i for i, t in self.tokenizer.added_tokens_decoder.items() if t.special
        }
        end = []
        for token in self._encode(text[spans[("content", 0)][1] :]):
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
