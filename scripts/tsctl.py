#!/usr/bin/env python3
"""Start and stop a TorchServe of this project's, and find its inference key.

Used by ``make serve``/``make stop`` and by the end-to-end tests. Each server has its own
work directory: the config.properties derived from the repository's, the key_file.json that
token authorization writes into the start directory, the logs, and a private TMPDIR (also
passed to the JVM as java.io.tmpdir) so that model copies, sockets and pid files stay out of
the shared /tmp. The server is stopped by the PID of its process group.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, TypeVar

import requests

ROOT = Path(__file__).resolve().parent.parent
ADDRESS_KEYS = {"inference": "inference_address", "management": "management_address",
                "metrics": "metrics_address"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(names=("inference", "management", "metrics"), avoid=()) -> Dict[str, int]:
    """Distinct free loopback ports, one per name, none in ``avoid``.

    Each socket stays bound until all are chosen: ports chosen one by one and released in
    between can come back twice, and TorchServe then fails to bind its second listener.
    """
    with contextlib.ExitStack() as stack:
        chosen: Dict[str, int] = {}
        while len(chosen) < len(names):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in avoid:
                chosen[names[len(chosen)]] = port
        return chosen


class PortInUse(RuntimeError):
    """A server exited because one of its addresses was taken."""


T = TypeVar("T")


def retry_on_taken_port(start_once: Callable[[], T], stop: Callable[[], None], attempts: int = 3) -> T:
    """``start_once()``, which chooses its ports afresh from the second call on, until it raises no
    :class:`PortInUse` (up to ``attempts`` calls; ``stop()`` after each that did). A port chosen free
    can be taken by another process in the seconds before a server binds it."""
    for attempt in range(1, attempts + 1):
        try:
            return start_once()
        except PortInUse as exc:
            stop()
            if attempt == attempts:
                raise
            print(f"{exc.args[0].splitlines()[0]}; starting again on other free ports", file=sys.stderr)
    raise AssertionError("unreachable")


BIND_FAILURE = "Failed to bind to address"


def read_properties(path: Path) -> Dict[str, str]:
    props = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            props[key.strip()] = value.strip()
    return props


def read_key(workdir: Path, kind: str = "inference") -> str:
    with open(workdir / "key_file.json", encoding="utf-8") as f:
        return json.load(f)[kind]["key"]


# OpenMP threads that spin between torch ops take the cores TorchServe's frontend and the
# clients need between steps; on a 2-core machine that slowed continuous batching's decode
# 20-fold (docs/continuous-batching.md). libgomp reads this once, before torch is imported,
# so it has to be in the worker's environment.
OMP_WAIT_POLICY = "PASSIVE"
# PASSIVE alone puts a thread to sleep at every barrier, and a decode step has hundreds (llama.cpp
# syncs its threads after each graph node): waking them cost the llamacpp backend 14.7 against 11.0
# ms a token at one stream and 156 against 202-212 tokens/s at eight (bench model, bf16, 2 threads,
# Zen 5 EPYC, `--quick` runs). An explicit spin count overrides PASSIVE's zero in libgomp: a thread
# spins ~0.2 ms (its estimate is 100,000 spins a millisecond) before it sleeps, long enough to
# bridge the gaps inside a step, far shorter than the default 3 ms that starved the frontend.
GOMP_SPINCOUNT = "20000"


def read_log(workdir: Path, name: str) -> str:
    """The whole of TorchServe's log ``name`` (``ts_log``, ``model_log``, ...): the files log4j2.xml rolled
    it into (``<name>.<dd-MMM>.log.gz``, at midnight or at 100 MB), oldest first, then the current one.
    A server started before midnight has its first lines in yesterday's file."""
    logs = Path(workdir) / "logs"
    rolled = sorted(logs.glob(f"{name}.*.log.gz"), key=lambda p: p.stat().st_mtime)
    text = "".join(gzip.decompress(p.read_bytes()).decode(errors="replace") for p in rolled)
    current = logs / f"{name}.log"
    return text + (current.read_text(errors="replace") if current.exists() else "")


def _absolute_log_config(vmarg: str, base_dir: Path) -> str:
    """``-Dlog4j.configurationFile=PATH`` with PATH made absolute against ``base_dir`` (TorchServe
    starts in its work directory, where a path relative to the config would not resolve)."""
    prefix = "-Dlog4j.configurationFile="
    if not vmarg.startswith(prefix) or "://" in vmarg:
        return vmarg
    return prefix + str(base_dir / vmarg[len(prefix):])


class TorchServe:
    def __init__(self, workdir: Path, model_store: Path, models: Optional[str] = None,
                 ports: Optional[Dict[str, int]] = None, base_config: Path = ROOT / "config.properties",
                 extra: Optional[Dict[str, str]] = None, env: Optional[Dict[str, str]] = None):
        self.workdir = Path(workdir).resolve()
        self.model_store = Path(model_store).resolve()
        self.props = read_properties(base_config) if base_config is not None else {}
        if base_config is not None and self.props.get("metrics_config"):
            # TorchServe resolves it against its working directory, which is ``workdir``.
            self.props["metrics_config"] = str(Path(base_config).resolve().parent / self.props["metrics_config"])
        self.props["model_store"] = str(self.model_store)
        if models is not None:
            self.props["load_models"] = models
        self.extra_props = dict(extra or {})
        # Ports a caller passed were free when chosen; start_ready chooses again if one was taken since.
        self.ports_chosen = bool(ports)
        if ports:
            self.use_ports(ports)
        self.props.update(self.extra_props)
        self.tmpdir = self.workdir / "tmp"
        base_dir = Path(base_config).resolve().parent if base_config is not None else ROOT
        self.props["vmargs"] = " ".join([_absolute_log_config(arg, base_dir) for arg in self.props.get("vmargs", "").split()]
                                        + [f"-Djava.io.tmpdir={self.tmpdir}"])
        self.extra_env = dict(env or {})
        self.process: Optional[subprocess.Popen] = None
        self.started_at: Optional[float] = None

    def use_ports(self, ports: Dict[str, int]) -> None:
        """Listen on ``ports``, and on free gRPC ports (a second server must not collide on
        TorchServe's default gRPC ports either), except where the extra properties say otherwise."""
        chosen = {ADDRESS_KEYS[name]: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        grpc = free_ports(("grpc_inference_port", "grpc_management_port"), avoid=set(ports.values()))
        chosen.update((key, str(port)) for key, port in grpc.items())
        self.props.update((key, value) for key, value in chosen.items() if key not in self.extra_props)

    def url(self, api: str = "inference") -> str:
        return self.props[ADDRESS_KEYS[api]]

    @property
    def key(self) -> str:
        return read_key(self.workdir)

    def auth_headers(self, kind: str = "inference") -> Dict[str, str]:
        """Bearer headers, or none when token authorization is off (as in the SageMaker container)."""
        if not self.token_authorization:
            return {}
        return {"Authorization": f"Bearer {read_key(self.workdir, kind)}"}

    @property
    def token_authorization(self) -> bool:
        """On unless the properties turn it off, or (with enable_envvars_config) TS_DISABLE_TOKEN_AUTHORIZATION."""
        if self.props.get("disable_token_authorization") == "true":
            return False
        from_env = self.env().get("TS_DISABLE_TOKEN_AUTHORIZATION", "").lower() == "true"
        return not (self.props.get("enable_envvars_config") == "true" and from_env)

    def env(self) -> Dict[str, str]:
        """The server's environment. This interpreter's bin comes first on PATH, so that ``torchserve``
        and the workers' ``python`` are its environment's even when that is not activated."""
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
        env.update(TMPDIR=str(self.tmpdir), LOG_LOCATION=str(self.workdir / "logs"),
                   METRICS_LOCATION=str(self.workdir / "logs"))
        env.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
        env.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
        env.update(self.extra_env)
        return env

    def load_failure(self) -> str:
        """The worker's reason when initialize() raised, with the lines of the message after it."""
        lines = self.model_log().splitlines()
        for i, line in enumerate(lines):
            if "Failed to load model" in line:
                tail = [entry.split("MODEL_LOG - ", 1)[-1] for entry in lines[i:i + 12]]
                return "\n".join(t for t in tail if not t.startswith("Traceback"))
        return ""

    def model_log(self) -> str:
        return read_log(self.workdir, "model_log")

    def start(self, log_name: str = "torchserve.out") -> subprocess.Popen:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in self.props.items()))
        cmd = ["torchserve", "--start", "--foreground", "--ncs", "--ts-config", str(config),
               "--model-store", str(self.model_store)]
        self.started_at = time.perf_counter()  # of the last start, the one start_ready kept
        with open(self.workdir / log_name, "wb") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(cmd, cwd=self.workdir, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self.process

    def bind_failure(self) -> str:
        """The frontend's "Failed to bind to address: ..." line, if it printed one. It goes to the
        console only: ts_log.log shows nothing but a clean "Inference model server stopped"."""
        path = self.workdir / "torchserve.out"
        text = path.read_text(errors="replace") if path.exists() else ""
        return next((line.split("IOException: ", 1)[-1].strip() for line in text.splitlines()
                     if BIND_FAILURE in line), "")

    def start_ready(self, timeout: float = 300.0, attempts: int = 3, started=None) -> float:
        """start() and wait_ready(), again on newly chosen ports where ports chosen free were taken
        before the JVM bound them (:func:`retry_on_taken_port`); configured ports are tried once.
        ``started(process)`` is called after each start (``make serve`` records the pid)."""
        starts = 0

        def once() -> float:
            nonlocal starts
            if starts:  # the ports of the start before were taken
                self.use_ports(free_ports())
            starts += 1
            process = self.start()
            if started is not None:
                started(process)
            return self.wait_ready(timeout)

        return retry_on_taken_port(once, self.stop, attempts if self.ports_chosen else 1)

    def log_tail(self, n: int = 60) -> str:
        lines = []
        for name in ("torchserve.out", "logs/model_log.log", "logs/ts_log.log"):
            path = self.workdir / name
            if path.exists():
                lines += [f"--- {name}"] + path.read_text(errors="replace").splitlines()[-n:]
        return "\n".join(lines)

    def wait_ready(self, timeout: float = 300.0) -> float:
        """Poll /ping until the model's workers are up; fail fast if the process died."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process is not None and self.process.poll() is not None:
                taken = self.bind_failure()
                if taken:
                    raise PortInUse(f"torchserve could not listen: {taken} (address already in use)\n{self.log_tail()}")
                raise RuntimeError(f"torchserve exited with {self.process.returncode}\n{self.log_tail()}")
            failure = self.load_failure()
            if failure:
                failure = settled(self.load_failure, failure)
                raise RuntimeError(f"the model failed to load (TorchServe would retry it until startupTimeout):\n{failure}")
            try:
                headers = self.auth_headers()
                r = requests.get(self.url() + "/ping", headers=headers, timeout=2)
                if r.status_code == 200 and r.json().get("status") == "Healthy" and self._models_ready():
                    return time.monotonic() - started
            except (OSError, ValueError, KeyError, requests.RequestException):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"torchserve not ready after {timeout:.0f} s\n{self.log_tail()}")

    def _models_ready(self) -> bool:
        """Ping says Healthy before any model is loaded; ask the management API for workers."""
        mgmt = self.auth_headers("management")
        models = [m.split("=")[0] for m in self.props.get("load_models", "").split(",") if m and m != "ALL"]
        for model in models:
            r = requests.get(f"{self.url('management')}/models/{model}", headers=mgmt, timeout=2)
            if r.status_code != 200:
                return False
            workers = r.json()[0].get("workers", [])
            if not workers or any(w.get("status") != "READY" for w in workers):
                return False
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the whole process group, even when the launcher already exited: TorchServe's
        Python workers can outlive a frontend that died (a port already taken, say)."""
        if self.process is None:
            return
        stop_group(self.process.pid, timeout, reap=self.process.poll)
        self.process.wait(timeout=5)


def settled(read: Callable[[], str], text: str, interval: float = 0.3, limit: float = 5.0) -> str:
    """``read()`` again until two reads ``interval`` s apart agree, for at most ``limit`` s: the worker's
    multi-line error reaches the log a line at a time, and its first line is seen before the rest."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(interval)
        again = read()
        if again == text:
            break
        text = again
    return text


@contextlib.contextmanager
def running(workdir: Path, model_store: Path, models: Optional[str] = None, timeout: float = 300.0, **kwargs):
    """A TorchServe on free loopback ports, ready when entered and stopped by PID on exit."""
    server = TorchServe(workdir, model_store, models=models, ports=free_ports(), **kwargs)
    try:
        server.ready_seconds = server.start_ready(timeout)
        yield server
    finally:
        server.stop()


def stop_group(pid: int, timeout: float = 30.0, reap=None) -> None:
    """SIGTERM the process group led by ``pid``, then SIGKILL what is left.

    ``reap`` collects the leader when it is our child; an unreaped zombie would keep the
    group alive in the eyes of ``killpg(pid, 0)``, for both waits. Without one, a leader this
    process started (``tsctl start`` and ``stop`` called in one process) is reaped by its pid.
    """
    reap = reap or functools.partial(_reap_child, pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if reap is not None:
                reap()
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def _reap_child(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: its own parent reaps it
        pass


def load_models_value(models: str, model_store: Path) -> str:
    """TorchServe's ``load_models`` for a comma list of model names in ``model_store``.

    A name is served from its archive directory (``no-archive``), else from ``<name>.tar.gz``
    or ``<name>.mar``; a name with none of them is an error that says how to build it.
    """
    entries = []
    for name in [m.strip() for m in models.split(",") if m.strip()]:
        if (model_store / name).is_dir():
            entries.append(name)
            continue
        archive = next((f"{name}{ext}" for ext in (".tar.gz", ".mar") if (model_store / f"{name}{ext}").is_file()), None)
        if archive is None:
            raise FileNotFoundError(f"no model {name!r} in {model_store}; build it with `make build MODEL={name}`")
        entries.append(f"{name}={archive}")
    if not entries:
        raise ValueError("no model named; pass --models NAME[,NAME...]")
    return ",".join(entries)


def startup_timeout(load_models: str, model_store: Path, default: float = 600.0) -> float:
    """Seconds to wait for READY: the largest ``startupTimeout`` of the served archives' model-configs,
    plus a minute for the frontend and the worker's start, and never less than ``default``.

    A 7B Neuron config allows 1800 s to load; giving up sooner would stop a server that is
    still loading. Packed archives (``.tar.gz``, ``.mar``) are not opened: ``default`` applies.
    """
    import yaml

    longest = 0.0
    for entry in load_models.split(","):
        name = entry.split("=", 1)[0]
        manifest = model_store / name / "MAR-INF" / "MANIFEST.json"
        if not manifest.is_file():
            continue
        config_file = json.loads(manifest.read_text()).get("model", {}).get("configFile")
        if config_file and (model_store / name / config_file).is_file():
            config = yaml.safe_load((model_store / name / config_file).read_text()) or {}
            longest = max(longest, float(config.get("startupTimeout", 120)))
    return max(default, longest + 60)


def health(workdir: Path, timeout: float = 5.0) -> str:
    """What a readiness probe needs: /ping with the inference key, and every model's workers READY.

    TorchServe 0.12 answers /ping with 400 unless it carries the inference key, so a plain
    HTTP probe cannot be used while token authorization is on. Raises on anything unhealthy.
    """
    props = read_properties(workdir / "config.properties")
    server = TorchServe(workdir, Path(props["model_store"]), base_config=workdir / "config.properties")
    r = requests.get(server.url() + "/ping", headers=server.auth_headers(), timeout=timeout)
    if r.status_code != 200 or r.json().get("status") != "Healthy":
        raise RuntimeError(f"/ping answered {r.status_code}: {r.text.strip()[:200]}")
    if not server._models_ready():
        raise RuntimeError(f"not every model of load_models={props.get('load_models')} has a READY worker")
    return f"healthy: {props.get('load_models')}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Start and stop the local TorchServe, print its key, check its health.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    default_workdir = ROOT / "build" / "serve"
    start = sub.add_parser("start", help="start TorchServe in the background and wait until its models are READY")
    start.add_argument("--workdir", type=Path, default=default_workdir, help="config, keys, logs and pid file")
    start.add_argument("--model-store", type=Path, default=ROOT / "model_store", help="where the built archives are")
    start.add_argument("--models", help="comma list of model names to serve (default: load_models of config.properties)")
    start.add_argument("--timeout", type=float,
                       help="seconds to wait for READY (default: the models' largest startupTimeout + 60, at least 600)")
    start.add_argument("--free-ports", action="store_true",
                       help="listen on free loopback ports instead of config.properties' 8080-8082 (`tsctl url` tells them)")
    stop = sub.add_parser("stop", help="stop the server started from --workdir (by its process group)")
    stop.add_argument("--workdir", type=Path, default=default_workdir, help="the workdir given to start")
    key = sub.add_parser("key", help="print the inference key")
    key.add_argument("--workdir", type=Path, default=default_workdir, help="the workdir given to start")
    url = sub.add_parser("url", help="print the inference address of the server started from --workdir")
    url.add_argument("--workdir", type=Path, default=default_workdir, help="the workdir given to start")
    url.add_argument("--api", choices=sorted(ADDRESS_KEYS), default="inference", help="which API's address")
    probe = sub.add_parser("health", help="exit 0 when /ping (with the inference key) is Healthy and every model READY")
    probe.add_argument("--workdir", type=Path, default=default_workdir, help="the workdir given to start")
    probe.add_argument("--timeout", type=float, default=5, help="seconds per HTTP call")
    args = parser.parse_args(argv)

    if args.cmd == "key":
        print(read_key(args.workdir))
        return 0
    if args.cmd == "url":
        print(read_properties(args.workdir / "config.properties")[ADDRESS_KEYS[args.api]])
        return 0
    if args.cmd == "health":
        try:
            print(health(args.workdir, args.timeout))
            return 0
        except (OSError, ValueError, KeyError, RuntimeError, requests.RequestException) as exc:
            print(f"unhealthy: {exc}", file=sys.stderr)
            return 1
    pid_file = args.workdir / "torchserve.pid"
    if args.cmd == "stop":
        if not pid_file.exists():
            print("no server running (no pid file)")
            return 0
        stop_group(int(pid_file.read_text()))
        pid_file.unlink()
        print("torchserve stopped")
        return 0
    return start_server(args, pid_file)


def start_server(args, pid_file: Path) -> int:
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), 0)
            print(f"torchserve already running (pid {pid_file.read_text().strip()}); run `make stop` first")
            return 1
        except ProcessLookupError:
            pid_file.unlink()
    models = args.models or read_properties(ROOT / "config.properties").get("load_models", "")
    try:
        load_models = load_models_value(models, args.model_store)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    (args.workdir / "key_file.json").unlink(missing_ok=True)
    server = TorchServe(args.workdir, args.model_store, models=load_models,
                        ports=free_ports() if args.free_ports else None)
    try:
        seconds = server.start_ready(args.timeout or startup_timeout(load_models, args.model_store),
                                     started=lambda process: pid_file.write_text(str(process.pid)))
    except (RuntimeError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        if isinstance(exc, PortInUse):
            print("another process listens there: `make stop` stops a server started from this workdir, "
                  "`make serve SERVE_ARGS=--free-ports` listens on free ports", file=sys.stderr)
        server.stop()
        pid_file.unlink(missing_ok=True)
        return 1
    names = ", ".join(f"{server.url()}/predictions/{m.split('=')[0]}" for m in load_models.split(","))
    print(f"torchserve ready in {seconds:.1f} s (pid {server.process.pid}): {names}; "
          f"logs in {args.workdir}/logs, inference key in {args.workdir}/key_file.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
