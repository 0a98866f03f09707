"""The precision hook of the train step, applied around the gradient computation."""

from __future__ import annotations

from jaxtyping import PyTree


class Precision:
    """How the gradient computation sees the parameters, and how the gradients leave it.

    The step differentiates `loss(precision.compute(model))` with respect to `model`
    and hands `precision.gradients(grads)` on, so a compute dtype (parameters cast
    inside the differentiated function, the gradients arriving in the parameters' own
    dtype) is a subclass. This one is the identity: every array in its own dtype.
    """

    def compute(self, model: PyTree) -> PyTree:
        """The model the loss function sees (inside the differentiated function)."""
        return model

    def gradients(self, grads: PyTree) -> PyTree:
        """The gradients the step goes on with."""
        return grads


FULL_PRECISION = Precision()
