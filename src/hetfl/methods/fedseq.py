"""FedSeq, two ways; ``grouping`` says which a result is.

* ``grouping: random`` (default): FedSeq as HFLDD compares against it (Chen et al., 2023; HFLDD's Eq. 19):
  ``clusters`` (O, 10) seeded random clusters of J = N / O clients, each a fixed ring led by a head.
* ``grouping: superclient`` (preset ``fedseq_superclient``): Zaccone et al.'s superclients, built
  greedily (:func:`~hetfl.fl.clustering.greedy_superclients`): each takes the client whose class
  distribution is farthest (KL) from its own pooled one, until it holds ``min_samples`` (800) samples or
  ``max_clients`` (11) clients. Their paper profiles a client by the confidence vector of a model trained
  on its data, an estimate of its class distribution; ours reads the class histograms the clients report
  (``client_info``, counted as ``info`` bytes). Every superclient trains every round, as in HFLDD's setting
  (their paper samples a fraction).

Per round the server sends the global model to every head (the first round sends the seed); in each ring
the model is trained ``epochs`` (the clients' E) by each client in turn and passed on (``peer`` bytes,
relayed by the server), back to the head, which uploads it; the server averages the heads' models weighted
by their rings' sample counts. Bytes with random rings: O |w| B1 ((2T - 1) + T J).
"""

from __future__ import annotations

import torch
from torch import nn

from hetfl.fl.aggregate import weighted_average
from hetfl.fl.client import ClientEnv, client_task, model_from_message, train_message
from hetfl.fl.clustering import greedy_superclients
from hetfl.fl.comm import RELAYED
from hetfl.fl.method import RoundMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload, state_payload
from hetfl.methods.common import client_models, require_one_architecture


@client_task("return_model")
def return_model(message: Payload, env: ClientEnv) -> Payload:
    """A head uploads the model its ring handed back (forwarded under ``relayed/``)."""
    return state_payload(model_from_message(message), arch=message.meta["arch"])


@register("fedseq")
class FedSeq(RoundMethod):
    name = "fedseq"
    defaults = {"rounds": 100, "sample_ratio": 1.0, "clusters": 10, "grouping": "random", "min_samples": 800,
                "max_clients": 11}
    ranges = {"clusters": {"ge": 1}, "sample_ratio": {"gt": 0, "le": 1},
              "grouping": {"choices": ("random", "superclient")}, "min_samples": {"ge": 1}, "max_clients": {"ge": 1}}

    def check(self, ctx: ServerContext) -> None:
        require_one_architecture(ctx, "fedseq passes one model around")
        if self.params["sample_ratio"] != 1.0:
            raise ValueError("fedseq trains every ring every round: sample_ratio must be 1")
        o = int(self.params["clusters"])
        if self.params["grouping"] == "random" and ctx.num_clients % o:
            raise ValueError(f"clusters: {ctx.num_clients} clients do not split into {o} rings of equal size")

    def setup(self, ctx: ServerContext) -> None:
        self.check(ctx)
        self.global_model = ctx.build(ctx.server_arch, purpose="global")
        info = ctx.client_info()
        self.sizes = info["num_samples"]
        if self.params["grouping"] == "superclient":
            self.rings = greedy_superclients(torch.as_tensor(info["label_counts"]), int(self.params["min_samples"]),
                                             int(self.params["max_clients"]), derive_seed(ctx.seed, "rings"))
        else:
            o = int(self.params["clusters"])
            g = torch.Generator().manual_seed(derive_seed(ctx.seed, "rings"))
            order = torch.randperm(ctx.num_clients, generator=g)
            self.rings = [order[i::o].tolist() for i in range(o)]  # ring r: its head first
        ctx.record["rings"] = self.rings

    def run_round(self, round_: int, ctx: ServerContext) -> None:
        cfg = self.local_config(ctx)
        weights = None if round_ == 1 else {k: v.detach().cpu() for k, v in self.global_model.state_dict().items()}
        carried: dict[int, dict[str, torch.Tensor] | None] = {r: weights for r in range(len(self.rings))}
        alive = set(range(len(self.rings)))
        for position in range(max(len(ring) for ring in self.rings)):
            messages, owner = {}, {}
            for r in sorted(a for a in alive if position < len(self.rings[a])):
                cid = self.rings[r][position]
                state = carried[r]
                relayed = position > 0
                message = train_message(
                    ctx.server_arch, ctx.shape, ctx.num_classes, cfg,
                    init_seed=derive_seed(ctx.seed, "global", ctx.server_arch) if state is None else 0,
                    seed=derive_seed(ctx.seed, "client-train", cid, round_), round=round_,
                    weights=None if relayed or state is None else state)
                if relayed:  # the previous client's model, counted at its peer upload
                    message.tensors.update({f"{RELAYED}{k}": v for k, v in state.items()})
                    message.meta["weights_under"] = RELAYED
                messages[cid], owner[cid] = message, r
            nxt = {cid: self.rings[owner[cid]][(position + 1) % len(self.rings[owner[cid]])] for cid in messages}
            uploads, _ = ctx.exchange(round_, messages, relay=nxt)
            for cid, r in owner.items():
                if cid in uploads:
                    carried[r] = {k: v for k, v in uploads[cid].tensors.items()}
                else:  # a ring whose client failed stops this round (its head uploads nothing)
                    alive.discard(r)
        heads = {self.rings[r][0]: r for r in sorted(alive)}
        returns = {}
        for head, r in heads.items():
            message = Payload({f"{RELAYED}{k}": v for k, v in carried[r].items()},
                              {"task": "return_model", "arch": ctx.server_arch, "in_channels": ctx.shape[0],
                               "image_size": ctx.shape[1], "num_classes": ctx.num_classes, "init_seed": 0,
                               "weights_under": RELAYED})
            returns[head] = message
        uploads, _ = ctx.exchange(round_, returns)
        self.book.update(round_, uploads)
        if uploads:
            torch.manual_seed(derive_seed(ctx.seed, "server", self.name, round_))
            self.aggregate(round_, uploads, ctx)

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        models = client_models(uploads, ctx)
        ring_of = {self.rings[r][0]: r for r in range(len(self.rings))}
        sizes = [float(sum(self.sizes[c] for c in self.rings[ring_of[h]])) for h in uploads]
        self.global_model.load_state_dict(weighted_average([models[h].state_dict() for h in uploads], sizes))

    def models(self) -> dict[str, nn.Module]:
        return {self.name: self.global_model}
