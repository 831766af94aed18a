"""The compiled graphs moved from the meta device, where they are traced, to CUDA.

AOTAutograd builds the joint forward-and-backward graph by running autograd on fake
tensors, which on a ``cuda`` fake tensor asks the CUDA driver for the device (the autograd
engine's device threads): there is none here. So the joint graph is traced on ``meta``,
whose kernels give every shape, and moved to ``cuda`` before inductor looks at it: the
constants naming a device are rewritten and every node's fake value propagated again from
``cuda`` inputs (``to_cuda``). Inductor's joint passes, the partitioner and the lowering
then see the graph a GPU run would give them. On meta, inductor's joint passes would
instead fold the graph away (a meta tensor holds no values).
"""

from __future__ import annotations

import torch
from torch.fx.node import map_aggregate

CUDA = torch.device("cuda", 0)


def _on_cuda(value):
    """A device argument naming meta, as CUDA device 0."""
    if isinstance(value, torch.device) and value.type == "meta":
        return CUDA
    if isinstance(value, str) and value == "meta":
        return CUDA
    return value


def cuda_inputs(mode, inputs) -> list:
    """``inputs`` (fake meta tensors) as fake CUDA tensors of the same layout, in ``mode``."""
    with mode:
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=CUDA)
                .requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                for t in inputs]


def to_cuda(gm: torch.fx.GraphModule, inputs=None) -> list:
    """Move ``gm`` to CUDA in place: device arguments rewritten, fake values propagated
    again from CUDA versions of ``inputs`` (its placeholders' values when not given).
    Returns the CUDA inputs."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if inputs is None:
        inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    for node in gm.graph.nodes:
        node.args = map_aggregate(node.args, _on_cuda)
        node.kwargs = map_aggregate(node.kwargs, _on_cuda)
    gm.recompile()
    mode = detect_fake_mode(inputs)
    moved = cuda_inputs(mode, inputs)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*moved)
    return moved
