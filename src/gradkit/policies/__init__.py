"""The policies as plain torch objects, one class per algorithm: logging, clipping, guards, rollback, warnings.

Each is exported by :mod:`gradkit` (``from gradkit import ZClip``) and served by every door; the Trainer callbacks
of :mod:`lightning_gradkit` wrap the same classes.
"""
