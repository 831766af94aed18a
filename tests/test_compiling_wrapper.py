"""``memcalc.compiling.wrapper``: the lines of inductor's generated wrapper named by the
buffer, the kernel that writes it and the user's line."""

import pytest

pytest.importorskip("torch")

from memcalc.compiling.wrapper import attribution, user_line  # noqa: E402

# the shape of inductor's wrapper code (torch/_inductor/codegen/wrapper.py), cut down
SOURCE = """\
    def call(self, args):
        primals_1, primals_2 = args
        buf0 = empty_strided_cuda((8, 128, 1), (128, 1, 1), torch.float32)
        buf1 = empty_strided_cuda((8, 128, 1), (128, 1, 1024), torch.float32)
        buf3 = reinterpret_tensor(buf1, (8, 128, 1), (128, 1, 1), 0); del buf1  # reuse
        # Topologically Sorted Source Nodes: [layer_norm], Original ATen: [aten.native_layer_norm]
        triton_per_fused_native_layer_norm_0.run(buf3, primals_1, buf0, 1024, 256, stream=raw_stream0)
        buf5 = empty_strided_cuda((1024, 1024), (1024, 1), torch.float32)
        # Topologically Sorted Source Nodes: [layer_norm, linear], Original ATen: [aten.addmm]
        extern_kernels.addmm(primals_2, buf3, buf3, alpha=1, beta=1, out=buf5)
        buf6 = empty_strided_cuda((4, ), (1, ), torch.float32)
        return (buf5, buf0, buf6)
"""
ORIGINS = {"layer_norm": ("model.py:12", "h = self.ln(x)"),
           "linear": ("model.py:13", "return self.fc(h)")}


def test_a_buffer_is_named_by_the_kernel_that_writes_it_and_the_users_line():
    lines = attribution(SOURCE, ORIGINS)
    assert lines[3][:2] == ("buf0 by triton_per_fused_native_layer_norm_0 at model.py:12",
                        "h = self.ln(x)")
    assert lines[8][:2] == ("buf5 by addmm at model.py:13", "return self.fc(h)")


def test_a_reused_buffer_is_named_by_the_kernel_that_writes_its_new_name():
    assert attribution(SOURCE, ORIGINS)[4][0] == (
        "buf1 by triton_per_fused_native_layer_norm_0 at model.py:12")


def test_a_buffer_no_kernel_writes_is_inductors():
    assert attribution(SOURCE, ORIGINS)[11][:2] == ("buf6 by inductor", "")


def test_a_kernel_line_is_named_by_its_kernel():
    assert attribution(SOURCE, ORIGINS)[10][0] == "addmm at model.py:13"


def test_user_line_is_the_last_frame_of_a_stack_trace():
    trace = ('  File "/home/u/model.py", line 20, in forward\n    return self.block(x)\n'
             '  File "/home/u/block.py", line 7, in forward\n    y = self.fc(x)\n')
    assert user_line(trace) == ("block.py:7", "y = self.fc(x)")
    assert user_line(None) == ("", "")


def test_a_kernel_computing_only_recomputed_forward_nodes_says_so():
    """In a backward's wrapper, the partitioner's recomputed forward nodes (tagged
    ``is_forward``) mark their kernel's buffers as recomputed; a kernel that also computes
    a backward node does not."""
    lines = attribution(SOURCE, ORIGINS, frozenset({"layer_norm"}))
    assert lines[3] == ("buf0 by triton_per_fused_native_layer_norm_0 at model.py:12",
                        "h = self.ln(x)", True)
    assert lines[8] == ("buf5 by addmm at model.py:13", "return self.fc(h)", False)  # linear
