"""HFLDD (hybrid FL with dataset distillation; Alg. 1-2, Eq. 4 and 18): clustering, distillation, then
FedAvg over the cluster heads.

The method's steps are numbered like rounds (so each is checkpointed and resumed as one):

* **Step 1, label knowledge**: every client trains ``pretrain_steps`` (E1, 10) mini-batch SGD steps at batch
  ``pretrain_batch_size`` (b1, 64) from the seeded initial model (Table I and Sec. V-C count E1 in update
  steps; ``pretrain_epochs``, when set, trains that many epochs instead) and uploads S_i, its softmax on D_g,
  ``aux_size`` (1,000) seeded images of the auxiliary set (:mod:`hetfl.data.auxiliary`: Fashion-MNIST for
  MNIST, MNIST for Fashion-MNIST), read from its own data root (kind ``soft_labels``). The server builds M_ij
  = KL(S_i || S_j) (Eq. 4), K-Means with ``clusters`` (K, 10) homogeneous clusters, and ClusterSampling (Alg.
  1) heterogeneous clusters of one client of each, with one random head each (:mod:`hetfl.fl.clustering`). A
  client without an accepted upload is left out. ``clusters.png`` (Fig. 4) shows each heterogeneous cluster's
  samples by class.
* **Step 2, distillation**: every member (non-head) distils ``distilled_size`` (400) images of its data
  with KIP (:mod:`hetfl.fl.kip`: ``kip_steps`` 3,000, ``kip_lr`` 0.004, ``kip_lambda`` 1e-6, ``kernel``
  ntk, 10 target samples per step) and sends them, uint8 (8 bits a pixel) with their labels, to its head
  through the server (``peer`` bytes, kinds ``distilled_data`` and ``labels``). ``share: raw``
  (``hfldd_nodd``, Fig. 5's "w/o DD") sends the member's raw data instead (kind ``raw_data``).
* **Steps 3 .. T + 2, training**: FedAvg over the heads (``rounds`` T, 300), from the initial model
  (``init: seed``); a head trains ``head_epochs`` (E2, 2) at batch ``head_batch_size`` (32) on its own data
  plus the sets it received (kept in its client state; forwarded once, in its first training message),
  weighted by that total size.

With K = 1 every client is its own head: no distillation, no peer bytes, and the training steps equal
``fedavg`` (``init: seed``, the same client settings) bit for bit. The ledger follows Eq. 18:
N |D_g| N_c B1 + sum |D~_i| B2 + H |w| (2T - 1) B1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hetfl.data.auxiliary import AUXILIARY, auxiliary_images
from hetfl.data.base import ImageDataset
from hetfl.fl.aggregate import weighted_average
from hetfl.fl.client import ClientEnv, client_task, model_from_message, train_message
from hetfl.fl.clustering import cluster_sampling, homogeneous_clusters, kl_matrix
from hetfl.fl.comm import RELAYED
from hetfl.fl.kip import KERNELS, distill
from hetfl.fl.method import RoundMethod, ServerContext, derive_seed, register
from hetfl.fl.payload import Payload, PayloadError, state_payload
from hetfl.fl.train_config import TrainConfig
from hetfl.fl.training import local_train, predict_logits
from hetfl.methods.common import client_models, require_one_architecture

RECEIVED = "received/"  # client-state prefix of the sets a head received


# ---- client tasks ----------------------------------------------------------------------------------
@client_task("soft_labels")
def soft_labels(message: Payload, env: ClientEnv) -> Payload:
    """Train from the sent initialisation, then upload the softmax on the auxiliary sample D_g."""
    m = message.meta
    model = model_from_message(message).to(env.device)
    local_train(model, env.data, TrainConfig(**m["train"]), env.device, seed=int(m["seed"]), progress=env.progress)
    shape = (int(m["in_channels"]), int(m["image_size"]), int(m["image_size"]))
    aux = auxiliary_images(m["aux"]["dataset"], env.data_root, shape, int(m["num_classes"]), int(m["aux"]["size"]),
                           int(m["aux"]["seed"]), int(m["aux"]["sample_seed"]))
    with torch.no_grad():
        probs = torch.softmax(predict_logits(model, aux, env.device), dim=1)
    return Payload({"soft": probs.cpu().float()}, {"kind": "soft_labels"})


@client_task("share_data")
def share_data(message: Payload, env: ClientEnv) -> Payload:
    """A member's set for its head: KIP-distilled images (or, ``raw``, its own data), uint8, and labels."""
    m = message.meta
    if m["raw"]:
        x, y, kind = env.data.x.clone(), env.data.y.clone(), "raw_data"
    else:
        data_x, data_y = env.data.batch(torch.arange(len(env.data)))
        images, y = distill(data_x, data_y, int(m["num_classes"]), int(m["size"]), int(m["steps"]), float(m["lr"]),
                            float(m["lambda"]), m["kernel"], int(m["target_batch"]), int(m["seed"]))
        x, kind = (images * 255).round().to(torch.uint8), "distilled_data"
    return Payload({"x": x, "y": y}, {"kind": kind, "tensor_kinds": {"y": "labels"}})


@client_task("head_train")
def head_train(message: Payload, env: ClientEnv) -> Payload:
    """Keep the sets forwarded in this message, then train on the own data plus every set received."""
    for key, value in message.tensors.items():
        if key.startswith(RELAYED):
            env.state[RECEIVED + key[len(RELAYED):]] = value.clone()
    data = env.data
    members = sorted({k[len(RECEIVED):].split("/")[0] for k in env.state if k.startswith(RECEIVED)}, key=int)
    if members:
        xs = [data.x, *(env.state[f"{RECEIVED}{c}/x"] for c in members)]
        ys = [data.y, *(env.state[f"{RECEIVED}{c}/y"] for c in members)]
        data = ImageDataset(torch.cat(xs), torch.cat(ys), data.num_classes, data.name)
    weights = Payload({k: v for k, v in message.tensors.items() if not k.startswith(RELAYED)}, message.meta)
    model = model_from_message(weights).to(env.device)
    cfg = TrainConfig(**message.meta["train"])
    stats = local_train(model, data, cfg, env.device, seed=int(message.meta["seed"]), progress=env.progress)
    return state_payload(model.cpu(), arch=message.meta["arch"], train_loss=stats["loss"], trained_samples=len(data))


def plot_clusters(groups: list[list[int]], label_counts: dict[int, list[int]], path: Any) -> None:
    """HFLDD's Fig. 4: per heterogeneous cluster, its samples stacked by class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = len(next(iter(label_counts.values())))
    counts = torch.tensor([[sum(label_counts[c][j] for c in group) for j in range(classes)] for group in groups],
                          dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(groups) + 1.5), 3.0))
    bottom = torch.zeros(len(groups), dtype=torch.float64)
    for j in range(counts.shape[1]):
        ax.bar(range(len(groups)), counts[:, j].tolist(), bottom=bottom.tolist(), label=str(j), width=0.8)
        bottom += counts[:, j]
    ax.set_xticks(range(len(groups)))
    ax.set_xlabel("heterogeneous cluster")
    ax.set_ylabel("samples")
    ax.legend(title="class", fontsize=6, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)


# ---- server ----------------------------------------------------------------------------------------
@register("hfldd")
class HFLDD(RoundMethod):
    name = "hfldd"
    defaults = {"rounds": 300, "sample_ratio": 1.0, "init": "seed", "clusters": 10, "aux_dataset": "",
                "aux_size": 1000, "pretrain_steps": 10, "pretrain_epochs": None,
                "pretrain_batch_size": 64, "distilled_size": 400, "kip_steps": 3000,
                "kip_lr": 0.004, "kip_lambda": 1e-6, "kernel": "ntk", "target_batch": 10, "head_epochs": 2,
                "head_batch_size": 32, "share": "distilled"}
    ranges = {"init": {"choices": ("seed",)}, "clusters": {"ge": 1}, "aux_size": {"ge": 1},
              "pretrain_steps": {"ge": 1}, "pretrain_epochs": {"type": "int", "ge": 1},
              "pretrain_batch_size": {"ge": 1}, "distilled_size": {"ge": 1}, "kip_steps": {"ge": 0},
              "kip_lr": {"gt": 0}, "kip_lambda": {"gt": 0}, "kernel": {"choices": tuple(KERNELS)},
              "target_batch": {"ge": 1}, "head_epochs": {"ge": 1}, "head_batch_size": {"ge": 1},
              "share": {"choices": ("distilled", "raw")}, "sample_ratio": {"gt": 0, "le": 1}}

    @property
    def rounds(self) -> int:
        return int(self.params["rounds"]) + 2  # steps 1 and 2 are the clustering and distillation stages

    def check(self, ctx: ServerContext) -> None:
        require_one_architecture(ctx, "hfldd averages the heads' models")
        if self.params["sample_ratio"] != 1.0:
            raise ValueError("hfldd trains every head every round: sample_ratio must be 1")
        if self.params["clusters"] > ctx.num_clients:
            raise ValueError(f"clusters: K = {self.params['clusters']} is more than the {ctx.num_clients} clients")
        if self.aux_name(ctx) is None:
            raise ValueError(f"no default auxiliary set for {ctx.dataset!r}; set aux_dataset")

    def aux_name(self, ctx: ServerContext) -> str | None:
        return self.params["aux_dataset"] or AUXILIARY.get(ctx.dataset)

    def setup(self, ctx: ServerContext) -> None:
        self.check(ctx)
        self.global_model = ctx.build(ctx.server_arch, purpose="global")
        n = ctx.num_clients
        self.assign = torch.full((n,), -1, dtype=torch.int64)  # heterogeneous cluster per client (-1: left out)
        self.is_head = torch.zeros(n, dtype=torch.bool)
        self.sets: dict[int, dict[str, torch.Tensor]] = {}  # member -> its shared set, until forwarded
        self.forwarded = torch.zeros(n, dtype=torch.bool)  # heads whose sets went out

    def run(self, ctx: ServerContext) -> dict[str, nn.Module]:
        self.start(ctx)
        for step in ctx.rounds(self):
            if step == 1:
                self.cluster(ctx)
            elif step == 2:
                self.share(ctx)
            else:
                self.train_round(step, ctx)
            ctx.end_round(step, self)
        return self.models()

    def _message(self, client_id: int, ctx: ServerContext, task: str, epochs: int, batch_size: int | None,
                 seed: int, weights: dict[str, torch.Tensor] | None = None, steps: int | None = None,
                 **extra: Any) -> Payload:
        cfg = self.local_config(ctx)
        cfg = TrainConfig(**{**cfg.to_dict(), "epochs": epochs, "steps": steps,
                             **({"batch_size": batch_size} if batch_size else {})})
        return train_message(ctx.server_arch, ctx.shape, ctx.num_classes, cfg,
                             init_seed=derive_seed(ctx.seed, "global", ctx.server_arch) if weights is None else 0,
                             seed=seed, weights=weights, task=task, **extra)

    def cluster(self, ctx: ServerContext) -> None:
        aux = {"dataset": self.aux_name(ctx), "size": self.params["aux_size"], "seed": ctx.seed,
               "sample_seed": derive_seed(ctx.seed, "hfldd-aux")}
        p = self.params
        epochs, steps = (p["pretrain_epochs"], None) if p["pretrain_epochs"] is not None else (1, p["pretrain_steps"])
        messages = {c: self._message(c, ctx, "soft_labels", epochs, p["pretrain_batch_size"],
                                     derive_seed(ctx.seed, "pretrain", c), steps=steps, aux=aux)
                    for c in range(ctx.num_clients)}
        uploads, _ = ctx.exchange(1, messages, cacheable=True)  # stateless: reused across K and w/o DD
        ids = sorted(uploads)
        if not ids:
            raise RuntimeError("hfldd: no client uploaded its soft labels")
        k = min(int(self.params["clusters"]), len(ids))
        labels = homogeneous_clusters(kl_matrix(torch.stack([uploads[c].tensors["soft"] for c in ids])), k, ctx.seed)
        clusters, heads = cluster_sampling(labels, ctx.seed)
        for h, (members, head) in enumerate(zip(clusters, heads)):
            self.assign[[ids[i] for i in members]] = h
            self.is_head[ids[head]] = True
        groups = [[ids[i] for i in members] for members in clusters]
        histograms = {c: uploads[c].meta.get("label_counts", [0] * ctx.num_classes) for c in ids}
        plot_clusters(groups, histograms, ctx.out_dir / "clusters.png")
        ctx.record["clusters"] = {"homogeneous": k, "heterogeneous": len(clusters),
                                  "homogeneous_labels": {str(c): int(lab) for c, lab in zip(ids, labels)},
                                  "heads": sorted(ids[h] for h in heads),
                                  "sizes": [len(m) for m in clusters], "left_out": sorted(set(range(ctx.num_clients))
                                                                                           - set(ids))}

    def head_of(self, client: int) -> int:
        cluster = int(self.assign[client])
        return next(c for c in range(len(self.assign)) if self.is_head[c] and int(self.assign[c]) == cluster)

    def share(self, ctx: ServerContext) -> None:
        members = [c for c in range(len(self.assign)) if int(self.assign[c]) >= 0 and not self.is_head[c]]
        p = self.params
        messages = {c: Payload({}, {"task": "share_data", "raw": p["share"] == "raw", "num_classes": ctx.num_classes,
                                    "size": p["distilled_size"], "steps": p["kip_steps"], "lr": p["kip_lr"],
                                    "lambda": p["kip_lambda"], "kernel": p["kernel"], "target_batch": p["target_batch"],
                                    "seed": derive_seed(ctx.seed, "kip", c), "kind": "state"})
                    for c in members}
        uploads, _ = ctx.exchange(2, messages, relay={c: self.head_of(c) for c in members}, cacheable=True)
        self.sets = {c: {"x": u.tensors["x"], "y": u.tensors["y"]} for c, u in uploads.items()}

    def validate_upload(self, client_id: int, message: Payload, upload: Payload, ctx: ServerContext) -> None:
        task = message.meta.get("task")
        if task == "soft_labels":
            soft = upload.tensors.get("soft")
            shape = (int(self.params["aux_size"]), ctx.num_classes)
            if soft is None or soft.dtype != torch.float32 or soft.dim() != 2 or soft.shape[1] != shape[1] \
                    or len(soft) > shape[0]:
                raise PayloadError(f"soft labels must be float32 of shape (<= {shape[0]}, {shape[1]})")
            rows = soft.sum(1)
            if not torch.isfinite(soft).all() or (soft < 0).any() or not torch.allclose(rows, torch.ones_like(rows),
                                                                                        atol=1e-3):
                raise PayloadError("soft labels must be probabilities (non-negative rows summing to 1)")
        elif task == "share_data":
            x, y = upload.tensors.get("x"), upload.tensors.get("y")
            limit = None if message.meta["raw"] else int(self.params["distilled_size"])
            if x is None or y is None or x.dtype != torch.uint8 or tuple(x.shape[1:]) != tuple(ctx.shape):
                raise PayloadError(f"a shared set is uint8 images of shape (n, {', '.join(map(str, ctx.shape))})")
            if len(y) != len(x) or (limit is not None and len(x) > limit):
                raise PayloadError(f"a shared set has at most {limit} images, each with a label")
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= ctx.num_classes):
                raise PayloadError("labels out of range")
        else:
            super().validate_upload(client_id, message, upload, ctx)

    def train_round(self, step: int, ctx: ServerContext) -> None:
        round_ = step - 2
        heads = [c for c in range(len(self.assign)) if self.is_head[c]]
        weights = None if round_ == 1 else {k: v.detach().cpu() for k, v in self.global_model.state_dict().items()}
        messages = {}
        for h in heads:
            message = self._message(h, ctx, "head_train", self.params["head_epochs"], self.params["head_batch_size"],
                                    derive_seed(ctx.seed, "client-train", h, round_), weights, round=round_)
            if not self.forwarded[h]:
                for c, s in self.sets.items():
                    if self.head_of(c) == h:
                        message.tensors.update({f"{RELAYED}{c}/x": s["x"], f"{RELAYED}{c}/y": s["y"]})
            messages[h] = message
        uploads, _ = ctx.exchange(step, messages)
        for h in uploads:
            self.forwarded[h] = True
        self.book.update(step, uploads)
        if uploads:
            self.aggregate(round_, uploads, ctx)

    def aggregate(self, round_: int, uploads: dict[int, Payload], ctx: ServerContext) -> None:
        """FedAvg over the heads, weighted by the data each trained on (its own plus the sets received)."""
        models = client_models(uploads, ctx)
        sizes = [float(uploads[c].meta["trained_samples"]) for c in uploads]
        self.global_model.load_state_dict(weighted_average([models[c].state_dict() for c in uploads], sizes))

    def models(self) -> dict[str, nn.Module]:
        return {self.name: self.global_model}

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        out.update({"stage.assign": self.assign, "stage.is_head": self.is_head, "stage.forwarded": self.forwarded})
        for c, s in self.sets.items():
            out.update({f"stage.set.{c}.x": s["x"], f"stage.set.{c}.y": s["y"]})
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.assign, self.is_head = state["stage.assign"].clone(), state["stage.is_head"].clone()
        self.forwarded = state["stage.forwarded"].clone()
        self.sets = {}
        for key, value in state.items():
            if key.startswith("stage.set."):
                _, _, c, name = key.split(".")
                self.sets.setdefault(int(c), {})[name] = value.clone()
