"""Forgiving names: "did you mean", the ``--impl`` vocabulary and the dtype aliases.

One place for how a user may spell an implementation, a list of implementations, a GPU
preset or a keyword, shared by the CLI and the Python API: a close miss gets a suggestion
(``memcalc.errors.did_you_mean``), anything else the list of what is allowed.
"""

from __future__ import annotations

from typing import Sequence

from memcalc.errors import did_you_mean  # noqa: F401  (the names' suggestions)
from memcalc.engine.program import dtype_name

ALL = "all"


def unknown(field: str, word: str, known: Sequence[str], what: str = "",
            listing: str = "") -> ValueError:
    """``field: unknown 'word' (did you mean ...?); known: ...`` as a ValueError;
    ``listing`` names the command that describes them."""
    hint = did_you_mean(word, known)
    kind = f"{what} " if what else ""
    more = f" ({listing} describes them)" if listing else ""
    return ValueError(f"{field}: unknown {kind}{word!r}{hint}; known: {', '.join(known)}{more}")


def impl_choices() -> list[str]:
    """The implementations a user can name (the traced functions of this process aside)."""
    from memcalc.impls import impl_names

    return [n for n in impl_names() if not n.startswith("trace:")]


def check_impl(name: str, field: str = "--impl") -> str:
    """``name`` if it is an implementation; a ValueError with a suggestion otherwise."""
    from memcalc.impls import canonical, get_impl

    name = canonical(name)
    try:
        get_impl(name)  # loads the modules it needs, or all of them to say it is unknown
    except ValueError:
        raise unknown(field, name, impl_choices(), "implementation", "memcalc impls") from None
    return name


def impl_list(values: str | Sequence[str] | None, field: str = "--impl") -> list[str] | None:
    """The ``--impl`` vocabulary of every command: repeated options and comma lists, each a
    known implementation; ``all`` (alone) gives None, meaning every implementation."""
    if values is None:
        return None
    texts = [values] if isinstance(values, str) else list(values)
    names = [n.strip() for text in texts for n in str(text).split(",")]
    if not names or not all(names):
        raise ValueError(f"{field}: {','.join(texts)!r} is not a comma-separated list of "
                         f"implementations (or 'all')")
    if ALL in names:
        if names != [ALL]:
            raise ValueError(f"{field}: 'all' stands alone (got {','.join(texts)!r})")
        return None
    return [check_impl(n, field) for n in dict.fromkeys(names)]


# what ``oom`` may solve for, as the CLI's --solve and the API's solve= spell it
SOLVE_FIELDS = {"seq": "seq_len", "seq-len": "seq_len", "seq_len": "seq_len",
                "batch": "batch", "head-dim": "head_dim", "head_dim": "head_dim"}


def solve_field(word: str, field: str = "--solve") -> str:
    """The configuration field ``word`` names (``seq`` -> ``seq_len``); a ValueError that
    names ``field``, with a suggestion, otherwise."""
    if word not in SOLVE_FIELDS:
        raise unknown(field, word, ["seq", "batch", "head-dim"], "size to solve")
    return SOLVE_FIELDS[word]


# the kinds of case of a live validation run, in the order it takes them
# (``memcalc.validation.cases``); here, so that the CLI lists them without importing it
CASE_KINDS = ("oom-threshold", "fused", "usercode", "modelcode", "training", "compiled",
              "grid")
# and of an emulated one: the grid, and context parallelism's ranks
# (``memcalc.validation.context_parallel``)
EMULATED_KINDS = ("grid", "cp")


def autocast_dtype(text: str | None, field: str = "--autocast") -> str | None:
    """An autocast dtype (``bf16``, ``fp16`` or torch's names) as torch's name, None for
    none; anything else, fp32 included, a ValueError naming ``field``."""
    if text is None:
        return None
    name = dtype_name(text)
    if name not in ("bf16", "fp16"):
        raise ValueError(f"{field}: {text!r} is not an autocast dtype; autocast runs in bf16 or "
                         f"fp16 (bfloat16, float16)")
    return torch_dtype(name, field)


def torch_dtype(text: str | None, field: str) -> str | None:
    """fp32, fp16, bf16 or an alias as torch's name (``bfloat16``); None for none; anything
    else a ValueError naming ``field``."""
    if text is None:
        return None
    short = dtype_name(text)
    if short is None:
        raise ValueError(f"{field}: unknown dtype {text!r}; known: fp32, fp16, bf16 (float32, "
                         f"float16, bfloat16)")
    return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[short]
