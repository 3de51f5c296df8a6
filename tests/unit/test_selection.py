import torch

from llama_engine.params import SamplingParams
from llama_engine.selection import TokenSelector, select_tokens


def test_greedy_rows_take_the_argmax_and_padding_rows_are_ignored():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    tokens = select_tokens(logits, [TokenSelector(SamplingParams()), TokenSelector(SamplingParams()), None])
    assert tokens.tolist()[:2] == [1, 0]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=1.5, seed=7)
    alone = [TokenSelector(params).sample(logits[1]) for _ in range(1)]
    sel = [TokenSelector(SamplingParams(do_sample=True, seed=1)), TokenSelector(params), TokenSelector(SamplingParams())]
    batched = select_tokens(logits, sel)
    assert batched[1].item() == alone[0]


def test_top_k_and_top_p_restrict_the_choices():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top_k = TokenSelector(SamplingParams(do_sample=True, top_k=2, seed=0))
    assert {top_k.sample(logits) for _ in range(200)} <= {0, 1}
    top_p = TokenSelector(SamplingParams(do_sample=True, top_p=0.5, seed=0))
    warped = top_p.warp(logits)
    assert torch.isinf(warped[1:]).all() and torch.isfinite(warped[0])
    samples = {TokenSelector(SamplingParams(do_sample=True, seed=s)).sample(logits) for s in range(200)}
    assert len(samples) >= 3
