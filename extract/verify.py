"""`python -m extract.verify store=<path or URL>`: check a shard store end to end.

Reads every committed shard, prints one line per shard (OK, or each problem found),
and exits with status 1 if anything is wrong: checksums, shapes, offsets, unreadable or
truncated files, sample ids committed twice.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from dspark.entry import stage_main
from dspark.errors import UserError
from dspark.store import ShardStore


def run(cfg: DictConfig) -> int:
    """Verify the store named by `cfg.store`; returns the number of problems."""
    try:
        store = ShardStore.open(cfg.store, OmegaConf.to_container(cfg.storage_options) or None)
    except FileNotFoundError as err:
        raise UserError(f"store={cfg.store}: {err}") from err
    sizes = {s["name"]: (s["n_samples"], s["n_tokens"]) for s in store.manifest["shards"]}
    bar = tqdm(total=len(sizes), desc="verify", unit="shard", file=sys.stderr)
    shown: set[str] = set()

    def report(name: str, problems: list[str]) -> None:
        bar.update()
        shown.update(problems)
        if problems:
            for p in problems:
                tqdm.write(f"PROBLEM {p}")
        else:
            n, t = sizes.get(name, ("?", "?"))  # "?": committed by a writer while we verify
            tqdm.write(f"OK      shards/{name} ({n} samples, {t} tokens)")

    problems = store.verify(on_shard=report)
    bar.close()
    for p in problems:
        if p not in shown:  # store-wide ones (root attrs, manifest) come after the shards
            print(f"PROBLEM {p}")
    total_tokens = sum(t for _, t in sizes.values())
    verdict = f"{len(problems)} problem(s)" if problems else "all OK"
    print(f"{cfg.store}: {len(sizes)} shards, {total_tokens} tokens: {verdict}")
    return len(problems)


@stage_main("verify")
def main(cfg: DictConfig) -> None:
    if run(cfg):
        sys.exit(1)


if __name__ == "__main__":
    main()
