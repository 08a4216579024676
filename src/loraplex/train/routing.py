"""Routing replay: a gradient-checkpointed MoE layer routes its tokens as it did in the
forward when backward recomputes it.

Recomputation re-runs the router on recomputed hidden states; on a GPU those can differ
in the last bit, and a top-k near a tie then picks another expert, so the recomputed
layer would not be the one whose activations the loss saw. `ReplayedRouter` replaces the
router: a call outside backward chooses the experts and records them (the one top-k of
the step); the call a checkpoint recompute makes inside backward keeps the recorded
experts and recomputes only their weights from the new logits, so gradients still flow
through the routing weights into earlier layers.
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import ops


def _softmax_then_topk(router: nn.Module, logits: torch.Tensor, index: torch.Tensor | None):
    # Qwen3-MoE, Mixtral: softmax over all experts, keep the top-k, renormalise (Mixtral
    # always; Qwen3-MoE when norm_topk_prob). Renormalised, that is the softmax of the k
    # chosen logits (softmax is monotonic, so the top-k of the logits are those of the
    # probabilities): 3 ops and 3 backward nodes instead of 6 and 5, which counts where
    # the host's per-op cost bounds a step (short sequences).
    if index is None:
        index = torch.topk(logits.detach(), router.top_k, dim=-1).indices
    if getattr(router, "norm_topk_prob", True):
        w = torch.softmax(logits.gather(-1, index), dim=-1, dtype=torch.float)
    else:
        w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, index)
    return (w.to(logits.dtype) if type(router).__name__.startswith("Qwen3") else w), index


def _topk_then_softmax(router: nn.Module, logits: torch.Tensor, index: torch.Tensor | None):
    # gpt-oss: top-k of the logits, softmax over those k.
    if index is None:
        index = torch.topk(logits.detach(), router.top_k, dim=-1).indices
    return torch.softmax(logits.gather(-1, index), dim=1), index


def _deepseek(router: nn.Module, logits: torch.Tensor, index: torch.Tensor | None):
    # DeepSeek-V2: softmax in float32, greedy or group-limited top-k, never renormalised;
    # V3: sigmoid scores, chosen with their correction bias within groups, renormalised
    # when norm_topk_prob; both times routed_scaling_factor.
    v3 = hasattr(router, "e_score_correction_bias")
    probs = torch.sigmoid(logits.float()) if v3 else torch.softmax(logits.float(), dim=-1)
    if index is None:
        method = "noaux_tc" if v3 else router.topk_method
        if method == "greedy":
            index = torch.topk(probs.detach(), router.top_k, dim=-1).indices
        else:
            index = ops.route_experts_grouped(logits.detach(), router.top_k, method, router.num_group,
                                              router.topk_group, False,
                                              getattr(router, "e_score_correction_bias", None))[1]
    w = probs.gather(-1, index)
    if v3 and router.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor, index


# Router class -> (logits, experts or None to choose them) -> (weights, experts), as the
# class computes them in transformers (tests check every one against it).
ROUTERS = {
    "Qwen3MoeTopKRouter": _softmax_then_topk,
    "MixtralTopKRouter": _softmax_then_topk,
    "GptOssTopKRouter": _topk_then_softmax,
    "DeepseekV2TopkRouter": _deepseek,
    "DeepseekV3TopkRouter": _deepseek,
}


def in_backward() -> bool:
    """True while the autograd engine runs a backward (where checkpoint recomputes run)."""
    return torch._C._current_graph_task_id() != -1


class ReplayedRouter(nn.Module):
    """A top-k router returning (logits, weights, experts) like transformers' own.

    Both calls run the same differentiable ops (logits, then weights gathered at the
    experts), only the choice of experts (no gradient) is skipped on replay: torch's
    checkpoint requires a recompute to save the same tensors as the forward did."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.route = ROUTERS[type(base).__name__]
        self.recorded: torch.Tensor | None = None
        self.replays = 0  # recomputes that reused the recorded experts (tests read it)

    def forward(self, hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, self.base.weight.shape[1])
        weight = self.base.weight
        if weight.dtype == torch.float32:  # DeepSeek keeps its router in float32 and routes there
            h = h.float()
        logits = nn.functional.linear(h, weight, getattr(self.base, "bias", None))
        replay = in_backward() and self.recorded is not None and self.recorded.shape[0] == h.shape[0]
        weights, index = self.route(self.base, logits, self.recorded if replay else None)
        if replay:
            self.replays += 1
        else:
            self.recorded = index
        return logits, weights, index


def install_routing_replay(model: nn.Module) -> list[ReplayedRouter]:
    """Wrap every known router of the model (an MoE block's `gate` or `router`)."""
    wrapped = []
    for module in list(model.modules()):
        for attr in ("gate", "router"):
            child = getattr(module, attr, None)
            if isinstance(child, nn.Module) and type(child).__name__ in ROUTERS:
                wrapped.append(ReplayedRouter(child))
                setattr(module, attr, wrapped[-1])
    return wrapped
