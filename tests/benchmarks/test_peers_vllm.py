"""benchmarks/peers_vllm.py: the machine line its results carry (the ratios differ by CPU)."""

import pytest

from kernels_pallas import native_cpu
from peers_vllm import machine

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9B45
flags\t\t: fpu avx512f avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9B45
"""


@pytest.mark.parametrize("amx, avx512_bf16, path", [(True, True, "AMX tiles"), (False, True, "AVX-512 BF16 vectors"),
                                                     (False, False, "XLA dots")])
def test_machine_names_the_cpu_cores_and_native_path(monkeypatch, amx, avx512_bf16, path):
    monkeypatch.setattr(native_cpu, "gemm_amx", lambda: amx)
    monkeypatch.setattr(native_cpu, "gemm_available", lambda: avx512_bf16)
    host = machine(CPUINFO)
    assert host == {"cpu": "AMD EPYC 9B45", "cores": host["cores"], "native_matmuls": path}
    assert host["cores"] >= 1


def test_machine_without_a_model_name_says_unknown():
    assert machine("processor\t: 0\nflags\t: fpu\n")["cpu"] == "unknown"
