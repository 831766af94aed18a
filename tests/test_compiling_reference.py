"""The compiled step's figures against a replay of the same inductor wrapper by code that is
not memcalc's tracer: ``Counter``, a dispatch mode that rounds each new storage to the
caching allocator's 512 B and frees it when Python drops it. Both run the wrapper memcalc's
compiler writes for an H100 (``memcalc.compiling``); the reference runs the protocol's
step itself (warm-up, grads set to None, then the measured forward and backward) and
counts what the wrapper allocates. What the wrapper does not show is written here from
PyTorch's source: cuBLAS's workspaces (derived constants) and, for the GPT block, the
scratch the memory-efficient attention backward allocates besides its grads."""

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


def _example(path: str, name: str):
    """``name`` of the example file ``path`` (the repository's ``examples/``)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        Path(path).stem, Path(__file__).resolve().parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


Block = _example("examples/attention/gpt_block.py", "Block")  # a GPT-2 block, 12 heads


EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def efficient_backward_scratch(grad_out: torch.Tensor) -> tuple[list[int], list[int]]:
    """Bytes ``_efficient_attention_backward`` (``aten/src/ATen/native/transformers/cuda/
    attention_backward.cu``) allocates (+) and frees (-) besides dq, dk, dv, in float32,
    before and after it makes them: a (B, N, H, D)-contiguous copy of grad_out unless it
    is one already; then delta = (grad_out * out).sum(-1), a (B, N, H, D) product and a
    (B, N, H) sum made (B, H, N)-contiguous; then the kernel's workspace, for head dims up
    to 64 a 64 x 64 tile (``kernels/cutlassB.h``), per (batch, head) ceil(N/64) x
    ceil(D/64) split-key dQ tiles of 16 B and 64 x 64 floats."""
    b, h, n, d = grad_out.shape
    copy = [] if grad_out.transpose(1, 2).is_contiguous() else [b * n * h * d * 4]
    product, rowsum, delta = b * n * h * d * 4, b * n * h * 4, b * h * n * 4
    workspace = b * h * -(-n // 64) * -(-d // 64) * (16 + 64 * 64 * 4)
    return copy, [product, rowsum, delta, -product, -rowsum, workspace, -delta, -workspace,
                  *(-c for c in copy)]


class Counter(TorchDispatchMode):
    """Bytes of storages made under it, each rounded up to 512 B, freed when collected;
    the hidden scratch of the attention kernels as ``efficient_backward_scratch`` says.
    ``peak_in``: the op running when the peak was reached."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # see the compiled code run, not the compiler

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak, self.peak_in = {}, 0, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before, after = efficient_backward_scratch(args[0]) \
            if func is EFFICIENT_BACKWARD else ([], [])
        self._scratch(before, func)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            # the forward's philox seed and offset: CPU tensors on CUDA without dropout
            # (attention.cu), device tensors in its meta registration
            if isinstance(t, torch.Tensor) and not (func is EFFICIENT and t.dim() == 0):
                self._made(t.untyped_storage(), func)
        self._scratch(after, func)
        return out

    def _scratch(self, changes: list[int], func) -> None:
        for nbytes in changes:
            self._count(-(-abs(nbytes) // 512) * 512 * (1 if nbytes > 0 else -1), func)

    def _count(self, nbytes: int, func) -> None:
        self.now += nbytes
        if self.now > self.peak:
            self.peak, self.peak_in = self.now, func

    def _made(self, storage, func) -> None:
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0 or storage.device.type != "meta":
            return  # an optimizer's state["step"]: a CPU tensor
        self.live[key] = -(-storage.nbytes() // 512) * 512
        self._count(self.live[key], func)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key) -> None:
        self.now -= self.live.pop(key)


def reference(module=None) -> tuple[int, int, int, object]:
    """(saved, forward peak, backward peak) above the measured step's start, from the
    wrapper as it runs under ``Counter``, and the op running at the backward's peak."""
    from memcalc.compiling.session import calls
    from memcalc.gpus import gpu_preset
    from memcalc.tracing.compiled import compile_call
    from memcalc.tracing.cuda_paths import CudaPaths, Mode

    paths = CudaPaths(gpu_preset("h100-80gb"))
    paths.tracer = SimpleNamespace(mask_adds=0)  # CUDA's SDPA rules on, as in a trace
    with calls(None), Mode(paths):
        with torch.device("meta"):
            model = (module or MLP)()
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
        return saved, forward, counter.peak, counter.peak_in


@pytest.mark.parametrize("model, compile", [(MLP, "default"), (SelfCompiled, None)],
                         ids=["--compile", "compiled in its constructor"])
def test_the_compiled_step_equals_a_replay_of_its_wrapper(model, compile):
    saved, forward, backward, _ = reference()
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


def test_a_compiled_gpt_block_equals_a_replay_of_its_wrapper():
    """The wrapper calls the memory-efficient attention kernel (float32 on an H100) as a
    fallback, between inductor's own buffers. Rounding to 512 B is the allocator's block
    for every tensor here (under 1 MiB, or a multiple of 2 MiB) but the backward's
    workspace (25,190,400 B, alive inside the kernel only): the peak is elsewhere."""
    saved, forward, backward, peak_in = reference(Block)
    b = memcalc.trace(Block, inputs={"x": ("B", "N", D)}, batch=B, seq_len=N,
                      compile="default")
    # at the start: the parameters (two LayerNorms 2 x 2 x 768, c_attn 768 x 2304 + 2304,
    # c_proj 768 x 768 + 768, c_fc 768 x 3072 + 3072, mlp_proj 3072 x 768 + 768, float32),
    # x and grad_out, and the two threads' cuBLAS workspaces
    params = 4 * (4 * 768 + 768 * 2304 + 2304 + 768 * 768 + 768 + 768 * 3072 + 3072
                  + 3072 * 768 + 768)  # 28,351,488
    start = params + 2 * 4 * B * N * D + 2 * 32 * MiB  # 145,792,000
    assert peak_in is not EFFICIENT_BACKWARD
    assert b.saved_bytes == saved
    assert b.forward_peak_bytes == start + forward
    assert b.backward_peak_bytes == start + backward


class LlamaStep(nn.Module):
    """A two-layer Hugging Face Llama with its loss, float32, sized so that every tensor its
    step makes is at most 1 MiB or a multiple of 2 MiB (the caching allocator's block is
    then the request rounded to 512 B, as ``Counter`` counts)."""

    def __init__(self):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                          num_attention_heads=4, num_key_value_heads=4,
                                          num_hidden_layers=2, vocab_size=1024)
        config._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def loop_reference(step) -> tuple[int, int, int, int, int, object]:
    """(saved, forward, backward and optimizer peaks, allocated at the end) of ``step``'s
    training loop step as the protocol runs it (a warm-up step, then the measured one; the loss
    held until the next forward returns; AdamW's foreach path, as torch picks on CUDA), all
    from the counter's zero, which is before the inputs; and the op running at the
    backward's peak."""
    from memcalc.compiling.session import calls
    from memcalc.gpus import gpu_preset
    from memcalc.tracing.compiled import compile_call
    from memcalc.tracing.cuda_paths import CudaPaths, Mode

    paths = CudaPaths(gpu_preset("h100-80gb"))
    paths.tracer = SimpleNamespace(mask_adds=0)
    counter, peaks = Counter(), []
    with calls(None), Mode(paths), counter:
        compiled = compile_call(step)
        ids = torch.empty(1, LLAMA_N, dtype=torch.int64, device="meta")
        labels = torch.empty(1, LLAMA_N, dtype=torch.int64, device="meta")
        optimizer = torch.optim.AdamW(step.parameters(), foreach=True)
        held = None
        for measured in (False, True):
            counter.peak = a0 = counter.now
            loss = compiled(ids, labels)
            saved = counter.now - a0 - 512  # less the loss's block
            peaks.append(counter.peak)
            held = loss  # the previous step's loss dies here
            del loss
            counter.peak = counter.now
            held.backward(torch.ones_like(held))
            peaks.append(counter.peak)
            backward_in = counter.peak_in
            counter.peak = counter.now
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            peaks.append(counter.peak)
        return saved, *peaks[3:], counter.now, backward_in


LLAMA_N = 1024


@pytest.mark.slow  # two compilations of a two-layer model: about a minute
def test_a_compiled_hugging_face_llama_training_step_equals_a_replay_of_its_wrapper():
    """Its loss and AdamW, compiled whole as ``torch.compile`` compiles a step function."""
    with torch.device("meta"):
        step = LlamaStep()
    saved, forward, backward, optimizer, _, backward_in = loop_reference(step)
    b = memcalc.trace(LlamaStep, inputs={"input_ids": ("B", "N", "int64"),
                                    "labels": ("B", "N", "int64")},
                      batch=1, seq_len=LLAMA_N, optimizer="adamw", compile="default")
    # resident from before the counter starts: the parameters (float32; none tied: the
    # embedding and lm_head 1024 x 256 each, per layer q, k, v, o 256 x 256, gate, up
    # 512 x 256, down 256 x 512, two RMSNorms 256, and the final norm 256), the rotary
    # embedding's inv_freq and original_inv_freq (32 floats each: a 512 B block each), and
    # the two threads' cuBLAS workspaces; each block a multiple of 512 B
    layer = 4 * (4 * 256 * 256 + 3 * 512 * 256 + 2 * 256)  # 2,623,488
    params = 4 * 2 * 1024 * 256 + 2 * layer + 4 * 256  # 7,345,152
    start = params + 2 * 512 + 2 * 32 * MiB  # 74,455,040
    assert backward_in is not EFFICIENT_BACKWARD
    assert b.saved_bytes == saved
    assert (b.forward_peak_bytes, b.backward_peak_bytes, b.optimizer_peak_bytes) == (
        start + forward, start + backward, start + optimizer)
