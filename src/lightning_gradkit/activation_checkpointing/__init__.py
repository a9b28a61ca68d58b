"""Activation checkpointing for any model under any strategy.

- :mod:`~lightning_gradkit.activation_checkpointing.injection`: module selection and the injection itself
  (:func:`~lightning_gradkit.inject_activation_checkpointing`); plain PyTorch.
- :mod:`~lightning_gradkit.activation_checkpointing.planner`: saved-activation measurement and the memory-budget
  planner; plain PyTorch.
- :mod:`~lightning_gradkit.activation_checkpointing.callback`: :class:`~lightning_gradkit.ActivationCheckpointing`,
  the Lightning wiring.
"""
