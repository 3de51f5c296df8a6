"""A full job queue answers 503 at once, and the requests already admitted still complete."""
from __future__ import annotations

import pytest
import requests

from conftest import MODEL, burst_statuses, serve_variant

QUEUE = 2


def one_slot(data):
    data.update(batchSize=1, maxBatchDelay=1, jobQueueSize=QUEUE)
    data["micro_batching"]["micro_batch_size"] = 1


@pytest.fixture(scope="module")
def small_queue_server(tiny_model_dir, tmp_path_factory):
    with serve_variant(tmp_path_factory.mktemp("queue"), MODEL, tiny_model_dir, one_slot) as ts:
        yield ts


def test_requests_beyond_the_queue_get_503(small_queue_server):
    url = f"{small_queue_server.url()}/predictions/{MODEL}"
    headers = {"Authorization": f"Bearer {small_queue_server.key}"}
    statuses = burst_statuses(small_queue_server, MODEL, "The function returns")
    assert statuses.count(503) >= 1, statuses
    assert statuses.count(200) >= 1 and set(statuses) <= {200, 503}, statuses
    ok = requests.post(url, json={"inputs": "Hi", "stream": False, "parameters": {"max_new_tokens": 2}},
                       headers=headers, timeout=60)
    assert ok.status_code == 200
