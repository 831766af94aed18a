"""What ``memcalc trace`` prints: the breakdown, its fit in a budget, and the CUDA paths the
trace took (which SDPA backend each call took and why) or could not see."""

from __future__ import annotations

from memcalc.analysis.breakdown import Breakdown
from memcalc.output.result import Result
from memcalc.analysis.budget import Budget, Fit


class Traced(Result):
    """A traced step: its breakdown, the budget check, and the trace's notes."""

    breakdown: Breakdown
    budget: Budget | None = None
    fit: Fit | None = None
    gpu: str = ""
    cuda_paths: bool = True  # False: the meta device's own code paths (--meta-paths)
    notes: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()  # the fused SDPA backends the trace modelled, not traced
    inputs: tuple[str, ...] = ()  # what the target was called with, as --input says it
    autocast: str | None = None  # the autocast region around the forward (--autocast)
    param_dtype: str | None = None  # the module's floating state as module.to(dtype) makes it
    optimizer: str | None = None  # the training loop's (--optimizer), as the option names it
    grad_accum: int = 1  # forward and backward passes per optimizer step (--grad-accum)
    clip: float | None = None  # the grads' largest total norm before the step (--clip-grad-norm)

    def summary(self) -> str:
        lines = [f"traced as on {self.gpu}: CUDA code paths emulated (memcalc's docs, "
                 "docs/guides/trace.md)" if self.cuda_paths else
                 f"traced on the meta device's own code paths (--meta-paths), not the CUDA "
                 f"paths of {self.gpu}"]
        if self.inputs:
            lines.append(f"called with {', '.join(self.inputs)} (--input)")
        if self.param_dtype:
            lines.append(f"parameters and buffers in {self.param_dtype} (--param-dtype: "
                         f"module.to(torch.{self.param_dtype}))")
        if self.autocast:
            lines.append(f"forward under torch.autocast('cuda', dtype=torch.{self.autocast}) "
                         f"(--autocast)")
        if self.optimizer or self.grad_accum > 1:
            lines.append(loop_line(self.optimizer, self.grad_accum, self.clip))
        lines += [f"- {n}" for n in self.notes]
        if self.budget is not None:
            lines += [self.budget.describe(), self.fit.describe()]
        return "\n".join(lines)

    # the rendering protocol (memcalc.output.render): the breakdown's tables, then what the trace
    # learnt; every format is derived from these
    def tables(self) -> list:
        return self.breakdown.tables()

    def footnotes(self) -> list[str]:
        from memcalc.output.results import caveats, rank_note

        return [self.summary(), *rank_note(self.breakdown),
                *caveats([self.breakdown.config.impl], self.kernels)]

    def csv_table(self):
        return self.breakdown.csv_table()

    def headline(self) -> str:
        return self.breakdown.headline()

    def records(self) -> list[dict]:
        return self.breakdown.records()

    def to_dict(self) -> dict:
        """The breakdown's JSON, the notes, and the budget and fit when checked."""
        extra = self.fit.verdict(self.budget) if self.budget is not None else {}
        return {**self.breakdown.to_dict(), "gpu": self.gpu, "cuda_paths": self.cuda_paths,
                "notes": list(self.notes), "kernels": list(self.kernels),
                "inputs": list(self.inputs), "autocast": self.autocast,
                "param_dtype": self.param_dtype, "optimizer": self.optimizer,
                "grad_accum": self.grad_accum, "clip_grad_norm": self.clip, **extra}


def loop_line(optimizer: str | None, grad_accum: int, clip: float | None = None) -> str:
    """What the training loop around the step ran: ``trained as a loop does: 2 forward and
    backward passes, then torch.optim.AdamW(foreach=True).step() and zero_grad(...)``."""
    from memcalc.tracing.optimizers import parse_optimizer

    spec = parse_optimizer(optimizer)
    passes = f"{grad_accum} forward and backward passes, grads accumulating, then " \
        if grad_accum > 1 else "forward, backward, then "
    if clip is not None:
        passes += (f"clip_grad_norm_(params, {clip:g}, foreach=True) (--clip-grad-norm), ")
    if spec is None:
        return f"trained as a loop does: {passes}the grads reset"
    step = "on the GPU (a float32 0-d tensor each)" if spec.step_on_device else \
        "a CPU scalar (no GPU memory)"
    return (f"trained as a loop does: {passes}{spec.describe()}.step() and "
            f"zero_grad(set_to_none=True) (--optimizer {spec.text()}); its state made by "
            f"the warm-up's step, state['step'] {step}; the loss held as "
            f"`loss = model(...)` holds it")
