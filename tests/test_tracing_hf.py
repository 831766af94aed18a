"""Hugging Face ``transformers`` models traced as people call them (``examples/huggingface``):
attention modules, a decoder layer and whole models with their masks, their loss and
mixed precision. Skipped without transformers (``pip install ".[hf]"``)."""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc.cli import main  # noqa: E402
from memcalc.tracing import installed_release  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "huggingface"


def run(capsys, monkeypatch, target, *options, attn="sdpa"):
    """``memcalc trace`` of an example's function with ``--json``: (exit status, the JSON
    or the error line)."""
    monkeypatch.setenv("ATTN_IMPLEMENTATION", attn)
    code = main(["trace", f"{EXAMPLES}/{target}", *options, "--json"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


def sdpa_notes(data) -> list[str]:
    return [n for n in data["notes"] if n.startswith("scaled_dot_product_attention")]


def sdpa_line() -> int:
    """The line of ``transformers/integrations/sdpa_attention.py`` that calls
    ``scaled_dot_product_attention`` in the installed release (182 in 5.24, 183 in 5.25)."""
    from transformers.integrations import sdpa_attention

    lines = Path(sdpa_attention.__file__).read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1)
                if "functional.scaled_dot_product_attention(" in text)


LLAMA_X = ("--input", "x=B,N,4096", "--batch", "1", "--seq", "256", "--autocast", "bf16",
           "--gpu", "a100-80gb")


def test_llama_attention_runs_gqa_sdpa_causal_on_flash(capsys, monkeypatch):
    """LlamaAttention from hidden states: the causal mask builder returns None (no padding,
    one sequence: its value reads answered as a GPU answers them), so sdpa runs is_causal
    with 8 key/value heads for 32 query heads, on flash under autocast."""
    code, data = run(capsys, monkeypatch, "llama.py:attention", *LLAMA_X)
    assert code == 0, data
    rules = f"torch {installed_release().text()}'s rules"  # the installed torch's
    line = sdpa_line()  # transformers' own call, where the installed release has it
    assert sdpa_notes(data) == [f"scaled_dot_product_attention at sdpa_attention.py:{line} "
                                f"(1, 32, 256, 128) bfloat16 causal, {rules}: flash (priority "
                                "flash > efficient > math > cudnn)"]
    saved = [c["name"].split(" (modeling_llama")[0] for c in data["saved"]]
    assert "autocast attn.q_proj.weight as bfloat16 (cached)" in saved


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_decoder_layer_traces(capsys, monkeypatch, attn):
    code, data = run(capsys, monkeypatch, "llama.py:decoder_layer", *LLAMA_X, attn=attn)
    assert code == 0, data
    # the layer's weights: q, o (4096 x 4096), k, v (1024 x 4096), gate, up, down (14336 x
    # 4096) float32 and two RMSNorm weights (4096)
    weights = (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096) * 4
    resident = sum(c["bytes"] for c in data["components"] if c["role"] == "parameter"
                   and c["name"].startswith("layer."))
    assert resident == weights


def test_a_causal_lm_step_traces_whole_with_its_loss(capsys, monkeypatch):
    """input_ids, attention_mask (all ones) and labels, as a training loop passes them: the
    loss (0-d) starts the backward; the logits upcast to float32 (B, N, vocab) and the
    log-softmax of cross-entropy are in the step."""
    code, data = run(capsys, monkeypatch, "llama.py:causal_lm", "--input", "input_ids=B,N:int64",
                     "--input", "attention_mask=B,N:int64", "--input", "labels=B,N:int64",
                     "--batch", "1", "--seq", "128", "--autocast", "bf16", "--gpu", "a100-80gb")
    assert code == 0, data
    assert "CausalLMOutputWithPast: its loss" in " ".join(data["notes"])
    shapes = {(tuple(c["shape"]), c["dtype"], c["op"]) for c in data["saved"]}
    assert ((128, 128256), "float32", "_log_softmax") in shapes  # B x N rows, the vocab


def test_gpt2_attention_and_language_model(capsys, monkeypatch):
    code, data = run(capsys, monkeypatch, "gpt2.py:attention", "--input", "x=B,N,768",
                     "--batch", "2", "--seq", "128", attn="eager")
    assert code == 0, data
    code, data = run(capsys, monkeypatch, "gpt2.py:language_model", "--input",
                     "input_ids=B,N:int64", "--input", "labels=B,N:int64", "--batch", "2",
                     "--seq", "128", "--autocast", "bf16", "--gpu", "a100-80gb")
    assert code == 0, data


def test_bert_with_a_padding_mask(capsys, monkeypatch):
    """A padded batch takes the mask builders' padded path: a (B, 1, N, N) mask reaches
    every attention call (eager: added to the scores)."""
    options = ("--input", "input_ids=B,N:int64", "--input", "attention_mask=B,N:int64:padded",
               "--batch", "2", "--seq", "128")
    code, data = run(capsys, monkeypatch, "bert.py:encoder", *options, attn="eager")
    assert code == 0, data
    code, data = run(capsys, monkeypatch, "bert.py:encoder", *options, attn="sdpa")
    assert code == 0, data  # the padding mask on a fused kernel (memcalc.tracing.cuda_paths)


def test_flex_attention_says_its_compiled_block_mask_cannot_be_followed(capsys, monkeypatch):
    """Hugging Face's flex path builds its BlockMask with create_block_mask(_compile=True):
    one line naming the user's line and the library's (its flex_attention calls would run
    the flex model: memcalc.tracing.flex)."""
    code, err = run(capsys, monkeypatch, "llama.py:attention", *LLAMA_X, attn="flex_attention")
    assert code == 2 and err.count("\n") == 1
    assert "(in transformers/masking_utils.py:" in err
    assert "create_block_mask compiled (torch.compile, or _compile=True): its kernel's " \
           "buffers are not modelled" in err


def test_oom_solves_the_length_of_a_traced_module(capsys, monkeypatch):
    """GPT-2's eager attention from hidden states (no fused kernel: sizes are polynomials
    in N), solved for N on a 2 GiB budget, and checked by tracing N and N + 1 directly."""
    monkeypatch.setenv("ATTN_IMPLEMENTATION", "eager")
    args = [f"{EXAMPLES}/gpt2.py:attention", "--input", "x=B,N,768", "--batch", "1",
            "--gpu-gb", "2", "--json"]
    assert main(["oom", "--trace", *args]) == 0
    n = json.loads(capsys.readouterr().out)["results"][0]["max_seq_len"]
    fits = []
    for seq in (n, n + 1):
        assert main(["trace", *args, "--seq", str(seq)]) == 0
        fits.append(json.loads(capsys.readouterr().out)["fits"])
    assert fits == [True, False]
    assert os.environ["ATTN_IMPLEMENTATION"] == "eager"


def test_llama_attention_with_flash_attention_2_calls_the_flash_attn_stand_in(
        capsys, monkeypatch):
    """attn_implementation="flash_attention_2" without flash-attn installed nor a GPU: while
    the trace runs, transformers takes the package as there (memcalc.tracing.hf_flash), and
    its flash_attn_func is the stand-in, which saves the (B, H, N) float32 softmax_lse:
    1 x 32 x 256 x 4 B = 32,768 B. Afterwards transformers' checks and its cache of the
    imported functions are as they were."""
    from transformers import modeling_flash_attention_utils as fa_utils

    before = (fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"],
              fa_utils.is_flash_attn_2_available, fa_utils._loaded_implementation)
    code, data = run(capsys, monkeypatch, "llama.py:attention", *LLAMA_X,
                     attn="flash_attention_2")
    assert code == 0, data
    assert "flash_attn_func (1, 256, 32, 128) bfloat16 causal: memcalc's flash-attn model " \
           "(flash-attn 2.8.3)" in data["notes"]
    lse = [(c["shape"], c["bytes"]) for c in data["saved"] if c["name"].startswith("flash-attn lse")]
    assert lse == [([1, 32, 256], 32_768)]
    assert (fa_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"],
            fa_utils.is_flash_attn_2_available, fa_utils._loaded_implementation) == before


def test_a_padded_batch_under_flash_attention_2_is_one_line(capsys, monkeypatch):
    """Unpadding picks rows by the mask's values (nonzero), which the meta device does not
    hold."""
    code, err = run(capsys, monkeypatch, "llama.py:causal_lm", "--input", "input_ids=B,N:int64",
                    "--input", "attention_mask=B,N:int64:padded", "--input",
                    "labels=B,N:int64", "--batch", "1", "--seq", "128", "--autocast", "bf16",
                    "--gpu", "a100-80gb", attn="flash_attention_2")
    assert code == 2 and err.count("\n") == 1 and "_get_unpad_data" in err


def test_llama_attention_with_flash_attention_3_on_hopper(capsys, monkeypatch):
    options = [o if o != "a100-80gb" else "h100-80gb" for o in LLAMA_X]
    code, data = run(capsys, monkeypatch, "llama.py:attention", *options,
                     attn="flash_attention_3")
    assert code == 0, data
    assert "flash_attn_interface.flash_attn_func (1, 256, 32, 128) bfloat16 causal: " \
           "memcalc's flash-attn3 model" in data["notes"]
