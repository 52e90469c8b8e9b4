"""Custom logits processors, with vLLM V1's interface (``vllm.v1.sample.logits_processor``).

A processor is a class loaded once at start-up (``--logits-processors module:Class``, ``LLM(...,
logits_processors=[cls or "module:Class"])``, or the ``omniserve.logits_processors`` entry-point
group) and instantiated in each worker as ``cls(config, device, is_pin_memory)``. It sees the batch
as a list of requests: ``update_state`` gets the batch's changes before each sampling step
(``BatchUpdate``: removed, then added, then moved; ``None`` when nothing changed), and ``apply``
gets that step's ``[batch_size, vocab]`` fp32 logits, row i being the request at index i, and
returns them changed. Requests configure a processor through ``SamplingParams.extra_args`` (the
API's ``vllm_xargs``); ``validate_params`` refuses bad ones when a request arrives.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from importlib.metadata import EntryPoints
from importlib.metadata import entry_points as _all_entry_points
from typing import TYPE_CHECKING, Any

import torch

from omniserve.registry import load_class
from omniserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from omniserve.config import OmniConfig

LOGITS_PROCESSORS_GROUP = "omniserve.logits_processors"
"""The entry-point group whose processors every engine loads (vLLM's ``vllm.logits_processors``)."""


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()
    """The request at the first index moves to the second; the first becomes empty."""
    SWAP = auto()
    """The requests at the two indices exchange them."""


AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
"""(index, params, prompt token ids, output token ids): the output list is the request's own,
which grows as it generates, so a processor holding it always sees the latest tokens."""
MovedRequest = tuple[int, int, MoveDirectionality]
RemovedRequest = int


@dataclass(frozen=True)
class BatchUpdate:
    """The batch's changes since the last update. Process them in order: removed, added, moved;
    an added or moved request replaces any request at its index."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM's interface)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for params (``extra_args``) this processor cannot run with: the
        request is refused when it arrives. (Optional: this one takes any.)"""
        return None

    @abstractmethod
    def __init__(self, vllm_config: OmniConfig, device: torch.device, is_pin_memory: bool) -> None:
        """Built once per worker, with the engine's config and the worker's device."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``[batch_size, vocab]`` fp32 logits -> the same, changed (in place or a new tensor)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes a row's most likely token: it then runs only
        on sampled (not greedy) rows' logits, after their temperature. Asked once, at start."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each ``apply`` with the batch's changes (None: none)."""


RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)
"""A per-request processor: (output ids, logits row) -> row, or (prompt ids, output ids, row)."""


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs per-request processors (``new_req_logits_processor``) row by row: the way to serve
    processors written one request at a time (as transformers' are). Subclasses implement
    ``is_argmax_invariant`` and ``new_req_logits_processor``; an overridden ``__init__`` must call
    this one."""

    def __init__(self, vllm_config: OmniConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The processor of a request with ``params``, or None when it takes none."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            processor = self.new_req_logits_processor(params)
            if processor is None:
                self._rows.pop(index, None)
            else:
                self._rows[index] = _bound(processor, prompt_ids or [], output_ids)
        for source, target, direction in batch_update.moved:
            moving, replaced = self._rows.pop(source, None), self._rows.pop(target, None)
            if moving is not None:
                self._rows[target] = moving
            if direction == MoveDirectionality.SWAP and replaced is not None:
                self._rows[source] = replaced

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, processor in self._rows.items():
            logits[index] = processor(logits[index])
        return logits


def _bound(
    processor: RequestLogitsProcessor, prompt_ids: list[int], output_ids: list[int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``processor`` as a function of the logits row alone (by how many arguments it takes)."""
    try:
        takes = len(inspect.signature(processor).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: assume the short form
        takes = 2
    if takes == 3:
        return lambda row: processor(prompt_ids, output_ids, row)  # type: ignore[call-arg]
    if takes == 2:
        return lambda row: processor(output_ids, row)  # type: ignore[call-arg]
    raise TypeError(
        f"a per-request logits processor takes (output_ids, logits) or (prompt_ids, output_ids, "
        f"logits), not {takes} arguments: {processor!r}"
    )


def resolve_logits_processors(
    specs: Sequence[Any], *, entry_points: bool = True
) -> tuple[type[LogitsProcessor], ...]:
    """The classes ``specs`` name, then (``entry_points``) those of the entry-point group, each
    once; ValueError naming a spec that is no importable ``LogitsProcessor`` subclass."""
    classes = [_checked(load_class(spec, "logits_processors"), f"logits_processors: {spec!r}")
               for spec in specs]  # fmt: skip
    for point in _entry_points() if entry_points else ():
        try:
            cls = point.load()
        except Exception as exc:
            where = f"entry point {point.name!r} ({point.value}) of {LOGITS_PROCESSORS_GROUP}"
            raise ValueError(f"{where} failed to load: {exc!r}") from exc
        classes.append(_checked(cls, f"entry point {point.name!r} of {LOGITS_PROCESSORS_GROUP}"))
    return tuple(dict.fromkeys(classes))


def _entry_points() -> EntryPoints:
    return _all_entry_points(group=LOGITS_PROCESSORS_GROUP)


def _checked(cls: Any, where: str) -> type[LogitsProcessor]:
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(
            f"{where} is not a subclass of omniserve.logits_processor.LogitsProcessor."
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"{where} does not implement {missing}.")
    return cls


def validate_request(classes: Sequence[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Each processor's ``validate_params`` on a request's params (ValueError refuses it)."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except ValueError as exc:
            raise ValueError(f"extra_args (vllm_xargs): logits processor {cls.__qualname__} "
                             f"refuses them: {exc}") from exc  # fmt: skip
