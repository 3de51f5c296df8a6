"""A port taken between choosing it and TorchServe binding it.

The frontend then stops at once, logs only a clean "Inference model server stopped", and its
launcher exits 0; the cause is on its console. A server on ports chosen free starts again on
others; one on configured ports fails with the address that was taken, and `make serve` says
what to do.
"""
from __future__ import annotations

import contextlib
import errno
import socket

import pytest
import requests

from scripts import tsctl
from scripts.tsctl import PortInUse, TorchServe, free_ports, main

# load_models empty: the frontend is ready once it listens, no worker to wait for.
NO_MODELS = ""


@contextlib.contextmanager
def taken(port: int):
    """Listen on ``port`` meanwhile; if another process already does, it stays taken all the same."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        yield


def test_free_ports_are_distinct_and_avoid_the_ones_named():
    ports = free_ports(tuple(f"p{i}" for i in range(40)))
    assert len(set(ports.values())) == 40
    avoided = free_ports(("a", "b"), avoid=set(ports.values()))
    assert not set(avoided.values()) & set(ports.values())


def test_a_free_port_taken_before_the_bind_is_chosen_again(tmp_path, capsys):
    ports = free_ports()
    server = TorchServe(tmp_path / "ts", tmp_path, models=NO_MODELS, ports=ports)
    try:
        with taken(ports["management"]):
            server.start_ready(timeout=120)
            assert server.url("management") != f"http://127.0.0.1:{ports['management']}"
            ping = requests.get(server.url() + "/ping", headers=server.auth_headers(), timeout=10)
            assert ping.json()["status"] == "Healthy"
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert f"Failed to bind to address: http://127.0.0.1:{ports['management']}" in err
    assert "starting again on other free ports" in err


def test_a_configured_port_that_is_taken_fails_with_its_address(tmp_path):
    port = tsctl.free_port()
    config = tmp_path / "config.properties"
    config.write_text(f"inference_address=http://127.0.0.1:{port}\nmanagement_address=http://127.0.0.1:{tsctl.free_port()}\n")
    server = TorchServe(tmp_path / "ts", tmp_path, models=NO_MODELS, base_config=config)
    try:
        with taken(port), pytest.raises(PortInUse, match=f"could not listen: Failed to bind to address: http://127.0.0.1:{port}"):
            server.start_ready(timeout=120)
    finally:
        server.stop()


def test_make_serve_on_a_taken_port_says_what_to_do_and_leaves_no_pid_file(model_store, tmp_path, capsys):
    inference = tsctl.read_properties(tsctl.ROOT / "config.properties")["inference_address"]
    workdir = tmp_path / "serve"
    with taken(int(inference.rsplit(":", 1)[1])):
        rc = main(["start", "--workdir", str(workdir), "--model-store", str(model_store), "--models", "tiny-llama",
                   "--timeout", "120"])
    assert rc == 1
    err = capsys.readouterr().err
    assert f"Failed to bind to address: {inference}" in err
    assert "`make stop`" in err and "SERVE_ARGS=--free-ports" in err
    assert not (workdir / "torchserve.pid").exists()


def test_make_serve_on_free_ports_chooses_again_when_one_was_taken(model_store, tmp_path, capsys, monkeypatch):
    real_free_ports = tsctl.free_ports
    first = real_free_ports()
    calls = []

    def first_taken(names=("inference", "management", "metrics"), avoid=()):
        """The addresses' first choice is ``first``, as if another process took its port after."""
        calls.append(names)
        return first if len(calls) == 1 else real_free_ports(names, avoid)

    monkeypatch.setattr(tsctl, "free_ports", first_taken)
    workdir = tmp_path / "serve"
    try:
        with taken(first["inference"]):
            rc = main(["start", "--workdir", str(workdir), "--model-store", str(model_store), "--models", "tiny-llama",
                       "--free-ports"])
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "starting again on other free ports" in err
        url = tsctl.read_properties(workdir / "config.properties")["inference_address"]
        assert url != f"http://127.0.0.1:{first['inference']}"
        assert requests.get(url + "/ping", headers={"Authorization": f"Bearer {tsctl.read_key(workdir)}"},
                            timeout=10).json()["status"] == "Healthy"
    finally:
        assert main(["stop", "--workdir", str(workdir)]) == 0
