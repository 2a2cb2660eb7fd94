"""Regenerate the committed stubs of jaxserve.proto: `python -m jaxserve.proto.generate [--out DIR]`.

protoc runs in a subprocess (grpcio-tools' bundled protobuf can crash inside a process that
has already imported torch). Needs the pinned grpcio-tools of the test extra. `--out` writes
the stubs elsewhere (the stub test compares such a copy with the committed files).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
ROOT = PROTO_DIR.parent.parent          # the folder holding the `jaxserve` package
STUBS = ("jaxserve_pb2.py", "jaxserve_pb2.pyi", "jaxserve_pb2_grpc.py")


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs into `out`; returns their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        # Run from the package root so the stubs import each other as `jaxserve.proto.*`.
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp}",
                        f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", "jaxserve/proto/jaxserve.proto"],
                       cwd=ROOT, check=True)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in STUBS:
            dest = out / name
            shutil.copyfile(pathlib.Path(tmp, "jaxserve", "proto", name), dest)
            paths.append(dest)
        return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)


if __name__ == "__main__":
    main()
