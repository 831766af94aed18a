"""``memcalc.tracing.flash_attn_ops``: the flash-attn packages' custom ops, seen by what
watches ops (selective-checkpoint policies, dispatch modes) as on a GPU."""

import pytest

torch = pytest.importorskip("torch")

import memcalc  # noqa: E402
from memcalc.tracing import flash_attn_ops as ops  # noqa: E402
from memcalc.tracing.flash_attn import stand_ins  # noqa: E402

FORWARD = {"flash-attn": "flash_attn::_flash_attn_forward",
           "flash-attn3": "flash_attn_3::_flash_attn_forward"}

# (B, N, H, d) = (1, 1024, 2, 64) bf16 on an H100, causal; what the forward op returns, each
# its own block (what a policy that saves the op keeps):
OUT = 1 * 1024 * 2 * 64 * 2  # 262,144 B
LSE = 1 * 2 * 1024 * 4  # 8,192 B: softmax_lse (B, H, N) float32
RNG = 512  # flash-attn 2's rng_state (2,) int64: 16 B, one 512-B block; FA3 makes none
SAVED_BY_THE_OP = {"flash-attn": OUT + LSE + RNG, "flash-attn3": OUT + LSE}
BNHD = {name: ("B", "N", "H", "D") for name in "qkv"}  # flash_attn_func's layout


def checkpointed(backend: str, policy=None, asked=None):
    """``flash_attn_func(q, k, v, causal=True).relu()`` under non-reentrant checkpointing:
    selective with ``policy`` (a list of op names to save, or "ask": recompute everything,
    recording the ops asked about), or full without one."""
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    def attn(q, k, v):
        if backend == "flash-attn":
            from flash_attn import flash_attn_func
        else:
            from flash_attn_interface import flash_attn_func
        return flash_attn_func(q, k, v, causal=True).relu()

    def ask(ctx, func, *args, **kwargs):
        asked.append(func.name())
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context():  # the ops exist while the trace runs: resolved then, as a policy would
        saved = ask if policy == "ask" else [ops.op(name) for name in policy]
        return create_selective_checkpoint_contexts(saved)

    def step(q, k, v):
        if policy is None:
            return checkpoint(attn, q, k, v, use_reentrant=False)
        return checkpoint(attn, q, k, v, use_reentrant=False, context_fn=context)
    return step


def saved(fn) -> int:
    return memcalc.trace(fn, seq_len=1024, batch=1, heads=2, head_dim=64, dtype="bf16",
                         gpu="h100-80gb", inputs=BNHD,
                         ).saved_bytes


@pytest.mark.parametrize("backend", ["flash-attn", "flash-attn3"])
def test_a_selective_checkpoint_policy_is_asked_about_the_packages_op_and_saves_its_outputs(
        backend):
    """The policy is asked about the package's forward op (flash_attn::_flash_attn_forward,
    flash_attn_3::_flash_attn_forward); recomputed, nothing of the call outlives the forward;
    saved, what the op returned is what the forward leaves behind (the Function's own saved
    tensors are dropped by checkpointing's hooks)."""
    asked = []
    assert saved(checkpointed(backend, "ask", asked)) == 0
    assert FORWARD[backend] in asked
    assert saved(checkpointed(backend, [FORWARD[backend]])) == SAVED_BY_THE_OP[backend]


@pytest.mark.parametrize("backend", ["flash-attn", "flash-attn3"])
def test_full_checkpointing_keeps_nothing_of_the_call(backend):
    assert saved(checkpointed(backend)) == 0


def test_without_checkpointing_the_function_saves_the_ops_outputs():
    """FlashAttnFunc saves q, k, v (the inputs), out_padded (the output's storage), the lse
    and rng_state: of its own, LSE + RNG; the relu after it saves its output (OUT)."""
    def step(q, k, v):
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, causal=True).relu()

    assert saved(step) == LSE + RNG + OUT


def test_a_dispatch_mode_sees_the_forward_and_backward_ops():
    """What PyTorch's own trackers (MemTracker, FlopCounterMode) watch: every op, through
    TorchDispatchMode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.name())
            return func(*args, **(kwargs or {}))

    def step(q, k, v):
        from flash_attn import flash_attn_func

        with Watch():
            out = flash_attn_func(q, k, v, causal=True)
        return out

    memcalc.trace(step, seq_len=256, batch=1, heads=2, head_dim=64, dtype="bf16",
                  gpu="h100-80gb", inputs=BNHD)
    assert "flash_attn::_flash_attn_forward" in seen


def test_the_ops_exist_only_inside_the_stand_ins_so_the_package_can_define_its_own_later():
    """Outside a trace the ops are gone: flash-attn imported later in the same process (a
    notebook that traces, then trains) defines them itself without a clash."""
    name = "flash_attn::_flash_attn_forward"
    assert not ops._exists(name)
    with stand_ins():
        assert ops._exists(name)
        with stand_ins():  # nested: the outer definition stays
            pass
        assert ops._exists(name)
    assert not ops._exists(name)
    library = torch.library.Library("flash_attn", "FRAGMENT")
    try:
        library.define("_flash_attn_forward" + ops.SCHEMAS[name])  # as the package would
    finally:
        library._destroy()


def test_the_schemas_parse_and_name_every_argument_the_functions_pass():
    """The arguments a call binds by name, with the schema's defaults (FA3's op takes 34)."""
    a = ops.arguments("flash_attn_3::_flash_attn_forward", (1, 2, 3), {"causal": True})
    assert (a["q"], a["v"], a["causal"], a["num_splits"], a["qv"]) == (1, 3, True, 1, None)
    assert len(a) == 34
