"""Figures from request records: percentiles, token rates and the throughput convention.

* TTFT: request sent -> first token line. ITL: gaps between a stream's consecutive token
  lines, pooled over the streams. E2E: request sent -> the request's last line.
* ``output_tokens_per_s``: every output token of the run / the run's wall time (first send
  to last completion).
* ``decode_tokens_per_s_per_stream``: median over streams of (tokens - 1) / (last token -
  first token), the decode rate a client sees once its stream has started.
* ``throughput_seq_tokens_per_s``: the Neuron samples' convention (seed 003), batch_size x
  sequence_length / end-to-end latency, where sequence_length counts prompt + generated
  tokens and the latency is the run's wall time; for mixed lengths, the sum of every
  request's prompt + generated tokens over the wall time.
"""
from __future__ import annotations

import statistics
from collections import Counter
from typing import Dict, Iterable, List, Optional

import numpy as np

from scripts.streaming_client import RequestRecord


def percentiles(values: Iterable[float], scale: float = 1000.0) -> Optional[Dict[str, float]]:
    data = np.asarray(list(values), dtype=float) * scale
    if data.size == 0:
        return None
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3),
            "mean": round(float(data.mean()), 3), "min": round(float(data.min()), 3),
            "max": round(float(data.max()), 3), "n": int(data.size)}


def summarize(records: List[RequestRecord], **labels) -> dict:
    ok = [r for r in records if r.ok]
    errors = [r.error for r in records if not r.ok]
    out = dict(labels)
    out.update(requests=len(records), ok=len(ok), errors=len(errors), error_samples=errors[:3])
    if not ok:
        return out
    wall = max(r.end for r in ok) - min(r.start for r in ok)
    tokens = sum(r.output_tokens for r in ok)
    seq_tokens = sum(r.output_tokens + r.input_tokens for r in ok)
    rates = [x for x in (r.decode_tokens_per_s() for r in ok) if x]
    itls = [gap for r in ok for gap in r.itls()]
    out.update(
        wall_s=round(wall, 4),
        total_output_tokens=tokens,
        short_streams=sum(1 for r in ok if r.output_tokens != r.requested_tokens),
        # the server's own token count differs from the tokens the client saw stream in
        streamed_vs_reported=sum(1 for r in ok if r.reported_tokens is not None and r.reported_tokens != len(r.token_times)),
        finish_reasons=dict(Counter(str(r.finish_reason) for r in ok)),
        ttft_ms=percentiles(r.ttft for r in ok),
        itl_ms=percentiles(itls),
        e2e_ms=percentiles(r.e2e for r in ok),
        output_tokens_per_s=round(tokens / wall, 3) if wall > 0 else None,
        decode_tokens_per_s_per_stream=round(statistics.median(rates), 3) if rates else None,
        throughput_seq_tokens_per_s=round(seq_tokens / wall, 3) if wall > 0 else None,
    )
    return out
