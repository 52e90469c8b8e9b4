"""Video token pruning (vLLM's ``--video-pruning-rate``, Efficient Video Sampling, arXiv
2510.14624): a video keeps the share ``1 - rate`` of its merged patch tokens, those that differ
most from the same spot in the frame group before; the first frame group is kept whole.

The kept count depends only on the video's grid and the rate, so the processor sizes the prompt's
placeholder before anything is encoded; which tokens are kept is known once the encoder has run
(``VideoPruning.kept_rows``). Two layouts:
- one run of pads for the whole video (Qwen2-VL, Qwen2.5-VL): the most dissimilar tokens of the
  whole video win, so a scene change keeps more than a still shot (vLLM's rule);
- one run per frame group between its timestamp and markers (Qwen3-VL), or frame groups
  interleaved with their soundtrack by time (the omni thinkers): each later frame group keeps an
  equal share (``frame_quotas``) of its own most dissimilar tokens, so every run's pads are its
  own frame group's tokens and a soundtrack's tokens keep their places among them
  (``prune_order``).
Ties keep the earlier token. Dissimilarity is ``1 - cos`` in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def retained_tokens(tokens_per_frame: int, num_frames: int, rate: float) -> int:
    """Tokens a video of ``num_frames`` frame groups keeps: ``floor(total * (1 - rate))``, never
    fewer than one whole frame group."""
    return max(tokens_per_frame, int(tokens_per_frame * num_frames * (1 - rate)))


def frame_quotas(tokens_per_frame: int, num_frames: int, rate: float) -> list[int]:
    """Tokens each frame group keeps in the per-frame-group layout: the first all of its own,
    the others an equal share of the rest (the earlier ones one more while it does not
    divide), summing to ``retained_tokens``."""
    rest = retained_tokens(tokens_per_frame, num_frames, rate) - tokens_per_frame
    later = num_frames - 1
    if later == 0:
        return [tokens_per_frame]
    share, extra = divmod(rest, later)
    return [tokens_per_frame] + [share + (i < extra) for i in range(later)]


def prune_order(is_video: torch.Tensor, tokens_per_frame: int, quotas: list[int]) -> torch.Tensor:
    """An item's token order (``[n]`` bool, True for a video token; a video interleaved with its
    soundtrack) after pruning by frame-group ``quotas``: each frame group's video tokens, which
    lie together, shrink to its quota, everything else stays where it was."""
    index = torch.cumsum(is_video.long(), 0) - 1  # each video token's index in the video
    frame = torch.div(index.clamp(min=0), tokens_per_frame, rounding_mode="floor")
    kept = index % tokens_per_frame < torch.tensor(quotas)[frame.clamp(max=len(quotas) - 1)]
    return is_video[~is_video | kept]


@dataclass(frozen=True)
class VideoPruning:
    """How one video is pruned: its merged grid (``num_frames`` frame groups of
    ``tokens_per_frame`` tokens each), the rate, and the layout (``per_frame``)."""

    num_frames: int
    tokens_per_frame: int
    rate: float
    per_frame: bool
    compared_width: int | None = None
    """The leading columns of a row that are compared (an embedding's main part, where the rows
    carry more after it); None: all."""

    @property
    def num_rows(self) -> int:
        """Rows the encoder outputs for the video, before pruning."""
        return self.num_frames * self.tokens_per_frame

    @property
    def num_kept(self) -> int:
        return retained_tokens(self.tokens_per_frame, self.num_frames, self.rate)

    def quotas(self) -> list[int]:
        """Kept tokens per frame group (the per-frame-group layout's run lengths)."""
        return frame_quotas(self.tokens_per_frame, self.num_frames, self.rate)

    def provisional_rows(self) -> torch.Tensor:
        """Rows that stand for the kept ones until the encoder has run (the first of each
        frame group's share), so a prompt's positions are laid out before they are known."""
        if not self.per_frame:
            return torch.arange(self.num_kept)
        return torch.cat([torch.arange(quota) + t * self.tokens_per_frame
                          for t, quota in enumerate(self.quotas())])  # fmt: skip

    def kept_rows(self, embeds: torch.Tensor) -> torch.Tensor:
        """Ascending indices (int64, on the host) of the rows of ``embeds`` (``[num_rows,
        width]``, the encoder's output for the video) that are kept."""
        if embeds.shape[0] != self.num_rows:
            raise ValueError(f"A video of {self.num_frames} x {self.tokens_per_frame} tokens "
                             f"got {embeds.shape[0]} encoder rows.")  # fmt: skip
        frames = embeds[:, : self.compared_width].float()
        frames = frames.reshape(self.num_frames, self.tokens_per_frame, -1)
        change = 1 - F.cosine_similarity(frames[1:], frames[:-1], dim=-1)  # [T - 1, per_frame]
        change = change.cpu()
        first = torch.arange(self.tokens_per_frame)
        if self.per_frame:
            picks = [first]
            for t, quota in enumerate(self.quotas()[1:], start=1):
                order = torch.argsort(change[t - 1], descending=True, stable=True)
                picks.append(torch.sort(order[:quota]).values + t * self.tokens_per_frame)
            return torch.cat(picks)
        order = torch.argsort(change.flatten(), descending=True, stable=True)
        later = order[: self.num_kept - self.tokens_per_frame] + self.tokens_per_frame
        return torch.cat([first, torch.sort(later).values])
