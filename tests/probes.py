"""A probe method for the contract tests: client state per method label and ``ctx.client_info``."""

from __future__ import annotations

import torch

from hetfl.fl.client import ClientEnv, client_task
from hetfl.fl.method import RoundMethod, ServerContext, register
from hetfl.fl.payload import Payload


@client_task("probe_state")
def probe_state(message: Payload, env: ClientEnv) -> Payload:
    owner = message.meta["owner"]
    if env.state.get("owner", owner) != owner:
        raise AssertionError(f"{owner} sees the state of {env.state['owner']}")
    env.state["owner"] = owner
    env.state["calls"] = int(env.state.get("calls", 0)) + 1
    env.state["last"] = torch.full((2,), float(env.state["calls"]))
    return Payload({}, {"calls": env.state["calls"], "kind": "state"})


@register("probe_state")
class ProbeState(RoundMethod):
    """Counts each client's calls in its state; uploads the count."""

    name = "probe_state"
    defaults = {"rounds": 3, "sample_ratio": 1.0}

    def setup(self, ctx: ServerContext) -> None:
        self.holder = ctx.build(ctx.server_arch)
        self.info = ctx.client_info()

    def client_message(self, client_id: int, round_: int, ctx: ServerContext) -> Payload:
        return Payload({}, {"task": "probe_state", "owner": self.name, "kind": "state"})

    def validate_upload(self, client_id, message, upload, ctx):  # noqa: ANN001, ANN201
        return None

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        for cid, upload in uploads.items():
            if upload.meta["num_samples"] != self.info["num_samples"][cid]:
                raise AssertionError(f"client_info says {self.info['num_samples'][cid]} samples for client {cid}")
            if upload.meta["label_counts"] != self.info["label_counts"][cid]:
                raise AssertionError(f"client_info has another label histogram for client {cid}")
            if upload.meta["calls"] != round_:
                raise AssertionError(f"client {cid} counted {upload.meta['calls']} calls in round {round_}")

    def models(self) -> dict[str, torch.nn.Module]:
        return {self.name: self.holder}


@register("probe_two_models")
class ProbeTwoModels(ProbeState):
    """Two models, the second the headline: every evaluation logs both."""

    name = "probe_two_models"

    def setup(self, ctx: ServerContext) -> None:
        super().setup(ctx)
        self.other = ctx.build(ctx.server_arch, purpose="other")

    def models(self) -> dict[str, torch.nn.Module]:
        return {"first": self.holder, "second": self.other}

    def headline(self, ctx: ServerContext) -> str:
        return "second"
