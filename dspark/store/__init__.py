"""Zarr v3 shard store of verifier hidden states: the hand-off from extraction to training.

Layout (a public format, read by users' own tools too; documented in docs/store-format.md):

    <store>/zarr.json        root group; attrs `format_version` (int), `target` = {`name_or_path`,
                             `hidden_size`, `num_hidden_layers`, `layer_ids` (ascending, last =
                             `num_hidden_layers`), `dtype`: "bfloat16" | "float8_e4m3fn"},
                             `tokenizer_sha256`, extra attrs
    <store>/manifest.json    {"format_version", "shards": [{"name", "n_samples", "n_tokens", "checksums"}]}
    <store>/shards/00000/    one group per shard, written by one writer, never modified after commit:
        hidden     [T, L, H] uint16  bf16 bit patterns, layers in `layer_ids` order
        token_ids  [T]       int32
        loss_mask  [T]       uint8
        offsets    [n+1]     int64   sample i owns rows offsets[i]:offsets[i+1]
        sample_ids [n]       int64
        attrs `checksums` = {array name: sha256 hex of its C-order little-endian bytes}
    <store>/.writers/        shard-name claims and the manifest lock (bookkeeping, not data)

FP8 stores (`target.dtype` "float8_e4m3fn") write `format_version` 2 (bf16 stores stay 1):
        hidden       [T, L, H] uint8    e4m3fn bit patterns
        hidden_scale [T, L]    float32  value = decode(hidden) * hidden_scale[..., None], the scale
                                        being the row's amax / 448 (1 if all zero); see `fp8`
and the checksums cover `hidden_scale` too. Readers return bf16 bit patterns from both.

A shard exists only once `manifest.json` lists it. A writer writes its whole shard group
first, then adds it to the manifest; a crash or full disk before that leaves an invisible
group that `clean_uncommitted` deletes and a rerun redoes.

Several writers (one per server or node) may share a store. A writer reserves a shard
name by exclusively creating `.writers/<name>.claim` before it creates the group, so
names stay `00000, 00001, ...` without ranges per writer; manifest updates are merged
under a lock. On a local or NFS path the claim and the lock are held with `flock`, which
the kernel releases when the process dies, so `clean_uncommitted` can tell a live
writer's unfinished shard from a dead one's at any time, for writers of this node; a
claim or lock owner file written on another node (flock may be node-local there) is
judged by age alone (`files.FOREIGN_CLAIM_STALE_S`); see docs/store-locking.md. On object storage (any other
fsspec URL) claims and the lock are exclusive creates (`pipe_file(mode="create")`):
safe only where the backend makes that a conditional write (local, memory, S3 with
If-None-Match, GCS generation preconditions); fsspec's generic fallback checks then
writes, which two writers can race. Liveness there is judged by age
(`files.REMOTE_CLAIM_STALE_S`, `REMOTE_LOCK_STALE_S`), so a dead writer's leftover is cleaned
only once it is old; it stays invisible meanwhile.

Modules by role: `format` (version, names, dtypes, codecs, `Sample`, bf16 bits, attr
checks), `fp8` (e4m3 quantization), `reader` (`ShardStore`: open, index, read), `writer` (`StoreWriter`: create,
claims, commit, clean), `verify` (end-to-end check), `files` (filesystem layer).
"""

from dspark.store.format import (
    BF16,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    FP8,
    HIDDEN_CHUNK_TOKENS,
    Sample,
    SampleRef,
    StoreMismatchError,
    bf16_to_bits,
    bits_to_tensor,
    sha256_of,
    validate_target,
)
from dspark.store.reader import ShardStore
from dspark.store.writer import StoreWriter

__all__ = [
    "BF16",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "FP8",
    "HIDDEN_CHUNK_TOKENS",
    "Sample",
    "SampleRef",
    "ShardStore",
    "StoreMismatchError",
    "StoreWriter",
    "bf16_to_bits",
    "bits_to_tensor",
    "sha256_of",
    "validate_target",
]
