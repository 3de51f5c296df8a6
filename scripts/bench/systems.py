"""The servers under test: this project's TorchServe, and peers when their environments exist.

Every server listens on 127.0.0.1 on free ports, runs in its own process group with its own
log file under the run's work directory, and is stopped by the PID of that group (SIGTERM,
then SIGKILL). Peers are never installed or built here; they are detected:

* llama.cpp: a ``llama-server`` binary on PATH, in ``build/peers/`` or in
  ``build/peers/llama.cpp/build/bin/`` (for an emulated CPU class only
  ``build/peers/llama.cpp/build-<class>/bin/``), and a GGUF of the bench model at
  ``build/peers/bench-model-<bf16|f16|fp32>.gguf`` (or ``--llama-gguf``; for the bf16 checkpoint the
  16-bit type ``gguf_type: auto`` picks on this CPU, :func:`.plan.gguf_type_of`);
* vLLM: a virtual environment at ``build/peers/vllm-venv`` whose Python imports vllm; it
  serves the bench model's safetensors directory directly.
"""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import requests

from scripts.streaming_client import Adapter, TorchServeAdapter
from scripts.tsctl import PortInUse, retry_on_taken_port

from .clients import LlamaServerAdapter, OpenAICompletionsAdapter
from .plan import gguf_type_of
from .server_metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "build" / "peers"


class TorchServeSystem:
    name = "torchserve"

    def __init__(self, work: Path, config: Path, checkpoint: Path, model_name: str = "bench-llama"):
        self.work = Path(work)
        self.config = Path(config)
        self.checkpoint = Path(checkpoint)
        self.model_name = model_name
        self.store = self.work / "model_store"
        #: the server's properties (None: this repository's config.properties)
        self.base_config: Optional[Path] = None
        #: properties set over the base config's (``tsctl.TorchServe``'s ``extra``)
        self.extra_properties: Dict[str, str] = {}
        self.server = None
        self.timings: Dict[str, float] = {}

    def build(self) -> None:
        from scripts import build_model

        started = time.perf_counter()
        code = build_model.main(["--config", str(self.config), "--checkpoint", str(self.checkpoint),
                                 "--name", self.model_name, "--build-dir", str(self.work / "models" / self.model_name),
                                 "--export-path", str(self.store)])
        if code:
            raise RuntimeError(f"build_model failed with {code}")
        self.timings["archive_s"] = round(time.perf_counter() - started, 2)

    def start(self, timeout: float) -> Adapter:
        from scripts.tsctl import TorchServe, free_ports

        workdir = self.work / "torchserve"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        base = {} if self.base_config is None else {"base_config": self.base_config}
        self.server = TorchServe(workdir, self.store, models=self.model_name, ports=free_ports(),
                                 extra=self.extra_properties, **base)
        self.timings["ready_s"] = round(self.server.start_ready(timeout), 2)
        self.timings["start_to_ready_s"] = round(time.perf_counter() - self.server.started_at, 2)
        return TorchServeAdapter(self.server.url(), self.model_name, self.server.auth_headers())

    @property
    def pid(self) -> Optional[int]:
        return None if self.server is None or self.server.process is None else self.server.process.pid

    def metrics(self) -> ServerMetrics:
        """The handler's own figures, from TorchServe's metrics API (no key, loopback)."""
        return ServerMetrics(self.server.url("metrics"), self.model_name)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


#: What a peer's log says when its port was taken: llama-server's, and uvicorn's (vLLM) errno text.
PORT_TAKEN = ("couldn't bind http server socket", "address already in use")


class PortTaken(PortInUse):
    """A peer exited because another process had taken its port."""


class PeerSystem(ABC):
    """A peer server started from its own environment; subclasses say how."""

    name = "?"
    health_path = "/health"

    def __init__(self, work: Path):
        self.work = Path(work)
        self.process: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.timings: Dict[str, float] = {}

    @abstractmethod
    def detect(self) -> Tuple[bool, str]:
        ...

    @abstractmethod
    def command(self) -> List[str]:
        ...

    def env(self) -> Dict[str, str]:
        return dict(os.environ)

    @abstractmethod
    def adapter(self) -> Adapter:
        ...

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    def start(self, timeout: float, attempts: int = 3) -> Adapter:
        """Start on a free port and wait for health; a port taken before the peer bound it (its log
        says so) is chosen again (``tsctl.retry_on_taken_port``)."""
        return retry_on_taken_port(lambda: self._start_once(timeout), self.stop, attempts)

    def _start_once(self, timeout: float) -> Adapter:
        from scripts.tsctl import free_port

        self.port = free_port()
        self.work.mkdir(parents=True, exist_ok=True)
        log_path = self.work / f"{self.name}.log"
        started = time.perf_counter()
        with open(log_path, "wb") as log:  # the child keeps its own copy
            self.process = subprocess.Popen(self.command(), cwd=self.work, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        while time.perf_counter() - started < timeout:
            if self.process.poll() is not None:
                text = log_path.read_text(errors="replace").lower()
                error = PortTaken if any(marker in text for marker in PORT_TAKEN) else RuntimeError
                raise error(f"{self.name} exited with {self.process.returncode}; see {log_path}")
            try:
                if requests.get(self.base_url + self.health_path, timeout=2).status_code == 200:
                    self.timings["start_to_ready_s"] = round(time.perf_counter() - started, 2)
                    return self.adapter()
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s")

    def stop(self) -> None:
        from scripts.tsctl import stop_group

        if self.process is not None and self.process.poll() is None:
            stop_group(self.process.pid, 30, reap=self.process.poll)
            self.process.wait(timeout=5)


class LlamaCppSystem(PeerSystem):
    """llama.cpp's ``llama-server`` on a GGUF of the bench model: in the dtype served (``llama.cpp``),
    or quantized (``quant="q8_0"``: the separately labelled ``llama.cpp-q8_0`` row)."""

    def __init__(self, work: Path, dtype: str, threads: int, parallel: int, max_length: int,
                 gguf: Optional[Path] = None, quant: Optional[str] = None, decode_threads: Optional[int] = None,
                 cpu_class: Optional[str] = None, flash_attn: str = "auto"):
        self.name = "llama.cpp" if quant is None else f"llama.cpp-{quant}"
        super().__init__(work)
        self.dtype, self.threads, self.parallel, self.max_length = dtype, threads, parallel, max_length
        #: ``-fa``: llama-server's flash attention, ``auto`` (its default), ``on`` or ``off``
        self.flash_attn = flash_attn
        #: ``-t``: threads for a batch of one token (one stream decoding); ``-tb`` is ``threads``.
        self.decode_threads = decode_threads or threads
        suffix = quant or {"float32": "fp32"}.get(dtype) or gguf_type_of(dtype)
        self.gguf = Path(gguf) if gguf else PEERS / f"bench-model-{suffix}.gguf"
        self.binary: Optional[str] = None
        #: an emulated CPU class (the bench's --cpu-class): only a llama-server built for it will do
        self.cpu_class = cpu_class

    def detect(self):
        if self.cpu_class:
            built = PEERS / "llama.cpp" / f"build-{self.cpu_class}" / "bin" / "llama-server"
            candidates = [built]
            missing = (f"not installed (no llama-server built for CPU class {self.cpu_class} at {built}: "
                       f"make bench-peers BENCH_PEERS=llama-{self.cpu_class})")
        else:
            candidates = [shutil.which("llama-server"), PEERS / "llama-server",
                          PEERS / "llama.cpp" / "build" / "bin" / "llama-server"]
            missing = "not installed (no llama-server on PATH, in build/peers/ or build/peers/llama.cpp/build/bin/)"
        self.binary = next((str(c) for c in candidates if c and os.access(str(c), os.X_OK)), None)
        if self.binary is None:
            return False, missing
        if not self.gguf.exists():
            return False, (f"not installed: llama-server at {self.binary}, but no GGUF of the bench model at "
                           f"{self.gguf} (convert_hf_to_gguf.py build/bench-model-* --outfile {self.gguf})")
        return True, f"{self.binary} with {self.gguf}"

    def command(self):
        return [self.binary, "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-c", str(self.max_length * self.parallel), "-np", str(self.parallel),
                "-t", str(self.decode_threads), "-tb", str(self.threads), "-b", str(self.max_length),
                "-fa", self.flash_attn]

    def twin(self, work: Path, **changes) -> "LlamaCppSystem":
        """The same server (the binary and GGUF :meth:`detect` found for this one) with ``changes``
        (another ``flash_attn``, another ``gguf``), working in ``work``: its own process, port and timings."""
        twin = copy.copy(self)
        unknown = set(changes) - {"flash_attn", "gguf"}
        if unknown:
            raise TypeError(f"a llama-server twin differs in flash_attn or gguf, not {sorted(unknown)}")
        for name, value in changes.items():
            setattr(twin, name, Path(value) if name == "gguf" else value)
        twin.work, twin.process, twin.port, twin.timings = Path(work), None, None, {}
        return twin

    def adapter(self):
        return LlamaServerAdapter(self.base_url)


class VllmSystem(PeerSystem):
    name = "vllm"

    def __init__(self, work: Path, checkpoint: Path, dtype: str, max_num_seqs: int, max_length: int,
                 venv: Path = PEERS / "vllm-venv"):
        super().__init__(work)
        self.checkpoint, self.dtype, self.max_num_seqs, self.max_length = Path(checkpoint), dtype, max_num_seqs, max_length
        self.venv = Path(venv)
        self.served_name = "bench-llama"

    def detect(self):
        python = self.venv / "bin" / "python"
        if not python.exists():
            return False, f"not installed (no virtual environment at {self.venv})"
        probe = subprocess.run([str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
                               capture_output=True, text=True, timeout=300)
        if probe.returncode != 0:
            return False, f"not installed: {python} cannot import vllm ({probe.stderr.strip()[-200:]})"
        return True, f"vllm {probe.stdout.strip()} in {self.venv}"

    def command(self):
        return [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.checkpoint), "--served-model-name", self.served_name,
                "--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype,
                "--max-model-len", str(self.max_length), "--max-num-seqs", str(self.max_num_seqs)]
        # (vLLM 0.32 logs no requests by default; --disable-log-requests is gone from its CLI)

    def env(self):
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache on CPU
        env["PATH"] = f"{self.venv / 'bin'}:{env.get('PATH', '')}"
        return env

    def adapter(self):
        return OpenAICompletionsAdapter(self.base_url, self.served_name)
