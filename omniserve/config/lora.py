"""The LoRA settings of an engine (``--enable-lora`` and its flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (``omniserve/lora``): present only with ``--enable-lora``."""

    max_loras: int = 1
    """Distinct adapters one step may run (each has a slot of weights on the device)."""
    max_lora_rank: int = 16
    """Largest rank an adapter may have (the slots are this wide)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (None: ``max_loras``); others are read again."""
    default_mm_loras: dict[str, str] = field(default_factory=dict)
    """vLLM's: modality -> the adapter (a PEFT directory) a request with media of that modality
    runs with when it names none (``lora.request.with_default_mm_lora``)."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )
