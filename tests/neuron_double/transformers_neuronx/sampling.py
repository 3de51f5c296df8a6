"""Test double of ``transformers_neuronx/sampling.py`` (aws-neuron/transformers-neuronx, 0.13.x).

Re-implements, with the real semantics, the host-side sampling loops that
``LlamaForSampling.sample`` uses:

* ``sample_llama`` validates ``top_k`` (positive int) and ``top_p`` (float in (0, 1]),
  encodes the prompt, then runs ``sample_loop_llama``;
* ``sample_loop_llama`` rejects a ``temperature`` that is not a positive *float*
  (after the prompt was encoded, as the real loop does), samples with
  ``top_k``/``top_p`` (``top_k=1`` is greedy), keeps one done flag per row and
  fills a finished row with the first EOS id, calls ``streamer.put(LongTensor[B, 1])``
  once per new token (never with the prompt) and ``streamer.end()`` once;
* ``sample_tokens`` is the loop for on-device generation (the model returns tokens);
* ``select_tokens`` samples ``[B, 1]`` tokens.  Like the real function it ignores
  its ``temperature`` argument.
"""
from typing import Optional

import torch

from transformers_neuronx.config import GenerationConfig
from transformers_neuronx.stopping_criteria import StoppingCriteriaList


def validate_top_k_top_p_min_tokens_to_keep(top_k, top_p, min_tokens_to_keep):
    if top_k is not None and (not isinstance(top_k, int) or not (top_k > 0)):
        raise ValueError('top_k has to be a strictly positive int.')
    if top_p is not None and (not isinstance(top_p, float) or not (0.0 < top_p <= 1.0)):
        raise ValueError('top_p has to be a strictly positive float that less than or equal to 1.0.')
    if min_tokens_to_keep is not None and (not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 0):
        raise ValueError('min_tokens_to_keep has to be a non-negative int.')


def validate_no_repeat_ngram_size(ngram_size):
    if ngram_size and (not isinstance(ngram_size, int) or ngram_size <= 0):
        raise ValueError(f"`ngram_size` has to be a strictly positive integer, but is {ngram_size}")


def _top_p(values, indices, top_p, min_tokens_to_keep, vocab):
    """Keep the smallest prefix of each (descending) row whose probability mass reaches
    ``top_p``; columns no row keeps are dropped, the rest of a row is set to -inf."""
    cumulative = torch.cumsum(torch.softmax(values, dim=-1, dtype=torch.float32), dim=-1)
    keep = torch.cat([torch.ones_like(cumulative[:, :1], dtype=torch.bool), cumulative[:, :-1] < top_p], dim=-1)
    keep[:, :min_tokens_to_keep] = True
    n_keep = min(max(int(keep.sum(dim=-1).max()), min_tokens_to_keep), vocab)
    values = values[:, :n_keep].clone()
    values[~keep[:, :n_keep]] = -float('inf')
    return values, indices[:, :n_keep]


def top_k_top_p_filtering(scores, top_k, top_p, min_tokens_to_keep=1):
    """Return ``(values, token_ids)`` of the candidate tokens, best first."""
    validate_top_k_top_p_min_tokens_to_keep(top_k, top_p, min_tokens_to_keep)
    vocab = scores.size(-1)
    if (top_k is None and top_p is None) or min_tokens_to_keep > vocab:
        return scores, torch.arange(vocab).repeat(scores.size(0), 1)
    if top_k is not None:
        values, indices = torch.topk(scores, min(max(top_k, min_tokens_to_keep), vocab))
        if top_p is None:
            return values, indices
    else:
        values, indices = torch.sort(scores, descending=True)
    return _top_p(values, indices, top_p, min_tokens_to_keep, vocab)


def filter_ngrams(ngram_size, input_ids, next_token_scores, cur_len):
    """Ban tokens that would repeat an n-gram already present in each row (HF rule)."""
    if cur_len + 1 < ngram_size:
        return next_token_scores
    for row, tokens in enumerate(input_ids.tolist()):
        seen = {}
        for gram in zip(*[tokens[i:] for i in range(ngram_size)]):
            seen.setdefault(tuple(gram[:-1]), []).append(gram[-1])
        prefix = tuple(tokens[cur_len + 1 - ngram_size:cur_len])
        next_token_scores[row, seen.get(prefix, [])] = -float("inf")
    return next_token_scores


def _sample(scores, top_k, top_p):
    values, indices = top_k_top_p_filtering(scores, top_k=top_k, top_p=top_p)
    probs = torch.softmax(values, dim=-1, dtype=torch.float32)
    chosen = torch.multinomial(probs, num_samples=1, replacement=True)
    return torch.gather(indices, 1, chosen), probs


def _stream(streamer, tokens, token):
    if streamer is not None and getattr(streamer, 'response_with_prefix', False):
        streamer.put(torch.cat(tokens, dim=-1))
    elif streamer:
        streamer.put(token)


def sample_loop_llama(model, input_ids, start_ids, next_token_scores, sequence_length, eos_token_id=2,
                      top_k=50, top_p=1.0, temperature=1.0, streamer=None, stopping_criteria_list=None,
                      ngram_size=None, cache_ids=None):
    validate_top_k_top_p_min_tokens_to_keep(top_k, top_p, None)
    if not isinstance(temperature, float) or not (temperature > 0):
        raise ValueError('temperature has to be a strictly positive float.')
    stopping_criteria_list = stopping_criteria_list if stopping_criteria_list is not None else StoppingCriteriaList()
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, dtype=torch.int32)
    done = torch.full((input_ids.size(0), 1), False)
    tokens = [input_ids]
    start_length = input_ids.shape[1]
    if cache_ids is None:
        cache_ids = torch.as_tensor([start_length - 1], dtype=torch.int32)
    else:
        start_length = max(cache_ids.flatten()).item() + 1

    for current_length in range(start_length, sequence_length):
        if ngram_size:
            next_token_scores = filter_ngrams(ngram_size, torch.cat(tokens, dim=-1), next_token_scores, current_length)
        if temperature != 1.0:
            next_token_scores /= temperature
        inputs, probs = _sample(next_token_scores, top_k, top_p)
        is_eos = torch.isin(inputs, eos)
        done = done | is_eos
        # A finished row keeps emitting the first EOS id; the model still sees `inputs`.
        token = torch.where(done & ~is_eos, eos[0], inputs)
        tokens.append(token)
        _stream(streamer, tokens, token)
        if current_length + 1 > sequence_length or done.all():
            break
        if stopping_criteria_list(input_ids, probs):
            break
        cache_ids = cache_ids + 1
        next_token_scores = model(inputs, cache_ids, start_ids)

    if streamer:
        streamer.end()
    return torch.cat(tokens, dim=-1)


@torch.no_grad()
def sample_llama(model, input_ids, start_ids, sequence_length, eos_token_id=2, top_k=50, top_p=1.0, temperature=1.0,
                 streamer=None, stopping_criteria_list=None, no_repeat_ngram_size=None, cache_ids=None):
    validate_top_k_top_p_min_tokens_to_keep(top_k, top_p, None)
    next_token_scores = model(input_ids, cache_ids, start_ids)
    if cache_ids is not None and model.neuron_config.use_2d_cache_ids:
        cache_ids = cache_ids.max(dim=1, keepdim=True).values
    if model.context_hook is not None:
        model.context_hook()
    return sample_loop_llama(
        model, input_ids, start_ids, next_token_scores, sequence_length, eos_token_id, top_k, top_p, temperature,
        streamer, stopping_criteria_list, ngram_size=no_repeat_ngram_size, cache_ids=cache_ids)


@torch.no_grad()
def sample_tokens(model, input_ids, start_ids=None, *, sequence_length: int = 128,
                  config: Optional[GenerationConfig] = None, streamer=None, cache_ids=None):
    """Loop for on-device generation: ``model(...)`` returns the next tokens ``[B, 1]``."""
    batch_size, start = input_ids.shape
    next_tokens = model(input_ids, cache_ids, start_ids)
    tokens = [input_ids]
    config = config if config is not None else GenerationConfig()
    eos = None
    if config.eos_token_id is not None:
        ids = config.eos_token_id
        eos = torch.tensor([ids] if isinstance(ids, int) else ids, dtype=torch.int32)
        done = torch.full((batch_size, 1), False)
    for current in range(start + 1, sequence_length + 1):
        if eos is not None:
            is_eos = torch.isin(next_tokens, eos)
            done |= is_eos
            if batch_size > 1:
                next_tokens[done & ~is_eos] = eos[0]
        tokens.append(next_tokens)
        if streamer:
            streamer.put(next_tokens)
        if (eos is not None and done.all()) or current >= sequence_length:
            break
        cache_ids = torch.as_tensor([current - 1], dtype=torch.int32)
        if model.neuron_config and model.neuron_config.use_2d_cache_ids:
            cache_ids = cache_ids.unsqueeze(0).expand(batch_size, 1)
        next_tokens = model(next_tokens, cache_ids, start_ids)
    if streamer:
        streamer.end()
    return torch.cat(tokens, dim=-1)


def select_tokens(next_token_scores, top_k=1, top_p=1.0, temperature=1.0):
    """Sample ``[B, 1]`` token ids; ``temperature`` is accepted and ignored (real behaviour)."""
    values, indices = top_k_top_p_filtering(next_token_scores, top_k=top_k, top_p=top_p)
    probs = torch.softmax(values, dim=-1)
    return torch.gather(indices, 1, torch.multinomial(probs, num_samples=1, replacement=True))
