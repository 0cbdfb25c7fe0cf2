"""An executor that fails on its third step, for testing how a core crash is reported."""

from __future__ import annotations

from asyncllm.executor.instant import InstantExecutor


class FailOnThirdStep(InstantExecutor):
    steps = 0

    def execute_model(self, so):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("simulated device failure in step 3")
        return super().execute_model(so)
