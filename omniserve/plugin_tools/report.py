"""The result of ``register-model --check``: one row per step, printed as a table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
_MAX_DETAIL = 400


@dataclass(frozen=True)
class CheckRow:
    name: str
    status: str
    """PASS, FAIL or SKIP."""
    detail: str


@dataclass
class CheckReport:
    architecture: str
    checkpoint: str
    rows: list[CheckRow] = field(default_factory=list)

    def add(self, name: str, ok: bool | None, detail: str) -> bool:
        """Record a row (``ok`` None: skipped); return whether it did not fail."""
        status = SKIP if ok is None else PASS if ok else FAIL
        if len(detail) > _MAX_DETAIL:
            detail = detail[: _MAX_DETAIL - 3] + "..."
        self.rows.append(CheckRow(name, status, " ".join(detail.split())))
        return ok is not False

    def row(self, name: str) -> CheckRow:
        return next(row for row in self.rows if row.name == name)

    @property
    def passed(self) -> bool:
        return all(row.status != FAIL for row in self.rows)

    def table(self) -> str:
        width = max([len("check"), *(len(row.name) for row in self.rows)])
        lines = [
            f"{self.architecture} on {self.checkpoint}",
            f"  {'check':{width}}  result  detail",
        ]
        lines += [f"  {r.name:{width}}  {r.status:6}  {r.detail}" for r in self.rows]
        counts = {s: sum(r.status == s for r in self.rows) for s in (PASS, FAIL, SKIP)}
        lines.append(
            f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped: "
            + ("the plugin passes." if self.passed else "the plugin FAILS.")
        )
        return "\n".join(lines)


@dataclass
class ModalityCase:
    """The dummy items of one modality and what processing them gave."""

    modality: str
    num_items: int
    inputs: Any = None
    """``MultiModalInputs`` of the dummy prompt."""
    features: list[Any] = field(default_factory=list)
