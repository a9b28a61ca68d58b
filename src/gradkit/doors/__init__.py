"""The doors without Lightning: :mod:`~gradkit.doors.loop` (a Fabric or plain-PyTorch loop, ``gradkit.GradKit``) and
:mod:`~gradkit.doors.huggingface` (the ``transformers.Trainer``, ``gradkit.install``). The Trainer's door is in
:mod:`lightning_gradkit`."""
