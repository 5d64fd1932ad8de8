"""`make bench`: run every bench/bench_*.py and collect their figures.

Each benchmark module defines `main(out_dir: Path) -> dict`, prints its figures, and
compares against a baseline measured in the same run (a ratio), since shared machines
are noisy. Results land in bench/results/<name>.json and a combined summary.json.

Usage: python -m bench [only=name1,name2] [out=bench/results]
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path


def _parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in {"only", "out"}:
            raise SystemExit(f"unknown argument {item!r}; expected only=a,b or out=DIR")
        args[key] = value
    return args


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    out_dir = Path(args.get("out", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    names = sorted(p.stem for p in Path(__file__).parent.glob("bench_*.py"))
    if "only" in args:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args["only"].split(",")}
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"no such benchmark(s): {sorted(unknown)}; have {names}")
        names = [n for n in names if n in wanted]
    summary: dict[str, dict] = {}
    failed = []
    for name in names:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            figures = importlib.import_module(f"bench.{name}").main(out_dir)
        except Exception as exc:  # keep going: one broken benchmark must not hide the others
            failed.append(name)
            figures = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"   FAILED: {figures['error']}", flush=True)
        figures["wall_s"] = round(time.perf_counter() - start, 2)
        summary[name] = figures
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out_dir / 'summary.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
