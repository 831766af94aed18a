"""What a traced function keeps resident: a module's state, a function's module-level tensors."""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from memcalc.engine.program import Role  # noqa: E402
from memcalc.tracing import TraceError, load_function  # noqa: E402
from memcalc.tracing.state import instantiate, on_meta, referenced  # noqa: E402


def listed(fn) -> list[tuple]:
    """``(name, role, shape, device, bytes)`` of each tensor ``fn`` keeps resident, as the
    trace sees them; the bytes are its storage's, what the tracer counts."""
    with on_meta(fn) as state:
        return [(name, role, tuple(t.shape), t.device.type, t.untyped_storage().nbytes())
                for name, t, role in state]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.register_buffer("mask", torch.ones(1, 1, 8, 8))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)
        self.cache = torch.zeros(5)  # a plain attribute, not registered: not the module's state

    def forward(self, q, k, v):
        return q


BLOCK_STATE = [
    ("proj.weight", Role.parameter, (8, 4), "meta", 128),  # 8 x 4 x 4 B
    ("proj.bias", Role.parameter, (8,), "meta", 32),  # 8 x 4 B
    ("mask", Role.buffer, (1, 1, 8, 8), "meta", 256),  # 1 x 1 x 8 x 8 x 4 B
    ("scratch", Role.buffer, (3,), "meta", 12),  # 3 x 4 B, non-persistent: resident too
]


def test_a_modules_parameters_then_buffers_are_resident_in_their_roles():
    with torch.device("meta"):
        block = Block()
    assert listed(block) == BLOCK_STATE


def on_the_cpu():
    return Block()


def one_buffer_on_the_cpu():
    with torch.device("meta"):
        block = Block()
    block.register_buffer("host", torch.ones(2))
    return block


@pytest.mark.parametrize("build", [on_the_cpu, one_buffer_on_the_cpu])
def test_a_modules_state_off_the_meta_device_is_traced_there_and_left_as_it_was(build):
    """The step runs on meta copies of the state, and the user's module keeps its own
    tensors: ``module.to("meta")`` erased a notebook's trained weights."""
    block = build()
    before = {n: t for n, t in [*block.named_parameters(), *block.named_buffers()]}
    state = listed(block)
    host = [("host", Role.buffer, (2,), "meta", 8)]  # 2 x 4 B
    assert state == BLOCK_STATE + (host if build is one_buffer_on_the_cpu else [])
    after = {n: t for n, t in [*block.named_parameters(), *block.named_buffers()]}
    assert after.keys() == before.keys() and all(after[n] is t for n, t in before.items())
    assert any(t.device.type == "cpu" for t in after.values())


def write_module(tmp_path, body: str, uses: str | None = None):
    """A user file of module-level ``body`` and ``attn``, which refers to the names ``uses``
    (default: every name ``body`` binds)."""
    if uses is None:
        uses = ", ".join(line.split(" = ")[0] for line in body.splitlines())
    path = tmp_path / "user_state.py"
    path.write_text("import torch\nfrom torch import nn\n" + body
                    + f"def attn(q, k, v):\n    ({uses},)\n    return q\n")
    fn = load_function(f"{path}:attn")
    return fn, fn.__globals__


def test_a_functions_globals_count_meta_tensors_and_modules_not_host_data(tmp_path):
    """Module-level meta tensors are buffers, module-level modules (traced on meta copies)
    bring their parameters; a CPU tensor is the user's data on the host, not device memory."""
    fn, module = write_module(tmp_path, (
        "TABLE = torch.empty(2, 3, device='meta')\n"
        "HOST = torch.ones(4)\n"
        "proj = nn.Linear(2, 2)\n"
        "Layer = nn.Linear\n"
        "SCALE = 0.5\n"))
    assert listed(fn) == [
        ("TABLE", Role.buffer, (2, 3), "meta", 24),  # 2 x 3 x 4 B
        ("proj.weight", Role.parameter, (2, 2), "meta", 16),  # 2 x 2 x 4 B
        ("proj.bias", Role.parameter, (2,), "meta", 8)]  # 2 x 4 B
    assert module["HOST"].device.type == "cpu" and module["proj"].weight.device.type == "cpu"


def test_only_the_names_the_function_refers_to_are_its_state(tmp_path):
    """A notebook's namespace holds every model the user has loaded: only what ``attn``
    refers to counts (through the module's functions it calls), and the rest is left
    alone (it was moved to the meta device, its weights erased, and counted)."""
    fn, module = write_module(tmp_path, (
        "TABLE = torch.empty(2, 3, device='meta')\n"
        "proj = nn.Linear(2, 2)\n"
        "unused = nn.Linear(3, 3)\n"
        "def helper(x):\n"
        "    return proj(x)\n"), uses="helper")
    assert [name for name, _ in referenced(fn)] == ["proj", "helper"]
    assert listed(fn) == [("proj.weight", Role.parameter, (2, 2), "meta", 16),  # 2 x 2 x 4 B
                          ("proj.bias", Role.parameter, (2,), "meta", 8)]  # 2 x 4 B
    assert module["unused"].weight.device.type == "cpu"


def test_each_storage_counts_once_under_its_first_name(tmp_path):
    """A view of a module-level tensor, a module under a second name and a module's own
    weight bound to a name all share storages that are already counted."""
    fn, _ = write_module(tmp_path, (
        "TABLE = torch.empty(4, 4, device='meta')\n"
        "ROW = TABLE[1]\n"
        "proj = nn.Linear(2, 2, bias=False, device='meta')\n"
        "alias = proj\n"
        "WEIGHT = proj.weight\n"))
    assert listed(fn) == [
        ("TABLE", Role.buffer, (4, 4), "meta", 64),  # 4 x 4 x 4 B, ROW's storage too
        ("proj.weight", Role.parameter, (2, 2), "meta", 16)]  # 2 x 2 x 4 B, once


class Tied(nn.Module):
    """A language model's embedding and output head sharing one weight."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.embed = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, width, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, q, k, v):
        return q


def test_a_module_built_on_the_cpu_keeps_its_tied_weights_on_the_meta_device():
    """Moved to meta, the shared weight is still one tensor: counted once, and on a GPU its
    two uses accumulate into one grad. (``module.to("meta")`` alone made one per module.)"""
    model = Tied(4)  # small enough to build on the CPU
    assert listed(model) == [
        ("embed.weight", Role.parameter, (4, 4), "meta", 64)]  # 4 x 4 x 4 B, once
    assert model.head.weight is model.embed.weight
    assert not torch.__future__.get_swap_module_params_on_conversion()  # left as it was


def test_a_module_level_parameter_is_a_parameter(tmp_path):
    """Not a buffer: the harness clears a parameter's grad after the warm-up, as for a
    module's (a buffer's role left the warm-up's grad counted in the measured step)."""
    fn, _ = write_module(tmp_path, "W = nn.Parameter(torch.empty(3, 4, device='meta'))\n")
    assert listed(fn) == [("W", Role.parameter, (3, 4), "meta", 48)]  # 3 x 4 x 4 B


def test_a_module_class_is_built_on_the_meta_device():
    """Built there, its state never materializes and its tied weight stays one tensor."""
    model = instantiate(Tied, "user.py:Tied")
    assert isinstance(model, Tied) and model.head.weight is model.embed.weight
    assert model.embed.weight.device.type == "meta"
    assert listed(model) == [
        ("embed.weight", Role.parameter, (1024, 1024), "meta", 4_194_304)]  # 1024 x 1024 x 4 B


class NeedsDim(nn.Module):
    def __init__(self, dim):
        super().__init__()


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.n = int(torch.zeros(1).item())


class SaysTwoLines(nn.Module):
    def __init__(self):
        raise ValueError("first line\nsecond line")


@pytest.mark.parametrize("cls, why", [
    (NeedsDim, "TypeError: NeedsDim.__init__() missing 1 required positional argument: 'dim'"),
    (ReadsAValue, "RuntimeError: Tensor.item() cannot be called on meta tensors"),
    (SaysTwoLines, "ValueError: first line"),
])
def test_a_constructor_failing_on_meta_is_a_one_line_trace_error(cls, why):
    """A ``ValueError`` (TraceError) of one line naming the target, the class and the
    constructor's own error, without the chained traceback of the user's code."""
    with pytest.raises(TraceError) as info:
        instantiate(cls, "user.py:Attn")
    assert str(info.value) == (f"--trace user.py:Attn: {cls.__name__}() failed on the meta "
                               f"device: {why} (the module must be constructible without "
                               "arguments)")
    assert isinstance(info.value, ValueError) and info.value.__suppress_context__


CACHED = '''
import functools
import math

import torch

P = 1024
_buf, _list, _global = {}, [], None


class _Holder:
    pass


holder = _Holder()


def _attend(q, k, v, mask):
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    att = att.masked_fill(mask[: q.size(-2), : q.size(-2)] == 0, float("-inf"))
    return torch.softmax(att, -1) @ v


def _built(q):
    return torch.tril(torch.ones(P, P, device=q.device))


def in_global(q, k, v):
    global _global
    if _global is None:
        _global = _built(q)
    return _attend(q, k, v, _global)


def in_dict(q, k, v):
    if "bias" not in _buf:
        _buf["bias"] = _built(q)
    return _attend(q, k, v, _buf["bias"])


def in_list(q, k, v):
    if not _list:
        _list.append(_built(q))
    return _attend(q, k, v, _list[0])


@functools.lru_cache
def _mask(n, device):
    return torch.tril(torch.ones(n, n, device=device))


def in_lru_cache(q, k, v):
    return _attend(q, k, v, _mask(P, q.device))


def on_object(q, k, v):
    if not hasattr(holder, "bias"):
        holder.bias = _built(q)
    return _attend(q, k, v, holder.bias)
'''


def test_state_a_first_call_builds_in_place_is_built_by_the_warm_up(tmp_path):
    """GPT-2's ``_attn`` written as a function caches its causal mask on first use: in a
    module-level dict, a list, an ``lru_cache``'d builder or on an object, as a rebound
    global does. The scratch forward that learns grad_out's shape filled those in place,
    so the warm-up found the mask made, and its storage was first seen at a slice in the
    measured step, in another segment. Each is now emptied after the scratch forward:
    every kind traces as the global does (the mask, 1,024 x 1,024 x 4 B, built by the
    warm-up and alive at the backward peak), and the user's objects are left empty."""
    import memcalc
    from memcalc.tracing import load_function

    (tmp_path / "cached.py").write_text(CACHED)
    figures = {}
    for name in ("in_global", "in_dict", "in_list", "in_lru_cache", "on_object"):
        fn = load_function(f"{tmp_path}/cached.py:{name}")
        b = memcalc.trace(fn, seq_len=333, batch=2, heads=3, head_dim=64, gpu="a100-80gb")
        masks = [c for c in b.backward_live if c.name.startswith("tril")]
        assert [c.bytes for c in masks] == [1024 * 1024 * 4], name
        figures[name] = b.figures()
    assert all(f == figures["in_global"] for f in figures.values())
    module = fn.__globals__
    assert module["_buf"] == {} and module["_list"] == [] and module["_global"] is None
    assert module["_mask"].cache_info().currsize == 0 and not hasattr(module["holder"], "bias")
