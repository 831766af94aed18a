"""CUDA autocast on the meta device (``memcalc/tracing/autocast.py``): CUDA's policy, the
cast cache, and the region written in the code or asked for with ``--autocast``."""

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from memcalc.cli import main  # noqa: E402
from memcalc.config import make_config  # noqa: E402
from memcalc.engine.inputs import inputs_of  # noqa: E402
from memcalc.tracing import Calling, TraceError, TraceOptions, load_function, trace, traced  # noqa: E402
from memcalc.tracing.autocast import policy_of  # noqa: E402
from memcalc.validation import figures_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NANOGPT = f"{ROOT}/examples/attention/nanogpt.py"
X = Calling(inputs_of(["x=B,N,768"]))
A100 = dict(seq_len=256, batch=2, gpu="a100-40gb")


def test_the_policy_by_release():
    assert policy_of("linear", (2, 13)) == "lower" and policy_of("__matmul__", (2, 4)) == "lower"
    assert policy_of("softmax", (2, 13)) == "set_opt_dtype"
    assert policy_of("layer_norm", (2, 13)) == "fp32" and policy_of("addcmul", (2, 13)) == "promote"
    assert policy_of("rms_norm", (2, 12)) == "fp32" and policy_of("rms_norm", (2, 11)) is None
    assert policy_of("gelu", (2, 13)) is None


def test_autocast_in_the_code_equals_autocast_around_it():
    """nanoGPT under --autocast bf16 and with torch.autocast in its forward: the same step;
    SDPA takes flash on the A100 (bf16 inside autocast) and the weights' casts are listed."""
    config = make_config(**A100)
    around = traced(load_function(f"{NANOGPT}:CausalSelfAttention"), config,
                    calling=Calling(X.inputs, "bfloat16"))
    inside = traced(load_function(f"{NANOGPT}:MixedPrecision"), config, calling=X)
    assert figures_of(around.breakdown) == figures_of(inside.breakdown)
    assert around.kernels == ("flash",)
    names = {c.name.split(" (nanogpt")[0] for c in around.breakdown.saved}
    assert {"autocast c_attn.weight as bfloat16 (cached)",
            "autocast c_proj.weight as bfloat16 (cached)"} <= names
    cast = next(c for c in around.breakdown.saved if c.name.startswith("autocast c_attn.weight"))
    assert (cast.dtype, cast.bytes) == ("bfloat16", 2304 * 768 * 2)  # 3,538,944


def _casts(fn, calling, **options):
    """The allocations the trace's autocast made (by name), over the whole run."""
    history = []
    traced(fn, make_config(**{**A100, **options}), history=history, calling=calling)
    return [e.component.name.split(" (test_")[0] for e in history
            if e.kind == "alloc" and e.component.name.startswith("autocast")]


class TwiceInOneRegion(torch.nn.Module):
    """One weight used by two linears in one autocast region: cast once (the cache)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(16, 16, device="meta"))

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, self.w)
            return torch.nn.functional.linear(y, self.w)


class TwoRegions(TwiceInOneRegion):
    """The same, each linear in its own region: the cache is cleared between them."""

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x, self.w)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.nn.functional.linear(y, self.w)


def test_a_parameters_cast_is_made_once_per_region():
    calling = Calling(inputs_of(["x=B,N,16"]), None)
    # per step (warm-up and measured): x's cast (a leaf that needs grad: cached too), w's
    assert _casts(TwiceInOneRegion(), calling) == 2 * ["autocast x as bfloat16 (cached)",
                                                       "autocast w as bfloat16 (cached)"]
    # the second region casts w again, and y (bf16 already) not at all
    assert _casts(TwoRegions(), calling) == 2 * ["autocast x as bfloat16 (cached)",
                                                 "autocast w as bfloat16 (cached)",
                                                 "autocast w as bfloat16 (cached)"]


def test_softmax_runs_in_float32_and_the_next_matmul_casts_back():
    def attn(q, k, v):
        with torch.autocast("cuda", dtype=torch.float16):
            p = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            assert p.dtype is torch.float32  # fp32_set_opt_dtype
            out = p @ v
            assert out.dtype is torch.float16
            return out

    b = trace(attn, make_config(seq_len=128, batch=1, heads=2, head_dim=16))
    p = [c for c in b.saved if c.shape == (1, 2, 128, 128)]
    # the scores' fp16 softmax to float32 is one fused kernel (half_to_float); its fp16 cast
    # for the last matmul is saved by it
    assert sorted(c.dtype for c in p) == ["float16", "float32"]


def test_cross_entropy_keeps_log_softmax_in_the_input_dtype():
    """cross_entropy_loss: log_softmax(x, 1, x.dtype) stays bf16, nll_loss casts it to
    float32 (LossNLL.cpp under autocast_mode.cpp's fp32 policy)."""
    def loss(logits, target):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return torch.nn.functional.cross_entropy(logits, target)

    calling = Calling(inputs_of(["logits=N,1000:bf16", "target=N:int64:zeros"]))
    b = trace(loss, make_config(seq_len=512, batch=1), calling=calling)
    saved = sorted((c.op, c.dtype) for c in b.saved if c.shape == (512, 1000))
    assert saved == [("_log_softmax", "bfloat16"), ("_to_copy", "float32")]


def test_autocast_off_inside_a_region_runs_as_written():
    def attn(q, k, v):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autocast("cuda", enabled=False):
                return q @ k.transpose(-2, -1) @ v

    b = trace(attn, make_config(seq_len=64, batch=1))
    assert {c.dtype for c in b.components if c.role.value in ("saved", "output")} == {"float32"}


def test_autocast_needs_the_cuda_paths():
    with pytest.raises(TraceError, match="--autocast: autocast is CUDA's"):
        traced(lambda q, k, v: q, make_config(), TraceOptions(cuda=False),
               calling=Calling(autocast="bfloat16"))


def test_bf16_into_float32_weights_without_autocast_is_refused_with_the_gpus_message(capsys):
    code = main(["trace", f"{NANOGPT}:CausalSelfAttention", "--input", "x=B,N,768:bf16",
                 "--seq", "64", "--batch", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert ("line 58 of nanogpt.py (q, k, v  = self.c_attn(x).split(self.n_embd, dim=2)): on a "
            "GPU this raises RuntimeError: mat1 and mat2 must have the same dtype, but got "
            "BFloat16 and Float") in err


@pytest.mark.parametrize("value, message", [("fp32", "'fp32' is not an autocast dtype"),
                                            ("bf61", "'bf61' is not an autocast dtype")])
def test_autocast_takes_bf16_or_fp16(capsys, value, message):
    code = main(["trace", f"{NANOGPT}:CausalSelfAttention", "--input", "x=B,N,768",
                 "--autocast", value])
    assert code == 2 and f"--autocast: {message}" in capsys.readouterr().err
