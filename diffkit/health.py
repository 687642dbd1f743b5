"""What diffkit says of the reference itself: random (dropout live in training mode, randomness in its
forward), constant output, parameters initialised to zero; and `--reinit-zero`.

(Split from diffkit.pipeline, which re-exports these names; layer 9: it imports align, capture, modelstate
and runner.)
"""
from __future__ import annotations

import torch

from .align import torch_op
from .capture import Trace, parameters_of
from .modelstate import bitwise_difference, restore_state, snapshot_state
from .runner import clone_inputs, run_captured

__all__ = ["reference_health", "may_be_random", "stochastic_reason", "reinit_zero_parameters"]


def reference_health(model: torch.nn.Module, inputs: list, trace: Trace, no_grad: bool,
                     state: dict | None = None, rerun: bool = True) -> list[str]:
    """Warnings about the reference itself: random (dropout live in training mode, randomness in its
    forward), constant output, zero-initialised parameters.  `state`: its buffers before the
    captured forward, restored for the second run (and the state after it put back).  The second run
    (randomness) only with `rerun`: a diff runs it when the candidate diverged, the only answer a
    random reference can explain."""
    notes: list[str] = []
    out = trace.output
    if out is not None and out.value is not None and out.value.is_floating_point():
        v = out.value
        if v.numel() and bool((v == 0).all()):
            notes.append("the reference output is all zeros: a candidate returning zeros would pass")
        elif v.numel() > 1 and float(v.max() - v.min()) == 0:
            notes.append(f"the reference output is constant ({float(v.flatten()[0]):g}): a constant candidate would pass")
    if rerun and out is not None and out.value is not None and out.value.is_floating_point():
        v = out.value
        after = snapshot_state(model)
        restore_state(model, state or {})
        again = run_captured(model, clone_inputs(inputs), no_grad=no_grad)  # not re-seeded: randomness shows
        restore_state(model, after)
        if again.output is not None and again.output.value is not None and \
                bitwise_difference(again.output.value, v) is not None:
            first = next((a.name for a, b in zip(trace.records, again.records)
                          if a.value is not None and b.value is not None and a.shape == b.shape
                          and bitwise_difference(a.value, b.value) is not None), "?")
            reason = stochastic_reason(model)
            w = again.output.value
            tol = 1e-2 if v.dtype in (torch.float16, torch.bfloat16) else 1e-4  # (KernelBench's, by dtype)
            close = w.shape == v.shape and bool(torch.allclose(w, v, atol=tol, rtol=tol, equal_nan=True))
            if close:  # noise too small to matter at the output: no reason to say no candidate can match
                gap = float((w.double() - v.double()).abs().nan_to_num(0.0).max()) if v.numel() else 0.0
                notes.append(f"the reference is random: two runs on the same inputs differ, first at {first} "
                             f"({reason}), by at most {gap:.3g} at the output: within KernelBench's tolerance "
                             f"({tol:g}), so a candidate can still match it")
            else:
                notes.append(f"the reference is random: two runs on the same inputs differ, first at {first} "
                             f"({reason}); its output depends on the random draw, so no candidate can match it "
                             f"reliably (KernelBench never calls eval())"
                             + ("; --eval turns dropout off" if reason.startswith(_LIVE_DROPOUT) else ""))
    # weights (not norm biases, which start at zero by design) that are all zero
    zero = [n for n, p in parameters_of(model) if p.dim() >= 2 and not bool(p.detach().any())]
    if zero:
        notes.append(f"parameters initialised to zero hide the paths through them: {', '.join(zero[:5])}"
                     + (" …" if len(zero) > 5 else "") + " (--reinit-zero gives them random values for the diff)")
    return notes


_RANDOM_OPS = ("dropout", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
               "bernoulli", "multinomial", "normal", "poisson", "uniform", "exponential", "geometric", "cauchy",
               "log_normal", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "rrelu", "random",
               "gumbel_softmax", "fractional_max_pool2d", "fractional_max_pool3d", "dropout1d", "dropout2d",
               "dropout3d")


def may_be_random(model: torch.nn.Module, trace: Trace) -> bool:
    """Whether a forward may draw random numbers: a dropout module live in training mode, or a record
    made by a sampling function (the second-run check confirms it)."""
    if stochastic_reason(model).startswith(_LIVE_DROPOUT):
        return True
    for r in trace.records:
        name = torch_op(r)
        if name in _RANDOM_OPS:
            return True
        if name == "scaled_dot_product_attention" and r.call is not None:  # attention dropout
            (_, _, tmpl), _ = r.call
            try:
                args, kwargs = tmpl
                p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            except (TypeError, ValueError, AttributeError):
                p = 0.0
            if isinstance(p, (int, float)) and p > 0:
                return True
    return False


_LIVE_DROPOUT = "dropout live in training mode: "


def stochastic_reason(model: torch.nn.Module) -> str:
    """Why a model's forward is random, in words: the dropout modules live in training mode, else
    randomness drawn in its own code."""
    drop = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)
    active = [f"{n or type(m).__name__} (p={m.p:g})" for n, m in model.named_modules()
              if isinstance(m, drop) and m.training and m.p > 0]
    mha = [n for n, m in model.named_modules() if isinstance(m, torch.nn.MultiheadAttention) and m.training
           and m.dropout > 0]
    if active or mha:
        return _LIVE_DROPOUT + ", ".join((active + [f"{n} (attention dropout)" for n in mha])[:4])
    return "randomness drawn in its forward (torch.rand/randn/dropout in its code)"


def reinit_zero_parameters(ref: torch.nn.Module, cand: torch.nn.Module | None = None, seed: int = 0) -> list[str]:
    """Give all-zero parameters of the reference random values (and copy them to the candidate)."""
    g = torch.Generator().manual_seed(seed)
    done = []
    cparams = dict(parameters_of(cand)) if cand is not None else {}
    with torch.no_grad():
        for n, p in parameters_of(ref):
            if p.dim() >= 2 and not bool(p.detach().any()):
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p))
                if n in cparams and cparams[n].shape == p.shape:
                    cparams[n].copy_(p)
                done.append(n)
    return done
