"""The compiled step's figures against a replay of the same inductor wrapper by code that is
not memcalc's tracer: ``Counter``, a dispatch mode that rounds each new storage to the
caching allocator's 512 B and frees it when Python drops it. Both run the wrapper memcalc's
compiler writes for an H100 (``memcalc.compiling``); the reference runs the protocol's
step itself (warm-up, grads set to None, then the measured forward and backward) and
counts what the wrapper allocates. The block has no SDPA, so nothing runs that the
wrapper does not show except cuBLAS's workspaces, added as derived constants."""

import weakref
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import memcalc  # noqa: E402

B, N, D = 8, 1024, 768
MiB = 2**20


class MLP(nn.Module):
    """LayerNorm, Linear(768, 3072), GELU, Linear(3072, 768), residual."""

    def __init__(self, d: int = D):
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class SelfCompiled(MLP):
    """The same block, compiling itself in its constructor (``Module.compile``)."""

    def __init__(self):
        super().__init__()
        self.compile()


class Counter(TorchDispatchMode):
    """Bytes of storages made under it, each rounded up to 512 B, freed when collected."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # see the compiled code run, not the compiler

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._made(t.untyped_storage())
        return out

    def _made(self, storage) -> None:
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = -(-storage.nbytes() // 512) * 512
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key) -> None:
        self.now -= self.live.pop(key)


def reference() -> tuple[int, int, int]:
    """(saved, forward peak, backward peak) above the measured step's start, from the
    wrapper as it runs under ``Counter``."""
    from memcalc.compiling.session import calls
    from memcalc.gpus import gpu_preset
    from memcalc.tracing.compiled import compile_call
    from memcalc.tracing.cuda_paths import CudaPaths, Mode

    paths = CudaPaths(gpu_preset("h100-80gb"))
    paths.tracer = SimpleNamespace(mask_adds=0)  # CUDA's SDPA rules on, as in a trace
    with calls(None), Mode(paths):
        with torch.device("meta"):
            model = MLP()
        compiled = compile_call(model)
        x = torch.empty(B, N, D, device="meta", requires_grad=True)
        grad_out = torch.empty(B, N, D, device="meta")
        compiled(x).backward(grad_out)  # warm-up: compiles
        x.grad = None
        for p in model.parameters():
            p.grad = None
        counter = Counter()
        with counter:
            y = compiled(x)
            saved, forward = counter.now - 4 * B * N * D, counter.peak  # less y
            counter.peak = counter.now
            y.backward(grad_out)
        return saved, forward, counter.peak


@pytest.mark.parametrize("model, compile", [(MLP, "default"), (SelfCompiled, None)],
                         ids=["--compile", "compiled in its constructor"])
def test_the_compiled_step_equals_a_replay_of_its_wrapper(model, compile):
    saved, forward, backward = reference()
    b = memcalc.trace(model, inputs={"x": ("B", "N", D)}, batch=B, seq_len=N,
                      compile=compile)
    # what is allocated when the measured step starts: the parameters (LayerNorm 2 x 768,
    # fc 3072 x 768 + 3072, out 768 x 3072 + 768, float32, each a multiple of 512 B),
    # x and grad_out (8 x 1024 x 768 x 4 B each), and one cuBLAS workspace per thread that
    # ran a matmul in the warm-up (main: forward, autograd: backward; 32 MiB on sm_90)
    params = 4 * (2 * 768 + 3072 * 768 + 3072 + 768 * 3072 + 768)  # 18,895,872
    inputs = 2 * 4 * B * N * D  # 50,331,648
    workspaces = 2 * 32 * MiB  # 67,108,864
    start = params + inputs + workspaces  # 136,336,384
    assert b.saved_bytes == saved
    assert b.forward_peak_bytes == start + forward
    assert b.backward_peak_bytes == start + backward


def test_the_compiled_step_differs_from_the_eager_one():
    """The replay is of compiled code: eager saves the GELU's input and output and the
    LayerNorm's output as the compiled step does, but holds the GELU backward's output
    beside the matmul's instead of writing it in place: its backward peak is higher."""
    compiled = memcalc.trace(MLP, inputs={"x": ("B", "N", D)}, batch=B, seq_len=N,
                             compile="default")
    eager = memcalc.trace(MLP, inputs={"x": ("B", "N", D)}, batch=B, seq_len=N)
    assert compiled.backward_peak_bytes < eager.backward_peak_bytes
