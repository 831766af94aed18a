"""The tensors a step is called with (protocol step 1): one per argument of the attention
function or module, each shaped in the step's sizes.

Built-in implementations take ``q, k, v`` (``QKV``); a traced target takes whatever its
signature asks for, declared as ``NAME=DIMS[:DTYPE[:FILL]]`` (``--input x=B,N,768``): DIMS
a comma list of whole numbers and letters bound to the step's sizes (``LETTERS``), or their
products (``H*D``), so that ``memcalc oom`` can still solve ``N`` or ``B``. Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

from memcalc.engine.dims import Dims
from memcalc.engine.program import ITEMSIZE, Role, Tensor

# letter -> (the Dims field, what it means, the option that sets it)
LETTERS = {"B": ("B", "batch", "--batch"), "N": ("N", "query length", "--seq"),
           "M": ("M", "key/value length", "--kv-len, default N"),
           "H": ("H", "heads", "--heads"), "K": ("Hk", "key/value heads", "--kv-heads, default H"),
           "D": ("D", "head dimension", "--head-dim")}

FLOATING = ("float32", "float16", "bfloat16", "float64")

# how integer and bool inputs are filled (floating ones are random): values matter to code
# that reads them (a padding mask's ``.all()``) and, live, to embedding lookups
FILLS = {"ones": "every element 1 (a mask that pads nothing; token ids of 1)",
         "zeros": "every element 0",
         "arange": "0, 1, ..., along the last dimension (position ids)",
         "padded": "ones, with the last quarter of the last dimension 0 in the first row "
                   "(a padding mask that pads one sequence)"}


@dataclass(frozen=True)
class Input:
    """One argument: its parameter name, its dims (whole numbers, letters, products of
    them), its dtype (None: the step's ``--dtype``), whether it needs a gradient (floating
    inputs do unless turned off), and the fill of integer and bool inputs (None: ``arange``
    for position ids, ``ones`` otherwise)."""

    name: str
    dims: tuple[str, ...]
    dtype: str | None = None
    grad: bool = True
    fill: str | None = None

    def shape(self, d: Dims) -> tuple[int, ...]:
        """The dims with the step's sizes put in."""
        return tuple(prod(getattr(d, LETTERS[f][0]) if f in LETTERS else int(f)
                          for f in dim.split("*")) for dim in self.dims)

    def dtype_in(self, d: Dims) -> str:
        return self.dtype or d.dtype

    def needs_grad(self, d: Dims) -> bool:
        """Floating, not turned off, and the step has a backward."""
        return self.grad and self.dtype_in(d) in FLOATING and not d.forward_only

    def filled(self, d: Dims) -> str:
        """How an integer or bool input's elements are set (floating ones: ``randn``)."""
        if self.dtype_in(d) in FLOATING:
            return "randn"
        return self.fill or ("arange" if "position" in self.name else "ones")

    def text(self) -> str:
        """As ``--input`` takes it: ``x=B,N,768``, ``mask=B,N:bool``."""
        suffix = "".join(f":{p}" for p in (self.dtype, self.fill) if p)
        return f"{self.name}={','.join(self.dims)}{suffix}"


QKV = (Input("q", ("B", "H", "N", "D")), Input("k", ("B", "K", "M", "D")),
       Input("v", ("B", "K", "M", "D")))

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FACTOR = re.compile(r"^([BNMHKD]|[1-9][0-9_]*)$")
EXAMPLE = "x=B,N,768 or mask=B,N:bool"


SHAPE_FIELDS = {"B": "batch", "N": "seq_len", "M": "kv_len", "H": "heads", "K": "kv_heads",
                "D": "head_dim"}


def sizes_read(inputs: tuple[Input, ...]) -> frozenset[str]:
    """The shape fields (``memcalc.config.Shape``'s names) the inputs' dims are written in
    (key/value length and heads follow the query's unless set: M reads N, K reads H)."""
    letters = {f for i in inputs for dim in i.dims for f in dim.split("*") if f in LETTERS}
    letters |= {"N"} if "M" in letters else set()
    letters |= {"H"} if "K" in letters else set()
    return frozenset(SHAPE_FIELDS[x] for x in letters)


def parse_input(text: str, field: str = "--input") -> Input:
    """``NAME=DIMS[:DTYPE[:FILL]]``; a ValueError naming ``field`` and what it takes."""
    from memcalc.engine.program import dtype_name

    name, sep, rest = str(text).partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise ValueError(f"{field}: {text!r} is not NAME=DIMS[:DTYPE] (e.g. {EXAMPLE})")
    dims_text, _, kinds = rest.partition(":")
    dims = tuple(d.strip() for d in dims_text.split(",")) if dims_text.strip() else ()
    for dim in dims:
        if not all(_FACTOR.match(f.strip()) for f in dim.split("*")):
            raise ValueError(f"{field} {name}: dim {dim!r} is not a whole number above 0, one "
                             f"of the letters {', '.join(LETTERS)} or a product of them "
                             f"(H*D); {letters_help()}")
    dims = tuple("*".join(f.strip().replace("_", "") for f in d.split("*")) for d in dims)
    dtype, _, fill = kinds.partition(":")
    dtype_value = None
    if dtype.strip():
        dtype_value = _torch_dtype(dtype.strip()) or dtype_name(dtype.strip())
        if dtype_value is None:
            from memcalc.errors import did_you_mean

            known = [*sorted(ITEMSIZE), "fp32", "fp16", "bf16"]
            raise ValueError(f"{field} {name}: unknown dtype {dtype.strip()!r}"
                             f"{did_you_mean(dtype.strip(), known)}; known: {', '.join(known)}")
        dtype_value = _torch_dtype(dtype_value) or dtype_value
    if fill.strip() and fill.strip() not in FILLS:
        from memcalc.errors import did_you_mean

        raise ValueError(f"{field} {name}: unknown fill {fill.strip()!r}"
                         f"{did_you_mean(fill.strip(), FILLS)}; known: {', '.join(FILLS)}")
    return Input(name, dims, dtype_value, True, fill.strip() or None)


def _torch_dtype(text: str) -> str | None:
    """A torch dtype's name (``int64``, ``torch.bool``, ``bfloat16``, ``fp16``), or None."""
    from memcalc.engine.program import dtype_name

    word = text.lower().removeprefix("torch.")
    short = dtype_name(word)
    if short is not None:
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[short]
    aliases = {"long": "int64", "int": "int32", "double": "float64", "byte": "uint8"}
    word = aliases.get(word, word)
    return word if word in ITEMSIZE else None


def letters_help(field: str = "--input") -> str:
    """``letters: B --batch, N --seq, ...``: the option (or, for the API's ``inputs``, the
    keyword) each letter stands for."""
    if field == "inputs":
        return "letters: " + ", ".join(f"{k} {SHAPE_FIELDS[k]}" for k in LETTERS)
    return "letters: " + ", ".join(f"{k} {flag.split(',')[0]}" for k, (_, _, flag) in LETTERS.items())


def inputs_of(values, no_grad=(), field: str = "--input") -> tuple[Input, ...]:
    """Inputs from ``--input`` texts or the API's mapping (``{"x": ("B", "N", 768)}``, a
    dtype and a fill may end the tuple: ``("B", "N", "bool")``), each name once; ``no_grad``
    names the floating inputs that need no gradient."""
    if isinstance(values, dict):
        inputs = [parse_input(f"{name}={_spec_text(name, spec, field)}", field)
                  for name, spec in values.items()]
    else:
        inputs = [parse_input(v, field) for v in values]
    names = [i.name for i in inputs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"{field}: {repeated[0]} is given twice")
    for name in no_grad:
        if name not in names:
            from memcalc.errors import did_you_mean

            raise ValueError(f"--no-grad {name}: no input of that name{did_you_mean(name, names)}"
                             f"; inputs: {', '.join(names) or 'none'}")
    return tuple(Input(i.name, i.dims, i.dtype, i.name not in no_grad, i.fill) for i in inputs)


def _spec_text(name: str, spec, field: str) -> str:
    """The API's ``("B", "N", 768)`` or ``"B,N,768:bool"`` as ``--input`` text."""
    if isinstance(spec, str):
        return spec
    if not isinstance(spec, (tuple, list)):
        raise ValueError(f"{field} {name}: a tuple of dims, e.g. ('B', 'N', 768) (got {spec!r})")
    parts = [str(s) for s in spec]
    kinds = []
    while parts and not _is_dim(parts[-1]):
        kinds.insert(0, parts.pop())
    return ",".join(parts) + "".join(f":{k}" for k in kinds)


def _is_dim(text: str) -> bool:
    return all(_FACTOR.match(f.strip()) for f in text.split("*"))


def input_tensors(d: Dims, inputs: tuple[Input, ...] = QKV,
                  out_like: tuple | None = None) -> list[Tensor]:
    """The step's inputs in the order they are allocated, then ``grad_out`` (shaped like
    q, or ``out_like = (shape, dtype)``; none for ``--loss sum``, a forward-only step or a
    0-d output, whose ``backward()`` needs none)."""
    tensors = [Tensor(i.name, i.shape(d), i.dtype_in(d), Role.input, i.filled(d)) for i in inputs]
    shape, dtype = out_like or ((d.B, d.H, d.N, d.D), d.dtype)
    if d.loss == "grad" and not d.forward_only and len(shape):
        tensors.append(Tensor("grad_out", tuple(shape), dtype, Role.input, "randn"))
    return tensors
