"""Validation of a pipelined replica: group 0's stages score it together.

Stage 0 reads the validation split (as :class:`~hybridagg.train.evaluate.Evaluator`
does for a whole replica), every stage runs its layers forward
(:meth:`~hybridagg.pipeline.PipelineStage.infer`), the last stage scores
the outputs, and every stage of the group learns the result.
"""

from __future__ import annotations

import torch

from ...comm import Comm
from ...pipeline import PipelineStage
from ..evaluate import Evaluator

__all__ = ["PipelinedValidation"]


class PipelinedValidation:
    """Scores the group's replica on the validation split (collective over the group).

    Args:
        stage: This rank's stage.
        group: The group's communicator.
        evaluator: Stage 0's reader of the split and the loss (``None``
            on the other stages).
        loss: The training loss, ``loss(output, labels)``.
        classify: Whether accuracy is measured (``--loss cross-entropy``).
        micro_batches: Micro-batches per validation batch.
    """

    def __init__(
        self,
        stage: PipelineStage,
        group: Comm,
        evaluator: Evaluator | None,
        loss,
        classify: bool,
        micro_batches: int,
    ) -> None:
        self.stage, self.group, self.evaluator = stage, group, evaluator
        self.loss, self.classify, self.micro_batches = loss, classify, micro_batches

    def run(self) -> tuple[float | None, float]:
        """``(accuracy, mean loss)`` of the replica (accuracy ``None`` for mse)."""
        # (streamed: stage 0 holds one validation batch at a time)
        loader = self.evaluator.loader if self.evaluator is not None else None
        count = self.group.bcast(
            len(loader) if loader is not None else None, 0, what="validation batches"
        )
        batches = iter(loader) if loader is not None else None
        correct, total, loss = 0, 0, 0.0
        for _ in range(count):
            x, y = next(batches) if batches is not None else (None, None)
            # the labels travel with the batch to the last stage
            values, dtype = self.group.bcast(
                (y.tolist(), str(y.dtype).removeprefix("torch."))
                if y is not None
                else None,
                0,
                what="validation labels",
            )
            y = torch.tensor(values, dtype=getattr(torch, dtype))
            out = self.stage.infer(x, self.micro_batches)
            if out is not None:
                loss += float(self.loss(out, y)) * len(y)
                if self.classify:
                    correct += int((out.argmax(1) == y).sum())
                total += len(y)
        last = self.group.size - 1
        result = (
            correct / max(1, total) if self.classify else None,
            loss / max(1, total),
        )
        return self.group.bcast(result, last, what="the validation result")

    def close(self) -> None:
        """Close stage 0's reader."""
        if self.evaluator is not None:
            self.evaluator.close()
