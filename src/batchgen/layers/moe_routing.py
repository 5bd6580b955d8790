"""DeepSeek-V3 expert selection: sigmoid scores, bias for choosing only, group limit.

For each token t with router logits u_t (float32) and experts i = 0..E-1 in G groups of
E/G consecutive experts:

    s_i     = sigmoid(u_i)                       (softmax(u)_i with scoring_func="softmax")
    c_i     = s_i + b_i                          b = e_score_correction_bias, choosing only
    score_g = sum of the two largest c_i in group g
    kept    = the topk_group groups of largest score_g
    chosen  = the top_k experts of largest c_i among the experts of kept groups
              (experts of other groups have c_i = -inf, never 0: with negative biases
              every kept c_i may be below 0, and a 0 would pick a masked expert)
    w_i     = s_i / sum_{j in chosen} s_j        (the unbiased scores; when norm_topk_prob)
    weight  = routed_scaling_factor * w_i

G = 1 (or topk_group = G) is no group limit. Everything runs on tensors of fixed shape:
no host synchronisation, so decode steps can be captured in CUDA graphs. On CUDA, with no
group limit, the whole choice is one kernel (kernels/expert_select.py) instead of the
seven torch ops of select_experts_torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.layers import batch_invariant


@dataclass(frozen=True)
class RoutingConfig:
    """The routing fields of a DeepSeek-V3 / Kimi-K2 config, validated."""

    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"

    def __post_init__(self) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ValueError(
                f"scoring_func={self.scoring_func!r} is not supported (sigmoid or softmax)"
            )
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(
                f"n_group={self.n_group} does not divide n_routed_experts={self.num_experts}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
        eligible = self.topk_group * (self.num_experts // self.n_group)
        if not 1 <= self.top_k <= eligible:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be in 1..{eligible} "
                f"(topk_group * experts per group)"
            )

    @classmethod
    def from_hf(cls, config) -> RoutingConfig:
        """From a transformers DeepseekV3Config (or Kimi-K2's); ValueError on a routing
        method other than DeepSeek-V3's ("noaux_tc")."""
        method = getattr(config, "topk_method", None) or "noaux_tc"
        if method != "noaux_tc":
            raise ValueError(
                f"topk_method={method!r} is not supported (DeepSeek-V3 routing is 'noaux_tc')"
            )
        n_group = getattr(config, "n_group", None) or 1
        return cls(
            num_experts=config.n_routed_experts,
            top_k=config.num_experts_per_tok,
            n_group=n_group,
            topk_group=getattr(config, "topk_group", None) or n_group,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
            scoring_func=getattr(config, "scoring_func", None) or "sigmoid",
        )


def select_experts(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, cfg: RoutingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64).

    The order of the top_k columns is unspecified; the weights follow the module
    docstring's equations (computed in float32 whatever the logits' dtype). On CUDA
    without a group limit, kernels/expert_select.py's one kernel (the same ids as
    select_experts_torch, weights within the last bit of a float32 sum)."""
    logits = logits.float()
    if logits.is_cuda and not _group_limit(cfg) and logits.stride(1) == 1:
        from batchgen.kernels.expert_select import expert_select

        bias = None if correction_bias is None else correction_bias.float()
        return expert_select(
            logits,
            bias,
            cfg.top_k,
            scoring=cfg.scoring_func,
            renormalize=cfg.norm_topk_prob,
            scale=cfg.routed_scaling_factor,
        )
    return select_experts_torch(logits, correction_bias, cfg)


def _group_limit(cfg: RoutingConfig) -> bool:
    return 1 < cfg.n_group and cfg.topk_group < cfg.n_group


def select_experts_torch(
    logits: torch.Tensor, correction_bias: torch.Tensor | None, cfg: RoutingConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """select_experts as torch ops on any device (the CPU's path, a group limit's, and
    the reference the one-kernel choice is tested against)."""
    logits = logits.float()
    group_limit = _group_limit(cfg)
    t, e = logits.shape
    if cfg.scoring_func == "sigmoid":  # rows padded in batch-invariant mode
        scores = batch_invariant.pointwise(torch.sigmoid, logits)
    else:
        scores = logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if group_limit:
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        kept = group_scores.topk(cfg.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * cfg.routed_scaling_factor, ids
