"""Mixed sources (`data=mix`): several sources drawn by weight or count into one set.

Each part is read as a source of its own (same `max_turns`). A conversation whose prompt
fingerprint (`split.prompt_fingerprint`) already came from an earlier part is dropped and
counted as "duplicate prompt across sources", so every prompt has one source and, through
the fingerprint split, one split. Parts with `samples` give exact counts; parts with
`weight` share `data.max_samples` by largest remainder. A part with a `split` puts every
conversation it gives in that split; the others are split by fingerprint. A part with fewer usable
conversations than its share gives all it has, and the summary says so. Sample ids are
`part index * ID_STRIDE + id within the part`: stable across runs, so a resumed or
re-weighted mix reuses every regenerated conversation it still draws.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from dspark.errors import UserError
from dspark.extract.data.config import MixPart, SourceConfig
from dspark.extract.data.problems import Problems
from dspark.extract.data.sources import Conversation, SourceData, load_source, select
from dspark.extract.data.split import prompt_fingerprint

ID_STRIDE = 10**9


def load_and_select(cfg: SourceConfig) -> tuple[SourceData, list[Conversation], list[dict[str, Any]] | None]:
    """(what was read, the drawn conversations in sample-id order, per-part summary or None)."""
    if cfg.source != "mix":
        loaded = load_source(cfg)
        return loaded, select(loaded.conversations, cfg.max_samples, cfg.seed), None
    quotas = _quotas(cfg.sources, cfg.max_samples)
    mixed = SourceData(name="mix", conversations=[], rows=0, problems=Problems())
    seen: set[str] = set()
    selected, parts = [], []
    for index, (part, quota) in enumerate(zip(cfg.sources, quotas)):
        loaded = load_source(
            SourceConfig(
                part.source, part.path, part.hf_name, part.hf_split, None, cfg.seed, cfg.max_turns, cfg.eval_fraction
            )
        )
        mixed.rows += loaded.rows
        mixed.problems.merge(loaded.problems)
        fresh, duplicates = [], 0
        for conv in loaded.conversations:
            fingerprint = prompt_fingerprint(conv.messages)
            if fingerprint in seen:
                duplicates += 1
                mixed.problems.add("duplicate prompt across sources", f"{loaded.name} sample {conv.sample_id}")
                continue
            if conv.sample_id >= ID_STRIDE:
                raise UserError(f"data.sources[{index}] {loaded.name}: sample id {conv.sample_id} >= {ID_STRIDE}")
            fresh.append(conv)
        # Fingerprints of the whole part, not only of its draw: a later part never repeats any of it.
        seen.update(prompt_fingerprint(c.messages) for c in fresh)
        drawn = [
            replace(c, sample_id=c.sample_id + index * ID_STRIDE, split=part.split)
            for c in select(fresh, quota, cfg.seed)
        ]
        mixed.conversations.extend(fresh)
        selected.extend(drawn)
        parts.append(
            asdict(part)
            | {
                "name": loaded.name,
                "rows": loaded.rows,
                "usable": len(loaded.conversations),
                "duplicates": duplicates,
                "requested": quota,
                "selected": len(drawn),
            }
        )
    return mixed, sorted(selected, key=lambda c: c.sample_id), parts


def _quotas(parts: list[MixPart], max_samples: int | None) -> list[int]:
    """Conversations to draw per part: `samples` as given, or `max_samples` split by weight."""
    weighted = [p.weight is not None for p in parts]
    if all(weighted):
        if max_samples is None:
            raise UserError("data.max_samples: a mix by weights needs a total to share (or give samples per source)")
        total = sum(p.weight for p in parts)
        exact = [max_samples * p.weight / total for p in parts]
        quotas = [int(x) for x in exact]
        by_remainder = sorted(range(len(parts)), key=lambda i: (quotas[i] - exact[i], i))
        for i in by_remainder[: max_samples - sum(quotas)]:
            quotas[i] += 1
        return quotas
    if any(weighted):
        raise UserError("data.sources: give every source a weight or every source a sample count, not both")
    return [p.samples for p in parts]
