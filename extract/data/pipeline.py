"""The data stage end to end: source -> (regenerate) -> tokenize -> split -> files.

Output in `data_dir`: `train.jsonl`, `eval.jsonl` (rows: sample_id, source, split,
input_ids, loss_mask), `token_freqs.npy` (int64 [vocab]: loss-masked train tokens) and
`summary.json`; plus the regeneration journal `regen-<settings hash>.jsonl` that makes a
rerun continue where a killed one stopped. The four files are one generation, switched
in with one rename (`output.publish`), so a reader never sees half a dataset or a mix.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dspark.config import TargetConfig
from dspark.errors import UserError
from dspark.extract.config import ServerConfig
from dspark.extract.data.config import RegenConfig, SourceConfig, TokenizeConfig
from dspark.extract.data.mix import load_and_select
from dspark.extract.data.output import SPLITS, publish
from dspark.extract.data.problems import Problems, RowError, row_error
from dspark.extract.data.regenerate import ChatSettings, Journal, attempts, journaled, pending, prompt_sha, regenerate
from dspark.extract.data.sources import Conversation
from dspark.extract.data.split import eval_fingerprints, prompt_fingerprint
from dspark.extract.data.tokenize import ChatTokenizer
from dspark.extract.scale import ScaleConfig, server_envs, tp_args
from dspark.extract.servers import check_served_model, served_model
from dspark.targets import resolve_target


def build_dataset(
    target: TargetConfig,
    source: SourceConfig,
    regen: RegenConfig,
    tokenize: TokenizeConfig,
    server: ServerConfig,
    data_dir: Path,
    scale: ScaleConfig,
) -> dict[str, Any]:
    """Run the whole stage; returns (and writes) the summary.

    With `scale.nodes` > 1 this node regenerates only its share into a journal of its own;
    the dataset is written by the node that finds every share done (or by any later run).
    """
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    verifier = resolve_target(target)  # null target fields derived from the verifier (target=auto)
    print(verifier.describe())
    target, model_dir, tok_sha = verifier.config, verifier.model_dir, verifier.tokenizer_sha256
    chat = ChatTokenizer(model_dir, target.chat_template_kwargs)  # a missing template fails before any work

    loaded, selected, parts = load_and_select(source)
    if loaded.problems:
        print(loaded.problems.report(f"source {loaded.name}: {loaded.rows} rows read"))
    if not selected:
        raise UserError(f"source {loaded.name}: no usable conversation among {loaded.rows} rows (reasons above)")

    settings = ChatSettings.of(regen, target)
    if regen.enabled:
        # Everything that changes what a conversation's regeneration would be; not the draw
        # (sample ids are stable, so a larger max_samples reuses what is done) nor the split.
        journal_key = {
            "target": target.name_or_path,
            "revision": target.revision,
            "model_dir": str(model_dir),
            "tokenizer_sha256": tok_sha,
            "source": [source.source, source.path, source.hf_name, source.hf_split, source.max_turns],
            "settings": asdict(settings),
        }
        if parts:  # a mix: its sources, not their weights (a re-weighted mix reuses what is done)
            journal_key["source"] = [source.max_turns] + [
                [p["source"], p["path"], p["hf_name"], p["hf_split"]] for p in parts
            ]
        external = _external_server(regen, verifier)
        if external is not None:  # what the given server runs (a started one runs model_dir, in the key)
            journal_key["server"] = {"id": external["id"], "root": external.get("root")}
        journal_path = data_dir / f"regen-{_short_hash(journal_key)}.jsonl"
        replies = _regenerated(
            selected, journal_path, model_dir, target, regen, server, chat, settings, data_dir, scale, external
        )
        if replies is None:
            return {"node_rank": scale.node_rank, "nodes": scale.nodes, "dataset_written": False}
    else:
        journal_key, journal_path, replies = {}, None, _source_replies(selected)

    max_length = tokenize.max_length or target.max_model_len
    rows, dropped, counts = _tokenize_and_split(
        selected, replies, chat, loaded.name, max_length, tokenize.min_loss_tokens, source.eval_fraction
    )
    if dropped:
        print(dropped.report(f"{len(selected)} selected conversations"))
    if not any(rows.values()):
        raise UserError(f"no sample survived (see the reasons above); nothing written to {data_dir}")

    vocab_size = verifier.vocab_size
    summary = {
        "target": {
            "name": target.name,
            "name_or_path": target.name_or_path,
            "revision": target.revision,
            "model_dir": str(model_dir),
            "tokenizer_sha256": tok_sha,
            "vocab_size": vocab_size,
            "end_of_turn_ids": chat.end_of_turn,
            **verifier.dataset_fields(),
        },  # reused by later passes
        "source": asdict(source)
        | {
            "name": loaded.name,
            "rows": loaded.rows,
            "usable": len(loaded.conversations),
            "selected": len(selected),
            "sources": parts,
        },
        "regeneration": _regen_summary(regen, settings, journal_path, replies, selected, journal_key),
        "tokenize": {
            "max_length": max_length,
            "min_loss_tokens": tokenize.min_loss_tokens,
            **counts,
            "thinking": chat.thinking,
        },
        "splits": {s: _split_stats(rows[s]) for s in SPLITS},
        "dropped": {"source": loaded.problems.to_dict(), "samples": dropped.to_dict()},
    }
    if target.mask_token_id is not None:
        # The mask token must be a row the data never contains (the drafter feeds it as "unknown").
        summary["target"]["mask_token_id"] = target.mask_token_id
        summary["target"]["mask_token_in_data"] = sum(
            r["input_ids"].count(target.mask_token_id) for s in SPLITS for r in rows[s]
        )
    publish(data_dir, rows, vocab_size, summary)
    print(format_summary(summary, data_dir))
    return summary


def _tokenize_and_split(selected, replies, chat, source_name, max_length, min_loss_tokens, eval_fraction):
    """Rows per split, what was dropped and why, and how many samples were truncated."""
    rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
    dropped, truncated, context_turns = Problems(), 0, 0
    # Split on the source prompts (known before regeneration), so which samples are held
    # out never depends on what the target happened to generate.
    # A mix source with its own split (`MixPart.split`) takes no part in the fingerprint split.
    fingerprints = {c.sample_id: prompt_fingerprint(c.messages) for c in selected}
    held_out = eval_fingerprints({fingerprints[c.sample_id] for c in selected if c.split is None}, eval_fraction)
    for conv in selected:
        where = f"sample {conv.sample_id}"
        try:
            entry = replies[conv.sample_id]
            if "error" in entry:
                raise RowError(entry["error"], entry.get("detail"))
            ids, mask, unscored = chat.encode_turns(entry["messages"], entry["finished"], conv.tools)
        except Exception as err:  # as reading a row: whatever fails for one sample costs that sample only
            dropped.add_error(row_error(err), where)
            continue
        if len(ids) > max_length:
            ids, mask, truncated = ids[:max_length], mask[:max_length], truncated + 1
        if sum(mask) < min_loss_tokens:
            dropped.add("too few loss tokens", where, f"{sum(mask)} < {min_loss_tokens}")
            continue
        context_turns += unscored
        split = conv.split or ("eval" if fingerprints[conv.sample_id] in held_out else "train")
        rows[split].append(
            {
                "sample_id": conv.sample_id,
                "source": conv.source or source_name,
                "split": split,
                "input_ids": ids,
                "loss_mask": mask,
            }
        )
    return rows, dropped, {"truncated": truncated, "turns_reasoning_dropped_by_template": context_turns}


def _external_server(regen: RegenConfig, verifier) -> dict | None:
    """The /v1/models entry of `regen.server_url`, refused unless it serves the target (as extraction does)."""
    if not (regen.enabled and regen.server_url):
        return None
    url = regen.server_url.rstrip("/")
    model = served_model(url, "regen.server_url")
    check_served_model(url, model, verifier, "regen.server_url")
    return model


def _regenerated(
    selected, journal_path, model_dir, target, regen, server, chat, settings, data_dir, scale: ScaleConfig, external
) -> dict[int, dict] | None:
    """Every selected conversation's journal entry; None while other nodes' shares are not all done."""
    journal = _open_journal(journal_path, scale)
    try:
        share = scale.share(selected, lambda conv: conv.sample_id)
        todo = pending(share, journal, regen.max_attempts)
        retries = sum(attempts(journaled(c, journal)) > 0 for c in todo)
        node = f" (node {scale.node_rank} of {scale.nodes}: {len(share)} of {len(selected)})" if scale.nodes > 1 else ""
        again = f" ({retries} retried after a failed attempt)" if retries else ""
        print(f"regeneration{node}: {len(todo)} to do{again}, {len(share) - len(todo)} already in {journal_path.stem}*")
        if todo:
            with _servers(model_dir, target, regen, server, data_dir, scale, external) as servers:
                regenerate(
                    todo,
                    journal,
                    servers,
                    chat,
                    settings,
                    concurrency=regen.concurrency,
                    request_timeout_s=regen.request_timeout_s,
                    max_attempts=regen.max_attempts,
                )
    finally:
        journal.close()
    journal = _open_journal(journal_path, scale)  # again: other nodes may have finished meanwhile
    journal.close()
    _report_failures([journaled(c, journal) for c in share], regen.max_attempts)
    missing = sum(journaled(c, journal) is None for c in selected)
    if missing:
        print(
            f"node {scale.node_rank} of {scale.nodes}: its share is done; {missing} conversation(s) of other "
            "nodes are not yet: the last node to finish writes the dataset (or rerun once they are)"
        )
        return None
    return {c.sample_id: journal.entries[c.sample_id] for c in selected}


def _open_journal(journal_path: Path, scale: ScaleConfig) -> Journal:
    """This node's journal (`regen-<hash>.jsonl`, or `.node<r>.jsonl` of several), reading every other one too."""
    own = journal_path if scale.nodes == 1 else journal_path.with_suffix(f".node{scale.node_rank}.jsonl")
    others = [p for p in sorted(journal_path.parent.glob(f"{journal_path.stem}*.jsonl")) if p != own]
    return Journal(own, others)


def _report_failures(entries: list[dict | None], max_attempts: int) -> None:
    """One stderr line on conversations whose regeneration failed: why, and whether a rerun retries them."""
    failed = [e for e in entries if e is not None and "error" in e]
    if not failed:
        return
    reasons = Counter(e["error"] for e in failed)
    final = sum(attempts(e) >= max_attempts for e in failed)
    print(
        f"warning: regeneration failed for {len(failed)} conversation(s) ("
        + ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))
        + f"), left out of the dataset: {len(failed) - final} will be retried by a rerun, {final} failed "
        f"regen.max_attempts={max_attempts} times and are not retried (summary.json: regeneration.failures)",
        file=sys.stderr,
        flush=True,
    )


@contextmanager
def _servers(
    model_dir: Path,
    target: TargetConfig,
    regen: RegenConfig,
    srv: ServerConfig,
    data_dir: Path,
    scale: ScaleConfig,
    external: dict | None,
) -> Iterator[list[tuple[str, str]]]:
    """(URL, served model id) of the given server, or of the gpus/tp servers started for this run (stopped on exit)."""
    if external is not None:
        if scale.servers != 1:
            raise UserError(
                f"regen.server_url names one server; gpus={scale.gpus} tp={scale.tp} needs "
                f"{scale.servers} started here (regen.server_url=null)"
            )
        yield [(regen.server_url.rstrip("/"), external["id"])]
        return
    import torch

    from dspark.extract.server import VLLMServer

    servers = [
        VLLMServer(
            model_dir,
            data_dir / "server",
            extra_args=[*tp_args(scale.tp), *srv.extra_args],
            env=env,
            ready_timeout_s=srv.ready_timeout_s,
            stop_timeout_s=srv.stop_timeout_s,
            max_model_len=target.max_model_len,
            dtype=target.dtype,
        )
        for env in server_envs(scale.gpus, torch.cuda.is_available(), dict(srv.env), scale.tp)
    ]
    with ExitStack() as running:
        for server in servers:  # all boot at once, then each is waited for
            server.launch()
            running.callback(server.stop)
        for server in servers:
            server.wait_ready()
        yield [(server.url, served_model(server.url)["id"]) for server in servers]


def _source_replies(selected: list[Conversation]) -> dict[int, dict]:
    """The source's own assistant turns, as journal-like entries (regen.enabled=false)."""
    replies = {}
    for conv in selected:
        messages = list(conv.messages)
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if not messages:
            detail = "regen.enabled=false needs the source's replies"
            replies[conv.sample_id] = {"error": "no assistant reply", "detail": detail}
        else:
            finished = [True] * sum(m["role"] == "assistant" for m in messages)
            replies[conv.sample_id] = {"prompt_sha": prompt_sha(messages), "messages": messages, "finished": finished}
    return replies


def _regen_summary(regen, settings, journal_path, replies, selected, journal_key) -> dict:
    out = {"enabled": regen.enabled}
    if not regen.enabled:
        return out
    entries = [replies[c.sample_id] for c in selected]
    ok = [e for e in entries if "error" not in e]
    failed = [e for e in entries if "error" in e]
    return (
        out
        | asdict(settings)
        | {
            "journal": f"{journal_path.stem}*.jsonl",
            "server": journal_key.get("server"),  # the given server's model (null: started for this run)
            "conversations": len(ok),
            "failed": len(failed),
            "failures": {
                "max_attempts": regen.max_attempts,
                "by_reason": dict(sorted(Counter(e["error"] for e in failed).items())),
                "retried_by_a_rerun": sum(attempts(e) < regen.max_attempts for e in failed),
                "not_retried": sum(attempts(e) >= regen.max_attempts for e in failed),
            },
            "assistant_turns": sum(len(e["finished"]) for e in ok),
            # Journals of older runs have no per-turn limits: their turns ran under max_new_tokens.
            **_cut_turns(ok, settings.max_new_tokens),
            "conversations_cut_to_fit_context": sum("cut_at_turn" in e for e in ok),
            "completion_tokens": sum(e["completion_tokens"] for e in ok),
        }
    )


def _cut_turns(entries: list[dict], max_new_tokens: int) -> dict[str, int]:
    """Regenerated turns stopped by the token limit, by which limit; and source tool-call turns kept."""
    limits = [
        (f, lim)
        for e in entries
        for f, lim in zip(e["finished"], e.get("max_tokens", [max_new_tokens] * len(e["finished"])))
    ]
    return {
        "turns_cut_by_max_new_tokens": sum(not f and lim == max_new_tokens for f, lim in limits),
        "turns_cut_by_context": sum(not f and lim is not None and lim < max_new_tokens for f, lim in limits),
        "tool_call_turns_kept": sum(lim is None for _, lim in limits),
    }


def _split_stats(rows: list[dict]) -> dict[str, int]:
    return {
        "samples": len(rows),
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "loss_tokens": sum(sum(r["loss_mask"]) for r in rows),
    }


def format_summary(summary: dict, data_dir: Path) -> str:
    lines = [
        f"dataset in {data_dir} (target {summary['target']['name_or_path']}, "
        f"tokenizer {summary['target']['tokenizer_sha256'][:12]})"
    ]
    for split, s in summary["splits"].items():
        lines.append(f"  {split:5s}: {s['samples']} samples, {s['tokens']} tokens, {s['loss_tokens']} loss tokens")
    for stage, problems in summary["dropped"].items():
        for reason, info in problems.items():
            lines.append(f"  dropped ({stage}) {reason}: {info['count']}")
    if summary["tokenize"]["truncated"]:
        lines.append(f"  truncated to {summary['tokenize']['max_length']} tokens: {summary['tokenize']['truncated']}")
    if summary["target"].get("mask_token_in_data"):
        lines.append(
            f"  WARNING: mask_token_id {summary['target']['mask_token_id']} occurs "
            f"{summary['target']['mask_token_in_data']} times in the data"
        )
    return "\n".join(lines)


def _short_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]
