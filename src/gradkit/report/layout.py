"""The gradient report's geometry (:mod:`gradkit.report.figure` draws in it): panel sizes in inches, so that every step
panel spans the same x range at the same place whatever the number of modules (the figure grows instead), and
matplotlib, loaded only when a figure is drawn."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradkit.report.data import INSTALL_HINT

__all__ = ["Layout", "pyplot", "row_labels"]

# Figure geometry, in inches: panel heights stay fixed whatever the number of modules (the figure grows instead).
WIDTH = 12.0
ROW_HEIGHT = 0.2
MAX_HEAT_HEIGHT = 11.0
MIN_HEAT_HEIGHT = 1.4
LABEL_HEIGHT = 0.12  # below this many inches per row, only every k-th module name is written
TOTAL_HEIGHT = 2.6
NOISE_HEIGHT = 2.0  # the critical-batch panel (`GradNormMonitor(noise_scale=True)`)
# Incident panels: the steps either side of an event, panels per row, at most this many panels, rows' height.
INCIDENT_COLUMNS = 2
MAX_INCIDENTS = 8
INCIDENT_ROW_HEIGHT = 0.16
INCIDENT_MIN_HEIGHT = 0.9
INCIDENT_MAX_HEIGHT = 4.0
INCIDENT_TITLE = 0.62  # inches above each panel for its title (up to three lines)
INCIDENT_BELOW = 0.45  # inches below each panel for its step labels
INCIDENT_HEADER = 0.6  # inches above the first row for the section title (two lines)
INCIDENT_RANGE = 2.0  # the colour scale spans 10**-2 .. 10**2 times a module's median
FADED = 0.4  # the alpha of a sparse heatmap's cells between logged steps


def pyplot():
    """matplotlib's ``pyplot`` on the Agg backend (files only, no window).

    Raises:
        ModuleNotFoundError: if matplotlib is not installed, with the command that installs it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"The gradient report needs matplotlib, which is not installed: {INSTALL_HINT}."
        ) from err
    return plt


@dataclass
class Layout:
    """Axes rectangles in inches, so all step panels get the same x extent whatever their labels.

    From the top: the module heatmap, the update-ratio heatmap (when logged), the totals with the events, the critical
    batch (when logged), then the incident panels (when there are incidents), ``INCIDENT_COLUMNS`` to a row.
    """

    rows: int
    label_chars: int
    ratio_rows: int = 0
    incidents: int = 0
    noise_panel: bool = False

    @property
    def heat_height(self) -> float:
        return min(max(self.rows * ROW_HEIGHT, MIN_HEAT_HEIGHT), MAX_HEAT_HEIGHT)

    @property
    def ratio_height(self) -> float:
        return min(max(self.ratio_rows * ROW_HEIGHT, MIN_HEAT_HEIGHT), MAX_HEAT_HEIGHT) if self.ratio_rows else 0.0

    @property
    def left(self) -> float:
        return max(1.0, 0.3 + 0.062 * self.label_chars)

    right = 1.25
    top = 0.45
    gap = 0.55
    bottom = 1.35
    incident_gap = 0.3  # inches between incident panels side by side

    @property
    def ratio_top(self) -> float:
        return self.top + self.heat_height + self.gap

    @property
    def total_top(self) -> float:
        return self.ratio_top + (self.ratio_height + self.gap if self.ratio_rows else 0.0)

    noise_title = 0.3  # inches more above the critical-batch panel: its title may take two lines
    noise_below = 0.8  # inches below it: its axis label (its legend is inside)

    @property
    def noise_top(self) -> float:
        return self.total_top + TOTAL_HEIGHT + self.bottom + self.noise_title

    @property
    def incident_top(self) -> float:
        if not self.noise_panel:
            return self.total_top + TOTAL_HEIGHT + self.bottom
        return self.noise_top + NOISE_HEIGHT + self.noise_below

    @property
    def incident_height(self) -> float:
        return min(max(self.rows * INCIDENT_ROW_HEIGHT, INCIDENT_MIN_HEIGHT), INCIDENT_MAX_HEIGHT)

    @property
    def incident_row_height(self) -> float:
        return INCIDENT_TITLE + self.incident_height + INCIDENT_BELOW

    @property
    def height(self) -> float:
        rows = math.ceil(self.incidents / INCIDENT_COLUMNS)
        incidents = INCIDENT_HEADER + rows * self.incident_row_height if rows else 0.0
        return self.incident_top + incidents

    def rect(self, y_from_top: float, h: float, fig_w: float = WIDTH) -> list[float]:
        width = fig_w - self.left - self.right
        return [self.left / fig_w, 1 - (y_from_top + h) / self.height, width / fig_w, h / self.height]

    def bar_rect(self, y_from_top: float, h: float) -> list[float]:
        """A colour bar in the right margin, beside a panel."""
        return [
            (WIDTH - self.right + 0.12) / WIDTH,
            1 - (y_from_top + h) / self.height,
            0.15 / WIDTH,
            h / self.height,
        ]

    def incident_rect(self, i: int) -> list[float]:
        """The ``i``-th incident panel: ``INCIDENT_COLUMNS`` to a row, the first column under the step panels."""
        row, col = divmod(i, INCIDENT_COLUMNS)
        width = (WIDTH - self.left - self.right - (INCIDENT_COLUMNS - 1) * self.incident_gap) / INCIDENT_COLUMNS
        x = self.left + col * (width + self.incident_gap)
        y = self.incident_top + INCIDENT_HEADER + row * self.incident_row_height + INCIDENT_TITLE
        h = self.incident_height
        return [x / WIDTH, 1 - (y + h) / self.height, width / WIDTH, h / self.height]


def row_labels(ax, rows: list[str], height: float) -> None:
    """Name the rows, every k-th one when the rows are too thin for a label each."""
    every = max(1, math.ceil(LABEL_HEIGHT * len(rows) / height))
    shown = range(0, len(rows), every)
    ax.set_yticks(list(shown), [rows[i] for i in shown], fontsize=7)
