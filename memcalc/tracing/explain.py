"""What a trace that fails tells the user: one line naming their line (and the library's
under it), what was raised, and what explains it, with a hint where one applies."""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
import warnings
from pathlib import Path
from typing import Callable

from memcalc.config import Config
from memcalc.engine.inputs import Input
from memcalc.errors import install_hint, one_line as _first_line
from memcalc.tracing.errors import NotModelled, RefusedOnGpu, TraceError
from memcalc.tracing.interrupt import held
from memcalc.tracing.target import stand_ins


def guarded(run: Callable, fn: Callable, called_with: str = ""):
    """Run a trace, the stand-ins of what cannot run on meta in place (``stand_ins``) and
    Ctrl-C held for the tracer's next op (``interrupt.held``); a failure becomes a TraceError naming the user's line, what the target was
    ``called_with`` (``q (8, 1, 1024, 16) float32, ...``) where that explains it, and a
    hint where one applies."""
    from memcalc.engine.allocator import OutOfMemory

    try:
        with warnings.catch_warnings(), stand_ins(), held():
            # torch's own warnings concern running on the meta device (dynamo refusing a
            # meta tensor, autocast without CUDA), not the user's code
            warnings.filterwarnings("ignore", module=r"torch\.")
            return run()
    except (TraceError, OutOfMemory):  # a capped trace's OOM is an answer, not a failure
        raise
    except Exception as error:  # noqa: BLE001 - anything the user's code raises on meta
        raise TraceError(_explain(error, fn, called_with) + install_hint(error)) from None


def _explain(error: Exception, fn: Callable, called_with: str = "") -> str:
    """One line: the user's line that failed, the library line under it where the failure
    came from a library's code (transformers' mask builders), what was raised, and what
    explains it: the meta device's refusal and a hint, an output that needs no grad, or the
    inputs (a shape the code did not expect); the code's own ``raise``, as it is."""
    source = _source_file(fn)
    frames = traceback.extract_tb(error.__traceback__)
    mine = [f for f in frames if f.filename == source]
    where = f"line {mine[-1].lineno} of {Path(source).name} ({mine[-1].line})" if mine \
        else getattr(fn, "__name__", None) or type(fn).__name__
    where += _library_line(frames, source)
    if isinstance(error, (NotModelled, RefusedOnGpu)):
        return f"{where}: {_first_line(error)}"
    known = next((why for text, why in UNFOLLOWED.items() if text in str(error)), None)
    if known:
        return f"{where}: {known}"
    raised = f"{type(error).__name__}: {_first_line(error)}"
    if _own_raise(frames, source):
        return f"{where} raised {raised}"
    if _meta_refused(error):
        hint = CPU_HINT if "device cpu" in str(error) else META_HINT
        return f"{where} cannot run on the meta device: {raised}. Hint: {hint}"
    if "does not require grad" in str(error):
        return (f"{where} raised {raised}: the output needs no gradient (detached, or made "
                f"under no_grad), so there is no backward to trace; --forward-only traces "
                f"inference")
    # torch's CUDA build on a machine without a GPU: "Found no NVIDIA driver on your system"
    # (torch/cuda/__init__.py, _lazy_init); its CPU build: "Torch not compiled with CUDA"
    if any(word in str(error).lower() for word in ("cuda", "device", "nvidia driver")):
        return f"{where} raised {raised}. If it runs on a GPU: {META_HINT}"
    return f"{where} raised {raised}" + (f" (called with {called_with})" if called_with else "")


def _own_raise(frames, source: str) -> bool:
    """Whether the failure is a ``raise`` statement of the user's own file."""
    last = frames[-1] if frames else None
    return last is not None and last.filename == source and \
        (last.line or "").startswith("raise")


def called_with(config: Config, inputs: tuple[Input, ...]) -> str:
    """``q (8, 1, 1024, 16) float32, k ..., v ...``: the tensors a trace calls its target with."""
    d = config.dims
    return ", ".join(f"{i.name} {i.shape(d)} {i.dtype_in(d)}" for i in inputs)


def _library_line(frames, source: str) -> str:
    """`` (in masking_utils.py:761, find_packed_sequence_indices)``: the last frame of the
    failure in neither the user's file nor torch nor memcalc nor Python's own library,
    when there is one after the user's last; else ``""``."""
    last_mine = max((i for i, f in enumerate(frames) if f.filename == source), default=-1)
    library = [f for f in frames[last_mine + 1:] if f.filename != source
               and written_by_users(f.filename)]
    if not library:
        return ""
    f = library[-1]
    return f" (in {Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}, {f.name})"


def written_by_users(path: str) -> bool:
    """Code of the user's or of a library they call (transformers), not torch's, memcalc's
    or Python's standard library (``contextlib``, ``logging``): where a failure is named."""
    from memcalc.tracing.tracer import _is_user_code

    path = os.path.abspath(path)
    return _is_user_code(path) and not _in_stdlib(path)


def _in_stdlib(path: str) -> bool:
    """Under the standard library's folder, and not in the packages installed there (a
    Python without a virtual environment keeps its site-packages inside it)."""
    parts = Path(path).parts
    return path.startswith(_STDLIB) and not {"site-packages", "dist-packages"} & set(parts)


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep

# kernels a trace cannot follow, told by what they raise on the meta device: one line each
UNFOLLOWED = {
    "FlexAttention is only supported on": (
        "FlexAttention (torch.nn.attention.flex_attention) runs a kernel that torch compiles "
        "for the GPU, which memcalc does not model yet; trace the same model with "
        "attn_implementation 'sdpa' or 'eager'"),
}
# code that needs a process group (a collective, DeepSpeed's DistributedAttention), traced
# without one: DeepSpeed's and torch's own words for it
NO_GROUP = ("the code needs a process group (a collective, DeepSpeed's DistributedAttention): "
            "trace it under --cp P, where it runs as each rank of P on a fake group; "
            "DeepSpeed's communication backend is set up under --cp-method ulysses")
UNFOLLOWED.update({"DeepSpeed backend not set": NO_GROUP,
                   "Default process group has not been initialized": NO_GROUP})
CPU_HINT = ("a tensor or module on the CPU is traced on meta copies only when the function "
            "refers to it by a module-level name (or it is the nn.Module traced): one reached "
            "through a closure, another object's attribute or a bound method stays on the CPU; "
            "make it with device='meta', or refer to it by its module-level name")
META_HINT = ("data-dependent code (.item(), .cpu(), shapes from values) cannot be traced; give "
             "a custom CUDA/Triton kernel a fake implementation (torch.library.register_fake), "
             "or pick the built-in model that matches it (memcalc impls)")


def _meta_refused(error: Exception) -> bool:
    """Whether torch refused an op for lack of data or of a meta kernel ("Tensor.item()
    cannot be called on meta tensors", "Cannot copy out of meta tensor", "Could not run
    'x' with arguments from the 'Meta' backend"): not an error of the code itself."""
    return isinstance(error, NotImplementedError) or "meta" in str(error).lower()


def _source_file(fn: Callable) -> str:
    """The file ``fn`` (or a module's class) is written in, "" when unknown; a function
    compiled for the trace (``--compile``) is the user's it wraps."""
    for target in (inspect.unwrap(fn), type(fn)):
        try:
            return inspect.getsourcefile(target) or ""
        except TypeError:
            continue
    return ""
