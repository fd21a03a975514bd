"""Static: always the same arm. The baseline every adaptive policy is measured against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from policies.algorithms.base import Learner
from policies.arms import Arm
from policies.context import Context
from policies.params import Param


class Static(Learner):
    NAME: ClassVar[str] = "static"
    PARAMS: ClassVar[Mapping[str, Param]] = {
        "arm": Param("eagle3:3", "The arm to play, e.g. 'eagle3:3', 'ngram:4' or 'off'."),
    }

    def __init__(self, *, arms: Sequence[Arm], params: Mapping[str, Any], rng: np.random.Generator) -> None:
        super().__init__(arms=arms, params=params, rng=rng)
        self.arm = Arm.parse(str(self.params["arm"]))

    def select(self, ctx: Context, allowed: Sequence[int]) -> int:
        for i in allowed:
            if self.arms[i] == self.arm:
                return i
        # The engine cannot play the configured arm: the closest K of the same method, else the first.
        same = [i for i in allowed if self.arms[i].method == self.arm.method]
        if same:
            return min(same, key=lambda i: abs(self.arms[i].k - self.arm.k))
        return allowed[0]
