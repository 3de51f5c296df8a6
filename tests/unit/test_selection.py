import math

import torch

from llama_engine.params import SamplingParams
from llama_engine.selection import TokenSelector, select_token_lists, select_tokens


def test_greedy_rows_take_the_argmax_with_its_logprob_and_padding_rows_are_ignored():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    tokens, logprobs = select_tokens(logits, [TokenSelector(SamplingParams()), TokenSelector(SamplingParams()), None])
    assert tokens.tolist()[:2] == [1, 0]
    assert math.isclose(logprobs[0], float(logits[0].log_softmax(-1)[1]), rel_tol=1e-6)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(do_sample=True, temperature=1.5, seed=7)
    alone, _ = TokenSelector(params).choose(logits[1])
    sel = [TokenSelector(SamplingParams(do_sample=True, seed=1)), TokenSelector(params), TokenSelector(SamplingParams())]
    batched, _ = select_tokens(logits, sel)
    assert batched[1].item() == alone


def test_unseeded_sampling_reports_the_seed_it_drew():
    selector = TokenSelector(SamplingParams(do_sample=True))
    assert isinstance(selector.seed, int)
    assert TokenSelector(SamplingParams()).seed is None


def test_top_k_keeps_exactly_k_tokens_when_the_kth_logit_ties():
    """Logits tied at the k-th (as bf16 logits often are): top-k keeps k of them, not every tied one."""
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, -2.0])
    selector = TokenSelector(SamplingParams(do_sample=True, top_k=2, seed=0, logprobs=5))
    chosen = {selector.choose(logits)[0] for _ in range(200)}
    assert len(selector.top) == 2 and selector.top[0][0] == 0
    assert chosen <= {0, selector.top[1][0]} and selector.top[1][0] in (1, 2, 3)


def test_tied_top_tokens_are_listed_and_cut_as_argmax_breaks_ties():
    """Listed alternatives of equal log-probability come lowest id first, the greedy pick among them first, and
    a tie at the cut keeps the lowest ids (``torch.topk`` orders and picks tied values in no set way)."""
    logits = torch.tensor([0.0, 2.0, -1.0, 2.0, 2.0, 1.0, 2.0])
    for k, want in ((7, [1, 3, 4, 6, 5, 0, 2]), (3, [1, 3, 4]), (5, [1, 3, 4, 6, 5]), (1, [1])):
        selector = TokenSelector(SamplingParams(logprobs=k))
        token, _ = selector.choose(logits)
        assert token == 1 and [i for i, _ in selector.top] == want
        assert all(a[1] >= b[1] for a, b in zip(selector.top, selector.top[1:]))
    tokens, _ = select_tokens(logits.unsqueeze(0), [TokenSelector(SamplingParams(logprobs=2))])
    assert tokens.tolist() == [1]


def test_top_k_and_top_p_restrict_the_choices():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top_k = TokenSelector(SamplingParams(do_sample=True, top_k=2, seed=0))
    assert {top_k.choose(logits)[0] for _ in range(200)} <= {0, 1}
    top_p = TokenSelector(SamplingParams(do_sample=True, top_p=0.5, seed=0))
    warped = top_p.warp(logits)
    assert torch.isinf(warped[1:]).all() and torch.isfinite(warped[0])
    samples = {TokenSelector(SamplingParams(do_sample=True, seed=s)).choose(logits)[0] for s in range(200)}
    assert len(samples) >= 3


def test_repetition_penalty_pushes_greedy_away_from_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    plain, _ = select_tokens(logits, [TokenSelector(SamplingParams(), prompt_ids=[0])])
    penalised = TokenSelector(SamplingParams(repetition_penalty=1.5), prompt_ids=[0])
    chosen, _ = select_tokens(logits, [penalised])
    assert plain.item() == 0 and chosen.item() == 1
    # the chosen token is now penalised too: next time the first one wins again
    again, _ = select_tokens(torch.tensor([[2.0, 1.9, -1.0]]), [penalised])
    assert again.item() == 0


def test_negative_logits_are_multiplied_by_the_penalty():
    selector = TokenSelector(SamplingParams(repetition_penalty=2.0), prompt_ids=[2])
    out = selector.penalise(torch.tensor([1.0, 1.0, -1.0]))
    assert out.tolist() == [1.0, 1.0, -2.0]


def test_token_lists_take_the_backends_greedy_picks_only_where_every_row_is_plain_greedy():
    """A backend's picks stand for the argmax and its logprob, so they are taken as they are (here they differ
    from the logits' argmax, to tell them apart); a row that samples, penalises or lists its top tokens has its
    choice computed from the logits, and so do picks of another row count."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    picks = ([2, 1], [-0.5, -0.25])
    greedy = TokenSelector(SamplingParams())
    assert select_token_lists(logits, [greedy, None], picks) == ([2, 1], [-0.5, -0.25])
    want_tokens, want_logprobs = select_tokens(logits, [greedy, greedy])
    assert select_token_lists(logits, [greedy, greedy]) == (want_tokens.tolist(), want_logprobs)
    for other in (SamplingParams(do_sample=True, seed=1), SamplingParams(repetition_penalty=1.5),
                  SamplingParams(logprobs=2)):
        tokens, logprobs = select_token_lists(logits, [greedy, TokenSelector(other)], picks)
        assert tokens[0] == want_tokens[0] == 1 and logprobs[0] == want_logprobs[0]
    assert select_token_lists(logits, [greedy, greedy], ([2], [-0.5])) == (want_tokens.tolist(), want_logprobs)
