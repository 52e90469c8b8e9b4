"""The multimodal settings of an engine: media limits and sources, the processor's defaults and
cache, the towers' attention."""

from __future__ import annotations

from dataclasses import dataclass, field

MM_ENCODER_ATTN_BACKENDS = ("auto", "TORCH_SDPA", "FLASH_ATTN")
"""The towers' attention (``attention/encoder.py``); auto: FLASH_ATTN on CUDA where its
start-up check passes, else TORCH_SDPA."""

MM_ENCODER_TP_MODES = ("weights", "data")
"""``--mm-encoder-tp-mode`` (``worker/encoder_runner.py``)."""

MM_PROFILE_SIZES: dict[str, tuple[str, ...]] = {
    "image": ("width", "height"),
    "video": ("num_frames", "width", "height"),
    "audio": ("length",),
}
"""The sizes vLLM's object form of ``--limit-mm-per-prompt`` may set, per modality."""


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    """Most items per modality in one prompt, e.g. {"image": 4, "video": 1}; unset: the model's."""
    mm_profile_sizes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Sizes of the start-up memory profile's item per modality, each at most the largest the
    processor takes (``--limit-mm-per-prompt``'s object form, e.g. {"image": {"count": 2,
    "width": 512, "height": 512}}): a smaller profile leaves a GPU more for the KV cache, and
    a larger item than profiled may then run it out of memory, as in vLLM."""
    mm_processor_kwargs: dict[str, object] = field(default_factory=dict)
    """Default HF processor kwargs (e.g. max_pixels, fps); requests may override them."""
    mm_processor_cache_gb: float = 4.0
    """Processor-output cache size in GiB (0 disables it)."""
    allowed_local_media_path: str | None = None
    """file:// URLs are served only from under this directory."""
    allowed_media_domains: tuple[str, ...] = ()
    """If set, http(s) media may only come from these hosts."""
    allow_private_media_urls: bool = False
    """Let http(s) media come from loopback/private addresses (off: SSRF protection)."""
    media_io_kwargs: dict[str, dict[str, object]] = field(default_factory=dict)
    """Per-modality media limits, e.g. {"video": {"num_frames": 16}} (``MediaConfig``)."""
    enable_mm_embeds: bool = False
    """Accept precomputed embeddings (``image_embeds`` / ``audio_embeds``) in place of media."""
    mm_encoder_attn_backend: str = "auto"
    """The towers' attention within their segments (``attention/encoder.py``): "auto",
    "TORCH_SDPA" or "FLASH_ATTN"."""
    mm_encoder_tp_mode: str = "weights"
    """vLLM's, under tensor parallelism: "weights", every rank encodes every item (its towers
    whole: vLLM's shards them); "data", the ranks split each step's items of a modality."""
    skip_mm_profiling: bool = False
    """vLLM's: the GPU start-up memory profile runs the text step only, so the KV cache takes
    what media would need at their peak (the user's to leave room for)."""
    video_pruning_rate: float = 0.0
    """vLLM's: the share of each video's tokens dropped before the decoder, those most like
    the frame group before (``omniserve.multimodal.pruning``); 0 keeps them all."""

    def modalities_off(self) -> frozenset[str]:
        """The modalities no prompt may carry (limit 0): their encoders are not even loaded."""
        return frozenset(m for m, limit in self.limit_mm_per_prompt.items() if limit == 0)

    def __post_init__(self) -> None:
        if not 0 <= self.mm_processor_cache_gb < float("inf"):
            raise ValueError(
                f"mm_processor_cache_gb must be a number >= 0, got {self.mm_processor_cache_gb}."
            )
        if self.mm_encoder_tp_mode not in MM_ENCODER_TP_MODES:
            raise ValueError(f"mm_encoder_tp_mode must be one of {MM_ENCODER_TP_MODES}, got "
                             f"{self.mm_encoder_tp_mode!r}.")  # fmt: skip
        if self.mm_encoder_attn_backend not in MM_ENCODER_ATTN_BACKENDS:
            raise ValueError(
                f"mm_encoder_attn_backend must be one of {MM_ENCODER_ATTN_BACKENDS}, got "
                f"{self.mm_encoder_attn_backend!r}."
            )
        if not 0 <= self.video_pruning_rate < 1:
            raise ValueError(
                f"video_pruning_rate must be in [0, 1), got {self.video_pruning_rate}."
            )
        for modality, limit in self.limit_mm_per_prompt.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0.")
        for modality, sizes in self.mm_profile_sizes.items():
            names = MM_PROFILE_SIZES.get(modality, ())
            for name, size in sizes.items():
                where = f"limit_mm_per_prompt[{modality!r}][{name!r}]"
                if name not in names:
                    takes = ", ".join(("count", *names))
                    raise ValueError(f"{where}: not a setting of {modality} (it takes: {takes}).")
                if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                    raise ValueError(f"{where} must be an integer >= 1, got {size!r}.")
