"""What a policy meets at each step: the step's measurements (:class:`StepStats`, read only), the decision it writes
(:class:`Decision`, through methods that take one clip form) and, once the step is written, what came of it
(:class:`StepOutcome`). Torch only.

The pipeline (:mod:`gradkit.step.pipeline`) measures the step into a ``StepStats``, hands every policy's ``decide``
the statistics and the one ``Decision`` of the step, applies the decision to the gradients, and hands ``observe``
the statistics and the outcome. The gradients themselves are never here: the pipeline hands them from its read to
its write, and keeps its own record of the step (:class:`~gradkit.step.pipeline.StepRecord`), which only the pipeline
and the doors' gate hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor
from torch.optim import Optimizer

from gradkit.step.norms import GradStats, ParamIndex

__all__ = ["Decision", "StepOutcome", "StepStats", "UnitNorms"]


@dataclass
class UnitNorms:
    """Unit-wise 2-norms of some gradients (AGC): one norm per slice along dim 0, i.e. per output unit.

    Measured in the pipeline's single read of the gradients, for the parameters a policy named in
    ``StatsRequest.unit_norm_names`` whose gradient has more than one dimension; the per-parameter norms in
    ``StepStats.norms`` are derived from them, so those gradients are read once. Values are local to the rank (a
    sharded gradient holds whole rows under FSDP2's dim-0 sharding) and already divided by ``StepStats.loss_scale``,
    but not multiplied by ``Decision.scale``.

    Attributes:
        positions: index positions (in ``ParamIndex.params``) of the parameters, in order.
        sizes: number of (local) units of each.
        flat: ``[sum(sizes)]`` the unit norms of all of them, concatenated in that order.
    """

    positions: list[int]
    sizes: list[int]
    flat: Tensor


@dataclass(frozen=True)
class StepStats:
    """What the pipeline measured for one optimizer step, read only. Every value is a device tensor.

    ``loss_scale`` is set when the gradients are still multiplied by the AMP loss scale (fused optimizers under
    16-mixed); every norm in ``norms`` and ``unit_norms`` is already expressed without it. No norm here carries the
    accumulation scale the policies decide (:meth:`Decision.scaled` applies it).

    Attributes:
        optimizer: the optimizer about to step.
        optimizer_idx: its position among the loop's optimizers (``StepContext.optimizers``).
        index: the parameters it steps (names, modules, param groups, sharding).
        present: the positions (in ``index``) of the parameters that have a gradient at this step.
        norms: per norm type the policies asked for, the gradients' statistics (:class:`~gradkit.GradStats`).
        reduced: the per-rank scalars the policies named (``Policy.reduce_request``), summed across ranks.
        primary_norm_type: the norm type of the step's logged gradient norm (the monitor's, 2.0 by default).
        logging_step: whether the loop logs at this step.
        loss_scale: the AMP loss scale the gradients still carry, or ``None``.
        unit_norms: the unit-wise 2-norms AGC asked for, or ``None``.
        has_gradients: whether the step has gradients to decide on.
    """

    optimizer: Optimizer
    optimizer_idx: int
    index: ParamIndex
    present: list[int]
    norms: dict[float, GradStats]
    reduced: dict[str, Tensor]
    primary_norm_type: float
    logging_step: bool
    loss_scale: Tensor | None = None
    unit_norms: UnitNorms | None = None
    has_gradients: bool = True

    @property
    def primary(self) -> GradStats:
        """Statistics at the primary norm type (the monitor's, 2.0 by default)."""
        return self.norms[self.primary_norm_type]


class Decision:
    """What the policies decided for one optimizer step: written only through its methods, one clip form at most.

    The accumulation scale multiplies in (:meth:`multiply_scale`), the skip flags OR in (:meth:`add_skip`); the clip is
    ONE of a coefficient for every gradient (:meth:`clip_by`), a coefficient per parameter (:meth:`clip_per_param`,
    AGC) or a value clamp (:meth:`clamp`), and a second clip is refused: each would rescale the gradients the other
    already clipped. The pipeline keeps the common factor a fused optimizer applies (``fold``).

    Attributes:
        scale: the product of the policies' factors for every gradient (``None``: 1).
        clip_coef: the clip coefficient for every gradient, or ``None``.
        param_coefs: per parameter position (``ParamIndex``), its clip coefficient(s) (AGC; empty: none).
        clamp_value: the value clip (in the units without the AMP loss scale), or ``None``.
        skip: a bool device scalar, true when the optimizer step must not apply (``None``: no policy may skip).
        clipped: whether a clip form was written (a coefficient, per-parameter coefficients or a value clamp).
        clip_decided: whether a clipping policy decided this step, even to leave the gradients alone (ZClip's warm-up).
        post_clip_total_fn: the clipper's own total norm after the clip (primary norm type), without a read of the
            gradients, or ``None``.
        folded: the common factor left for a fused optimizer's ``grad_scale`` (``None``: the gradients were written).
    """

    __slots__ = (
        "clamp_value",
        "clip_coef",
        "clip_decided",
        "clipped",
        "folded",
        "param_coefs",
        "post_clip_total_fn",
        "scale",
        "skip",
    )

    def __init__(self) -> None:
        self.scale: Tensor | None = None
        self.clip_coef: Tensor | None = None
        self.param_coefs: dict[int, Tensor] = {}
        self.clamp_value: float | None = None
        self.skip: Tensor | None = None
        self.clipped = False
        self.clip_decided = False
        self.post_clip_total_fn: Callable[[], Tensor] | None = None
        self.folded: Tensor | None = None

    def scaled(self, value: Tensor) -> Tensor:
        """A norm of the measured gradients (``StepStats.norms``) expressed for the gradients after the accumulation
        scale: the norm the optimizer would see without clipping."""
        return value if self.scale is None else value * self.scale

    def multiply_scale(self, factor: Tensor) -> None:
        """Fold a factor for every gradient (e.g. accumulation normalization) into the single multiply."""
        self.scale = factor if self.scale is None else self.scale * factor

    def add_skip(self, flag: Tensor) -> None:
        """Ask the door not to step the optimizer when ``flag`` (a bool device scalar) is true."""
        self.skip = flag if self.skip is None else self.skip | flag

    def decide_clip(self) -> None:
        """A clipping policy decided this step (with or without a clip: ZClip's warm-up leaves the gradients)."""
        self.clip_decided = True

    def clip_by(self, coef: Tensor) -> None:
        """Clip every gradient by ``coef`` (a device scalar, at most 1).

        Raises:
            ValueError: a clip was already written this step (a second clipper).
        """
        if self.clipped:
            raise self._second_clip("clip_by")
        self.clip_coef = coef
        self.clipped = self.clip_decided = True

    def clip_per_param(self, coefs: dict[int, Tensor], post_total: Callable[[], Tensor] | None = None) -> None:
        """Clip each parameter's gradient by its coefficient(s) (``coefs``: position in the index -> a tensor that
        broadcasts against its gradient); ``post_total`` gives the total norm after the clip without a read.

        Raises:
            ValueError: a clip was already written this step (a second clipper).
        """
        if self.clipped:
            raise self._second_clip("clip_per_param")
        self.param_coefs = dict(coefs)
        self.post_clip_total_fn = post_total
        self.clipped = self.clip_decided = True

    def clamp(self, value: float) -> None:
        """Clamp every gradient element to ``[-value, value]`` (units without the AMP loss scale).

        Raises:
            ValueError: a clip was already written this step (a second clipper).
        """
        if self.clipped:
            raise self._second_clip("clamp")
        self.clamp_value = value
        self.clipped = self.clip_decided = True

    def fold(self, factor: Tensor) -> None:
        """Leave the common ``factor`` to a fused optimizer's ``grad_scale`` (the pipeline's apply phase)."""
        self.folded = factor

    def _second_clip(self, method: str) -> ValueError:
        """The error of a second clip form in one step (``method`` received it), naming the form already written."""
        form = "a coefficient" if self.clip_coef is not None else "per-parameter coefficients"
        form = "a value clamp" if self.clamp_value is not None else form
        return ValueError(
            f"`Decision.{method}` got a second clip for this step, which already holds {form}: each clipper would "
            "rescale the gradients the other already clipped. Keep exactly one clipping policy."
        )


class StepOutcome(Protocol):
    """What ``Policy.observe`` reads of a step once its decision was applied: the decision and what came of it, read
    only (the pipeline's :class:`~gradkit.step.pipeline.StepRecord` answers). Off logging steps, ask only what the
    step already knows on the host: every read below but :meth:`skip_known_on_host` may wait for the device."""

    @property
    def decision(self) -> Decision:
        """What the policies decided for the step."""
        ...

    def post_clip_total(self) -> Tensor:
        """Total norm (primary norm type) of the gradients after scaling and clipping: derived without a read of the
        gradients where the clip allows, else measured once (logging steps only)."""
        ...

    def skip_on_host(self) -> bool:
        """The skip decision as a Python bool: one host read per step, shared by everyone who asks."""
        ...

    def flag_on_host_with_skip(self, flag: Tensor) -> bool:
        """``flag`` (a device bool) as a Python bool, read in the same transfer as the skip decision."""
        ...

    def skip_known_on_host(self) -> bool | None:
        """The skip decision if it is already on the host, else ``None`` (never synchronizes)."""
        ...

    def was_skipped(self) -> bool:
        """Whether the step was skipped, asked once it is over (a policy that folds its values in one step late)."""
        ...
