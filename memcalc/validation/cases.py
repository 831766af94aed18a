"""What a live run measures, and the three columns of each case.

Cases, in the order a run takes them (the most evidence per minute first):
- ``oom-threshold``: for a few implementations, the ``N`` that memcalc's OOM solver says fits
  a capped allocator and ``N + 1`` that does not, both run live under that cap;
- ``fused``: sdpa-flash and sdpa-efficient (``memcalc/data/live.json``), whose models are
  read from kernel sources and which the meta device cannot run;
- ``usercode``: ``memcalc/validation/usercode.py`` (sdpa as torch picks it, cuDNN attention,
  fused dropout, half-to-float softmax), whose model is the tracer;
- ``modelcode``: ``memcalc/validation/modelcode.py`` (modules from hidden states, autocast
  around and inside them, module state, Hugging Face attention), whose model is the tracer;
- ``training``: ``memcalc/validation/training.py`` (language models to their loss, with an
  optimizer), whose model is the program ``oom --trace`` solves;
- ``compiled``: ``memcalc/validation/compiled.py`` (a GPT block and a Hugging Face Llama
  compiled whole at two activation memory budgets, blocks compiled in a constructor), whose
  model is the tracer compiling for the preset GPU, run live as torch compiles it;
- ``grid``: the shipped grid (the emulated backend's), re-targeted to the live device.

For each case: the model (``predict``, or the tracer for user code), the emulated trace of
the same code on the installed torch (``emulated.measure``) where the meta device can run
it, and the live run. ``compare.Check`` attributes the differences.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memcalc.config import Config, DType, Shape
from memcalc.errors import one_line
from memcalc.names import CASE_KINDS
from memcalc.validation.compare import FITTED_KINDS, Check, case_key

LIVE_GRID = Path(__file__).resolve().parents[1] / "data" / "live.json"
KINDS = CASE_KINDS  # declared with the CLI's vocabulary
OOM_IMPLS = ("naive", "naive-softmax", "sdpa-math")
OOM_CAPACITY = 2 << 30  # small, so that N and N + 1 run in milliseconds


@dataclass(frozen=True)
class Case:
    """One live run: a configuration, the code it runs, and for OOM threshold cases the
    allocator's cap and the model's verdict under it."""

    kind: str
    config: Config
    fn: Callable | None = None  # user code; None: the reference code of config.impl
    capacity: int | None = None
    expected: str | None = None  # fits | oom
    # model code: ``fn`` is an nn.Module class, built on the device that runs it, and
    # called as this says (memcalc.tracing.Calling); None: fn(q, k, v)
    calling: object = None
    # compiled code: (mode, activation budget) its torch.compile calls run at, as
    # ``--compile`` and ``--compile-budget`` say; None: as the command runs them
    compile: tuple[str | None, float | None] | None = None

    @property
    def key(self) -> str:
        return case_key(self.kind, self.config, self.capacity)

    def code(self, device: str = "meta") -> Callable:
        """``fn(q, k, v)`` with the configuration's options bound; model code's module built
        on ``device`` (in ``--param-dtype`` where given), called with its inputs."""
        if self.fn is None:
            from memcalc.validation.reference import reference_fn

            return reference_fn(self.config)
        from memcalc.tracing import bound

        if self.calling is None:
            return bound(self.fn, self.config)
        import torch

        if not isinstance(self.fn, type):  # an instance or a function: its state is placed
            return bound(self.fn, self.config, self.calling)  # on the device as it runs
        from memcalc.tracing import compiled

        with torch.device(device):
            module = self.fn()
        if self.calling.param_dtype:
            module.to(getattr(torch, self.calling.param_dtype))
        return bound(compiled.target(module), self.config, self.calling)

    def compiling(self):
        """The compiler the case's code runs under (``memcalc.compiling``): its
        ``compile``'s mode and budget; none of its own without one."""
        if self.compile is None:
            return nullcontext()
        from memcalc.compiling.session import calls

        mode, budget = self.compile
        return calls(mode, activation_budget=budget)

    @property
    def loop(self):
        """The training loop model code runs in (``memcalc.tracing.optimizers.Loop``)."""
        from memcalc.tracing.optimizers import Loop

        return self.calling.loop if self.calling is not None else Loop()

    @property
    def inputs(self) -> tuple:
        """What ``code()`` is called with (``memcalc.engine.inputs``): the implementation's
        arguments (``(B, N, H, d)`` for the flash-attn packages), or model code's."""
        from memcalc.impls import get_impl

        return get_impl(self.config.impl).inputs if self.calling is None else self.calling.inputs

    def model(self) -> tuple[dict[str, int] | None, str]:
        """The model's figures (the tracer's for user code; for a training step, the program
        ``oom --trace`` solves, fitted over lengths), or None and why."""
        try:
            if self.kind in FITTED_KINDS:
                return self._fitted()
            if self.fn is not None:
                with self.compiling():
                    return self._traced(), "memcalc trace"
            from memcalc.analysis.predict import predict

            return predict(self.config).figures(), ""
        except Exception as error:  # noqa: BLE001 - a model that cannot answer is a record
            return None, f"{type(error).__name__}: {one_line(error)}"

    def _fitted(self) -> tuple[dict[str, int], str]:
        """The figures of the program ``oom --trace`` solves at this length (fitted over
        lengths where it holds, else a direct trace), and how it is made."""
        from memcalc.analysis.predict import predict
        from memcalc.impls import get_impl

        how = get_impl(self.config.impl).how(self.config.dims)
        return predict(self.config).figures(), f"oom --trace's: {how}"

    def _traced(self) -> dict[str, int]:
        """A direct trace of the case's code, as ``memcalc trace`` runs it."""
        from memcalc.tracing import Calling, prepared, trace

        fn = prepared(self.fn, self.config.impl) if self.calling else self.fn
        return trace(fn, self.config, calling=self.calling or Calling()).figures()

    def emulated(self) -> tuple[dict[str, int] | None, str, str]:
        """The meta-device trace on the installed torch: figures, outcome, detail."""
        from memcalc.impls import get_impl

        if self.kind in FITTED_KINDS:
            try:
                return self._traced(), "measured", "memcalc trace"
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                return None, "error", f"{type(error).__name__}: {one_line(error)}"
        if self.fn is not None:
            return None, "absent", "user code: the tracer is its model"
        if not get_impl(self.config.impl).traced:
            return None, "absent", "fused kernel: the meta device cannot run it"
        from memcalc.engine.allocator import OutOfMemory
        from memcalc.validation import emulated

        try:
            return emulated.measure(self.config, capacity=self.capacity).figures(), \
                "measured", ""
        except OutOfMemory as error:
            return None, "oom", str(error)
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            return None, "error", f"{type(error).__name__}: {one_line(error)}"


def grid_cases(configs: list[Config], env: dict[str, str]) -> list[Case]:
    """The grid re-targeted to the live device, each distinct configuration once (grids
    name several GPU presets; on one device they coincide)."""
    from memcalc.validation.cuda import live_config

    unique = {c.model_dump_json(): c for c in (live_config(c, env) for c in configs)}
    return [Case("grid", c) for c in unique.values()]


def fused_cases(env: dict[str, str]) -> list[Case]:
    """``memcalc/data/live.json``: the fused SDPA backends, and the flash-attn packages'
    kernels where the package is installed (``flash_attn``, FA3's ``flash_attn_interface``)."""
    from memcalc.validation.grid import load_grid

    cases = grid_cases(load_grid(LIVE_GRID).expand(), env)
    return [Case("fused", c.config) for c in cases if _importable(c.config.impl)]


PACKAGES = {"flash-attn": "flash_attn", "flash-attn3": "flash_attn_interface"}


def _importable(impl: str) -> bool:
    """Whether the package an implementation's reference code imports is installed."""
    import importlib.util

    return impl not in PACKAGES or importlib.util.find_spec(PACKAGES[impl]) is not None


def usercode_cases(env: dict[str, str]) -> list[Case]:
    """Each user function at two lengths, fp16 (bf16 for cuDNN), causal where it matters."""
    from memcalc.validation.cuda import live_config
    from memcalc.validation.usercode import USER_CODE, register

    names = register()
    dtypes = {"sdpa-cudnn": DType.bf16}
    causal = {"sdpa-default": (False, True), "sdpa-cudnn": (False, True)}
    cases = []
    for key, fn in USER_CODE.items():
        for is_causal in causal.get(key, (False,)):
            for n in (1024, 4096):
                config = Config(impl=names[key], dtype=dtypes.get(key, DType.fp16),
                                causal=is_causal,
                                shape=Shape(batch=2, heads=4, seq_len=n, head_dim=64))
                cases.append(Case("usercode", live_config(config, env), fn))
    return cases


def modelcode_cases(env: dict[str, str]) -> list[Case]:
    """Each model-code module (``memcalc/validation/modelcode.py``) at two lengths."""
    from memcalc.validation.modelcode import model_code, register

    return _code_cases("modelcode", model_code(), register(), env)


def training_cases(env: dict[str, str]) -> list[Case]:
    """Each training step (``memcalc/validation/training.py``) at two lengths."""
    from memcalc.validation.training import register, training_code

    return _code_cases("training", training_code(), register(), env)


def _code_cases(kind: str, codes: dict, names: dict[str, str], env: dict[str, str],
                compiles: dict[str, tuple] | None = None) -> list[Case]:
    """Each module of ``codes`` (registered as ``names``) at two lengths, batch 2, fp32
    inputs (autocast, the parameters' dtype and the training loop as its calling says);
    compiled as ``compiles`` says of it (``Case.compile``)."""
    from memcalc.validation.cuda import live_config

    return [Case(kind, live_config(Config(impl=names[key], shape=Shape(batch=2, seq_len=n)),
                                   env), code.module, calling=code.calling,
                 compile=(compiles or {}).get(key))
            for key, code in codes.items() for n in (1024, 4096)]


def compiled_cases(env: dict[str, str]) -> list[Case]:
    """Each compiled step (``memcalc/validation/compiled.py``) at two lengths, batch 2,
    compiled in its mode at its budget."""
    from memcalc.validation.compiled import compiled_code, register

    codes = compiled_code()
    return _code_cases("compiled", {key: code for key, (code, _, _) in codes.items()},
                       register(), env, {key: (mode, b) for key, (_, mode, b) in codes.items()})


def oom_cases(env: dict[str, str], capacity: int) -> list[Case]:
    """For each of ``OOM_IMPLS`` (the seeds' B=8 H=1 d=16 fp32 step) the threshold memcalc's
    solver finds for an allocator capped at ``capacity``: N (fits) and N + 1 (does not)."""
    from memcalc.analysis.budget import fit
    from memcalc.analysis.solver import max_fitting
    from memcalc.validation.cuda import live_config

    cases = []
    for impl in OOM_IMPLS:
        base = live_config(Config(impl=impl, shape=Shape(batch=8, seq_len=2048)), env)
        n = max_fitting(base, capacity).max_value
        for length in (n, n + 1):
            config = base.replace(seq_len=length)
            verdict = "fits" if fit(config, capacity).fits else "oom"
            cases.append(Case("oom-threshold", config, capacity=capacity, expected=verdict))
    return cases


def all_cases(kinds: tuple[str, ...], grid_configs: list[Config], env: dict[str, str],
              capacity: int, impls: list[str] | None = None) -> list[Case]:
    """Every case of ``kinds``, in ``KINDS`` order; only ``impls`` when given."""
    build = {"oom-threshold": lambda: oom_cases(env, capacity), "fused": lambda: fused_cases(env),
             "usercode": lambda: usercode_cases(env),
             "modelcode": lambda: modelcode_cases(env),
             "training": lambda: training_cases(env),
             "compiled": lambda: compiled_cases(env),
             "grid": lambda: grid_cases(grid_configs, env)}
    cases = [c for kind in KINDS if kind in kinds for c in build[kind]()]
    return [c for c in cases if impls is None or c.config.impl in impls]


def run_case(case: Case, gpu) -> Check:
    """The three columns of ``case``: model, emulated trace and the live run on ``gpu``
    (``cuda.LiveGpu``). An OOM is an outcome; any other failure of the run is recorded as
    an error and the run goes on. Where the live run measured figures that the emulated
    trace does not explain (they differ, or there is no emulated column), the ops' scratch
    bytes are recorded too."""
    predicted, model_detail = case.model()
    emulated, emulated_outcome, emulated_detail = case.emulated()
    outcome, measured, detail = _live(case, gpu)
    scratch = {}
    if outcome == "measured" and (emulated is None or emulated != measured):
        scratch = _scratch(case, gpu)
    return Check(config=case.config, predicted=predicted, measured=measured, outcome=outcome,
                 detail=detail, case=case.kind, model_detail=model_detail, emulated=emulated,
                 emulated_outcome=emulated_outcome, emulated_detail=emulated_detail,
                 capacity_bytes=case.capacity, expected=case.expected, scratch=scratch)


def _live(case: Case, gpu) -> tuple[str, dict[str, int] | None, str]:
    from memcalc.validation.compare import figures_of

    try:
        with case.compiling(), _compiled_live():
            m = gpu.measure(case.config, case.code(gpu.device), case.capacity, case.inputs,
                            case.loop)
    except gpu.oom_errors as error:
        return "oom", None, one_line(error)
    except Exception as error:  # noqa: BLE001 - an unsupported kernel, say: recorded
        return "error", None, f"{type(error).__name__}: {one_line(error)}"
    return "measured", figures_of(m), ""


def _compiled_live():
    """Compiled code run by torch on the GPU (``memcalc.compiling.session.live_run``)
    where the code is compiled (a compiler is given); nothing otherwise."""
    from memcalc.tracing import compiled

    if not compiled.compiling():
        return nullcontext()
    from memcalc.compiling.session import live_run

    return live_run()


def _scratch(case: Case, gpu) -> dict[str, int]:
    try:
        with case.compiling(), _compiled_live():
            return gpu.scratch(case.config, case.code(gpu.device), case.inputs, case.loop)
    except Exception:  # noqa: BLE001 - a diagnostic: its failure must not lose the run
        return {}
