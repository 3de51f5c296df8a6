"""A full job queue answers 503 at once, and the requests already admitted still complete."""
from __future__ import annotations

import pytest
import requests
import yaml

from conftest import MODEL, ROOT, build_model, burst_statuses
from tsctl import running

QUEUE = 2


@pytest.fixture(scope="module")
def small_queue_server(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("queue")
    data = yaml.safe_load((ROOT / "model-config" / f"{MODEL}.yaml").read_text())
    data.update(batchSize=1, maxBatchDelay=1, jobQueueSize=QUEUE)
    data["micro_batching"]["micro_batch_size"] = 1
    config = work / f"{MODEL}.yaml"
    config.write_text(yaml.safe_dump(data))
    build_model.main(["--config", str(config), "--checkpoint", str(tiny_model_dir), "--name", MODEL,
                      "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    with running(work / "ts", work / "store", models=MODEL) as ts:
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
