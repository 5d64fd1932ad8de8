"""File operations of the shard store that the zarr API does not cover: atomic replace,
shard-name claims and the manifest lock. One implementation per kind of filesystem,
chosen from the URL (`files_for`); the `dspark.store` package docstring explains the protocol.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import fsspec
from fsspec.implementations.local import LocalFileSystem
from zarr.storage import FsspecStore, LocalStore

from dspark.atomic_dir import fsync_dir, fsync_tree

WRITERS = ".writers"
# Object storage has no lock that dies with its holder: a manifest lock older than
# this is assumed abandoned (a manifest update takes well under a second) ...
REMOTE_LOCK_STALE_S = 120.0
# ... and an unfinished shard whose claim is older than this is assumed dead.
REMOTE_CLAIM_STALE_S = 24 * 3600.0
LOCK_TIMEOUT_S = 600.0
# On a POSIX path, a claim or lock file written on another node is judged by age alone, as
# on object storage: flock may be node-local there (see docs/store-locking.md).
FOREIGN_CLAIM_STALE_S = REMOTE_CLAIM_STALE_S
FOREIGN_LOCK_STALE_S = REMOTE_LOCK_STALE_S
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def json_bytes(obj) -> bytes:
    """The bytes of a small JSON file of the store (manifest, claims)."""
    return (json.dumps(obj, indent=1) + "\n").encode()


def node_id() -> str:
    """This machine (one kernel, so one flock table): its hostname and, where Linux has one, its boot id."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _claim_info() -> bytes:
    return json_bytes({"node": node_id(), "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})


def _age_s(info: bytes | None) -> float:
    """Seconds since a claim/lock file was written; unreadable content counts as ancient."""
    try:
        return time.time() - float(json.loads(info)["time"])  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError):
        return float("inf")


def _written_here(info: bytes) -> bool:
    """Whether a claim/lock file was written on this node (then this kernel's flock tells if its writer lives)."""
    try:
        return json.loads(info)["node"] == node_id()
    except (TypeError, ValueError, KeyError):
        return False  # not yet written, or by an older writer: judged as another node's


def _file_age_s(info: bytes, fd: int) -> float:
    """Age of a claim/lock file: from its content, else (empty: being written) from its mtime."""
    age = _age_s(info)
    return age if age != float("inf") else time.time() - os.fstat(fd).st_mtime


# ---------------------------------------------------------------------------------------
# File operations the zarr API does not cover: atomic replace, claims, the manifest lock.
# One implementation per kind of filesystem, chosen from the URL.
# ---------------------------------------------------------------------------------------


class LocalClaim:
    """An exclusively created claim file, flock-ed for as long as the name is in use."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def release(self) -> None:
        # Unlink before unlocking: nobody can then lock this file and judge its owner dead.
        with suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)


class LocalFiles:
    """Store on a POSIX filesystem (local disk or NFS): O_EXCL claims, flock, fsync + rename.

    flock decides liveness only for files written on this node: on NFS, Lustre or BeeGFS
    mounted with node-local locks another node's flock is invisible here. A claim written
    on another node is taken over only once `FOREIGN_CLAIM_STALE_S` old; the manifest lock
    is an exclusively created owner file as well as a flock.
    """

    def __init__(self, root: Path):
        self.root = root

    def zarr_store(self, read_only: bool) -> LocalStore:
        return LocalStore(self.root, read_only=read_only)

    def prepare(self) -> None:
        (self.root / WRITERS).mkdir(parents=True, exist_ok=True)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def names_in(self, rel: str) -> list[str]:
        try:
            return os.listdir(self.root / rel)
        except FileNotFoundError:
            return []

    def replace_atomically(self, rel: str, data: bytes) -> None:
        # rename(2) within one filesystem is atomic: readers see the old or the new file,
        # never a partial one. The temp file therefore sits next to the target (a move
        # across filesystems is a copy + delete and is not atomic). fsync before the
        # rename so a crash cannot leave the new name pointing at unwritten blocks, and
        # fsync the directory so the rename itself survives a crash.
        target = self.root / rel
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(target.parent)

    @contextmanager
    def locked(self) -> Iterator[None]:
        with open(self.root / WRITERS / "manifest.lock", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # released by the kernel if we die
            try:
                owner = self._own_lock()
                try:
                    yield
                finally:
                    with suppress(FileNotFoundError):
                        owner.unlink()
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _own_lock(self) -> Path:
        """Create the manifest lock's owner file exclusively (the flock alone may be node-local)."""
        path = self.root / WRITERS / "manifest.lock.owner"
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # released meanwhile
                try:
                    info = os.read(fd, 4096)
                    # Under our flock, an owner from this node is dead; one from another, stale only when old.
                    abandoned = _written_here(info) or _file_age_s(info, fd) > FOREIGN_LOCK_STALE_S
                finally:
                    os.close(fd)
                if abandoned:
                    with suppress(FileNotFoundError):
                        path.unlink()
                elif time.monotonic() > deadline:
                    raise TimeoutError(
                        f"manifest lock {path} held by another node for over {LOCK_TIMEOUT_S:.0f} s"
                    ) from None
                else:
                    time.sleep(0.05)
                continue
            try:
                os.write(fd, _claim_info())
                os.fsync(fd)
            finally:
                os.close(fd)
            return path

    def _claim_path(self, name: str) -> Path:
        return self.root / WRITERS / f"{name}.claim"

    def claimed_names(self) -> list[str]:
        return [n.removesuffix(".claim") for n in self.names_in(WRITERS) if n.endswith(".claim")]

    def try_claim(self, name: str) -> LocalClaim | None:
        path = self._claim_path(name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return None
        return self._lock_claim(fd, path, info=_claim_info())

    def take_over(self, name: str) -> LocalClaim | None:
        """Claim `name` if nobody holds it (its writer finished or died); None if in use.

        A claim written on another node counts as in use until `FOREIGN_CLAIM_STALE_S` old,
        whatever flock says here (it may not see that node's locks).
        """
        path = self._claim_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return self.try_claim(name)
        info = os.read(fd, 4096)
        if not _written_here(info) and _file_age_s(info, fd) < FOREIGN_CLAIM_STALE_S:
            os.close(fd)
            return None
        return self._lock_claim(fd, path, info=_claim_info())  # the claim now names its new holder

    @staticmethod
    def _lock_claim(fd: int, path: Path, info: bytes | None) -> LocalClaim | None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A cleaner may have unlinked (and someone re-created) the file between our
            # open and our lock: only the file still at `path` is the claim.
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(path)
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            return None
        if info is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, info, 0)
        return LocalClaim(fd, path)

    def remove_tree(self, rel: str) -> None:
        with suppress(FileNotFoundError):
            shutil.rmtree(self.root / rel)

    def sync_tree(self, rel: str) -> None:
        """fsync every file and directory under `rel` (zarr's LocalStore does not)."""
        fsync_tree(self.root / rel)


class RemoteClaim:
    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        self.fs, self.path = fs, path

    def release(self) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm(self.path)


class RemoteFiles:
    """Store on any other fsspec filesystem (object storage, memory://)."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem, root: str, storage_options: dict):
        self.url, self.fs, self.root, self.storage_options = url, fs, root.rstrip("/"), storage_options

    def zarr_store(self, read_only: bool) -> FsspecStore:
        return FsspecStore.from_url(self.url, storage_options=self.storage_options or None, read_only=read_only)

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def prepare(self) -> None:
        self.fs.makedirs(self._path(WRITERS), exist_ok=True)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(rel))
        except FileNotFoundError:
            return None

    def names_in(self, rel: str) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self._path(rel), detail=False)]
        except FileNotFoundError:
            return []

    def replace_atomically(self, rel: str, data: bytes) -> None:
        # Object stores have no rename: fsspec's mv is a server-side copy + delete. Each
        # object PUT/copy is atomic (readers get the old or the new object, never a
        # partial one), so the manifest still flips in one step; a crash between copy
        # and delete leaves only a stray temp object, which nothing reads.
        tmp = self._path(f".{rel}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, self._path(rel))

    @contextmanager
    def locked(self) -> Iterator[None]:
        path = self._path(f"{WRITERS}/manifest.lock")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                self.fs.pipe_file(path, _claim_info(), mode="create")
                break
            except FileExistsError:
                if _age_s(self.read_bytes(f"{WRITERS}/manifest.lock")) > REMOTE_LOCK_STALE_S:
                    with suppress(FileNotFoundError):
                        self.fs.rm(path)  # abandoned by a dead writer
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"manifest lock {path} held for over {LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            with suppress(FileNotFoundError):
                self.fs.rm(path)

    def _claim_rel(self, name: str) -> str:
        return f"{WRITERS}/{name}.claim"

    def claimed_names(self) -> list[str]:
        return [n.removesuffix(".claim") for n in self.names_in(WRITERS) if n.endswith(".claim")]

    def try_claim(self, name: str) -> RemoteClaim | None:
        path = self._path(self._claim_rel(name))
        try:
            self.fs.pipe_file(path, _claim_info(), mode="create")
        except FileExistsError:
            return None
        return RemoteClaim(self.fs, path)

    def take_over(self, name: str) -> RemoteClaim | None:
        info = self.read_bytes(self._claim_rel(name))
        if info is not None:
            if _age_s(info) < REMOTE_CLAIM_STALE_S:
                return None
            with suppress(FileNotFoundError):
                self.fs.rm(self._path(self._claim_rel(name)))
        return self.try_claim(name)

    def remove_tree(self, rel: str) -> None:
        if self.fs.exists(self._path(rel)):
            self.fs.rm(self._path(rel), recursive=True)

    def sync_tree(self, rel: str) -> None:
        """Nothing to do: an object store acknowledges a PUT only once it is durable."""


def files_for(url: str, storage_options: dict | None) -> LocalFiles | RemoteFiles:
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        return LocalFiles(Path(root))
    return RemoteFiles(url, fs, root, storage_options or {})
