"""The optimizer of a traced training step (``memcalc/tracing/optimizers.py``): torch's own,
as CUDA picks it, in the loop the protocol runs (``run_protocol`` with ``Training``)."""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402
from memcalc.analysis.predict import predict  # noqa: E402
from memcalc.engine.program import Role  # noqa: E402
from memcalc.impls.device import gpu_of  # noqa: E402
from memcalc.tracing import TraceOptions, load_function, paths_for  # noqa: E402
from memcalc.tracing.optimizers import (OptimizerSpec, build, foreach_on_meta,  # noqa: E402
                                        fused_on_meta, loop_of, parse_optimizer)
from memcalc.tracing.tracer import Tracer, component, function_modes  # noqa: E402
from memcalc.validation import figures_of  # noqa: E402

from cli_helpers import run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT = f"{ROOT}/examples/training/gpt.py"
INPUTS = {"idx": ("B", "N", "int64"), "targets": ("B", "N", "int64")}
CLI_INPUTS = ("--input", "idx=B,N:int64", "--input", "targets=B,N:int64")
PHASES = ("forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "peak_bytes",
          "reserved_peak_bytes")


def test_the_option_names_an_optimizer_and_how_torch_runs_it():
    assert parse_optimizer("adamw") == OptimizerSpec("adamw", "foreach")
    assert parse_optimizer(" AdamW:Fused ") == OptimizerSpec("adamw", "fused")
    assert parse_optimizer("sgd:forloop").describe() == \
        "torch.optim.SGD(lr=0.01, momentum=0.9, foreach=False)"
    assert parse_optimizer(None) is None
    with pytest.raises(ValueError, match=r"--optimizer: unknown optimizer 'adamww' \(did you "
                                         r"mean 'adamw'\?\); known: adamw, adam or sgd"):
        parse_optimizer("adamww")
    with pytest.raises(ValueError, match="unknown implementation 'fuse' of adamw .did you "
                                         "mean 'fused'"):
        parse_optimizer("adamw:fuse")


@pytest.mark.parametrize("accum, optimizer, message", [
    (2, None, "--grad-accum 2: grads accumulate for an optimizer step; give --optimizer"),
    (0, "adamw", "--grad-accum: forward and backward passes per optimizer step, a whole "
                 "number of at least 1 .got 0."),
])
def test_grad_accumulation_needs_an_optimizer_and_a_count(accum, optimizer, message):
    with pytest.raises(ValueError, match=message):
        loop_of(optimizer, accum)


def test_built_as_cuda_would_pick_it():
    """On CUDA torch's default is foreach (``_default_to_fused_or_foreach``); on the meta
    device it would be the for-loop: the trace asks for CUDA's choice by name."""
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    assert build(OptimizerSpec("adamw"), [p]).defaults["foreach"] is True
    assert build(OptimizerSpec("adam", "forloop"), [p]).defaults["foreach"] is False
    import torch.optim.optimizer as optimizer

    with fused_on_meta():  # torch refuses fused=True off its device list, meta included
        assert build(OptimizerSpec("adamw", "fused"), [p]).defaults["fused"] is True
        assert "meta" in optimizer._get_fused_kernels_supported_devices()
    assert "meta" not in optimizer._get_fused_kernels_supported_devices()


def literal_loop(model, config, spec: str, accumulate: int = 1,
                 clip: float | None = None) -> dict[str, int]:
    """The training loop as nanoGPT's ``train.py`` writes it (``loss = model(X, Y)``,
    ``loss.backward()`` per micro-step, then ``clip_grad_norm_`` when ``clip`` is given,
    ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``), twice, the second read as
    ``torch.cuda`` would be: the peak reset where each phase starts, read where it ends.
    Under memcalc's tracer (its model of the allocator and of CUDA's kernels) but not its
    protocol, which is what it checks."""
    d = config.dims
    tracer = Tracer(config.workspace_bytes, None, paths_for(config, TraceOptions()), gpu_of(d))
    ledger, read = tracer.ledger, {}
    opt_spec = parse_optimizer(spec)
    with tracer, function_modes(tracer), \
            fused_on_meta() if opt_spec.impl == "fused" else nullcontext(), \
            foreach_on_meta():
        for name, p in model.named_parameters():  # resident from the start
            tracer.adopt(p, component(name, Role.parameter, "resident", tuple(p.shape),
                                      "float32", 0), located=False)
        idx = torch.ones(d.B, d.N, dtype=torch.int64, device="meta")
        targets = torch.ones(d.B, d.N, dtype=torch.int64, device="meta")
        optimizer = build(opt_spec, model.parameters())

        def phase(name, measured):  # the peak of the phase that ends, then a reset
            tracer.collect_frees()  # what died since the last op: freed at its death
            if measured and name:
                read[name] = max(read.get(name, 0), ledger.allocator.peak_allocated)
                read["reserved"] = max(read.get("reserved", 0), ledger.allocator.peak_reserved)
            ledger.reset_peak()

        loss = None
        for measured in (False, True):
            phase("", measured)
            for _ in range(accumulate):
                loss = model(idx, targets)[1]  # logits dropped, loss held until the next
                phase("forward", measured)
                loss.backward()
                phase("backward", measured)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            phase("optimizer", measured)
    return {"forward_peak_bytes": read["forward"], "backward_peak_bytes": read["backward"],
            "optimizer_peak_bytes": read["optimizer"],
            "peak_bytes": max(read["forward"], read["backward"], read["optimizer"]),
            "reserved_peak_bytes": read["reserved"]}


@pytest.mark.parametrize("spec, accumulate, clip", [
    ("adamw", 1, None), ("adamw:fused", 1, None), ("adamw:forloop", 1, None), ("adam", 1, None),
    ("sgd", 1, None), ("adamw", 2, None), ("sgd:fused", 3, None), ("adamw", 1, 1.0),
    ("adamw:fused", 2, 0.5)])
def test_the_traced_step_equals_the_training_loop_written_out(spec, accumulate, clip):
    """Every phase's peak and the reserved peak equal those of the loop written out, for
    each optimizer and implementation, with grads accumulated over micro-steps, and
    clipped."""
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer=spec, grad_accum=accumulate,
                      clip_grad_norm=clip, seq_len=257, batch=2)
    assert {k: getattr(b, k) for k in PHASES} == literal_loop(model, b.config, spec, accumulate,
                                                              clip)


def _parameter_bytes(model, itemsize: int = 4) -> int:
    """The bytes of the model's parameters, each once (the head is tied to wte)."""
    return sum(p.numel() * itemsize for p in model.parameters())


def test_adamw_keeps_two_moments_per_parameter_and_a_square_root_while_it_steps():
    """At the optimizer's peak: each parameter, its grad, AdamW's ``exp_avg`` and
    ``exp_avg_sq`` (``zeros_like`` in the first ``step()``), and the foreach path's
    ``_foreach_sqrt`` of the second moments, one per parameter (``_multi_tensor_adam``,
    torch/optim/adam.py); the step counts are CPU scalars, not on the device."""
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer="adamw", seq_len=128, batch=2)
    params = _parameter_bytes(model)
    # TinyGPT: wte 4096 x 256 (tied to the head), wpe 16384 x 256, 2 blocks of 789,760
    # (2 layer norms of 256 + 256, c_attn 256 x 768 + 768, c_proj 256 x 256 + 256, MLP
    # 256 x 1024 + 1024 and 1024 x 256 + 256), ln_f 256 + 256:
    # 1,048,576 + 4,194,304 + 1,579,520 + 512 = 6,822,912 parameters of 4 B
    assert params == 6_822_912 * 4
    live = b.optimizer_live
    state = [c for c in live if c.role is Role.optimizer_state]
    assert sum(c.bytes for c in state) == 2 * params
    assert {c.name.rpartition(": ")[2] for c in state} == {"exp_avg", "exp_avg_sq"}
    assert "transformer.wte.weight: exp_avg_sq" in {c.name for c in state}
    roots = [c for c in live if c.op == "_foreach_sqrt"]
    assert sum(c.bytes for c in roots) == params and all(c.role is Role.temporary
                                                         for c in roots)
    assert roots[0].name.startswith("_foreach_sqrt (adam.py:")  # the optimizer's own line
    grads = [c for c in live if c.role is Role.gradient]
    assert sum(c.bytes for c in grads) == params
    assert "transformer.h.0.attn.c_attn.weight.grad" in {c.name.split(" (")[0] for c in grads}
    assert b.optimizer_peak_bytes == sum(c.allocated for c in live)


def test_fused_adamw_keeps_its_step_counts_on_the_device_and_no_square_root():
    """``fused=True``: ``state["step"]`` is a float32 0-d tensor on the device per parameter
    (``_init_group``), a 512 B block each; the kernel updates in place (``_fused_adamw_``
    allocates nothing: fused_adamw_impl.cu, multi_tensor_apply_for_fused_optimizer)."""
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer="adamw:fused", seq_len=128, batch=2)
    steps = [c for c in b.optimizer_live if c.name.endswith(": step")]
    assert len(steps) == len(list(model.parameters())) == 2 + 2 * 12 + 2  # wte, wpe, ln_f
    assert {(c.bytes, c.allocated, c.dtype) for c in steps} == {(4, 512, "float32")}
    assert not [c for c in b.optimizer_live if c.op == "_foreach_sqrt"]


def test_sgd_keeps_one_momentum_buffer_per_parameter():
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer="sgd", seq_len=128, batch=2)
    state = [c for c in b.optimizer_live if c.role is Role.optimizer_state]
    assert sum(c.bytes for c in state) == _parameter_bytes(model)  # clone of each grad
    assert {c.name.rpartition(": ")[2] for c in state} == {"momentum_buffer"}


def test_pure_bf16_training_keeps_its_moments_in_bf16():
    """``model.to(torch.bfloat16)`` (--param-dtype bf16): AdamW's state is ``zeros_like``
    the parameters, so bf16 too: 2 x 2 B per parameter."""
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer="adamw", param_dtype="bf16",
                      seq_len=128, batch=2)
    state = [c for c in b.optimizer_live if c.role is Role.optimizer_state]
    assert {c.dtype for c in state} == {"bfloat16"}
    assert sum(c.bytes for c in state) == 2 * _parameter_bytes(model, itemsize=2)


@pytest.mark.parametrize("spec, accumulate", [("adamw", 1), ("adamw:fused", 2)])
def test_the_fitted_training_step_equals_direct_traces(spec, accumulate):
    """``oom --trace`` solves a training step from its program fitted over lengths: the
    warm-up as traced (its optimizer creates the state) and each measured phase; at any
    length it gives a direct trace's figures (saved and optimizer peak included)."""
    model = load_function(f"{GPT}:SlowTinyGPT")
    calling = memcalc.tracing.Calling(memcalc.engine.inputs.inputs_of(
        ["idx=B,N:int64", "targets=B,N:int64"], []), loop=loop_of(spec, accumulate))
    name = memcalc.tracing.register_function(model, "slow-tiny-gpt", calling)
    for n in (100, 1000, 3001):
        config = memcalc.make_config(impl=name, seq_len=n, batch=2)
        direct = memcalc.tracing.trace(model, config, calling=calling)
        fitted = predict(config)
        assert figures_of(fitted) == figures_of(direct)
        assert fitted.optimizer_peak_bytes == direct.optimizer_peak_bytes


def test_a_target_without_parameters_has_nothing_to_optimize(capsys):
    code, out, err = run(capsys, "trace", f"{ROOT}/examples/custom_softmax/variants.py:"
                         "reciprocal", "--seq", "64", "--optimizer", "adamw")
    assert code == 2 and err.count("\n") == 1
    assert "--optimizer adamw: the target has no parameters that need grad" in err


@pytest.mark.parametrize("argv, message", [
    (("--grad-accum", "2"), "--grad-accum 2: grads accumulate for an optimizer step"),
    (("--optimizer", "sgd", "--forward-only"), "--optimizer sgd: steps after a backward; "
                                               "--forward-only traces inference"),
    (("--optimizer", "lion"), "--optimizer: unknown optimizer 'lion'"),
    (("--optimizer", "adamw", "--grad-accum", "-1"), "--grad-accum: forward and backward"),
    (("--clip-grad-norm", "1.0"), "--clip-grad-norm 1.0: the grads are clipped before an "
                                  "optimizer step; give --optimizer"),
    (("--optimizer", "adamw", "--clip-grad-norm", "0"), "--clip-grad-norm: the largest total "
                                                        "norm of the grads, a positive number"),
    (("--optimizer", "adamw", "--clip-grad-norm", "one"), "--clip-grad-norm: the largest "
                                                          "total norm"),
])
def test_bad_loop_options_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, "trace", f"{GPT}:TinyGPT", *CLI_INPUTS, "--seq", "64", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err and not out


@pytest.mark.parametrize("width", [80, 120, None])  # None: piped
def test_the_command_shows_the_optimizer_peak_and_the_loop(capsys, monkeypatch, width):
    if width:
        monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run(capsys, "trace", f"{GPT}:TinyGPT", *CLI_INPUTS, "--seq", "128",
                         "--batch", "2", "--optimizer", "adamw:fused", "--grad-accum", "2")
    assert code == 0, err
    assert "optimizer peak (step, zero_grad)" in out and "…" not in out
    text = " ".join(out.split())
    assert "trained as a loop does: 2 forward and backward passes, grads accumulating, then " \
           "torch.optim.AdamW(fused=True).step() and zero_grad(set_to_none=True)" in text
    assert "state['step'] on the GPU" in text


def test_json_has_the_optimizer_peak_or_null(capsys):
    code, out, _ = run(capsys, "trace", f"{GPT}:TinyGPT", *CLI_INPUTS, "--seq", "64",
                       "--batch", "1", "--optimizer", "sgd", "--json")
    data = json.loads(out)
    assert data["optimizer"] == "sgd" and data["grad_accum"] == 1
    assert data["peak_bytes"] == max(data["forward_peak_bytes"], data["backward_peak_bytes"],
                                     data["optimizer_peak_bytes"])
    code, out, _ = run(capsys, "trace", f"{GPT}:TinyGPT", *CLI_INPUTS, "--seq", "64",
                       "--batch", "1", "--json")
    assert json.loads(out)["optimizer_peak_bytes"] is None


def test_the_table_says_what_dominates_by_role(capsys, monkeypatch):
    """Where a model's state is alive at the peak, a table of it by role, largest first:
    AdamW's state is twice the weights (fp32: 2 x 6,822,912 x 4 B = 54,583,296 B, each a
    block of its own size); a breakdown of attention alone has no such table."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, err = run(capsys, "trace", f"{GPT}:TinyGPT", *CLI_INPUTS, "--seq", "64",
                         "--batch", "1", "--optimizer", "adamw")
    assert code == 0, err
    table = out.split("by role\n", 1)[1].split("\n\n", 1)[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["optimizer"][1:4] == ["state", "56", "54,583,296"]  # 2 x 28 parameters
    assert rows["parameter"][1:3] == ["28", "27,291,648"]  # 6,822,912 x 4 B
    assert "by role" not in run(capsys, "breakdown", "--seq", "1024")[1]


def test_the_title_says_how_the_step_ran_not_a_dtype_nothing_took():
    """Token ids take no --dtype: the title names the weights' dtype, autocast's, the
    optimizer and the micro-steps instead of ``fp32``; hidden states do take it."""
    model = load_function(f"{GPT}:TinyGPT")
    b = memcalc.trace(model, inputs=INPUTS, optimizer="adamw:fused", grad_accum=2,
                      param_dtype="bf16", seq_len=128, batch=2)
    assert b.config.label() == "B=2 N=128 bf16 weights adamw:fused x2 micro-steps"
    attention = load_function(f"{ROOT}/examples/attention/nanogpt.py:CausalSelfAttention")
    b = memcalc.trace(attention, inputs={"x": ("B", "N", 768)}, autocast="bf16",
                      seq_len=64, batch=1)
    assert b.config.label() == "B=1 N=64 fp32 autocast bf16"


class TwoLinear(torch.nn.Module):
    """``Linear(300, 1000)``, ReLU, ``Linear(1000, 300)``, summed."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(300, 1000), torch.nn.Linear(1000, 300)

    def forward(self, x):
        return self.b(self.a(x).relu()).sum()


def test_clipping_takes_the_foreach_norms_buffer_of_partial_norms():
    """``clip_grad_norm_(..., foreach=True)``: ``_foreach_norm`` as CUDA runs it
    (``memcalc/tracing/foreach.py``), a float32 buffer of 4 grads x ceil(300,000 / 65,536)
    = 5 chunks = 20 partial norms (80 B), then each grad's 0-d norm, the buffer freed as it
    returns; then the norms stacked (4 x 4 B) into the total norm."""
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, register_function, traced

    history = []
    calling = Calling(inputs_of(["x=B,N,300"], []), loop=loop_of("adamw", 1,
                                                                  clip_grad_norm=1.0))
    config = memcalc.make_config(impl=register_function(TwoLinear(), "TwoLinear", calling),
                                 seq_len=64, batch=2)
    traced(TwoLinear(), config, TraceOptions(), history=history, calling=calling)
    names = [(e.kind, e.component.name.split(" (")[0], e.component.bytes) for e in history
             if e.component is not None]
    start = max(i for i, n in enumerate(names) if n[1] == "_foreach_norm partial norms"
                and n[0] == "alloc")
    assert names[start:start + 8] == [
        ("alloc", "_foreach_norm partial norms", 80), *[("alloc", "_foreach_norm", 4)] * 4,
        ("free", "_foreach_norm partial norms", 80), ("alloc", "stack", 16),
        ("alloc", "linalg_vector_norm", 4)]
