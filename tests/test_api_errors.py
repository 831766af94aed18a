"""The Python API under bad values: ``memcalc.breakdown``, ``oom``, ``sweep`` and ``compare``
raise pydantic's ValidationError or a ValueError (ValidationError is one) whose message
names the field, never anything else."""

import pytest

import memcalc

NAIVE = {"impls": ["naive"], "seq_len": 64}

CASES = [
    ("breakdown", {"seq_len": 0}, "seq_len"),
    ("breakdown", {"seq_len": "x"}, "seq_len"),
    ("breakdown", {"seq_len": 1.5}, "seq_len"),
    ("breakdown", {"batch": -2}, "batch"),
    ("breakdown", {"head_dim": 2**61, "kv_len": 0}, "kv_len"),
    ("breakdown", {"dtype": "fp8"}, "dtype"),
    ("breakdown", {"impl": "flashy"}, "impl"),
    ("breakdown", {"gpu": "tpu"}, "gpu"),
    ("breakdown", {"loss": "mean"}, "loss"),
    ("breakdown", {"chunk": 0}, "chunk"),
    ("breakdown", {"heads": 4, "kv_heads": 3}, "kv_heads: 3 must divide heads (4)"),
    ("breakdown", {"cublas_workspace_config": "4096"}, "cublas_workspace_config"),
    ("oom", {**NAIVE, "gpu_gb": "x"}, "gpu-gb"),
    ("oom", {**NAIVE, "gpu_gb": -1}, "gpu-gb"),
    ("oom", {**NAIVE, "gpu_gb": "1/0"}, "gpu-gb"),
    ("oom", {**NAIVE, "reserve": "1,,x"}, "reserve"),
    ("oom", {**NAIVE, "reserve": -5}, "reserve"),
    ("oom", {**NAIVE, "reserve": 10**30}, "reserve"),
    ("oom", {"impls": ["flashy"]}, "impl"),
    ("oom", {**NAIVE, "solve": "heads"}, "solve"),
    ("oom", {"impls": "naive"}, "impls"),
    ("oom", {**NAIVE, "time_limit": "x"}, "time_limit"),  # a TypeError from a comparison
    ("validate", {"impls": ["nope"]}, "impls"),
    ("sweep", {"seq_lens": (0,)}, "seq_len"),
    ("sweep", {"seq_lens": ()}, "seq_len"),
    ("sweep", {"impls": ("flashy",)}, "impl"),
    ("sweep", {"seq_lens": ("x",)}, "seq_len"),
    ("sweep", {"seq_lens": (10**30,)}, "seq_len"),
    ("sweep", {"seq_lens": 64}, "seq_len"),
    ("sweep", {"dtypes": ("fp8",)}, "dtype"),
    ("compare", {"seq_len": 64, "gpu_gb": 0}, "gpu-gb"),
    ("compare", {**NAIVE, "reserve": 10**30}, "reserve"),
    ("compare", {**NAIVE, "impls": ["flashy"]}, "impl"),
    ("compare", {**NAIVE, "baseline": "flashy"}, "baseline"),
]


@pytest.mark.parametrize("function, options, field", CASES)
def test_bad_value_names_the_field(function, options, field):
    with pytest.raises(Exception) as caught:
        getattr(memcalc, function)(**options)
    assert isinstance(caught.value, ValueError), repr(caught.value)
    assert field in str(caught.value), str(caught.value)


def test_unknown_keyword_is_a_type_error():
    """Python's own rule for a misspelt keyword: TypeError naming it."""
    with pytest.raises(TypeError, match="'seqence_len' .*did you mean 'seq_len'"):
        memcalc.breakdown(seqence_len=64)


def test_keyword_aliases_are_accepted():
    """The CLI's ``seq`` and the usual model-config names mean the canonical options."""
    assert memcalc.breakdown(seq=64).config.shape.seq_len == 64
    assert memcalc.breakdown(seq_length=64, num_heads=2).config.shape.heads == 2
    with pytest.raises(TypeError, match="'seq' and 'seq_len' are the same option"):
        memcalc.breakdown(seq=64, seq_len=64)
    with pytest.raises(TypeError, match="'seq_len' and 'seq' are the same option"):
        memcalc.breakdown(seq_len=64, seq=64)  # it said 'seq_len' and 'seq_len'


def test_oom_solves_the_sizes_as_the_command_line_spells_them():
    """``solve="seq"`` (the CLI's --solve seq) was refused; a near miss is suggested."""
    assert memcalc.oom(impl="naive", gpu_gb=1, solve="seq").field == "seq_len"
    assert memcalc.oom(impl="naive", gpu_gb=1, solve="head-dim").field == "head_dim"
    with pytest.raises(ValueError, match="solve: unknown size to solve 'headdim' "
                                         "\\(did you mean 'head-dim'\\?\\)"):
        memcalc.oom(solve="headdim")


def test_numpy_integers_are_lengths():
    """``seq_lens=np.arange(...)`` was refused as not "a list of integers"; bools still are."""
    np = pytest.importorskip("numpy")
    table = memcalc.sweep(seq_lens=np.arange(1024, 3073, 1024))
    assert [r.seq_len for r in table.rows] == [1024, 2048, 3072]
    assert all(type(r.seq_len) is int for r in table.rows)
    with pytest.raises(ValueError, match="seq_lens"):
        memcalc.sweep(seq_lens=[True])


def test_a_misspelt_keyword_of_the_function_itself_is_suggested():
    """The function's own keywords are candidates too (``seqlens`` suggested ``seq_len``,
    which sweep does not sweep; ``time_limt`` suggested nothing)."""
    with pytest.raises(TypeError, match="'seqlens' .*did you mean 'seq_lens'"):
        memcalc.sweep(seqlens=[64])
    with pytest.raises(TypeError, match="'time_limt' .*did you mean 'time_limit'.*; it takes "
                                        "gpu_gb, reserve, impls, solve, work_limit, time_limit, "
                                        "impl,"):
        memcalc.oom(time_limt=3)


def test_one_implementation_or_length_is_not_silently_ignored():
    """compare(impl=...) and oom(impl=...) compared and solved all 17; sweep(seq_len=...)
    swept the five default lengths. One given is the one used; both given is an error."""
    assert [r.impl for r in memcalc.compare(impl="flash2", seq_len=64).rows] == ["flash2"]
    assert [r.impl for r in memcalc.oom(impl="flash2", gpu_gb=1).results] == ["flash2"]
    assert [r.seq_len for r in memcalc.sweep(seq_len=1024).rows] == [1024]
    with pytest.raises(TypeError, match="impls or impl, not both"):
        memcalc.compare(impl="naive", impls=["flash2"])
    with pytest.raises(TypeError, match="seq_lens or seq_len, not both"):
        memcalc.sweep(seq_len=64, seq_lens=[64])


def test_a_fit_in_a_budget_that_is_not_one_says_what_it_takes():
    """``b.fit("1GiB")`` raised AttributeError: 'str' object has no attribute ..."""
    b = memcalc.breakdown(seq_len=64)
    with pytest.raises(TypeError, match="a Budget or a number of bytes"):
        b.fit("1GiB")
    assert b.fit(b.reserved_peak_bytes).fits and not b.fit(b.reserved_peak_bytes - 1).fits


def test_options_one_implementation_refuses_leave_the_others_to_the_api_too():
    """``memcalc.compare(heads=4, kv_heads=2)`` raised naive's refusal (the base was
    naive), where the command lists naive as refused; so did oom and sweep."""
    rows = memcalc.compare(heads=4, kv_heads=2, seq_len=256, impls=["naive", "sdpa-math"]).rows
    assert [(r.impl, r.breakdown is not None) for r in rows] == [
        ("naive", False), ("sdpa-math", True)]
    assert [r.impl for r in memcalc.oom(impls=["naive", "sdpa-math"], heads=4, kv_heads=2,
                                        gpu_gb=8).results] == ["sdpa-math"]
    assert len(memcalc.sweep(impls=("sdpa-math",), heads=4, kv_heads=2, seq_lens=(256,)).rows) == 1


def test_a_search_with_nothing_replayed_says_so():
    """"no exact answer within 0.0001 s (fits at 0)": 0 is no length, and nothing fitted."""
    report = memcalc.oom(impls=["naive"], time_limit=0.0001)
    assert report.unsolved[0].reason.startswith(
        "no exact answer within 0.0001 s (nothing replayed in time)")
