"""The Lightning ``Trainer`` callbacks of lightning_gradkit, one module per job.

Import them from the package: ``from lightning_gradkit import ZClip``. Each gradient-path callback is a thin
subclass of its torch policy (in the ``gradkit`` import root) and
:class:`~lightning_gradkit.trainer_door.GradKitCallback`; ``accumulation`` and ``manual_accumulation`` (exact
accumulation) and ``validation`` (inference-mode validation) are Trainer-only.
"""
