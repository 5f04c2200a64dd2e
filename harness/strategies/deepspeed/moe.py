"""DeepSpeed MoE (model.n_experts > 0 on strategy.engine=deepspeed, ZeRO 0-2).

Each block's MLP becomes a `deepspeed.moe.layer.MoE` with ep_size = parallel.ep, built from the same
weights as the single-process MoE (router -> gate.wg, global expert ep_rank * E/ep + i -> local
expert i) and the same TopKGate settings models/moe.py mirrors, so losses match; expert parameters
go to their own optimizer groups (`split_params_into_different_moe_groups_for_optimizer`) and are
reduced over the expert-data group, tokens reach their experts by all-to-all over the ep group.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from harness.strategies.base import canonical_name
from harness.strategies.deepspeed.engine import DeepSpeedStrategy

# Imports inside functions: the parts of torch, DeepSpeed and brigade that only some strategies, devices or
# modes use.


class DeepSpeedMoE(DeepSpeedStrategy):
    def build_module(self, model):
        ep_rank = self.dims.coords(dist.get_rank())["ep"]
        for block in model.blocks.values():
            block.mlp = DeepSpeedMoEMLP(block.mlp, self.run.model, self.dims.ep, ep_rank).to(self.device)
        return model

    def optimizer_groups(self, model):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        return split_params_into_different_moe_groups_for_optimizer(super().optimizer_groups(model))

    def gpt_name(self, name):
        # blocks.<i>.mlp.moe.deepspeed_moe.gate.wg.*                       -> blocks.<i>.mlp.router.*
        # blocks.<i>.mlp.moe.deepspeed_moe.experts.deepspeed_experts.<j>.* -> blocks.<i>.mlp.experts.<global>.*
        m = re.fullmatch(r"(.*\.mlp)\.moe\.deepspeed_moe\.(?:gate\.wg|experts\.deepspeed_experts\.(\d+))\.(.*)", name)
        if m is None:
            return canonical_name(name)
        mlp, local, rest = m.groups()
        if local is None:
            return f"{mlp}.router.{rest}"
        per_rank = self.run.model.n_experts // self.dims.ep
        return f"{mlp}.experts.{self.dims.coords(dist.get_rank())['ep'] * per_rank + int(local)}.{rest}"


class DeepSpeedMoEMLP(torch.nn.Module):
    """A block's MLP as a DeepSpeed MoE layer, holding the same weights as the native MoE it replaces."""

    def __init__(self, native, cfg, ep: int, ep_rank: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        from models.moe import MIN_CAPACITY

        drop = cfg.capacity_factor > 0  # brigade: 0 = no capacity limit = DeepSpeed's drop_tokens=False
        self.moe = MoE(hidden_size=cfg.d_model, expert=native.experts["0"], num_experts=cfg.n_experts, ep_size=ep,
                       k=cfg.top_k, capacity_factor=cfg.capacity_factor if drop else 1.0,
                       eval_capacity_factor=cfg.capacity_factor if drop else 1.0, min_capacity=MIN_CAPACITY,
                       noisy_gate_policy=None, drop_tokens=drop, use_rts=False, top2_2nd_expert_sampling=False)
        layer = self.moe.deepspeed_moe
        with torch.no_grad():
            layer.gate.wg.weight.copy_(native.router.weight)
            local = layer.experts.deepspeed_experts
            for i, expert in enumerate(local):  # DeepSpeed's layout: rank r of the ep group holds r*E/ep + i
                expert.load_state_dict(native.experts[str(ep_rank * len(local) + i)].state_dict())
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x):
        y, self.aux_loss, _ = self.moe(x)  # aux: DeepSpeed's l_aux, summed over blocks by GPT.aux_loss
        return y


STRATEGY = DeepSpeedMoE
