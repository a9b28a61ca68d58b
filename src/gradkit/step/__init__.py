"""The step: measure the gradients once, reduce, let the policies decide, apply the decision once, step or skip.

What every door shares: :mod:`~gradkit.step.pipeline` (the order of a step, and its own record of each step),
:mod:`~gradkit.step.protocol` (what a policy and a door see), :mod:`~gradkit.step.plan` (what a policy reads and
decides at a step), :mod:`~gradkit.step.norms` (the one-pass statistics), :mod:`~gradkit.step.gate` (the optimizer
step or its skip), :mod:`~gradkit.step.accounting` (the count of steps and skips), and the state a skip or a replay
puts back (:mod:`~gradkit.step.snapshot`, :mod:`~gradkit.step.replay`).
"""
