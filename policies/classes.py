"""The bound on the traffic classes one engine's loop learns about, written once for the sidecar and the
simulator.

Each traffic class is a context of the loop (memory, status, snapshot, metric labels), so an engine
naming a new class on every step must not grow them without bound. ``ClassBound`` keeps the classes an
engine has named, at most ``limit`` of them with ``default`` among them from the start, and pools every
class beyond those into ``default`` before the loop sees a step.

What must hold: the classes admitted are the first ones named, in step order (within a step, in sorted
order), so the outcome does not depend on how the steps are cut into batches (the sidecar gets batches
of any size, the replay reports one step at a time); a class once pooled is pooled for good; ``known``
never holds more than ``max(limit, 1)`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.observation import StepBatch

#: Distinct traffic classes one engine's loop learns about; later ones are pooled into "default".
MAX_CLASSES_PER_ENGINE = 256
#: The class a request without one has, and the one the classes beyond the bound are pooled into.
DEFAULT_CLASS = "default"


@dataclass(slots=True)
class ClassBound:
    """The classes one engine has named (``known``) and how many steps had a class pooled."""

    limit: int = MAX_CLASSES_PER_ENGINE
    known: set[str] = field(default_factory=lambda: {DEFAULT_CLASS})
    #: Steps in which at least one class was pooled into ``default``.
    pooled_steps: int = 0

    def __post_init__(self) -> None:
        self.known.add(DEFAULT_CLASS)

    def apply(self, batch: StepBatch) -> StepBatch:
        """``batch`` with every class beyond the first ``limit`` named renamed to ``default``; the
        classes it names first take the room left."""
        known = self.known
        names = batch.class_names
        if known.issuperset(names):  # the usual batch: only classes the engine named before
            return batch
        of = batch.class_of
        pooled: set[str] = set()
        for i in range(len(batch)):  # in step order: the first classes named take the room
            used = {names[j] for j in set(of[batch.rows(i)].tolist())}
            new = sorted(used - known)
            if not new:
                continue
            room = max(self.limit - len(known), 0)
            known.update(new[:room])
            if len(new) <= room:
                continue
            self.pooled_steps += 1
            pooled.update(new[room:])
        return batch.renamed(dict.fromkeys(pooled, DEFAULT_CLASS)) if pooled else batch
