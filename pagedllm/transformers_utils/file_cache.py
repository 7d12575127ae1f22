"""Keys and safe writes for what pagedllm caches about a model file. Torch-free.

A cache entry is keyed by a hash of the model file's bytes (never by its name, size or time: a
file rewritten in place with the same size and time is a different model), plus whatever else
changes the derived result. Entries are written into a private staging folder and renamed into
place in one step, so a reader sees a whole entry or none, and two processes that build the same
entry at once both succeed (one rename wins; the other's copy is dropped).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


logger = logging.getLogger("pagedllm")

# Staging folders older than this were left by a process that died while writing.
_STALE_STAGING_S = 3600
_CHUNK = 1 << 22

# Per process: (path, device, inode, size, mtime, ctime) -> digest, so the file is hashed once
# however many parts of start-up ask. The inode change time moves on every write (and on
# utime), so a file rewritten in place never reuses an old digest.
_digests: dict[tuple, str] = {}
_digests_lock = threading.Lock()


def _signature(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, hex (about 1 GB/s; computed once per process per file)."""
    signature = _signature(path)
    with _digests_lock:
        if signature in _digests:
            return _digests[signature]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # releases the GIL: other start-up work goes on meanwhile
    value = digest.hexdigest()
    with _digests_lock:
        _digests[signature] = value
    return value


def entry_key(*parts: object) -> str:
    """A short hex key for an entry from the parts that change its content."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:24]


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sweep_staging(parent: Path) -> None:
    """Remove staging folders that a crashed writer left behind."""
    now = time.time()
    for stale in parent.glob(".staging-*"):
        try:
            if now - stale.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass


@contextmanager
def staged_entry(final: Path) -> Iterator[Path]:
    """Write a cache entry: yields an empty staging folder; when the block ends without an
    error, the folder's files are synced to disk and it is renamed to `final`. If another
    process published `final` first, this copy is dropped. On error, nothing is published."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_staging(final.parent)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=final.parent))
    try:
        yield staging
        _fsync_tree(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.exists():
                raise
            logger.debug("Cache entry %s was written by another process first", final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def discard_entry(entry: Path) -> None:
    """Remove a broken cache entry. It is renamed away first (atomically), so no reader can
    find it half deleted; processes that still map its files keep them until they exit."""
    if not entry.exists():
        return
    trash = entry.with_name(f".staging-discard-{entry.name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # someone else discarded or replaced it
    shutil.rmtree(trash, ignore_errors=True)


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, or None if it is missing or not valid JSON."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json_entry(final: Path, value: dict) -> None:
    """Publish a single JSON file atomically (write beside it, then rename over)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".staging-", suffix=".json", dir=final.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staging, final)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
