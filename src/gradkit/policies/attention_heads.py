r"""The query and key weights of an attention module's heads, and the exact per-head maxima of its logits: what
:class:`~gradkit.QKClip` reads and rescales.

- :func:`find_heads`: the rows (columns for GPT-2's ``Conv1D``) of each head's query and key projection in the
  module's parameters: separate projections (``q_proj``/``k_proj`` of Llama-style models, BERT's ``query``/``key``,
  ``wq``/``wk``, ``to_q``/``to_k``), a fused ``[q | k | v]`` projection (``qkv``, GPT-2's ``c_attn``, ``qkv_proj``,
  ``Wqkv``), one interleaved per key head (``query_key_value``: GPT-NeoX, Bloom, Falcon), multi-latent attention's
  up-projections (DeepSeek-V2/V3: per head ``[nope | rope]`` query rows, ``[nope | value]`` key-value rows) or
  ``nn.MultiheadAttention``'s ``in_proj_weight``; :class:`Unreadable` says why when there is none.
- :func:`sdpa_head_max`: the largest logit of each head of a ``F.scaled_dot_product_attention`` call, over every
  batch element, query and key (its mask, causality and scale applied), computed in query chunks.
- :func:`mha_head_max`: the same for ``nn.MultiheadAttention``, from its projections and masks.

Pure PyTorch; no Lightning here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Heads", "ModuleScopedMode", "Slab", "Unreadable", "find_heads", "mha_head_max", "sdpa_head_max"]


class ModuleScopedMode(TorchFunctionMode):
    """A function mode entered by one module's forward pre-hook and left by its forward hook (:meth:`start`,
    :meth:`stop`), so that it sees the calls of that forward only: how ``EarlyWarning`` and ``QKClip`` read an
    attention module's logits. ``owner`` is the policy, ``name`` the module's."""

    def __init__(self, owner: object, name: str) -> None:
        super().__init__()
        self.owner, self.name = owner, name
        #: Whether the mode is entered (by the module's forward pre-hook) and not exited yet.
        self.open = False

    def start(self) -> None:
        self.__enter__()
        self.open = True

    def stop(self) -> None:
        if self.open:
            self.open = False
            self.__exit__(None, None, None)


_SEPARATE = (("q_proj", "k_proj"), ("query", "key"), ("wq", "wk"), ("to_q", "to_k"))
_FUSED = ("qkv", "c_attn", "qkv_proj", "Wqkv")
_HEADS = ("num_heads", "n_head", "num_attention_heads", "n_heads")
_KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_query_groups")
_HEAD_DIM = ("head_dim", "head_size", "attention_head_size")
# Multi-latent attention (DeepSeek-V2/V3; HF's names, then DeepSeek's own): the query projection (low-rank, else full
# rank), the key-value up-projection (per head [k nope | v]) and the down-projection that also makes the rotary key
# every head shares.
_MLA = (("q_b_proj", "q_proj", "kv_b_proj", "kv_a_proj_with_mqa"), ("wq_b", "wq", "wkv_b", "wkv_a"))
_MLA_DIMS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Fused projections interleaved per key head, [its query heads | key | value] (GPT-NeoX, Bloom, Falcon).
_INTERLEAVED = ("query_key_value",)
# Normalized q and k: their logits do not scale with the projection weights (and qk-layernorm bounds them already).
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "norm_q", "norm_k")
# Logits per chunk of an exact maximum: bounds its temporary (fp32) to 256 MiB.
_CHUNK_LOGITS = 1 << 26


class Unreadable(ValueError):
    """An attention module whose heads' query and key weights cannot be found, with the reason."""


@dataclass
class Slab:
    """The rows of one parameter that hold heads: the parameter, the dimension of its rows (1 for ``Conv1D``'s
    ``(in, out)`` weight) and where the first head starts along it.

    With a ``period`` the heads are interleaved with other rows: the rows come in blocks of ``period`` rows, each
    holding ``per_block`` heads of ``width`` rows (``head_dim`` where 0) from row ``start`` of the block on (GPT-NeoX's
    per-head ``[q | k | v]``, or a multi-latent head's ``[nope | rope]`` query rows)."""

    param: Tensor
    dim: int
    start: int
    period: int = 0
    width: int = 0
    per_block: int = 1


@dataclass
class Heads:
    """One attention module's heads: ``heads`` query heads of ``head_dim`` rows, ``kv_heads`` key heads (query head
    ``h`` reads key head ``h // (heads // kv_heads)``, as Llama's ``repeat_kv``), and the weights and biases holding
    them (``q``, ``k``). ``q_rope`` holds query rows whose keys every head shares (multi-latent attention's rotary
    query): they take the head's whole factor, and the shared key rows are not scaled."""

    heads: int
    kv_heads: int
    head_dim: int
    q: list[Slab]
    k: list[Slab]
    q_rope: list[Slab] = field(default_factory=list)


def _attribute(modules: list[nn.Module], names: tuple[str, ...]) -> int | None:
    """The first integer attribute of ``names`` on the modules (or their ``config``), in order."""
    for module in modules:
        for owner in (module, getattr(module, "config", None)):
            for name in names:
                value = getattr(owner, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _linear_slabs(proj: nn.Module) -> tuple[list[Slab], int]:
    """A projection's weight and bias as slabs, and its output rows (GPT-2's ``Conv1D`` holds ``(in, out)``)."""
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, Tensor) or weight.ndim != 2:
        raise Unreadable(f"`{type(proj).__name__}` has no 2-D `weight`")
    dim = 1 if type(proj).__name__ == "Conv1D" else 0
    slabs = [Slab(weight, dim, 0)]
    bias = getattr(proj, "bias", None)
    if isinstance(bias, Tensor):
        slabs.append(Slab(bias, 0, 0))
    return slabs, weight.shape[dim]


def _projections(module: nn.Module) -> tuple[nn.Module, list[Slab], list[Slab], int, int, bool]:
    """``(owner, q slabs, k slabs, q rows, k rows, fused)`` of the first projections found in ``module`` (the owner is
    the module holding them, whose attributes give the head counts)."""
    for owner in module.modules():
        children = dict(owner.named_children())
        for q_name, k_name in _SEPARATE:
            if q_name in children and k_name in children:
                q, q_rows = _linear_slabs(children[q_name])
                k, k_rows = _linear_slabs(children[k_name])
                return owner, q, k, q_rows, k_rows, False
        for name in _FUSED:
            if name in children:
                slabs, rows = _linear_slabs(children[name])
                return owner, slabs, slabs, rows, rows, True
    raise Unreadable(
        "it holds no query and key projections gradkit knows: children named "
        + ", ".join(f"`{q}`/`{k}`" for q, k in _SEPARATE)
        + " or a fused [q | k | v] projection named "
        + ", ".join(f"`{n}`" for n in _FUSED)
        + ", an interleaved one named `query_key_value`, or multi-latent attention's `q_b_proj`/`kv_b_proj`"
    )


def _mha_heads(module: nn.MultiheadAttention) -> Heads:
    if module.bias_k is not None:
        raise Unreadable("`add_bias_kv=True` adds a learned key that is not a head's rows of the key projection")
    heads, dim = module.num_heads, module.head_dim
    width = heads * dim
    if module.in_proj_weight is not None:
        q = [Slab(module.in_proj_weight, 0, 0)]
        k = [Slab(module.in_proj_weight, 0, width)]
    else:
        q, k = [Slab(module.q_proj_weight, 0, 0)], [Slab(module.k_proj_weight, 0, 0)]
    if module.in_proj_bias is not None:
        q.append(Slab(module.in_proj_bias, 0, 0))
        k.append(Slab(module.in_proj_bias, 0, width))
    return Heads(heads, heads, dim, q, k)


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[nn.Module, dict[str, nn.Module]] | None:
    """The first module of ``module``'s tree (itself first) with a child of each of ``names``, and its children."""
    for owner in module.modules():
        children = dict(owner.named_children())
        if all(n in children for n in names):
            return owner, children
    return None


def _mla_heads(module: nn.Module) -> Heads | None:
    """The heads of a multi-latent attention (DeepSeek-V2/V3), ``None`` where ``module`` is none: per head, rows
    ``[nope | rope]`` of the query projection and rows ``[nope | value]`` of ``kv_b_proj``; the rotary key comes from
    ``kv_a_proj_with_mqa``, one for every head, and is left out (Kimi K2's rule for MLA)."""
    for low_q, full_q, up_kv, down_kv in _MLA:
        found = _child(module, (up_kv, down_kv))
        if found is None:
            continue
        owner, children = found
        query = children.get(low_q, children.get(full_q))
        if query is None:
            raise Unreadable(f"its multi-latent attention has `{up_kv}` but no query projection `{low_q}`/`{full_q}`")
        return _mla_layout([owner, module], query, children[up_kv])
    return None


def _mla_layout(places: list[nn.Module], query: nn.Module, up_kv: nn.Module) -> Heads:
    heads = _attribute(places, _HEADS)
    nope, rope, value = (_attribute(places, (name,)) for name in _MLA_DIMS)
    if heads is None or nope is None or rope is None or value is None:
        raise Unreadable(
            "its multi-latent attention does not say its head count and head sizes: attributes "
            f"{', '.join(_HEADS[:1] + _MLA_DIMS)} on it or its `config`"
        )
    q, q_rows = _linear_slabs(query)
    k, k_rows = _linear_slabs(up_kv)
    if q_rows != heads * (nope + rope) or k_rows != heads * (nope + value):
        raise Unreadable(
            f"its multi-latent projections ({q_rows} query rows, {k_rows} key-value rows) are not {heads} heads of "
            f"[{nope} nope | {rope} rope] query rows and [{nope} nope | {value} value] key-value rows"
        )
    return Heads(
        heads,
        heads,
        nope + rope,
        q=[replace(s, period=nope + rope, width=nope) for s in q],
        k=[replace(s, period=nope + value, width=nope) for s in k],
        q_rope=[replace(s, start=nope, period=nope + rope, width=rope) for s in q],
    )


def _interleaved_heads(module: nn.Module) -> Heads | None:
    """The heads of a fused projection laid out per key head as ``[its query heads | key | value]`` (GPT-NeoX's and
    Bloom's per-head ``[q | k | v]``, Falcon's grouped layout), ``None`` where ``module`` has none."""
    for name in _INTERLEAVED:
        found = _child(module, (name,))
        if found is not None:
            return _interleaved_layout([found[0], module], found[1][name])
    return None


def _interleaved_layout(places: list[nn.Module], proj: nn.Module) -> Heads:
    slabs, total = _linear_slabs(proj)
    heads = _attribute(places, _HEADS)
    if heads is None:
        raise Unreadable(f"no head count: none of the attributes {', '.join(_HEADS)} on it or its `config`")
    kv_heads = _attribute(places, _KV_HEADS) or heads
    dim = _attribute(places, _HEAD_DIM) or total // (heads + 2 * kv_heads)
    group = heads // kv_heads
    if heads % kv_heads or total != kv_heads * (group + 2) * dim:
        raise Unreadable(
            f"its fused projection's {total} rows are not blocks [{group} query heads | key | value] of {dim} rows "
            f"for each of {kv_heads} key heads"
        )
    period = (group + 2) * dim
    return Heads(
        heads,
        kv_heads,
        dim,
        q=[replace(s, period=period, per_block=group) for s in slabs],
        k=[replace(s, start=group * dim, period=period) for s in slabs],
    )


def find_heads(module: nn.Module) -> Heads:
    """The heads of ``module`` and the parameters that hold their query and key rows.

    Raises:
        Unreadable: with the reason, where they cannot be found (no known projection, no head count, normalized q
            and k, shapes that do not divide into heads).
    """
    if isinstance(module, nn.MultiheadAttention):
        return _mha_heads(module)
    norms = [n for n, _ in module.named_modules() if n.rsplit(".", 1)[-1] in _QK_NORMS]
    if norms:
        raise Unreadable(
            f"it normalizes its queries and keys (`{norms[0]}`): its logits do not scale with the projection weights, "
            "and qk-layernorm bounds them already"
        )
    for layout in (_mla_heads, _interleaved_heads):
        found = layout(module)
        if found is not None:
            return found
    owner, q, k, q_rows, k_rows, fused = _projections(module)
    places = [owner, module]
    heads = _attribute(places, _HEADS)
    if heads is None:
        raise Unreadable(f"no head count: none of the attributes {', '.join(_HEADS)} on it or its `config`")
    dim = _attribute(places, _HEAD_DIM)
    kv_heads = _attribute(places, _KV_HEADS)
    if fused:  # [q | k | v]: heads * dim query rows, then kv_heads * dim key rows, then as many value rows
        total = q_rows
        dim = dim or total // (heads + 2 * (kv_heads or heads))
        kv_heads = kv_heads or (total - heads * dim) // (2 * dim) if dim else 0
        q_rows, k_rows = heads * dim, kv_heads * dim
        if total != q_rows + 2 * k_rows:
            raise Unreadable(f"its fused projection's {total} rows are not [q | k | v] of {heads} query heads")
        k = [Slab(s.param, s.dim, q_rows) for s in k]
    else:
        dim = dim or q_rows // heads
        kv_heads = k_rows // dim if dim else 0
    if not dim or q_rows != heads * dim or k_rows != kv_heads * dim or not kv_heads or heads % kv_heads:
        raise Unreadable(
            f"its projections ({q_rows} query rows, {k_rows} key rows) do not split into {heads} heads of "
            f"{dim} rows with a whole number of query heads per key head"
        )
    return Heads(heads, kv_heads, dim, q, k)


def sdpa_head_max(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """Per query head, the largest logit ``q.k * scale`` of a ``F.scaled_dot_product_attention`` call over every batch
    element, query and key, in fp32: ``(heads,)``, ``-inf`` where every logit is masked.

    ``scale`` defaults to ``1 / sqrt(E)``; key heads are repeated for grouped-query attention (``enable_gqa``);
    ``is_causal`` masks keys after the query (top-left aligned, as the call does), a boolean ``attn_mask`` masks its
    ``False`` entries and a float one is added. Computed in chunks of query positions (the logits are never held
    whole).

    Example::

        >>> q = torch.zeros(1, 2, 3, 4); q[0, 1] = 1.0
        >>> sdpa_head_max(q, torch.ones(1, 2, 3, 4))
        tensor([0., 2.])
    """
    q, k = query.detach(), key.detach()
    if q.ndim == 2:  # (L, E): one head
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    heads, length, dim = q.shape[-3:]
    if k.shape[-3] != heads:
        k = k.repeat_interleave(heads // k.shape[-3], dim=-3)
    factor = scale if scale is not None else 1.0 / math.sqrt(dim)
    keys = k.shape[-2]
    mask = None if attn_mask is None else torch.broadcast_to(attn_mask.detach(), (*q.shape[:-1], keys))
    per_chunk = max(1, _CHUNK_LOGITS // max(1, q[..., :1, :1].numel() * keys))
    best = torch.full((heads,), -math.inf, device=q.device)
    for start in range(0, length, per_chunk):
        rows = slice(start, min(length, start + per_chunk))
        logits = (q[..., rows, :].float() @ k.float().transpose(-1, -2)) * factor
        if is_causal:
            later = (
                torch.arange(keys, device=q.device)[None, :] > torch.arange(start, rows.stop, device=q.device)[:, None]
            )
            logits = logits.masked_fill(later, -math.inf)
        if mask is not None:
            part = mask[..., rows, :]
            logits = logits.masked_fill(~part, -math.inf) if part.dtype == torch.bool else logits + part.float()
        best = torch.maximum(best, logits.transpose(0, -3).reshape(heads, -1).amax(1))
    return best


def mha_head_max(
    module: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
) -> Tensor:
    """Per head, the largest logit of an ``nn.MultiheadAttention`` call, from its projections of ``query`` and
    ``key`` (its ``attn_mask`` and ``key_padding_mask`` applied: ``True`` or ``-inf`` masks out), ``(heads,)``."""
    heads = _mha_heads(module)
    width = heads.heads * heads.head_dim
    if not module.batch_first and query.ndim == 3:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    if module.in_proj_weight is not None:
        w_q, w_k = module.in_proj_weight[:width], module.in_proj_weight[width : 2 * width]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    q = F.linear(query, w_q, None if bias is None else bias[:width])
    k = F.linear(key, w_k, None if bias is None else bias[width : 2 * width])
    split = (*q.shape[:-1], heads.heads, heads.head_dim)
    q, k = q.reshape(split).transpose(-2, -3), k.reshape((*k.shape[:-1], heads.heads, heads.head_dim)).transpose(-2, -3)
    mask = None
    if attn_mask is not None:  # MultiheadAttention's convention: True is masked out; (L, S) or (B * H, L, S)
        mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask
        if mask.ndim == 3:
            mask = mask.reshape(q.shape[0], heads.heads, *mask.shape[1:])
    if key_padding_mask is not None:
        pad = key_padding_mask[..., None, None, :]
        pad = ~pad if pad.dtype == torch.bool else pad
        if pad.ndim == 3:  # one unbatched sequence
            pad = pad[0]
        mask = pad if mask is None else _combined(mask, pad)
    return sdpa_head_max(q, k, mask, is_causal and attn_mask is None)


def _combined(mask: Tensor, pad: Tensor) -> Tensor:
    """Two masks as one (boolean ``True`` keeps; a float one adds)."""
    if mask.dtype == torch.bool and pad.dtype == torch.bool:
        return mask & pad
    as_float = [
        m if m.dtype != torch.bool else torch.zeros_like(m, dtype=torch.float32).masked_fill(~m, -math.inf)
        for m in (mask, pad)
    ]
    return as_float[0] + as_float[1]
