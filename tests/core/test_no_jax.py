import subprocess
import sys


def test_importing_core_does_not_import_jax():
    code = ("import sys, jaxserve.core, jaxserve; "
            "bad = [m for m in ('jax', 'jaxlib', 'flax', 'numpy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
