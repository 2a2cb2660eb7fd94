"""The on-disk cache of converted models (GGUF -> Hugging Face folder).

A GGUF file is converted once into `<cache_dir>/<name>-<key>`. The key (`content_key`)
hashes the converter version, the file's size and modification time, its first 16 MiB
(the GGUF header -- metadata, tokenizer, tensor table with each tensor's type -- is a few
MiB) and its last 1 MiB: milliseconds, whatever the file's size. The stored dtypes follow
from the tensor types (checkpoints.gguf_file), so the key needs no dtype of its own.
So a converter fix, an edited, replaced or merely touched file gets a new folder, and a
copy that keeps the modification time (`cp -p`, `rsync -t`) shares the folder. A file
rewritten in place with the same size, modification time, header and last MiB is
trusted to be the same file: delete its folder to convert it again.

The folder is written under a temporary name and renamed into place, so a folder that
exists is complete; concurrent first starts both convert and one rename wins.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from checkpoints.base import CheckpointError

# Bump when the conversion's output changes, so stale cached folders are not reused.
# 2: F16/BF16 tensors are stored as they are, not as float32; the key no longer hashes the whole file.
CONVERTER_VERSION = 2
# How much of the file's start and end the key hashes. GGUF headers are a few MiB, mostly
# tokenizer: the default model's is 1.7 MiB for 49k tokens + 49k merges, so Llama 3's 128k
# + 280k come to ~8 MiB. The head thus covers the header and the first tensor bytes; a
# longer header is covered up to here, its tensor table then only by size and mtime.
# Finding the exact header end with gguf.GGUFReader takes ~2 s on the 98 MB default model
# (it maps every token string); this takes ~13 ms.
_HEAD_BYTES = 16 << 20
_TAIL_BYTES = 1 << 20
# A partial folder this old was left by a killed conversion, not one still running.
_STALE_PARTIAL_SECONDS = 3600


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxserve/models, or ~/.cache/jaxserve/models."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jaxserve" / "models"


def content_key(path: str | os.PathLike) -> str:
    """12 hex digits of sha256 over CONVERTER_VERSION, size, mtime, first 16 MiB and last 1 MiB of the file."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        stamp = f"jaxserve-converter-{CONVERTER_VERSION}\n{st.st_size}\n{st.st_mtime_ns}\n"
        digest = hashlib.sha256(stamp.encode())
        digest.update(f.read(_HEAD_BYTES))
        if st.st_size > _HEAD_BYTES:
            f.seek(max(_HEAD_BYTES, st.st_size - _TAIL_BYTES))
            digest.update(f.read(_TAIL_BYTES))
    return digest.hexdigest()[:12]


def cached_conversion(
    source: str | os.PathLike,
    name: str,
    convert: Callable[[Path], None],
    cache_dir: str | os.PathLike | None = None,
) -> tuple[Path, bool]:
    """(folder, converted_now): the cached folder for `source`, made by `convert(tmp_dir)` if absent."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"{name}-{content_key(source)}"
    if folder.is_dir():
        return folder, False
    for stale in root.glob(f".{folder.name}.*.partial"):
        try:
            if time.time() - stale.stat().st_mtime > _STALE_PARTIAL_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile by another process
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=root))
    except OSError as e:
        raise CheckpointError(
            f"cannot write converted models to {root}: {e}; pass another cache_dir or set XDG_CACHE_HOME"
        ) from e
    try:
        convert(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cached model is an ordinary folder
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; use its folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder, True
