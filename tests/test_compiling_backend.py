"""``memcalc.compiling.backend``: the joint graph AOTAutograd traces on the meta device
differentiates as it would on CUDA."""

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch._C import DispatchKey  # noqa: E402

from memcalc.compiling.backend import _composites_decomposed, _shadowing_composites  # noqa: E402


def backward_graph(fn, *inputs) -> str:
    """The code of ``fn``'s backward graph as AOTAutograd traces it on the meta device
    (the backward lowered with the forward, as a compiled trace does)."""
    import torch._dynamo
    import torch._functorch.config as functorch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes = []

    def backward(gm, example_inputs):
        codes.append(gm.code)
        return make_boxed_func(gm.forward)

    def joint(gm, example_inputs):
        with _composites_decomposed():
            return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward),
                                bw_compiler=backward)(gm, example_inputs)

    torch._dynamo.reset()
    with functorch.patch(force_non_lazy_backward_lowering=True):
        torch.compile(fn, backend=joint, dynamic=False)(*inputs)
    torch._dynamo.reset()
    return codes[0]


def test_a_loss_differentiates_on_meta_as_on_cuda():
    """cross_entropy's nll_loss has a Python meta kernel (``activate_meta``); left in
    place, the backward AOTAutograd traced on meta returned None for the logits' grad."""
    x = torch.empty(16, 128, device="meta", requires_grad=True)
    target = torch.empty(16, dtype=torch.int64, device="meta")
    code = backward_graph(lambda x, t: F.cross_entropy(x, t), x, target)
    assert "nll_loss_backward" in code and "tangents_1" in code.split("return")[0]


def test_the_meta_kernels_are_put_back():
    nll_loss = torch.ops.aten.nll_loss.default
    assert nll_loss in _shadowing_composites()
    kernel = nll_loss.py_kernels[DispatchKey.Meta]
    with _composites_decomposed():
        assert DispatchKey.Meta not in nll_loss.py_kernels
    assert nll_loss.py_kernels[DispatchKey.Meta] is kernel
