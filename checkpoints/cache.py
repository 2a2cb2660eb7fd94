"""The on-disk cache of converted models (GGUF -> Hugging Face folder).

A GGUF file is converted once into `<cache_dir>/<name>-<key>`, where the key hashes the
file's bytes and the converter version, so an edited file or a converter fix gets a new
folder. The folder is written under a temporary name and renamed into place, so a
folder that exists is complete; concurrent first starts both convert and one rename wins.
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
CONVERTER_VERSION = 1
# A partial folder this old was left by a killed conversion, not one still running.
_STALE_PARTIAL_SECONDS = 3600


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxserve/models, or ~/.cache/jaxserve/models."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jaxserve" / "models"


def content_key(path: str | os.PathLike) -> str:
    """12 hex digits of sha256 over the file's bytes and CONVERTER_VERSION."""
    digest = hashlib.sha256(f"jaxserve-converter-{CONVERTER_VERSION}\n".encode())
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
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
