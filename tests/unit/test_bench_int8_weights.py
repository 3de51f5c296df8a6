"""scripts/bench/int8_weights.py on the tiny model: a script that prints figures (their values are not
asserted), run end to end with the fewest rounds; and its perplexity, which is what the figures' quality line
rests on, checked against the plain model's own loss."""
import math

import pytest
import torch

from llama_engine.backends import cpu_kernels
from scripts.bench import int8_weights

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="int8 weights need the native CPU kernels")


def test_it_prints_each_figure_for_both_sides(tiny_model_dir, capsys):
    assert int8_weights.main(["--model", str(tiny_model_dir), "--rounds", "1", "--steps", "2", "--greedy", "4",
                              "--batches", "1,2", "--prefills", "16", "--perplexity-tokens", "40"]) == 0
    out = capsys.readouterr().out
    for line in ("first logits after 16 tokens", "greedy tokens: the first", "perplexity over 40 tokens",
                 "decode, 1 row(s): default", "decode, 2 row(s): default", "prefill of 16 tokens: default"):
        assert line in out, line
    assert out.count("int8") >= 5


def test_its_decode_blocks_fit_the_positions_without_a_perplexity_pass(tiny_model_dir, capsys):
    """The slots hold the decode blocks' prompt and steps too: with no perplexity pass to size them, 30 steps
    after a 16-token prompt once ran past max_length."""
    assert int8_weights.main(["--model", str(tiny_model_dir), "--rounds", "1", "--steps", "30", "--greedy", "2",
                              "--batches", "1", "--prefills", "16", "--perplexity-tokens", "0"]) == 0
    assert "decode, 1 row(s): default" in capsys.readouterr().out


def test_perplexity_is_the_exponent_of_the_mean_loss_of_each_next_token(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids = int8_weights.held_out_ids(tiny_model_dir, 30)
    assert len(ids) == 30
    backend = int8_weights.load(tiny_model_dir, "auto", 1, 64)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=backend.dtype, use_safetensors=True)
    with torch.inference_mode():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
        got = int8_weights.perplexity(backend, ids)
    assert got == pytest.approx(math.exp(float(loss)), rel=2e-3)
