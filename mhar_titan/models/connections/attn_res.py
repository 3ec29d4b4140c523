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
from .base import Connection


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

    def flow(self, params: DepthRouting, x0: Tensor, observer=None, buffered: bool = True) -> Router:
        router = Router(self.schedule, params, self.settings, observer, buffered=buffered)
        router.start(x0)
        return router
