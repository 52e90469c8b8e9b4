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


def step():  # a prefill's activations: tens of MB each, freed in another order than allocated
    qkv = torch.ones(7540, 1536)
    q = qkv[:, :512] * 2
    heads = torch.ones(7540, 8, 128)
    out = heads * q.sum()
    del qkv, heads
    return float(out[0, 0, 0] + (torch.ones(7540, 512) + q)[0, 0])


applied = keep_freed_memory()
for _ in range(5):  # the heap settles within a few steps
    step()
counts = []
for _ in range(5):  # now and then a step still grows the heap past a fragmented hole
    faults = resource.getrusage(0).ru_minflt
    step()
    counts.append(resource.getrusage(0).ru_minflt - faults)
print(applied, sorted(counts)[2])
"""


def _probe(**env: str) -> tuple[bool, int]:
    """Whether the settings applied, and the median page faults of a settled step."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc settings")
@pytest.mark.slow
def test_freed_activations_are_reused_without_page_faults() -> None:
    applied, faults = _probe()
    assert applied
    assert faults < 5000  # a step on fresh mappings takes ~34k faults of 4 KiB pages
    applied, _ = _probe(OMNISERVE_CPU_MALLOC_TUNING="0")  # untuned, glibc's own heuristics
    assert not applied  # decide; their fault counts vary from run to run


def test_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from omniserve import envs

    monkeypatch.setenv("OMNISERVE_CPU_MALLOC_TUNING", "yes")
    with pytest.raises(ValueError, match="OMNISERVE_CPU_MALLOC_TUNING must be '0' or '1'"):
        envs.cpu_malloc_tuning()
