"""FSDP2 in a trace (``memcalc/tracing/fsdp.py``): torch's own ``fully_shard`` code run as
each rank on a fake process group on the meta device, its buffers on streams of their own."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402
from memcalc.engine.program import Role  # noqa: E402
from memcalc.tracing.errors import TraceError  # noqa: E402
from memcalc.tracing.fsdp import Sharding, blocks, sharding_of  # noqa: E402

from cli_helpers import run  # noqa: E402

INPUTS = {"x": ("B", "N", 30)}


class Stack(torch.nn.Module):
    """Two layers of ``Linear(30, 10)`` then ``Linear(10, 30)``, on 30 features."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(30, 10), torch.nn.ReLU(), torch.nn.Linear(10, 30))
            for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _trace(**options):
    return memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw",
                         **options)


def _bytes(b, role: Role, phase: str = "optimizer_live") -> dict[str, int]:
    return {c.name: c.bytes for c in getattr(b, phase) if c.role is role}


def test_the_repeated_layers_are_torchtitans_units():
    stack = Stack()
    assert blocks(stack) == list(stack.layers)
    assert sharding_of(None) is None
    assert sharding_of(4) == Sharding(4)
    with pytest.raises(ValueError, match=r"--fsdp: FSDP ranks, a whole number of at least 1 "
                                         r"\(got 0\)"):
        sharding_of(0)
    with pytest.raises(ValueError, match=r"--reshard-after-forward: one of default, always, "
                                         r"never \(got 'alway'\) \(did you mean 'always'\?\)"):
        sharding_of(2, "alway")


def test_a_rank_holds_its_padded_shard_and_adamws_moments_of_its_own_rows():
    """Over 4 ranks a (10, 30) weight is chunked ceil(10 / 4) = 3 rows a rank: 3, 3, 3, 1.
    Every rank keeps the shard padded to 3 rows (3 x 30 x 4 B = 360 B; the bias 3 x 4 =
    12 B); AdamW's two moments are of the rank's own rows: rank 0 3 rows, rank 3 one."""
    shown = _trace(fsdp=4)
    assert shown.rank == 0 and len(shown.rank_peaks) == 4
    params = _bytes(shown, Role.parameter)
    assert params["layers.0.0.weight"] == 3 * 30 * 4  # padded shard
    assert params["layers.0.0.bias"] == 3 * 4
    assert params["layers.0.2.weight"] == 8 * 10 * 4  # (30, 10): ceil(30 / 4) = 8 rows
    state = _bytes(shown, Role.optimizer_state)
    assert state["layers.0.0.weight: exp_avg"] == state["layers.0.0.weight: exp_avg_sq"] \
        == 3 * 30 * 4
    # rank 0's whole state: 2 moments x (2 layers x (3x30 + 3 + 8x10 + 8) elements) x 4 B
    assert sum(state.values()) == 2 * 2 * (90 + 3 + 80 + 8) * 4  # 2,896 B
    # rank 3 keeps 1 row of each (10, 30) weight and 6 of each (30, 10) one (30 - 3 x 8):
    # 2 x 2 x (30 + 1 + 60 + 6) x 4 B = 1,552 B
    last = _rank(3)
    assert sum(_bytes(last, Role.optimizer_state).values()) == 2 * 2 * (30 + 1 + 60 + 6) * 4
    assert _bytes(last, Role.parameter) == params  # the padded shards are alike


def _rank(rank: int, history: list | None = None):
    """Rank ``rank``'s step of ``Stack`` under FSDP over 4 ranks, with AdamW."""
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, register_function, traced
    from memcalc.tracing.optimizers import loop_of

    calling = Calling(inputs_of(["x=B,N,30"], []), loop=loop_of("adamw"), fsdp=Sharding(4))
    config = memcalc.make_config(impl=register_function(Stack(), "Stack", calling),
                                 seq_len=8, batch=2)
    return traced(Stack(), config, TraceOptions(), history=history, calling=calling,
                  rank=rank).breakdown


def test_the_all_gather_buffers_are_named_and_sized():
    """A layer's all-gather buffer holds every rank's padded shards: 4 x (3 x 30 + 3 + 8 x
    10 + 8) float32 = 4 x 181 x 4 B = 2,896 B; the unsharded parameters are named after
    theirs, and are gone from the forward's live set once a layer reshards (the first of
    two, by torchtitan's default)."""
    history = []
    _rank(0, history)
    made = {e.component.name: e.component for e in history
            if e.kind == "alloc" and e.component is not None}
    buffer = made["all-gather buffer (layers.0)"]
    assert buffer.bytes == 4 * (3 * 30 + 3 + 8 * 10 + 8) * 4 and buffer.role is Role.collective
    # 1-D, every rank's padded rows: 4 x 3 x 30
    assert made["layers.1.0.weight (unsharded)"].shape == (360,)
    # resharded after each forward (layers.0, by the default policy) and after each
    # backward: each of its allocations is freed (FSDP resizes the storage to 0)
    unsharded = [e.kind for e in history
                 if e.component is not None and e.component.name == "layers.0.0.weight (unsharded)"]
    # gathered in the forward and again in the backward, of the warm-up and the measured step
    assert unsharded.count("alloc") == unsharded.count("free") == 4
    assert made["reduce-scatter input (layers.1)"].bytes == buffer.bytes
    assert made["reduce-scatter output (layers.1): sharded grads"].bytes == buffer.bytes // 4


def test_a_rank_peaks_below_one_gpu_holding_it_all():
    one, four = _trace(), _trace(fsdp=4)
    assert four.peak_bytes < one.peak_bytes


def test_the_cli_says_which_rank_and_refuses_fsdp_options_alone(capsys):
    code, out, err = run(capsys, "trace", f"{__file__}:Stack", "--input", "x=B,N,30",
                         "--seq", "8", "--batch", "2", "--optimizer", "adamw", "--fsdp", "4")
    assert code == 0, err
    assert "adamw fsdp=4, rank 0 of 4 on" in out
    code, out, err = run(capsys, "trace", f"{__file__}:Stack", "--input", "x=B,N,30",
                         "--seq", "8", "--fsdp-param-dtype", "bf16")
    assert code == 2
    assert err.strip().endswith("--fsdp-param-dtype bf16: an FSDP option; give --fsdp P")


def test_a_function_is_refused():
    def attention(q, k, v):
        return q

    with pytest.raises(ValueError, match="--fsdp: FSDP shards an nn.Module's parameters"):
        memcalc.trace(attention, seq_len=8, fsdp=2)


def test_tensor_parallelism_with_it_is_refused_and_cp_needs_the_same_ranks():
    with pytest.raises(ValueError, match="--fsdp 2 --tp 2: --tp splits the heads of a "
                                         "built-in implementation"):
        memcalc.trace(Stack, inputs=INPUTS, seq_len=8, heads=2, fsdp=2, tp=2)
    with pytest.raises(ValueError, match="--fsdp-tp 2: a tensor-parallel plan is the model's "
                                         "own; give --fsdp-apply"):
        memcalc.trace(Stack, inputs=INPUTS, seq_len=8, fsdp=2, fsdp_tp=2)
    with pytest.raises(ValueError, match="--fsdp 2 --cp 4: FSDP and context parallelism run "
                                         "over the same ranks here"):
        memcalc.trace(Stack, inputs=INPUTS, seq_len=16, fsdp=2, cp=4)


def test_one_rank_is_traced_when_asked():
    """``Calling.rank``: only that rank's step (validation checks each rank's program)."""
    shown = _rank(3)
    assert shown.rank is None  # one rank traced: no ranking
    state = _bytes(shown, Role.optimizer_state)
    assert state["layers.0.0.weight: exp_avg"] == 1 * 30 * 4  # rank 3's one row


def test_oom_solves_each_number_of_ranks_in_a_row_of_its_own(capsys):
    """``oom --trace --fsdp 2,4``: one fitted program per P, a row each; the title leaves
    the ranks to the rows."""
    code, out, err = run(capsys, "oom", "--trace", f"{__file__}:Stack", "--input",
                         "x=B,N,30", "--batch", "2", "--optimizer", "adamw", "--fsdp", "2,4",
                         "--gpu-gb", "1", "--reserve", "0", "--csv")
    assert code == 0, err
    rows = [line.split(",")[0] for line in out.splitlines()[1:]]
    assert rows == [f"trace:{__file__}:Stack fsdp=2", f"trace:{__file__}:Stack fsdp=4"]


def test_a_model_already_sharded_is_refused():
    """Its construction needed a process group; --fsdp shards the unsharded model per rank."""
    from memcalc.tracing.context_parallel import Ranks, fake_group
    from memcalc.tracing.fsdp import shard

    with fake_group(Ranks(2, 0)):
        with torch.device("meta"):
            model = Stack()
        shard(model, Sharding(2), device="cpu")  # a mesh on the CPU: no device handle needed
        with pytest.raises(TraceError, match="--fsdp: the model is already sharded"):
            shard(model, Sharding(2), device="cpu")


def test_the_process_groups_leave_the_excepthook_as_they_found_it():
    """``init_process_group`` wraps ``sys.excepthook`` for good (a ``[rank0]: `` prefix on
    every line of a later traceback, one more per group set up): each rank's fake group puts
    it back."""
    import sys

    hook = sys.excepthook
    _trace(fsdp=2)
    assert sys.excepthook is hook


def test_sweep_tabulates_each_number_of_ranks(capsys):
    """``sweep --trace --fsdp 2,4``: a series per P, each its fitted program's figures,
    which a direct trace of that P gives too."""
    code, out, err = run(capsys, "sweep", "--trace", f"{__file__}:Stack", "--input",
                         "x=B,N,30", "--batch", "2", "--optimizer", "adamw", "--fsdp", "2,4",
                         "--seq", "300", "--bytes", "--csv")
    assert code == 0, err
    header, *rows = out.splitlines()
    names = header.split(",")
    table = {r.split(",")[0]: dict(zip(names, r.split(","))) for r in rows}
    assert list(table) == [f"trace:{__file__}:Stack fsdp=2", f"trace:{__file__}:Stack fsdp=4"]
    four = memcalc.trace(Stack, inputs=INPUTS, seq_len=300, batch=2, optimizer="adamw", fsdp=4)
    assert int(table[f"trace:{__file__}:Stack fsdp=4"]["peak_bytes"]) == four.peak_bytes


def shard_each_linear(model, mesh):
    """A user's own ``apply_fsdp``: every Linear its own group, none resharded after the
    forward, then the root."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


def test_the_users_own_fully_shard_calls_are_traced_as_written():
    """``fsdp_apply``: each Linear a group (named after it), as the function wrote it; the
    policy options are its to decide."""
    history = []
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, register_function, traced
    from memcalc.tracing.optimizers import loop_of

    sharding = sharding_of(4, apply=shard_each_linear, apply_name="shard_each_linear")
    calling = Calling(inputs_of(["x=B,N,30"], []), loop=loop_of("adamw"), fsdp=sharding)
    config = memcalc.make_config(impl=register_function(Stack(), "Stack", calling),
                                 seq_len=8, batch=2)
    result = traced(Stack(), config, TraceOptions(), history=history, calling=calling)
    made = {e.component.name: e.component.bytes for e in history
            if e.kind == "alloc" and e.component}
    # layers.0.0 is Linear(30, 10): 4 ranks x (3 x 30 + 3) padded elements x 4 B = 1,488 B
    assert made["all-gather buffer (layers.0.0)"] == 4 * (3 * 30 + 3) * 4
    assert "all-gather buffer (layers.1.2)" in made
    assert any("FSDP2 as shard_each_linear applies it" in n for n in result.notes)
    with pytest.raises(ValueError, match="--fsdp-apply shard_each_linear: its own fully_shard "
                                         "calls decide resharding"):
        sharding_of(4, "never", apply=shard_each_linear, apply_name="shard_each_linear")
    with pytest.raises(ValueError, match="an FSDP option; give the number of ranks"):
        sharding_of(None, apply=shard_each_linear, apply_name="shard_each_linear")


def test_an_apply_that_shards_nothing_is_refused():
    with pytest.raises(ValueError, match=r"--fsdp-apply .*<lambda>: it called fully_shard "
                                         r"on nothing of the model"):
        memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, fsdp=2,
                      fsdp_apply=lambda model, mesh: None)


class Mlp(torch.nn.Module):
    """Two residual blocks of ``Linear(64, 256)``, ReLU, ``Linear(256, 64)``."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(MlpBlock() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class MlpBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def tensor_and_fully_sharded(model, mesh):
    """Megatron's MLP split over mesh["tp"] (up by columns, down by rows), each block then
    the root sharded over mesh["dp_shard"], as torchtitan's 2-D parallelism does."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    for block in model.layers:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])


def test_tensor_parallelism_inside_fsdp_ranks():
    """``--fsdp 2 --fsdp-tp 2`` over 4 ranks: up.weight (256, 64) split by columns over 2
    tensor-parallel ranks (128 rows), then its rows over 2 FSDP ranks: 64 x 64 x 4 B =
    16,384 B a rank, as are AdamW's moments of it; down.weight (64, 256) by rows (64 x
    128), then 32 x 128 x 4 B = 16,384 B."""
    shown = memcalc.trace(Mlp, inputs={"x": ("B", "N", 64)}, seq_len=8, batch=2,
                          optimizer="adamw", fsdp=2, fsdp_tp=2,
                          fsdp_apply=tensor_and_fully_sharded)
    assert len(shown.rank_peaks) == 4
    params = _bytes(shown, Role.parameter)
    assert params["layers.0.up.weight"] == 64 * 64 * 4
    assert params["layers.0.down.weight"] == 32 * 128 * 4
    state = _bytes(shown, Role.optimizer_state)
    assert state["layers.0.up.weight: exp_avg"] == 64 * 64 * 4


def test_a_ranks_signature_is_the_rows_fully_shard_gives_it():
    """Ranks are traced once per signature: it must be what torch's ``fully_shard`` hands
    each rank (``torch.chunk`` of dim 0), the uneven last rank included."""
    from memcalc.tracing.context_parallel import Ranks, fake_group
    from memcalc.tracing.fsdp import rank_signature, shard

    for rank in range(4):
        with fake_group(Ranks(4, rank)):
            with torch.device("meta"):
                model = Stack()
            expected = rank_signature(model, 4, rank)
            shard(model, Sharding(4), device="cpu")
            rows = tuple(p.to_local().shape[0] for p in model.parameters())
        assert rows == expected  # rank 3: 1 row of each (10, 30) weight, 6 of each (30, 10)


def shard_columns(model, mesh):
    """A user's own ``apply_fsdp`` that shards each weight by columns (``Shard(1)``): not
    the rows ``rank_signature`` predicts."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)


@pytest.mark.parametrize("apply, world, traces", [
    # Stack over 4 ranks, dim 0 chunked as fully_shard does: (10, 30) weights and (10,)
    # biases 3, 3, 3, 1 rows; (30, 10) and (30,) 8, 8, 8, 6: ranks 0 to 2 hold alike, rank
    # 3 otherwise: two kinds, two traces
    (shard_each_linear, 4, 2),
    # by columns over 2 ranks (30 / 2 and 10 / 2: FSDP takes no uneven columns), which the
    # prediction of rows does not hold for: every rank traced
    (shard_columns, 2, 2),
    (shard_each_linear, 2, 1),  # 5 and 15 rows on each of 2 ranks: one kind
])
def test_ranks_the_users_apply_shards_alike_are_traced_once(monkeypatch, apply, world,
                                                            traces):
    from memcalc.tracing import direct

    traced, original = [], direct._rank_traced
    monkeypatch.setattr(direct, "_rank_traced", lambda *args: traced.append(args[-1])
                        or original(*args))
    shown = memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw",
                          fsdp=world, fsdp_apply=apply)
    assert len(traced) == traces and len(shown.rank_peaks) == world


# --- --mesh: torchtitan's axes -------------------------------------------------------------
GPT_INPUTS = {"idx": ("B", "N", "int64"), "targets": ("B", "N", "int64")}
FIGURES = ("saved_bytes", "forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes",
           "reserved_peak_bytes")


def _gpt(seq_len: int = 512, **layout):
    """nanoGPT's TinyGPT (2 layers of 256, causal SDPA) over ``seq_len`` positions with
    AdamW."""
    from memcalc.tracing import load_function

    model = load_function(f"{Path(__file__).parents[1]}/examples/training/gpt.py:TinyGPT")
    return memcalc.trace(model, inputs=GPT_INPUTS, seq_len=seq_len, batch=1,
                         optimizer="adamw", **layout)


def _figures(b) -> dict[str, int]:
    return {k: getattr(b, k) for k in FIGURES}


def _parameter_bytes(b) -> int:
    return sum(c.bytes for c in b.forward_live if c.role is Role.parameter)


def test_a_mesh_of_cp_alone_is_fsdp_and_cp_over_the_same_ranks():
    """torchtitan's dp_shard_cp: with dp_shard 1, FSDP shards over the 4 cp ranks, which
    is what --fsdp 4 --cp 4 has always traced: every figure alike."""
    assert _figures(_gpt(mesh=memcalc.Mesh(cp=4))) == _figures(_gpt(fsdp=4, cp=4))


def test_fsdp_and_cp_on_axes_of_their_own():
    """dp_shard=2,cp=2: FSDP shards every parameter over the 2 x 2 ranks (each holds what
    --fsdp 4 gives it), while the ring runs over 2 ranks of 256 positions each (the
    sequence split as --cp 2 splits it); the 4 ranks all traced or matched."""
    mesh = _gpt(mesh="dp_shard=2,cp=2")
    assert _parameter_bytes(mesh) == _parameter_bytes(_gpt(fsdp=4, cp=4))
    assert _parameter_bytes(mesh) * 2 == _parameter_bytes(_gpt(fsdp=2, cp=2))
    assert len(mesh.rank_peaks) == 4
    inputs = {c.name: c.shape for c in mesh.forward_live if c.role is Role.input}
    assert inputs["idx"] == (1, 256)  # 512 positions over cp = 2


def test_hsdp_replicates_the_shards():
    """dp_replicate=2,dp_shard=2: each replica shards over its 2 ranks, so a rank holds
    what --fsdp 2 gives it, and the 4 ranks are 2 kinds of 2 alike."""
    hsdp = memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw",
                         mesh=memcalc.Mesh(dp_replicate=2, dp_shard=2))
    two = memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw", fsdp=2)
    assert _bytes(hsdp, Role.parameter) == _bytes(two, Role.parameter)
    assert len(hsdp.rank_peaks) == 4


def shard_over_dp_shard_cp(model, mesh):
    """A user's apply over --mesh's axes, as torchtitan's parallelize_llama takes its FSDP
    mesh: dp_shard x cp flattened."""
    from torch.distributed.fsdp import fully_shard

    assert mesh.mesh_dim_names == ("dp_shard", "cp")
    fully_shard(model, mesh=mesh["dp_shard_cp"])


def test_the_users_apply_gets_the_mesh_of_the_axes_given(capsys):
    code, out, err = run(capsys, "trace", f"{__file__}:Stack", "--input", "x=B,N,30", "--seq",
                         "8", "--batch", "2", "--optimizer", "adamw", "--mesh",
                         "dp_shard=2,cp=2", "--fsdp-apply", f"{__file__}:shard_over_dp_shard_cp",
                         "--json")
    assert code == 0 and not err, err
    notes = json.loads(out)["notes"]
    assert any("on a mesh of 2 x 2 ranks ('dp_shard', 'cp')" in n for n in notes)


@pytest.mark.parametrize("argv, message", [
    (("--mesh", "dp_shard=2,cp=2", "--fsdp", "2"), "--mesh dp_shard=2,cp=2: it lays out every "
                                                   "rank; drop --fsdp, --cp and --fsdp-tp"),
    (("--mesh", "dp_shard=2,tp=2"), "--mesh tp=2: a tensor-parallel plan is the model's own"),
    (("--mesh", "dp_shrd=2"), "--mesh: unknown axis 'dp_shrd' (did you mean 'dp_shard'?)"),
    (("--mesh", "cp=0"), "--mesh: cp takes a whole number of ranks, at least 1"),
])
def test_a_mesh_it_cannot_trace_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, "trace", f"{__file__}:Stack", "--input", "x=B,N,30",
                         "--seq", "8", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_each_stream_keeps_a_pool_of_its_own():
    """The caching allocator's pools are per stream (``BlockComparatorSize``): Stack's
    blocks are all small, so each stream that allocates reserves a 2 MiB segment of its
    own: the default stream, FSDP's all-gather stream (its buffers) and its reduce-scatter
    stream (the output); the two threads' cuBLAS workspaces are 32 MiB segments each.
    2 x 33,554,432 + 3 x 2,097,152 = 73,400,320 B, for 2 ranks and for 4."""
    for world in (2, 4):
        b = memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw",
                          fsdp=world)
        assert b.reserved_peak_bytes == 2 * 33_554_432 + 3 * 2_097_152


def test_fsdps_fused_copies_take_their_packed_metadata():
    """``split_with_sizes_copy`` (the all-gather copy-out) and the reduce-scatter copy-in
    (``chunk_cat``; ``chunk_cat_mixed_dtype`` from torch 2.15) pack their metadata into an
    int64 tensor on the GPU (``memcalc.impls.packed_copies``). A block of Stack over 2
    ranks: 4 parameters of 150, 5, 150 and 15 padded elements a rank (600, 20, 600, 60 B),
    one 2,048-B tile each: the copy-out packs 3 x 4 + 1 + 4 = 17 entries (136 B), the
    copy-in 5 x 4 + 2 + 4 = 26 (208 B)."""
    history = []
    _traced(Stack(), 2, history)
    packed = {e.component.name.split(" (")[0]: e.component.bytes for e in history
              if e.kind == "alloc" and e.component is not None
              and "packed metadata" in e.component.name}
    assert packed == {"all-gather copy-out packed metadata": 136,
                      "reduce-scatter copy-in packed metadata": 208}


def _traced(model, world: int, history: list):
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, register_function, traced

    from memcalc.tracing.optimizers import loop_of

    calling = Calling(inputs_of(["x=B,N,30"], []), loop=loop_of("adamw"), fsdp=Sharding(world))
    config = memcalc.make_config(impl=register_function(model, "Stack", calling), seq_len=8,
                                 batch=2)
    return traced(model, config, TraceOptions(), history=history, calling=calling, rank=0)


def test_a_reduce_dtype_of_float32_reduces_bf16_grads_in_float32():
    """MixedPrecisionPolicy(bf16, float32): layer 1's reduce-scatter input holds every
    rank's padded rows in float32: 2 ranks x (5 x 30 + 5 + 15 x 10 + 15) x 4 B = 2,560 B
    (in bf16 it would be half), its output one rank's, 1,280 B (1,536-B block)."""
    b = memcalc.trace(Stack, inputs=INPUTS, seq_len=8, batch=2, optimizer="adamw", fsdp=2,
                      fsdp_param_dtype="bf16", fsdp_reduce_dtype="fp32")
    live = {c.name: c for c in b.backward_live}
    assert live["reduce-scatter input (layers.1)"].bytes == 2 * (5 * 30 + 5 + 15 * 10 + 15) * 4
    assert live["reduce-scatter output (layers.1): sharded grads"].bytes == 1280


@pytest.mark.parametrize("layout", [{"fsdp": 2, "cp": 2}, {"mesh": "dp_shard=2,cp=2"}])
def test_the_fitted_program_under_context_parallelism_is_the_ranks_step(layout):
    """What ``oom --trace`` and ``sweep --trace`` solve: each rank's program fitted over its
    rows (traced at even lengths, 122 to 514 a rank: the ring takes a rank's rows in two
    chunks) with the ring in it, equal to a direct trace at 32,768 positions (16,384 a
    rank), figure by figure, and each rank's peaks those of that rank's trace (on the mesh,
    the ranks at dp_shard 0). Under autocast to bf16 the ring runs cuDNN's kernel, whose
    buffers are polynomials in a rank's rows. (The program was once fitted without the
    ring; then every rank as rank 0, and rank 1's peak came out above its trace's; then at
    multiples of 256 rows a rank from 15,616 only, past TinyGPT's 16,384 positions: every
    length a search tried was traced directly.)"""
    from memcalc.analysis.predict import predict
    from memcalc.config import Mesh
    from memcalc.impls import get_impl
    from memcalc.tracing import Calling, load_function, register_function
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing.fsdp import sharding_of
    from memcalc.tracing.optimizers import loop_of

    gpt = load_function(f"{Path(__file__).parents[1]}/examples/training/gpt.py:TinyGPT")
    mesh = Mesh.parse(layout["mesh"]) if "mesh" in layout else None
    sharding = sharding_of(layout.get("fsdp"), mesh=mesh)
    calling = Calling(inputs_of(["idx=B,N:int64", "targets=B,N:int64"], []), "bfloat16",
                      loop=loop_of("adamw"), fsdp=sharding)
    config = memcalc.make_config(impl=register_function(gpt, "gpt", calling), seq_len=32768,
                                 batch=1, cp=2)
    fitted = predict(config)
    assert get_impl(config.impl).how(config.dims).startswith(
        "each rank's program fitted over its rows (traced at 122 to 514 rows a rank")
    traced = _gpt(seq_len=32768, autocast="bf16", **layout)
    assert _figures(fitted) == _figures(traced)
    assert fitted.rank_peaks == traced.rank_peaks[:2]
    assert fitted.rank_reserved == traced.rank_reserved[:2]


def test_a_step_over_several_ranks_fits_only_where_every_rank_fits(monkeypatch):
    """``trace`` with a budget under --fsdp 2 --cp 2: each rank's step is replayed capped at
    the budget, as each runs on its own GPU, and a rank that runs out is the step's OOM,
    named (here rank 1's capped trace made to run out; rank 0, the busiest unbounded,
    fits by releasing cached segments). Only the busiest rank was once replayed: at 65,808
    tokens Llama-3-8B over FSDP 8 x CP 8 "fit" on rank 0 while ranks 1, 5 and 6 ran out."""
    import memcalc.tracing.direct as direct
    from memcalc.analysis.budget import Budget
    from memcalc.engine.allocator import OutOfMemory
    from memcalc.engine.inputs import inputs_of
    from memcalc.tracing import Calling, TraceOptions, load_function, register_function
    from memcalc.tracing.fsdp import sharding_of
    from memcalc.tracing.optimizers import loop_of

    gpt = load_function(f"{Path(__file__).parents[1]}/examples/training/gpt.py:TinyGPT")
    calling = Calling(inputs_of(["idx=B,N:int64", "targets=B,N:int64"], []), "bfloat16",
                      loop=loop_of("adamw"), fsdp=sharding_of(2))
    config = memcalc.make_config(impl=register_function(gpt, "gpt", calling), seq_len=4096,
                                 batch=1, cp=2)
    real = direct._measure

    def measured(call, config, options, inputs, capacity=None, *args, rank=0, **kwargs):
        if capacity is not None and rank == 1:
            raise OutOfMemory(2 << 20, capacity - (1 << 20), capacity)
        return real(call, config, options, inputs, capacity, *args, rank=rank, **kwargs)

    monkeypatch.setattr(direct, "_measure", measured)
    unbounded = direct.traced(gpt, config, TraceOptions(), calling=calling).breakdown
    assert unbounded.rank == 0  # the busiest: 377,487,360 B reserved, rank 1 375,390,208
    budget = Budget(device="given", memory_bytes=unbounded.reserved_peak_bytes - (2 << 20),
                    reserve_bytes=0)
    fit = direct.traced(gpt, config, TraceOptions(), budget, calling=calling).fit
    assert not fit.fits and fit.oom_rank == 1
    assert fit.describe().startswith("OOM on rank 1: a 2,097,152 B segment")
    monkeypatch.setattr(direct, "_measure", real)
    assert direct.traced(gpt, config, TraceOptions(), budget, calling=calling).fit.retried
