"""Figures from a Result: the error through the network, and per-stage heatmaps.

Nothing here measures anything new: the per-stage metrics come from the Result, and the images
are drawn from the values the stages already hold (`Stage.ref_value`, `Stage.cand_value`; a stage
whose values were not kept, or whose shapes differ, has nothing to draw).  Large maps are block-max-pooled with torch,
on the tensors' own device, before they reach matplotlib, so plotting cost does not grow with
the activation size.
"""
from __future__ import annotations

import io
import math

import torch

from .align import to_ref_layout
from .measure import worst_elements as ranked_elements

MAX_PIXELS = 192  # heatmaps are pooled to at most this many cells per side


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        try:
            matplotlib.use("Agg")
        except Exception:
            pass
    import matplotlib.pyplot as plt

    return plt


def to_png(fig, dpi: int = 80) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


# result.json stores Inf as the largest double; anything this large is drawn as "not finite" (log
# axes overflow computing margins around it)
DRAWN_AS_INF = 1e300


def _finite_or_nan(x) -> float:
    return x if x is not None and math.isfinite(x) and abs(x) < DRAWN_AS_INF else float("nan")


def error_profile(result, ax=None):
    """Max and mean |error| per compared stage in execution order, log scale, tolerance drawn.
    Stages whose error is NaN or Inf are marked with a cross at the top of the axis."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3.2))
    stages = result.compared
    xs = [s.index for s in stages]
    tiny = 1e-12
    maxes = [_finite_or_nan(s.stats.max_abs) for s in stages]
    means = [_finite_or_nan(s.stats.mean_abs) for s in stages]
    ax.semilogy(xs, [m if m != m else max(m, tiny) for m in maxes], ".-", label="max |error|", color="#c0392b")
    ax.semilogy(xs, [m if m != m else max(m, tiny) for m in means], ".-", label="mean |error|", color="#2980b9",
                alpha=0.8)
    tol = result.tolerance()
    ax.axhline(tol["atol"], color="#7f8c8d", ls="--", lw=1, label=f"atol {tol['atol']:g}")
    bad = [x for x, m in zip(xs, maxes) if m != m]
    if bad:
        top = max([m for m in maxes if m == m] + [tol["atol"], 1.0]) * 10
        ax.semilogy(bad, [top] * len(bad), "x", color="#7d3c98", label="NaN/Inf error")
    fd = result.first_divergence
    if fd is not None:
        ax.axvline(fd.index, color="#c0392b", ls=":", lw=1.5)
        ax.annotate(f"first divergence\n{(fd.ref_name or fd.cand_name or '?')[:40]}", xy=(fd.index, tol["atol"]),
                    xytext=(6, 12), textcoords="offset points", fontsize=8, color="#c0392b")
    rc = result.root_cause
    if rc is not None and rc is not fd:
        ax.axvline(rc.index, color="#8e44ad", ls=":", lw=1.5)
        ax.annotate("root cause", xy=(rc.index, tol["atol"]), xytext=(6, -16), textcoords="offset points",
                    fontsize=8, color="#8e44ad")
    ax.set_xlabel("stage (execution order)")
    ax.set_ylabel("|candidate − reference|")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, which="major", alpha=0.3)
    if fig is not None:
        fig.tight_layout()
    return fig if fig is not None else ax.figure


def values(stage) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(reference, candidate brought into the reference's layout) of a stage, on the reference's
    device; None when either value was not kept or the two cannot be put side by side."""
    ref, cand = stage.ref_value, stage.cand_value
    if ref is None or cand is None:
        return None
    ref = ref.detach()
    try:
        cand = to_ref_layout(cand.detach(), tuple(ref.shape), stage.pair_transform).to(ref.device)
    except (ValueError, RuntimeError):
        return None
    if tuple(cand.shape) != tuple(ref.shape):
        return None
    return ref, cand


def _no_values(stage) -> ValueError:
    return ValueError(f"stage {stage.index} {stage.name}: values not kept (or shapes that cannot be aligned), "
                      f"nothing to draw")


def _abs_diff(ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """|candidate − reference| in float64; NaN (a NaN on either side) shown as Inf."""
    return torch.nan_to_num((cand.to(torch.float64) - ref.to(torch.float64)).abs(), nan=float("inf"))


def _displayable(t: torch.Tensor) -> torch.Tensor:
    """A map matplotlib can colour: NaN and ±Inf clamped to the finite range (Inf = the brightest)."""
    finite = t[torch.isfinite(t)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0.0, 1.0)
    return torch.nan_to_num(t, nan=hi, posinf=hi, neginf=lo)


def _as_2d(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Last two axes; leading axes reduced by max (of |value| for diffs, by value otherwise)."""
    t = t.detach()
    if t.dim() == 0:
        return t.reshape(1, 1), "scalar"
    if t.dim() == 1:
        return t.reshape(1, -1), f"[{t.shape[0]}]"
    lead = t.shape[:-2]
    if lead:
        t = t.reshape(-1, *t.shape[-2:]).amax(dim=0)
    return t, ("max over leading axes " + "×".join(map(str, lead)) if lead else "")


def pool(t: torch.Tensor, max_side: int = MAX_PIXELS) -> torch.Tensor:
    """Block max-pool a 2-D map (on its device) down to at most `max_side` cells per side."""
    h, w = t.shape
    if h <= max_side and w <= max_side:
        return t
    kh, kw = math.ceil(h / max_side), math.ceil(w / max_side)
    x = t.to(torch.float32)[None, None]
    pos = torch.nn.functional.max_pool2d(x, (kh, kw), ceil_mode=True)
    neg = torch.nn.functional.max_pool2d(-x, (kh, kw), ceil_mode=True)
    # keep the larger magnitude of each block, with its sign
    out = torch.where(pos.abs() >= neg.abs(), pos, -neg)
    return out[0, 0]


def stage_maps(stage) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(reference, candidate, |difference|) 2-D maps of a stage, pooled, as float32 on the CPU."""
    pair = values(stage)
    if pair is None:
        raise _no_values(stage)
    ref, cand = pair
    diff = _abs_diff(ref, cand)
    r2, note = _as_2d(ref.to(torch.float32))
    c2, _ = _as_2d(cand.to(torch.float32))
    d2, _ = _as_2d(diff.to(torch.float32))
    return pool(r2).cpu(), pool(c2).cpu(), pool(d2).cpu(), note


def heatmap(stage, worst_slices: int = 4):
    """reference | candidate | |difference| over the last two axes, plus a grid of the worst slices."""
    plt = _plt()
    r, c, d, note = stage_maps(stage)
    r, c, d = _displayable(r), _displayable(c), _displayable(d)
    shape = list(stage.ref_value.shape)
    rows_label = f"axis {len(shape) - 2} ({shape[-2]})" if len(shape) >= 2 else ""
    cols_label = f"axis {len(shape) - 1} ({shape[-1]})" if shape else ""
    slices = _worst_slices(stage, worst_slices)
    nrow = 2 if slices else 1
    fig, axes = plt.subplots(nrow, 3 if not slices else max(3, len(slices)), figsize=(11, 3.3 * nrow), squeeze=False)
    vmin = float(torch.minimum(r.min(), c.min()))
    vmax = float(torch.maximum(r.max(), c.max()))
    for ax, img, title, kw in ((axes[0][0], r, "reference", dict(vmin=vmin, vmax=vmax, cmap="viridis")),
                               (axes[0][1], c, "candidate", dict(vmin=vmin, vmax=vmax, cmap="viridis")),
                               (axes[0][2], d, "|difference|", dict(cmap="magma"))):
        im = ax.imshow(img.numpy(), aspect="auto", interpolation="nearest", **kw)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(cols_label, fontsize=8)
        ax.set_ylabel(rows_label, fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in axes[0][3:]:
        ax.axis("off")
    for j, (idx, sl) in enumerate(slices):
        ax = axes[1][j]
        im = ax.imshow(pool(sl).numpy(), aspect="auto", interpolation="nearest", cmap="magma")
        ax.set_title(f"|difference| at {list(idx)}", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046)
    for ax in (axes[1][len(slices):] if slices else []):
        ax.axis("off")
    fig.suptitle(f"{stage.ref_name}  {'×'.join(map(str, shape))}" + (f"  ({note})" if note else ""), fontsize=10)
    fig.tight_layout()
    return fig


def _worst_slices(stage, k: int) -> list[tuple[tuple, torch.Tensor]]:
    """The k leading-axis slices with the largest error (only for tensors with leading axes)."""
    pair = values(stage)
    if pair is None or pair[0].dim() < 3:
        return []
    diff = _abs_diff(*pair)
    lead = diff.shape[:-2]
    flat = diff.reshape(-1, *diff.shape[-2:])
    score = flat.amax(dim=(1, 2))
    top = torch.argsort(score, descending=True)[:k]
    out = []
    for i in top.tolist():
        idx, rem = [], i
        for size in reversed(lead):
            idx.append(rem % size)
            rem //= size
        out.append((tuple(reversed(idx)), _displayable(flat[i].to(torch.float32).cpu())))
    return out


def _say_no_values(ax, title: str) -> None:
    ax.text(0.5, 0.5, "values not kept", ha="center", va="center", transform=ax.transAxes, color="#777")
    ax.set_title(title, fontsize=9)


def error_histogram(stage, ax=None):
    """Histogram of candidate − reference over the finite elements, log counts."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(4.5, 3))
    pair = values(stage)
    if pair is None:
        _say_no_values(ax, "error histogram")
        return fig if fig is not None else ax.figure
    ref, cand = pair
    d = (cand.to(torch.float64) - ref.to(torch.float64)).flatten()
    d = d[torch.isfinite(d)]
    if d.numel() > 200_000:
        d = d[torch.randperm(d.numel(), device=d.device)[:200_000]]
    ax.hist(d.cpu().numpy(), bins=60, color="#c0392b", alpha=0.85)
    ax.set_yscale("log")
    ax.set_xlabel("candidate − reference", fontsize=8)
    ax.set_title("error histogram", fontsize=9)
    return fig if fig is not None else ax.figure


def error_vs_magnitude(stage, ax=None):
    """Error against the reference value: a scale bug is a line through 0, an offset a flat band."""
    plt = _plt()
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(4.5, 3))
    pair = values(stage)
    if pair is None:
        _say_no_values(ax, "error vs reference value")
        return fig if fig is not None else ax.figure
    ref = pair[0].to(torch.float64).flatten()
    d = pair[1].to(torch.float64).flatten() - ref
    keep = torch.isfinite(ref) & torch.isfinite(d)
    ref, d = ref[keep], d[keep]
    if ref.numel() > 20_000:
        pick = torch.randperm(ref.numel(), device=ref.device)[:20_000]
        ref, d = ref[pick], d[pick]
    ax.scatter(ref.cpu().numpy(), d.cpu().numpy(), s=2, alpha=0.4, color="#2c3e50")
    ax.axhline(0, color="#7f8c8d", lw=0.8)
    ax.set_xlabel("reference value", fontsize=8)
    ax.set_ylabel("candidate − reference", fontsize=8)
    ax.set_title("error vs reference value", fontsize=9)
    return fig if fig is not None else ax.figure


def error_distribution(stage):
    """The error histogram and the error against the reference value, side by side (a Figure)."""
    fig, axes = _plt().subplots(1, 2, figsize=(9, 3))
    error_histogram(stage, axes[0])
    error_vs_magnitude(stage, axes[1])
    fig.tight_layout()
    return fig


def worst_elements(stage, k: int = 10) -> list[dict]:
    """The stage's k worst elements, worst first, ranked as `Stats.worst` is (see
    `measure.worst_elements`); [] when the stage has no metrics or its values were not kept."""
    pair = values(stage)
    if pair is None or stage.stats is None:
        return []
    return ranked_elements(*pair, stage.stats.atol, stage.stats.rtol, k)
