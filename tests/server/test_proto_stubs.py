"""The committed gRPC stubs are exactly what `python -m jaxserve.proto.generate` makes of the proto."""

import subprocess
import sys

from jaxserve.proto import generate


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    subprocess.run([sys.executable, "-m", "jaxserve.proto.generate", "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    for name in generate.STUBS:
        fresh, committed = (tmp_path / name).read_bytes(), (generate.PROTO_DIR / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run `python -m jaxserve.proto.generate` and commit it"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(generate.STUBS)
