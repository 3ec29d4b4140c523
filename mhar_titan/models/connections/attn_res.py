"""Depth routing (AttnRes, MHAR): `residual = "attn_res"`, every mode of MHAR_SPEC sections 1 and 2.

Each sublayer's input is a learned depth-softmax mix of the sources its routing site reads (the
routing plan, plan.py), split into H routing heads; each sublayer's output adds the entries the plan
says to the one growing source list. The parameters (`routing_params.DepthRouting`), the schedule
made once per model from the plan (`schedule.RoutingSchedule`) and the per-forward `router.Router`
(the flow) and `router.RoutingLink` (each block's link) are this connection's three lifetimes.
"""
from __future__ import annotations

from torch import Tensor

from ..plan import RoutingPlan
from ..router import Router
from ..routing_params import DepthRouting, RoutingSettings
from ..schedule import RoutingSchedule
from .base import Connection, checkpointed_blocks


class AttnRes(Connection):
    """`residual = "attn_res"`: depth routing over the routing plan of `args`."""

    name = "attn_res"

    def __init__(self, args):
        super().__init__(args)
        self.plan = RoutingPlan.from_args(args)
        self.settings = RoutingSettings.from_args(args)
        self.schedule = RoutingSchedule.from_plan(self.plan, args.n_layers)

    def parameters(self) -> DepthRouting:
        return DepthRouting(self.args, self.plan)

    # -- the cost model, read from the routing plan (docs/DESIGN.md "Bytes model") --
    def flops_per_token(self) -> int:
        """4 d per source of every site (the null source included): 2 d for its logit against the
        pseudo-query, 2 d for its term of the weighted sum (`metrics.flops_per_token`'s routing part,
        which is 3 times this)."""
        return 4 * self.args.dim * sum(self.plan.source_counts)

    def depth_reads(self) -> tuple[int, int]:
        """`RoutingPlan.routing_rows`: per call, N rows forward and N + 2 backward at a site over N
        (B, T, d) sources (the sources, then the upstream gradient and the saved output); grouped,
        each group's start entries once plus the merges' rows (docs/DESIGN.md "Grouped routing")."""
        return self.plan.routing_rows()

    def kept_rows(self, ac: str) -> int:
        """The two sublayer outputs of every block kept as routing sources: 2 rows a block without
        checkpointing; a checkpointed block keeps both outputs where the baseline keeps one (1 row),
        and the block recomputed at a time holds its two again (2 rows). The normalised keys the
        eager and compile routing save depend on the kernel that runs and are counted by the dry
        run (`dryrun._activation_elements_per_token`). A plan without a final site (the paper
        layout) is estimated as the baseline, as the dry run did before the depth connections."""
        if self.plan.final is None:
            return 0
        checkpointed = checkpointed_blocks(ac, self.args.n_layers)
        return sum(1 if c else 2 for c in checkpointed) + (2 if any(checkpointed) else 0)

    def flow(self, params: DepthRouting, x0: Tensor, observer=None, buffered: bool = True) -> Router:
        router = Router(self.schedule, params, self.settings, observer, buffered=buffered)
        router.start(x0)
        return router
