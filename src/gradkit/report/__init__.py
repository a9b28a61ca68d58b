"""The gradient report: the event log (:mod:`~gradkit.report.events`), what a run's logs say
(:mod:`~gradkit.report.data`) and one PNG of it (:mod:`~gradkit.report.figure`, ``python -m gradkit.report``)."""

from __future__ import annotations

from gradkit.report.data import load_run
from gradkit.report.figure import build_figure, draw, main, render, render_data, save

# The names of the old ``gradkit/report.py`` stay importable from ``gradkit.report``.
__all__ = ["build_figure", "draw", "load_run", "main", "render", "render_data", "save"]
