"""memcalc.names: "did you mean" suggestions, the --impl vocabulary and the dtype aliases."""

import pytest

from memcalc.impls import impl_names
from memcalc.names import check_impl, did_you_mean, impl_choices, impl_list, unknown
from memcalc.engine.program import dtype_name
from memcalc.engine.program import Program

def test_did_you_mean_offers_up_to_three_names_starting_with_the_word():
    """Prefix matches in the given order, any case, spaces trimmed, spelt as known."""
    assert did_you_mean("a100", ["h100-80gb", "a100-40gb", "a100-80gb"]) == (
        " (did you mean 'a100-40gb' or 'a100-80gb'?)")
    assert did_you_mean(" NAIVE", ["naive", "naive-softmax", "naive-weights", "naive-x"]) == (
        " (did you mean 'naive' or 'naive-softmax' or 'naive-weights'?)")  # 4th left out
    assert did_you_mean("h100", ["H100-80GB"]) == " (did you mean 'H100-80GB'?)"


def test_did_you_mean_falls_back_to_the_closest_name():
    """No name starts with "flahs2"; difflib's ratio with "flash2" is 2 x 5 / 12 = 0.83
    ("fla", "h", "2" match), over the 0.6 cutoff; "naive" and "linear" share 1 and 2
    characters (ratios 0.18 and 0.33)."""
    assert did_you_mean("flahs2", ["naive", "Flash2", "linear"]) == " (did you mean 'Flash2'?)"


def test_did_you_mean_is_empty_without_a_match_or_a_word():
    """An empty word starts every name; it must suggest none of them."""
    assert did_you_mean("zzz", ["naive", "flash2"]) == ""
    assert did_you_mean("", ["naive", "flash2"]) == ""
    assert did_you_mean("  ", ["naive", "flash2"]) == ""


def test_unknown_is_a_one_line_value_error_naming_the_field():
    error = unknown("--gpu", "h100", ["a100-40gb", "h100-80gb"], "GPU", "memcalc gpus")
    assert isinstance(error, ValueError)
    assert str(error) == ("--gpu: unknown GPU 'h100' (did you mean 'h100-80gb'?); "
                          "known: a100-40gb, h100-80gb (memcalc gpus describes them)")
    assert str(unknown("field", "q", ["a", "b"])) == "field: unknown 'q'; known: a, b"


def test_check_impl_returns_a_known_name_and_names_the_field_otherwise():
    """"flashy" vs "flash2": ratio 2 x 5 / 12 = 0.83, the best ("sdpa-flash": 10 / 16)."""
    assert check_impl("naive") == "naive"
    with pytest.raises(ValueError) as caught:
        check_impl("flashy", "--baseline")
    assert str(caught.value) == (
        "--baseline: unknown implementation 'flashy' (did you mean 'flash2'?); "
        f"known: {', '.join(impl_choices())} (memcalc impls describes them)")


def test_traced_functions_are_accepted_but_not_offered(scratch_register):
    """A ``trace:`` implementation belongs to this process: usable by name, never listed."""
    scratch_register("trace:test-names-fn", "a traced function", lambda d: Program((), ()))
    assert "trace:test-names-fn" in impl_names()
    assert "trace:test-names-fn" not in impl_choices()
    assert "naive" in impl_choices()
    assert check_impl("trace:test-names-fn") == "trace:test-names-fn"


def test_impl_list_reads_repeated_options_and_comma_lists_once_each_in_order():
    assert impl_list(None) is None
    assert impl_list("flash2") == ["flash2"]
    assert impl_list(["naive, flash2", "linear", "naive"]) == ["naive", "flash2", "linear"]


def test_impl_list_all_alone_means_every_implementation():
    assert impl_list("all") is None
    assert impl_list([" all "]) is None
    with pytest.raises(ValueError) as caught:
        impl_list(["naive", "all"], "--only")
    assert str(caught.value) == "--only: 'all' stands alone (got 'naive,all')"


def test_impl_list_refuses_empty_entries_and_unknown_names():
    with pytest.raises(ValueError) as caught:
        impl_list("naive,,flash2")
    assert str(caught.value) == ("--impl: 'naive,,flash2' is not a comma-separated list of "
                                 "implementations (or 'all')")
    with pytest.raises(ValueError) as caught:
        impl_list([])
    assert str(caught.value) == ("--impl: '' is not a comma-separated list of implementations "
                                 "(or 'all')")
    with pytest.raises(ValueError, match="^--only: unknown implementation 'flashy'"):
        impl_list("naive,flashy", "--only")


class _TorchDtype:
    """Stands in for ``torch.bfloat16``, whose ``str`` is ``torch.bfloat16`` (no torch import:
    it takes seconds)."""

    def __str__(self) -> str:
        return "torch.bfloat16"


def test_dtype_name_maps_aliases_to_the_canonical_names():
    assert [dtype_name(v) for v in ("fp32", "fp16", "bf16")] == ["fp32", "fp16", "bf16"]
    assert dtype_name(" BFloat16 ") == "bf16"
    assert dtype_name("torch.half") == "fp16"
    assert dtype_name("float") == "fp32"
    assert dtype_name(_TorchDtype()) == "bf16"


def test_dtype_name_is_none_for_other_types():
    assert [dtype_name(v) for v in ("fp8", "float64", "int8", "")] == [None, None, None, None]


def test_an_implementation_is_named_in_any_case():
    """``--impl Naive`` was refused while ``--gpu H100-80GB`` and ``--dtype FP16`` were
    taken: an implementation's name differing only in case is that implementation."""
    import memcalc
    from memcalc.names import check_impl, impl_list

    assert check_impl("Naive") == "naive" and impl_list("NAIVE,Flash2") == ["naive", "flash2"]
    assert memcalc.breakdown(impl="SDPA-Math", seq_len=64).config.impl == "sdpa-math"
    with pytest.raises(ValueError, match="unknown implementation 'Naiv'"):
        check_impl("Naiv")
