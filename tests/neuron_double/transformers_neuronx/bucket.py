"""Test double of ``transformers_neuronx/bucket.py`` (aws-neuron/transformers-neuronx).

Same bucket rules as the real module:

* token buckets: a list is used sorted; an int ``n`` gives powers of two from 128
  up to ``n`` plus ``n`` itself (``utils.power_of_two_bucket_sizes(128, n)``);
* context buckets: a list is used sorted; an int ``n > 0`` gives ``[n]``, ``n <= 0``
  disables context encoding; ``None`` gives half of every token bucket;
* ``find`` picks the smallest bucket that fits, or the largest one.
"""
import bisect
from typing import List, Optional, Union


def power_of_two_bucket_sizes(min_bucket_size: int, max_bucket_size: int) -> List[int]:
    """Mirror of ``utils.power_of_two_bucket_sizes``."""
    sizes = []
    size = min_bucket_size
    while size < max_bucket_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_bucket_size)
    return sizes


def token_sizes(buckets_or_size: Union[List[int], int]) -> List[int]:
    if isinstance(buckets_or_size, list):
        return sorted(buckets_or_size)
    return power_of_two_bucket_sizes(128, buckets_or_size)


def context_sizes(buckets_or_size: Optional[Union[List[int], int]],
                  token_buckets: Optional[List[int]] = None) -> List[int]:
    if isinstance(buckets_or_size, list):
        return sorted(buckets_or_size)
    if isinstance(buckets_or_size, int):
        return [] if buckets_or_size <= 0 else [buckets_or_size]
    if token_buckets is not None and buckets_or_size is None:
        return [bucket // 2 for bucket in token_buckets]
    # The real module raises NotImplementedError here; the double uses TypeError.
    raise TypeError(f'Prompt bucket config {buckets_or_size} not supported')


def batch_sizes(batch_size: Union[List[int], int]) -> List[int]:
    if isinstance(batch_size, int):
        return [batch_size]
    if isinstance(batch_size, list):
        return sorted(batch_size)
    raise TypeError("batch_size must be list of ints or int type")


def find(buckets: Optional[List[int]], size: int) -> Optional[int]:
    if not buckets:
        return None
    return buckets[bisect.bisect_left(buckets, size, hi=len(buckets) - 1)]
