r"""Act before the spike: :class:`QKClip` rescales the query and key weights of each attention head whose largest
logit went over a threshold (MuonClip's QK-Clip, Kimi K2, 2025; Megatron-LM's ``qk_clip``). Pure PyTorch; the
``Trainer`` callback of the same name is :class:`lightning_gradkit.QKClip`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradkit._util.arguments import check_bool, check_float, check_int
from gradkit.policies.attention_heads import (
    Heads,
    ModuleScopedMode,
    Slab,
    Unreadable,
    find_heads,
    mha_head_max,
    sdpa_head_max,
)
from gradkit.policies.sharded_heads import forward_heads, local_row_index
from gradkit.step.norms import local_tensor, world_size
from gradkit.step.params import clean_name
from gradkit.step.plan import StepOutcome, StepStats
from gradkit.step.protocol import Stage, StepContext, state_key
from gradkit.step.replay import replaying
from gradkit.step.selection import outermost_attention, parse_patterns

__all__ = ["QKClip"]

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SOFTMAX = (torch.softmax, F.softmax, Tensor.softmax)
_SHARDING_HINT = (
    "QKClip rescales weights sharded by FSDP2 (`fully_shard`) and tensor parallelism (`ColwiseParallel` on the query "
    "and key projections); leave this module out of `attention`, or place its weights so"
)
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")
# FlexAttention's operator (what `flex_attention` calls, compiled or not): `(query, key, value, score_mod, block_mask,
# scale, kernel_options, ...)`, returning `(out, lse, max_scores)` (a torch without max_scores returns two: not read).
_FLEX = getattr(torch.ops.higher_order, "flex_attention", None)
_FLEX_OPTIONS = 6


class _LogitMode(ModuleScopedMode):
    """Active inside one attention module's training forward: reads the exact per-head maxima of its logits."""

    owner: QKClip

    def __init__(self, owner: QKClip, name: str) -> None:
        super().__init__(owner, name)
        #: Each FlexAttention call's largest score per row ``(batch, heads, queries)``, in the kernel's log2 units: read
        #: at the end of the forward (the call may run inside ``torch.compile``, where nothing else should happen).
        self.flex: list[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Inside this method the mode is off: what it computes here is not seen again.
        if func is F.scaled_dot_product_attention:
            call = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
            with torch.no_grad():
                value = sdpa_head_max(
                    call["query"], call["key"], call.get("attn_mask"), bool(call.get("is_causal")), call.get("scale")
                )
            self.owner.note(self.name, value)
        elif func in _SOFTMAX:
            scores = args[0] if args else kwargs.get("input", kwargs.get("self"))
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(scores, Tensor) and scores.ndim == 4 and dim in (-1, 3):  # (batch, heads, queries, keys)
                with torch.no_grad():
                    self.owner.note(self.name, scores.detach().transpose(0, 1).reshape(scores.shape[1], -1).amax(1))
        elif _FLEX is not None and func is _FLEX:
            return self._flex(func, list(args), kwargs)
        return func(*args, **kwargs)

    def _flex(self, func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """A FlexAttention call, asked for its rows' largest scores too (``OUTPUT_MAX``, which ``return_aux`` sets).
        Dynamo traces this inside ``flex_attention``'s compile: plain Python only."""
        options = args[_FLEX_OPTIONS] if len(args) > _FLEX_OPTIONS else kwargs.get("kernel_options", {})
        wants = options.get("BACKEND") != "FLASH"  # its FLASH backend has no max scores to give
        # The eager (math) path computes them anyway; the CPU's inductor kernel has none (it returns the output alone,
        # and reading them fails its compile), but FlexAttention has no backward on the CPU: no training forward.
        if wants and args[0].device.type not in ("cpu", "mps"):
            options = {**options, "OUTPUT_MAX": True}
            if len(args) > _FLEX_OPTIONS:
                args[_FLEX_OPTIONS] = options
            else:
                kwargs = {**kwargs, "kernel_options": options}
        out = func(*args, **kwargs)
        if wants and len(out) > 2:
            self.flex.append(out[2])
        return out


class QKClip:
    r"""Rescale the query and key weights of each attention head whose largest logit exceeds ``threshold``, after
    every optimizer step (QK-Clip, the "Clip" of MuonClip: Kimi K2 tech report, 2025; Megatron-LM's
    ``megatron/core/optimizer/qk_clip.py``).

    **The rule.** For query head ``h`` with ``S_h``, the largest pre-softmax logit ``q.k * scale`` over the step's
    training forwards (every micro-batch, every batch element, query and unmasked key), ``gamma_h = tau / S_h`` where
    ``S_h > tau`` and 1 elsewhere. A key head ``g`` serving query heads ``G`` (grouped-query attention; one head per
    group otherwise) is scaled by ``sqrt(min_{h in G} gamma_h)`` and query head ``h`` by
    ``gamma_h / sqrt(min_{h in G} gamma_h)``, so every pair's logits scale by exactly its own ``gamma_h`` (with one
    query head per key head both are scaled by ``sqrt(gamma_h)``, the paper's rule). The biases of the query and key
    rows are scaled with their weights, so the logits scale exactly. A head over the threshold thus has its largest
    logit of the step brought back to ``tau``; a head under it keeps its logits (in a group with a clipped head its
    query rows grow as its key rows shrink). Multi-latent attention (DeepSeek-V2/V3) follows the report's rule for
    MLA: the head's own query and key components (``q^C``, ``k^C``: the "nope" rows of ``q_b_proj`` and
    ``kv_b_proj``) by ``sqrt(gamma_h)``, its rotary query ``q^R`` by ``gamma_h``, and the rotary key ``k^R``, which
    every head shares (``kv_a_proj_with_mqa``), left as it is so no other head is touched. The rescale is on the
    device (``torch.where``), with no host sync.

    **Where the maxima come from.** Exactly, from what the module computes in its training forward: the input of a
    ``softmax`` over 4-D scores ``(batch, heads, queries, keys)`` (eager attention: HF GPT-2, BERT and Llama with
    ``attn_implementation="eager"``), the query and key of a ``F.scaled_dot_product_attention`` call, whose logits
    are computed again here in chunks (its mask, causality, scale and grouped-query layout applied; this costs about
    one more ``q @ k^T`` of the attention per step), the largest score of each row that FlexAttention's kernel
    computes anyway (``flex_attention``'s ``max_scores``, asked of every call in the forward, compiled or not: its
    ``block_mask`` and ``score_mod`` applied, as its softmax sees them), and for ``nn.MultiheadAttention`` its own
    projections of its query and key with its masks. Rotary embeddings and scaling are seen as the module applies
    them. The maxima stay device tensors (``torch.maximum`` over the step's micro-batches); under
    ``torch.distributed`` every module's maxima travel in one all-reduce (MAX), so every rank rescales the same.

    **Which weights.** Each selected module's query and key projections: ``q_proj``/``k_proj`` (Llama-style),
    ``query``/``key`` (BERT), ``wq``/``wk``, ``to_q``/``to_k``, a fused ``[q | k | v]`` projection ``qkv``,
    ``c_attn`` (GPT-2's ``Conv1D``), ``qkv_proj`` or ``Wqkv``, a fused projection ``query_key_value`` interleaved
    per key head as ``[its query heads | key | value]`` (GPT-NeoX's per-head ``[q | k | v]``, Falcon's grouped and
    multi-query layouts; Bloom's is the same, untested), multi-latent attention's ``q_b_proj`` (or ``q_proj``) and
    ``kv_b_proj`` beside ``kv_a_proj_with_mqa`` (Hugging Face's DeepSeek-V2/V3; DeepSeek's own ``wq_b``/``wq``,
    ``wkv_b``, ``wkv_a``), or
    ``nn.MultiheadAttention``'s ``in_proj_weight`` (or ``q_proj_weight``/``k_proj_weight``); the head count from the
    module's (or its ``config``'s) ``num_heads``/``n_head``/``num_attention_heads``,
    ``num_key_value_heads``/``n_query_groups``/``num_kv_heads`` and ``head_dim``/``head_size`` (for MLA,
    ``qk_nope_head_dim``, ``qk_rope_head_dim`` and ``v_head_dim``). A module where they cannot be found, or that
    normalizes its queries and keys (qk-layernorm), is refused at ``attach`` with the reason; one whose forward
    computes its logits in a kernel gradkit cannot read (flash-attn, Transformer Engine, FlexAttention's ``FLASH``
    backend, which has no max scores) is refused at the end of the step that ran it. ``torch.compile`` of the
    attention modules is untested (the maxima are read in Python, inside their forward; FlexAttention's own compile
    is traced through).

    **Sharded weights.** FSDP2 (``fully_shard``) and tensor parallelism (``ColwiseParallel`` query and key
    projections, ``RowwiseParallel`` output projection; both on a 2-D mesh): the rule is computed for every head of
    the whole weight, and each rank multiplies the rows its shard holds (their global indices found once at
    ``attach`` from the DTensor's mesh and placements: uneven shards and a head split between two ranks included).
    A tensor-parallel rank's forward computes its own heads (``first ... first + count - 1`` of its mesh coordinate);
    their maxima take their place among all the module's heads, ``-inf`` elsewhere, and the one all-reduce (MAX) of
    the step, over every rank, fills in the others. The head counts are the whole module's (its ``config``'s), as
    Hugging Face models give them. FSDP1's flat shards are refused at ``attach`` (a rank does not know where a row
    starts), as is a weight placed as a partial sum; a tensor-parallel forward whose query and key rows are not
    split alike, once, evenly into whole heads (or that splits a fused ``[q | k | v]`` projection) is refused at its
    first forward.

    **Scaled updates** (``scale_updates=True``, off by default: the rule above is MuonClip's). An optimizer whose step
    has a size set by the learning rate (Adam) turns weights that the rescale keeps small by a larger fraction at each
    step: on the bench's AdamW proxy QK-Clip holds the query and key rows where each step turns them by 10% to 43%,
    against 1% to 4% in the qk-layernorm twin. With this switch each head's query and key rows take the optimizer's
    update times the product of every factor they were rescaled by so far (the rows as they were before the step
    plus that fraction of the step's change), so a clipped head's rows keep about the relative step they had before
    it was clipped. A query factor above 1 (a grouped-query head whose key head was clipped) leaves its product as it
    is. It costs a copy of the query and key rows per step (taken before the optimizer step) and one interpolation
    after it, on the device; the products are the policy's state (``state_dict``), so a resumed run continues them.
    A head that stays clipped has its rows' updates shrink with it, toward a standstill.

    **Logged** on logging steps only (read there, in the loop's one transfer): ``qk_clip/max_logit``, the largest
    logit over every head of the step, and ``qk_clip/clipped_heads``, how many heads it rescaled. Built with
    ``enabled=False`` it reads and rescales nothing until an :class:`~gradkit.EscalationLadder` switches it on (its
    ``mitigate`` rung; off again below it): a step whose forwards ran while it was off is not rescaled.

    Args:
        threshold: ``tau``, the largest logit a head may keep (> 0); Kimi K2 uses 100.
        attention: the attention modules: ``"auto"`` (the outermost modules whose class name ends in
            ``Attention``), or class names or ``re:`` patterns (:mod:`gradkit.step.selection`).
        log_every_n_steps: how often to log, in optimizer steps; defaults to the loop's period (the rescale runs
            every step).
        enabled: rescale from the first step; ``False`` builds it switched off (no logit read, no rescale, no cost)
            until an :class:`~gradkit.EscalationLadder` in the loop reaches its ``mitigate`` rung.
        scale_updates: scale each clipped head's later updates by the product of its factors (see above).

    Raises:
        ValueError: at construction, naming the argument; at ``attach``, a pattern that selects no module, a
            module whose query and key weights cannot be found (the message names it, the reason and what to do),
            weights flattened by FSDP1, or a weight placed as a partial sum.
        RuntimeError: after a step, a selected module whose training forward ran without exposing its logits; in a
            tensor-parallel forward, query and key heads split otherwise than alike, once and evenly.

    Example::

        >>> import torch
        >>> from gradkit import GradKit, QKClip
        >>> _ = torch.manual_seed(0)
        >>> attention = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> optimizer = torch.optim.SGD(attention.parameters(), lr=0.0)
        >>> clip = QKClip(threshold=0.5, attention=["MultiheadAttention"])
        >>> kit = GradKit(attention, optimizer, clip, log_dir=False)
        >>> x = torch.randn(2, 5, 8) * 10
        >>> attention(x, x, x)[0].sum().backward()
        >>> _ = kit.step(optimizer)
        >>> clip.attention_modules, clip.clipped_heads
        ([''], 2)
    """

    stage = Stage.OBSERVE

    def __init__(
        self,
        threshold: float = 100.0,
        attention: list[str] | Literal["auto"] = "auto",
        log_every_n_steps: int | None = None,
        enabled: bool = True,
        scale_updates: bool = False,
    ) -> None:
        self.threshold = check_float("threshold", threshold, above=0.0, hint="Kimi K2 uses `threshold=100`.")
        self.attention = attention
        self._patterns = () if attention == "auto" else parse_patterns("attention", attention, allow_empty=False)
        if log_every_n_steps is not None:
            check_int("log_every_n_steps", log_every_n_steps, 1, hint="None follows the loop's logging period.")
        self.log_every_n_steps = log_every_n_steps
        self.enabled = check_bool("enabled", enabled)
        self.scale_updates = check_bool("scale_updates", scale_updates)
        #: Whether it reads the logits and rescales now: ``enabled``, until an EscalationLadder switches it.
        self.active = self.enabled
        self._heads: dict[str, Heads] = {}
        self._readers: dict[str, nn.Module] = {}  # the module whose forward each attention's maxima come from
        # Sharded weights: the global index of each local row of a (param, dim), where a rank holds some of them.
        self._rows: dict[tuple[int, int], Tensor] = {}
        # Tensor parallelism: (first, count) of the query heads a rank's forward computes, found at its first forward.
        self._local_heads: dict[str, tuple[int, int]] = {}
        self._hooks: list[RemovableHandle] = []
        self._modes: dict[str, _LogitMode] = {}
        self._maxima: dict[str, Tensor] = {}
        self._ran: set[str] = set()  # the modules whose training forward ran during the step
        self._stepped = False
        self._logging = False
        #: Heads rescaled by the last step (a device scalar; read it on the host yourself).
        self._clipped: Tensor | None = None
        #: ``scale_updates``: per module, each head's product of the factors its rows were rescaled by so far (query,
        #: key, rotary query rows), and the rows as they were before the step under way.
        self._factors: dict[str, dict[str, Tensor]] = {}
        self._before: list[tuple[Slab, str, str, Tensor]] = []

    @property
    def state_key(self) -> str:
        return state_key(self)

    def state_dict(self) -> dict[str, Any]:
        """The product of the factors each head's rows were rescaled by (``scale_updates``; empty otherwise)."""
        return {"factors": {name: dict(parts) for name, parts in self._factors.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._factors = {name: dict(parts) for name, parts in state_dict.get("factors", {}).items()}

    @property
    def attention_modules(self) -> list[str]:
        """The attention modules read and rescaled (known after ``attach``)."""
        return list(self._heads)

    @property
    def clipped_heads(self) -> int:
        """How many heads the last step rescaled (reads the device)."""
        return 0 if self._clipped is None else int(self._clipped)

    # -- the model ----------------------------------------------------------------------------------------------
    def attach(self, ctx: StepContext, model: nn.Module) -> None:
        """Find the attention modules and their heads' weights, and hook their forwards.

        Raises:
            ValueError: a pattern that selects no module, or a module whose heads' weights cannot be found.
        """
        self.detach(ctx)
        self._heads, self._readers, self._rows, self._local_heads = {}, {}, {}, {}
        if ctx.flat_sharded():
            raise ValueError(
                "QKClip rescales rows of the query and key weights, and under FSDP1 (flat shards over several ranks) "
                "a rank does not hold them whole, nor knows where a row starts. Use FSDP2 (`fully_shard`; "
                "`ModelParallelStrategy` for the Trainer), DDP or tensor parallelism, or leave QKClip out."
            )
        named = [(clean_name(n), m) for n, m in model.named_modules()]
        for name, module in outermost_attention(named, self._patterns):
            reader = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)), module)
            self._heads[name] = self._heads_of(name, reader)
            self._readers[name] = reader
            if isinstance(reader, nn.MultiheadAttention):
                hook = functools.partial(self._mha_hook, name)
                # Before FSDP2's own post-forward hook (a module sharded on itself): its weights are still whole then.
                self._hooks.append(reader.register_forward_hook(hook, with_kwargs=True, prepend=True))
            else:
                self._modes[name] = _LogitMode(self, name)
                self._hooks.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
                self._hooks.append(module.register_forward_hook(functools.partial(self._exit, name), always_call=True))
        if not self._heads:
            ctx.warn(
                f"QKClip found no attention module in `{type(model).__name__}` (no module whose class name ends in "
                "`Attention`): it rescales nothing. Select them with `attention=[...]` (class names or `re:` patterns)."
            )

    def _heads_of(self, name: str, module: nn.Module) -> Heads:
        try:
            heads = find_heads(module)
        except Unreadable as reason:
            raise ValueError(
                f"QKClip cannot rescale the heads of `{name or 'the model'}` ({type(module).__name__}): {reason}. "
                "Leave it out of `attention` (select the modules to clip by class name or `re:` pattern), or give it "
                "one of the projections QKClip reads (see `help(gradkit.QKClip)`)."
            ) from None
        self._index_shards(name, heads)
        return heads

    def _index_shards(self, name: str, heads: Heads) -> None:
        """Where a rank holds some rows of a DTensor weight (FSDP2, tensor parallelism): their global indices."""
        for slab in [*heads.q, *heads.k]:
            try:
                index = local_row_index(slab.param, slab.dim)
            except Unreadable as reason:
                raise ValueError(
                    f"QKClip cannot rescale the heads of `{name or 'the model'}`: {reason}. {_SHARDING_HINT}"
                ) from None
            if index is not None:
                self._rows[(id(slab.param), slab.dim)] = index

    def detach(self, ctx: StepContext | None = None) -> None:
        """Remove the hooks (and leave a mode a failed forward left open)."""
        for handle in self._hooks:
            handle.remove()
        for mode in self._modes.values():
            mode.stop()
        self._hooks, self._modes, self._maxima, self._ran, self._before = [], {}, {}, set(), []

    # -- the forwards -------------------------------------------------------------------------------------------
    def _reads(self, module: nn.Module) -> bool:
        """Whether the forward under way is a training forward of the step (Python only: no device work), while it is
        active (a step whose forwards ran inactive rescales nothing, whenever a ladder switches it on)."""
        return self.active and module.training and torch.is_grad_enabled() and not replaying()

    def _enter(self, name: str, module: nn.Module, args: Any) -> None:
        if self._reads(module):
            self._ran.add(name)
            self._modes[name].start()

    def _exit(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        mode = self._modes.get(name)
        if mode is not None:
            mode.stop()
            for scores in mode.flex:  # (batch, heads, queries) in log2 units: the kernel's softmax runs on exp2
                if scores.numel():
                    self.note(name, scores.detach().float().transpose(0, 1).flatten(1).amax(1) * math.log(2))
            mode.flex.clear()

    def _mha_hook(self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not self._reads(module):
            return
        self._ran.add(name)
        call = {**dict(zip(_MHA_ARGS, args, strict=False)), **kwargs}
        assert isinstance(module, nn.MultiheadAttention)
        with torch.no_grad():
            value = mha_head_max(
                module,
                call["query"],
                call["key"],
                call.get("key_padding_mask"),
                call.get("attn_mask"),
                bool(call.get("is_causal", False)),
            )
        self.note(name, value)

    def note(self, name: str, value: Tensor) -> None:
        """A forward's per-head maxima of module ``name``: kept as their maximum over the step (on the device)."""
        heads = self._heads[name].heads
        if value.shape != (heads,) and value.ndim == 1:  # tensor parallelism: this rank's heads only
            value = self._spread(name, value)
        if value.shape != (heads,):  # a shape, on the host: scores whose dimension 1 is not the heads
            raise RuntimeError(
                f"QKClip read the logits of {value.numel()} heads in `{name}`, whose projections hold {heads}: its "
                "scores are not laid out (batch, heads, queries, keys). Leave it out of `attention`."
            )
        previous = self._maxima.get(name)
        value = value.float()
        self._maxima[name] = value if previous is None else torch.maximum(previous, value)

    def _spread(self, name: str, value: Tensor) -> Tensor:
        """A tensor-parallel rank's maxima of its heads, at their place among all the module's heads (``-inf``
        elsewhere: the all-reduce (MAX) of the step fills them in from the ranks that compute them)."""
        if name not in self._local_heads:  # once: the forward's weights, as it sees them (host only)
            try:
                self._local_heads[name] = forward_heads(find_heads(self._readers[name]), self._heads[name])
            except Unreadable as reason:
                raise RuntimeError(
                    f"QKClip cannot read the heads of `{name or 'the model'}`: {reason}. {_SHARDING_HINT}"
                ) from None
        first, count = self._local_heads[name]
        if value.numel() != count:
            return value  # not this rank's heads: `note` says what it read
        return F.pad(value, (first, self._heads[name].heads - first - count), value=-math.inf)

    # -- the step -----------------------------------------------------------------------------------------------
    def observe(self, stats: StepStats, outcome: StepOutcome, ctx: StepContext) -> None:
        """An optimizer step happens: rescale after it (the Trainer calls ``after_step`` after every micro-batch)."""
        if self.scale_updates and self.active and not self._stepped:  # before the step: its update is blended after
            self._before = [
                (slab, name, part, _row_target(slab, count, heads.head_dim, self._rows).clone())
                for name, heads in self._heads.items()
                for part, slabs, count in (
                    ("query", heads.q, heads.heads),
                    ("key", heads.k, heads.kv_heads),
                    ("rope", heads.q_rope, heads.heads),
                )
                for slab in slabs
            ]
        self._stepped = True
        self._logging = ctx.is_logging_step(self.log_every_n_steps)

    def after_step(self, ctx: StepContext) -> None:
        if not self._stepped:
            return
        self._stepped = False
        if self._before:
            self._blend_updates()
        unread = self._ran - self._maxima.keys()
        self._ran = set()
        if unread:
            raise RuntimeError(
                f"QKClip read no attention logits in `{sorted(unread)[0]}` during the step: its forward calls neither "
                "`softmax` on 4-D scores, `F.scaled_dot_product_attention` nor FlexAttention with max scores "
                "(flash-attn, a fused kernel, FlexAttention's FLASH backend?), so its largest logit is unknown. Use "
                "eager or SDPA attention (`attn_implementation='eager'` or 'sdpa' for Hugging Face models), or leave "
                "it out of `attention`."
            )
        if not self._maxima:
            return  # no training forward this step (its batches were dropped)
        names = list(self._heads)
        device = next(iter(self._maxima.values())).device
        maxima = torch.cat(
            [self._maxima.get(n, torch.full((self._heads[n].heads,), -math.inf, device=device)) for n in names]
        )
        self._maxima = {}
        if world_size() > 1:  # every rank rescales the same: one collective for every module's heads
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        over = maxima > self.threshold
        gamma = torch.where(over, self.threshold / maxima, torch.ones_like(maxima))
        with torch.no_grad():
            for name, part in zip(names, gamma.split([self._heads[n].heads for n in names]), strict=True):
                query, key = _rescale(self._heads[name], part, self._rows)
                if self.scale_updates:
                    applied = {"query": query.clamp(max=1.0), "key": key}
                    if self._heads[name].q_rope:
                        applied["rope"] = part
                    self._compound(name, applied)
        self._clipped = over.sum()
        if self._logging:
            ctx.log({"qk_clip/max_logit": maxima.amax(), "qk_clip/clipped_heads": self._clipped.float()})

    def _blend_updates(self) -> None:
        """``scale_updates``: each head's rows take the step's update times the product of the factors they were
        rescaled by so far, ``before + factor * (after - before)`` (a skipped step changed nothing: nothing moves)."""
        with torch.no_grad():
            for slab, name, part, before in self._before:
                factors = self._factors.get(name, {}).get(part)
                if factors is not None:
                    head_dim = self._heads[name].head_dim
                    target = _row_target(slab, factors.numel(), head_dim, self._rows)
                    weight = _row_factor(slab, factors.to(target.device), head_dim, self._rows, target)
                    target.lerp_(before, 1.0 - weight)
        self._before = []

    def _compound(self, name: str, applied: dict[str, Tensor]) -> None:
        """Multiply this step's factors (at most 1) into module ``name``'s products, on the device."""
        products = self._factors.setdefault(name, {})
        for part, factor in applied.items():
            previous = products.get(part)
            products[part] = factor if previous is None else previous.to(factor.device) * factor


def _rescale(heads: Heads, gamma: Tensor, rows: dict[tuple[int, int], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Scale each head's query and key rows so that its logits scale by ``gamma`` (per query head): the key head of a
    group by ``sqrt(min gamma)``, each query head by ``gamma / sqrt(min gamma)``. ``rows``: the global index of the
    local rows of each sharded ``(id(param), dim)`` (:func:`~gradkit.policies.sharded_heads.local_row_index`).
    Returns the query heads' and the key heads' factors."""
    group = gamma.view(heads.kv_heads, heads.heads // heads.kv_heads)
    key_scale = group.amin(1).sqrt()
    query_scale = (group / key_scale[:, None]).reshape(-1)
    for slab, per_head in (
        *((slab, query_scale) for slab in heads.q),
        *((slab, key_scale) for slab in heads.k),
        # Its key is every head's: the rotary query rows take the whole gamma (Kimi K2, MLA).
        *((slab, gamma) for slab in heads.q_rope),
    ):
        target = _row_target(slab, per_head.numel(), heads.head_dim, rows)
        target.mul_(_row_factor(slab, per_head, heads.head_dim, rows, target))
    return query_scale, key_scale


def _row_target(slab: Slab, heads: int, head_dim: int, index: dict[tuple[int, int], Tensor] | None) -> Tensor:
    """The tensor holding ``slab``'s ``heads`` heads of rows on this rank, a view of the parameter's storage:

    - a shard holding some rows of a DTensor (its rows' global ``index``): its whole local tensor;
    - heads interleaved with other rows (``slab.period``): a strided view of the heads' rows, ``(..., blocks,
      per_block * width, ...)`` along ``slab.dim``;
    - otherwise the slab's rows of the local tensor (a DTensor split along another dimension, or replicated, holds
      every row).
    """
    local = local_tensor(slab.param)
    if index is not None and (id(slab.param), slab.dim) in index:
        return local
    if slab.period:
        blocks = heads // slab.per_block
        held = local.narrow(slab.dim, 0, blocks * slab.period).unflatten(slab.dim, (blocks, slab.period))
        return held.narrow(slab.dim + 1, slab.start, slab.per_block * (slab.width or head_dim))
    return local.narrow(slab.dim, slab.start, heads * head_dim)


def _row_factor(
    slab: Slab, per_head: Tensor, head_dim: int, index: dict[tuple[int, int], Tensor] | None, target: Tensor
) -> Tensor:
    """Each row's factor from ``per_head``, shaped to broadcast against ``target`` (:func:`_row_target`): for a shard,
    every global row's factor (1 outside the slab's heads) picked by the local rows' global indices."""
    shape = [1] * target.ndim
    local_rows = None if index is None else index.get((id(slab.param), slab.dim))
    if local_rows is not None:
        rows = per_head.repeat_interleave(head_dim).to(target.device, target.dtype)
        total = slab.param.shape[slab.dim]
        every = F.pad(rows, (slab.start, total - slab.start - rows.numel()), value=1.0)
        shape[slab.dim] = -1
        return every.index_select(0, local_rows).view(shape)
    if slab.period:
        width = slab.width or head_dim
        shape[slab.dim], shape[slab.dim + 1] = per_head.numel() // slab.per_block, slab.per_block * width
        return per_head.repeat_interleave(width).to(target.device, target.dtype).view(shape)
    shape[slab.dim] = -1
    return per_head.repeat_interleave(head_dim).to(target.device, target.dtype).view(shape)
