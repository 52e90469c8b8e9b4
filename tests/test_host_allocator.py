"""CPU workers keep freed activation memory in the heap (glibc mallopt), unless turned off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

_PROBE = """
import resource
import torch
from omniserve.worker.host_allocator import keep_freed_memory
applied = keep_freed_memory()
x = torch.empty(8 << 20)  # 32 MiB: above glibc's default mmap ceiling
x.fill_(1.0)
del x
faults = resource.getrusage(0).ru_minflt
y = torch.empty(8 << 20)
y.fill_(2.0)  # reuses the freed heap block when tuned: no page faults
print(applied, resource.getrusage(0).ru_minflt - faults)
"""


def _probe(**env: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
def test_freed_activations_are_reused_without_page_faults() -> None:
    applied, faults = _probe()
    assert applied
    assert faults < 1000  # a fresh 32 MiB mapping would take ~8k faults of 4 KiB pages
    applied, faults = _probe(OMNISERVE_CPU_MALLOC_TUNING="0")
    assert not applied
    assert faults > 4000


def test_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from omniserve import envs

    monkeypatch.setenv("OMNISERVE_CPU_MALLOC_TUNING", "yes")
    with pytest.raises(ValueError, match="OMNISERVE_CPU_MALLOC_TUNING must be '0' or '1'"):
        envs.cpu_malloc_tuning()
