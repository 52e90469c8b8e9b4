"""Classes a config carries into spawned processes (custom logits processors), pickled by value
where they live in the user's script or notebook (``__main__``), which spawned processes never
re-run (``process_utils.spawning``), and by reference otherwise: cloudpickle's rule."""

from __future__ import annotations

from typing import Any

import cloudpickle


class ClassesByValue(tuple[type, ...]):
    def __reduce__(self) -> tuple[Any, ...]:
        return _loads, (cloudpickle.dumps(tuple(self)),)


def _loads(data: bytes) -> ClassesByValue:
    return ClassesByValue(cloudpickle.loads(data))
