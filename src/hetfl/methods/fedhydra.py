"""FedHydra: one-shot, data-free FL by model stratification and stratified aggregation.

Paper: "A Unified Solution to Diverse Heterogeneities in One-Shot Federated Learning"
(../shared/seeds/001_*.txt), Alg. 1:

* **Model stratification** (Alg. 2, Eq. 1-7): per client k and class j a fresh generator is trained
  T_G steps on ``CE(F_k(G(z)), j)`` (Eq. 1); its loss trajectory gives ``u_kj = (max - min) / min``
  (Eq. 2), U is c x m (Eq. 3), ``U_r`` normalises its rows over clients (Eq. 4-5), ``U_c`` its
  columns over classes (Eq. 6-7). A client's c generators train in lockstep (one graph, one Adam
  over the summed losses), which equals c separate runs (``stratify_reference``; tested).
* **Stratified aggregation** (Alg. 3, Eq. 8-11): ``P_hat_k = P_k * U_c[:, k]``,
  ``P[i] = sum_k U_r[y_i, k] * P_hat_k[i]``.
* **Data generation** (Eq. 12-16): ``L_gen = CE(P, y) + lambda_1 L_BN + lambda_2 L_AD``, ``L_BN`` the
  DeepInversion loss averaged over clients, ``L_AD = -KL(P || F_g(x))``.
* **Model distillation** (Eq. 17-19): ``L_glo = KL(P || F_g(x)) + beta * CE(F_g(x), argmax P)``.

Choices the paper leaves open (defaults):
* G is initialised once and keeps its Adam state across epochs (Alg. 1 line 10); each epoch draws new
  z and uniform labels (line 12); z is not optimised. The student starts from scratch; no augmentation.
* One student SGD step per batch of the epoch's T_G ("all generated intermediates"); earlier epochs'
  batches are replayed only as ``pool_size`` / ``replay`` say. ``beta`` = 1; temperature 1 (Eq. 15, 17).
* Stratification: batch ``strat_batch_size`` = 64 (Alg. 2: "a batch"), Adam at ``generator_lr`` with
  betas 0.5/0.999 (DENSE's); ``strat_precision: bf16`` autocasts only the generators' forwards.
Variants (not in the paper; off by default):
* ``u_transform: log1p`` normalises ``log(1 + U)``: confident clients make Eq. 2's u span orders of
  magnitude, and Eq. 8 then scales whole classes by near-zero weights. ``u_transform_on: rows |
  columns`` applies it to U_r (Eq. 5) or U_c (Eq. 7) only.
* ``column_scale: mean`` multiplies U_c by c: Eq. 7's unit column sums divide near-uniform logits by
  ~c, a teacher temperature in Eq. 13, 15 and 17 that the paper does not state.
* ``saturated: max``: a one-class client's CE trajectory on its class is flat near 0, so Eq. 2 gives
  it u = 0; entries whose minimum CE is below ``SATURATED_CE`` get U's largest u instead ("a lower
  minimum loss value indicates stronger guidance"). The minima are saved as ``L_min``.
* ``aggregation: mean`` (DENSE's average teacher, FedHydra's losses); ``reset_generator`` and
  ``optimize_z`` (G and z re-drawn and trained each epoch, as DENSE); ``keep: best`` (the epoch's
  lowest-loss batch); ``adv_mask: disagree | agree`` (Eq. 15 on the samples where student and P
  disagree, as DENSE's code, or agree, which bounds it).
* The authors' public code (github.com/Jun-B0518/ICDE2025-FL-SA; read, none taken) runs DENSE's loop
  with Eq. 19's CE weight 0 by default; ``fedhydra`` follows the paper's text, the preset
  ``fedhydra_dense`` the code's loop.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hetfl.fl.datafree import DataFreeConfig, DataFreeDistiller, Recipe, kl_div
from hetfl.fl.method import ServerContext, derive_seed, register
from hetfl.fl.precision import autocast, check_precision
from hetfl.methods.common import DataFreeMethod
from hetfl.models.generator import Generator

EPS = 1e-8
SATURATED_CE = 1e-8  # minimum CE below which a trajectory counts as saturated (``saturated: max``)


# ---- model stratification --------------------------------------------------------------------
def guidance(losses: torch.Tensor) -> torch.Tensor:
    """Eq. 2 on loss trajectories (..., T_G): ``(max - min) / min`` (min floored at 1e-12; losses
    are recorded in float64 so a confident teacher's CE does not underflow to 0)."""
    losses = losses.double()
    lo = losses.amin(dim=-1)
    return (losses.amax(dim=-1) - lo) / lo.clamp_min(1e-12)


def normalise_rows_and_columns(U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4-7: ``U_r`` (rows sum to 1) and ``U_c`` (columns sum to 1); an all-zero row or column
    becomes uniform."""
    U = U.clamp_min(0)
    rows = U.sum(dim=1, keepdim=True)
    cols = U.sum(dim=0, keepdim=True)
    U_r = torch.where(rows > 0, U / rows.clamp_min(EPS), torch.full_like(U, 1.0 / U.shape[1]))
    U_c = torch.where(cols > 0, U / cols.clamp_min(EPS), torch.full_like(U, 1.0 / U.shape[0]))
    return U_r, U_c


def _strat_inputs(seed: int, client: int, num_classes: int, batch: int, nz: int, shape: tuple[int, int, int],
                  device: torch.device) -> tuple[list[Generator], torch.Tensor]:
    """The c generators and noise batches of one client, each seeded by (seed, client, class)."""
    gens, zs = [], []
    for j in range(num_classes):
        torch.manual_seed(derive_seed(seed, "fedhydra-strat", client, j))
        gens.append(Generator(nz, 64, shape[1], shape[0]).to(device))
        zs.append(torch.randn(batch, nz, device=device))
    return gens, torch.stack(zs)


def _adam(params: list[torch.Tensor], lr: float) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=lr, betas=(0.5, 0.999))


def train_generators_batched(teacher: nn.Module, gens: list[Generator], z: torch.Tensor, labels: torch.Tensor,
                             steps: int, lr: float, precision: str = "fp32") -> torch.Tensor:
    """Train ``len(gens)`` generators in lockstep, generator g towards ``labels[g]`` on noise ``z[g]``:
    one graph per step (the generators' outputs stacked), one teacher forward on all g x b images,
    one backward of the summed losses and one Adam step over all parameters. Returns the (g, steps)
    loss trajectories. ``precision: bf16`` runs the generators' forwards under bf16 autocast; the
    teacher always sees fp32 images and the CE is float64 (``strat_precision``, module docstring)."""
    g, b = z.shape[0], z.shape[1]
    for gen in gens:
        gen.train().to(memory_format=torch.channels_last)
    opt = _adam([p for gen in gens for p in gen.parameters()], lr)
    y = labels.repeat_interleave(b)
    history = []
    for _ in range(steps):
        with autocast(z.device, precision):
            x = torch.stack([gen(z[i]) for i, gen in enumerate(gens)])  # (g, b, C, H, W)
        if precision != "fp32":  # the teacher in fp32 whatever the generators ran in
            x = x.float()
        logits = teacher(x.flatten(0, 1)).double()  # float64 CE: no underflow to 0 for confident teachers
        per_gen = F.cross_entropy(logits, y, reduction="none").reshape(g, b).mean(dim=1)
        opt.zero_grad(set_to_none=True)
        per_gen.sum().backward()
        opt.step()
        history.append(per_gen.detach())
    return torch.stack(history, dim=1)


def stratify(teachers: list[nn.Module], num_classes: int, shape: tuple[int, int, int], steps: int,
             batch: int, lr: float, nz: int, seed: int, device: torch.device, progress: Any = None,
             precision: str = "fp32") -> torch.Tensor:
    """Alg. 2, batched over classes: the c x m matrix U of Eq. 3."""
    return guidance(stratify_losses(teachers, num_classes, shape, steps, batch, lr, nz, seed, device, progress,
                                    precision))


def saturate(U: torch.Tensor, L_min: torch.Tensor, threshold: float = SATURATED_CE) -> torch.Tensor:
    """``saturated: max``: every entry whose minimum CE ``L_min`` (c x m) is below ``threshold``
    gets the largest ``u`` of U (a flat trajectory at a near-zero loss is the strongest guidance
    by the paper's reading of Eq. 2, not the weakest)."""
    return torch.where(L_min.to(U.dtype) < threshold, U.max(), U)


def stratify_losses(teachers: list[nn.Module], num_classes: int, shape: tuple[int, int, int], steps: int,
                    batch: int, lr: float, nz: int, seed: int, device: torch.device,
                    progress: Any = None, precision: str = "fp32") -> torch.Tensor:
    """Alg. 2, batched over classes: the (c, m, T_G) CE trajectories L_kj (Eq. 1)."""
    columns = []
    clients = range(len(teachers)) if progress is None else progress(range(len(teachers)),
                                                                        desc="fedhydra: stratification", unit="client")
    for k in clients:
        teacher = teachers[k].eval()
        gens, z = _strat_inputs(seed, k, num_classes, batch, nz, shape, device)
        labels = torch.arange(num_classes, device=device)
        columns.append(train_generators_batched(teacher, gens, z, labels, steps, lr, precision))  # (c, T_G)
    return torch.stack(columns, dim=1)  # (c, m, T_G)


def stratify_reference(teachers: list[nn.Module], num_classes: int, shape: tuple[int, int, int], steps: int,
                       batch: int, lr: float, nz: int, seed: int, device: torch.device) -> torch.Tensor:
    """The one-generator-at-a-time loop of Alg. 2 (slow; for tests)."""
    U = torch.zeros(num_classes, len(teachers), dtype=torch.float64)
    for k, teacher in enumerate(teachers):
        teacher.eval()
        gens, z = _strat_inputs(seed, k, num_classes, batch, nz, shape, device)
        for j, gen in enumerate(gens):
            gen.train()
            opt = _adam(list(gen.parameters()), lr)
            y = torch.full((batch,), j, device=device)
            losses = []
            for _ in range(steps):
                loss = F.cross_entropy(teacher(gen(z[j])).double(), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            U[j, k] = guidance(torch.stack(losses))
    return U


# ---- stratified aggregation --------------------------------------------------------------------
def stratified_aggregation(logits: torch.Tensor, y: torch.Tensor, U_r: torch.Tensor, U_c: torch.Tensor) -> torch.Tensor:
    """Alg. 3: (m, b, c) client logits -> (b, c) SA logits (Eq. 8-11)."""
    P_hat = logits * U_c.t().unsqueeze(1)  # Eq. 8: client k's class-j logit scaled by U_c[j, k]
    V = U_r[y]  # Eq. 10: (b, m) weights of each sample's target class
    return torch.einsum("bm,mbc->bc", V, P_hat)  # Eq. 11


U_TRANSFORMS = {"none": lambda U: U, "log1p": torch.log1p}
AGGREGATIONS = ("stratified", "mean")
ADV_MASKS = ("none", "disagree", "agree")


class FedHydraRecipe(Recipe):
    keep = "all"
    reset_generator = False
    optimize_z = False

    def __init__(self, U_r: torch.Tensor, U_c: torch.Tensor, beta: float, aggregation: str = "stratified",
                 reset_generator: bool = False, adv_mask: str = "none", keep: str = "all",
                 optimize_z: bool = False) -> None:
        self.U_r, self.U_c, self.beta = U_r, U_c, beta
        self.aggregation, self.reset_generator, self.adv_mask = aggregation, reset_generator, adv_mask
        self.keep, self.optimize_z = keep, optimize_z

    def aggregate(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.aggregation == "mean":  # ablation: DENSE's average ensemble with FedHydra's losses
            return logits.mean(dim=0)
        return stratified_aggregation(logits, y, self.U_r.to(logits.dtype), self.U_c.to(logits.dtype))

    def generator_loss(self, P: torch.Tensor, s: torch.Tensor, y: torch.Tensor, bn: torch.Tensor,
                       cfg: DataFreeConfig) -> torch.Tensor:
        kl = kl_div(P, s, 1.0, reduction="none")
        if self.adv_mask != "none":  # ablation: only the samples the student gets wrong (DENSE) or right
            same = s.argmax(dim=1) == P.argmax(dim=1)
            kl = kl * (same if self.adv_mask == "agree" else ~same).float()
        l_ad = -kl.mean()  # Eq. 15
        return F.cross_entropy(P, y) + cfg.lambda_bn * bn.mean() + cfg.lambda_adv * l_ad  # Eq. 16

    def student_loss(self, P: torch.Tensor, s: torch.Tensor, cfg: DataFreeConfig) -> torch.Tensor:
        return kl_div(P, s, cfg.temperature) + self.beta * F.cross_entropy(s, P.argmax(dim=1))  # Eq. 19


@register("fedhydra")
class FedHydra(DataFreeMethod):
    name = "fedhydra"
    caveat = ("FedHydra as its paper writes it (Alg. 1-3): its student collapses to chance on MNIST and "
              "Fashion-MNIST, see docs/results/fedhydra.md; fedhydra_dense_log1p runs its losses in the "
              "authors' loop")
    method_defaults: dict[str, Any] = {"lr": 0.01, "beta": 1.0, "strat_batch_size": 64, "temperature": 1.0,
                                       "u_transform": "none", "aggregation": "stratified",
                                       "reset_generator": False, "column_scale": "sum", "adv_mask": "none",
                                       "keep": "all", "optimize_z": False, "saturated": "eq2",
                                       "u_transform_on": "both", "strat_precision": "fp32"}

    def check(self, ctx: ServerContext) -> None:
        super().check(ctx)
        if self.params["u_transform"] not in U_TRANSFORMS:
            raise ValueError(f"fedhydra: u_transform must be one of {sorted(U_TRANSFORMS)}, "
                             f"got {self.params['u_transform']!r}")
        if self.params["u_transform_on"] not in ("both", "rows", "columns"):
            raise ValueError("fedhydra: u_transform_on must be 'both', 'rows' (U_r only) or 'columns' (U_c only), "
                             f"got {self.params['u_transform_on']!r}")
        if self.params["aggregation"] not in AGGREGATIONS:
            raise ValueError(f"fedhydra: aggregation must be one of {list(AGGREGATIONS)}, "
                             f"got {self.params['aggregation']!r}")
        if self.params["column_scale"] not in ("sum", "mean"):
            raise ValueError("fedhydra: column_scale must be 'sum' (Eq. 7) or 'mean', "
                             f"got {self.params['column_scale']!r}")
        if self.params["adv_mask"] not in ADV_MASKS:
            raise ValueError(f"fedhydra: adv_mask must be one of {list(ADV_MASKS)}, got {self.params['adv_mask']!r}")
        for key in ("reset_generator", "optimize_z"):
            if not isinstance(self.params[key], bool):
                raise ValueError(f"fedhydra: {key} must be true or false, got {self.params[key]!r}")
        if self.params["saturated"] not in ("eq2", "max"):
            raise ValueError("fedhydra: saturated must be 'eq2' (Eq. 2 as written) or 'max', "
                             f"got {self.params['saturated']!r}")
        check_precision(self.params["strat_precision"], "fedhydra: strat_precision")
        if self.params["keep"] not in ("all", "best"):
            raise ValueError(f"fedhydra: keep must be 'all' or 'best', got {self.params['keep']!r}")
        if self.params["optimize_z"] and not self.params["reset_generator"]:
            raise ValueError("fedhydra: optimize_z needs reset_generator: true (z is re-drawn with the generator)")

    def recipe(self, teachers: list[nn.Module], ctx: ServerContext) -> Recipe:
        cfg = self.config
        path = ctx.out_dir / "stratification.json"
        key = {"seed": ctx.seed, "steps": cfg.generator_steps, "batch": self.params["strat_batch_size"],
               "lr": cfg.generator_lr, "nz": cfg.nz, "archs": ctx.client_archs}
        key["precision"] = self.params["strat_precision"]
        saved = json.loads(path.read_text()) if ctx.resume and path.is_file() else {}
        if saved.get("key") == key and "L_min" in saved:
            U, L_min = (torch.tensor(saved[n], dtype=torch.float64) for n in ("U", "L_min"))
            if "seconds" in saved:  # the stratification a resumed stage reuses counts in its seconds
                ctx.record["stratification_seconds"] = saved["seconds"]
                ctx.add_prior_seconds(saved["seconds"])
        else:
            start = time.perf_counter()
            if cfg.channels_last:  # the teachers in NHWC, as the loop after it puts them
                teachers = [t.to(memory_format=torch.channels_last) for t in teachers]
            L = stratify_losses(teachers, ctx.num_classes, ctx.shape, cfg.generator_steps,
                                self.params["strat_batch_size"], cfg.generator_lr, cfg.nz, ctx.seed, ctx.device,
                                ctx.progress, self.params["strat_precision"]).cpu()
            U, L_min = guidance(L), L.amin(dim=-1)
            ctx.record["stratification_seconds"] = time.perf_counter() - start
        used = saturate(U, L_min) if self.params["saturated"] == "max" else U
        on, transformed = self.params["u_transform_on"], U_TRANSFORMS[self.params["u_transform"]](used)
        U_r, _ = normalise_rows_and_columns(transformed if on in ("both", "rows") else used)  # Eq. 5
        _, U_c = normalise_rows_and_columns(transformed if on in ("both", "columns") else used)  # Eq. 7
        path.write_text(json.dumps({"U": U.tolist(), "U_r": U_r.tolist(), "U_c": U_c.tolist(),
                                    "L_min": L_min.tolist(), "key": key,
                                    **({"seconds": ctx.record["stratification_seconds"]}
                                       if "stratification_seconds" in ctx.record else {})}))
        plot_weights(U_c, ctx.out_dir / "U_c.png")
        scale = ctx.num_classes if self.params["column_scale"] == "mean" else 1  # columns average 1
        return FedHydraRecipe(U_r.float().to(ctx.device), scale * U_c.float().to(ctx.device),
                              float(self.params["beta"]), self.params["aggregation"], self.params["reset_generator"],
                              self.params["adv_mask"], self.params["keep"], self.params["optimize_z"])

    def after(self, engine: DataFreeDistiller, ctx: ServerContext) -> None:
        if engine.last_batch is not None:
            plot_samples(engine.last_batch[0], engine.last_batch[1], ctx.num_classes, ctx.out_dir / "samples.png")


def plot_weights(U_c: torch.Tensor, path: Any) -> None:
    """Heatmap of U_c (FedHydra Fig. 5b): rows = classes, columns = clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, m = U_c.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * m, 1.0 + 0.45 * c))
    im = ax.imshow(U_c.numpy(), cmap="Reds", vmin=0, vmax=max(float(U_c.max()), 1e-6), aspect="auto")
    for j in range(c):
        for k in range(m):
            ax.text(k, j, f"{float(U_c[j, k]):.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(m), [f"client {k}" for k in range(m)], rotation=45, ha="right")
    ax.set_yticks(range(c), [f"class {j}" for j in range(c)])
    ax.set_title("U_c: per-client class weights")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_samples(x8: torch.Tensor, y: torch.Tensor, num_classes: int, path: Any, per_class: int = 8) -> None:
    """A grid of synthetic images, one row per target class (FedHydra Fig. 12)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(num_classes, per_class, figsize=(per_class * 0.8, num_classes * 0.8), squeeze=False)
    for j in range(num_classes):
        rows = (y.cpu() == j).nonzero().flatten()[:per_class]
        for i in range(per_class):
            ax = axes[j][i]
            ax.axis("off")
            if i < len(rows):
                img = x8[rows[i]].cpu().permute(1, 2, 0).numpy()
                ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=255)
        axes[j][0].set_title(str(j), fontsize=6, loc="left")
    fig.tight_layout(pad=0.1)
    fig.savefig(path, dpi=100)
    plt.close(fig)
