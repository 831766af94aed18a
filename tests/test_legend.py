"""Who made each component ("made by"), and the legend of the naive family's short names."""

import io

import pytest
from rich.console import Console

from memcalc.engine.component import Component
from memcalc.options import PIPED_WIDTH
from memcalc.config import make_config
from memcalc.output.legend import legend, made_by
from memcalc.output.render import markdown, text
from memcalc.engine.program import Role
from memcalc.analysis.predict import predict


SYMBOLS = "s scores, m row max, e = exp_x = exp(s - m), r = row_sum, p = e / r"
GRADS = "dX is the grad of X"
TERMS = ("e/r, e/r/r, -dp and -dp*e/r/r are the terms of DivBackward0's grad of r = -dp * e / r^2 "
         "(torch's derivatives.yaml)")
LEGEND = f"names: {SYMBOLS}; {GRADS}; {TERMS}"  # naive's table shows names of all three parts


def component(name: str, op: str, role: Role = Role.temporary) -> Component:
    return Component(name=name, role=role, op=op, shape=(1, 16, 16), dtype="float32",
                     bytes=1024, allocated=1024)  # 1 x 16 x 16 x 4 B


def test_made_by_reads_the_node_from_the_name_and_its_op():
    """The same name is made by different nodes depending on the op that allocated it."""
    assert made_by(component("e/r", "div")) == "DivBackward0: grad of r (e / r)"
    assert made_by(component("dscores", "add")) == "autograd engine: the two grads of s added"
    assert made_by(component("dscores", "_softmax_backward_data")) == "SoftmaxBackward0: grad of s"


def test_made_by_an_unknown_name_or_op_is_the_op():
    assert made_by(component("p", "mul")) == "mul"  # "p" is known only from div and _softmax
    assert made_by(component("softmax", "_softmax")) == "_softmax"  # sdpa-math's name


@pytest.mark.parametrize("name, op", [("q", "randn"), ("grad_out", "randn"), ("ids", "ones")])
def test_the_inputs_are_made_by_their_fill(name, op):
    assert made_by(component(name, op, Role.input)) == f"input ({op})"


def test_a_cublas_workspace_is_made_by_the_handle_pool():
    assert made_by(component("cuBLAS workspace, main thread", "cublas")) == "cuBLAS handle pool"


@pytest.mark.parametrize("names, parts", [
    (["e/r"], [SYMBOLS, TERMS]),  # e/r is one of r's terms, written with e and r
    (["-dp"], [TERMS]),
    (["exp_x", "row_sum"], [SYMBOLS]),
    (["dp/r"], [SYMBOLS, GRADS]),
    (["dscores"], [GRADS]),  # naive-softmax's: none of the exp/sum names
    (["ds", "dsm"], [GRADS]),  # naive-weights'
    (["exp_x", "dp", "-dp*e/r/r"], [SYMBOLS, GRADS, TERMS]),
])
def test_the_legend_explains_the_short_names_shown(names, parts):
    shown = [component("q", "randn"), *(component(n, "div") for n in names)]
    assert legend(shown) == ["names: " + "; ".join(parts)]


def test_no_legend_without_short_names():
    # flash2's components: nothing the legend explains
    shown = [component(n, "empty_like") for n in ("q", "out", "delta", "dq", "dk", "dv", "lse")]
    assert legend(shown) == [] and legend([]) == []


@pytest.mark.parametrize("width", [60, 80, 120])
def test_legend_is_shown_whole_at_every_width(width):
    """The legend is a note under the components table: wrapped, never cut, at any width,
    of the parts the table needs; a table without the short names (flash2) has none."""
    config = dict(seq_len=256, batch=1)  # naive's peak holds e/r, -dp, exp_x: 1 x 256 x 256
    for impl, shown in (("naive", LEGEND), ("naive-softmax", f"names: {GRADS}"), ("flash2", None)):
        console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
        console.print(predict(make_config(impl=impl, **config)))
        out = console.export_text()
        assert max(len(line) for line in out.splitlines()) <= width
        words = " ".join(out.split())
        assert words.count("names: ") == (shown is not None), impl
        assert shown is None or shown in words, impl
        assert (TERMS in words) == (impl == "naive"), impl  # naive-softmax's is one part


def test_plain_text_and_markdown_show_who_made_each_component():
    b = predict(make_config(impl="naive", seq_len=256, batch=1))
    # piped (a file, a pipe): PIPED_WIDTH = 200 columns. The legend is 211 characters:
    # 193 + 1 space + 17 for its last word, "derivatives.yaml)", which wraps to a line alone
    head, last = LEGEND.rsplit(" ", 1)
    assert (len(LEGEND), len(head), last) == (211, 193, "derivatives.yaml)")
    piped = [line.rstrip() for line in text(b, width=PIPED_WIDTH).splitlines()]
    assert piped[piped.index(head) + 1] == last
    md = markdown(b)  # --markdown: each note a paragraph of its own, never wrapped, its *
    assert f"\n{LEGEND.replace('*', chr(92) + '*')}\n" in md  # escaped (no emphasis)
    assert "| e/r | DivBackward0: grad of r (e / r) | temporary |" in md
    assert "| q | input (randn) | input |" in md
    assert "| cuBLAS workspace, main thread | cuBLAS handle pool | workspace |" in md


@pytest.mark.parametrize("name, op, said", [
    ("flash dq_accum (ScaledDotProductFlashAttentionBackward)", "empty",
     "flash kernel: backward: float32 accumulator of dq"),
    ("dq_accum", "empty", "fused kernel: backward: float32 accumulator of dq"),  # the model's
    ("efficient dout_t (ScaledDotProductEfficientAttentionBackward)", "contiguous",
     "efficient kernel: backward: grad_out copied to the kernel's layout"),
    ("dq", "bmm", "BmmBackward0: grad of q"),  # naive's dq: not a kernel's
])
def test_a_fused_kernels_tensors_say_what_they_are(name, op, said):
    """Not ``empty`` or ``contiguous``, the allocator call that made them."""
    assert made_by(component(name, op)) == said
