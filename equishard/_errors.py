"""The exceptions equishard raises for misconfiguration.

Every check runs before XLA sees the program, and every message names what a user
needs to find the mistake: the parameter's path, its shape, the spec and the mesh.
"""

from __future__ import annotations


class EquishardError(ValueError):
    """Base class of every error equishard raises for bad input.

    A subclass of `ValueError`, so code that already catches `ValueError` keeps
    working.
    """


class MeshError(EquishardError):
    """A mesh or layout string is malformed or does not fit the devices."""


class SpecError(EquishardError):
    """A `PartitionSpec` does not fit the array or the mesh it is used with."""


class LayerConfigError(EquishardError):
    """A layer was constructed with an invalid hyperparameter."""


class DistributedError(EquishardError):
    """The multi-process runtime was misconfigured or started too late."""


class CheckpointError(EquishardError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


class ConventionError(EquishardError):
    """A function of one gradient convention was called under the other.

    xLSTM-JAX's local-loss functions (`gather_params`, `gather_array_with_mean_grads`,
    `shard_module_params`, `sync_gradients`) need `shard_map(..., check_vma=False)`;
    equishard's own functions differentiate the global loss with the check on.
    """


class TrainStepError(EquishardError):
    """A train step was given what its contract refuses: a loss function's return value,
    an optimizer, a state or a batch that does not fit the step (the message names the
    argument, what was expected and what was given)."""


class TrainingError(EquishardError):
    """A run cannot go on: its steps keep producing non-finite values."""


class GenerationError(EquishardError):
    """Generation or evaluation was asked for what it cannot do: a prompt that is empty
    or does not fit the maximum length, a sampling option out of range, a vocabulary
    that does not match the model's, a run directory with no verified checkpoint."""
