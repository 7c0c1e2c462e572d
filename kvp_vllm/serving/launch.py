"""Start a `kvp-vllm serve` process, wait until it answers, stop it with its whole process group.
Shared by the test suite and the serving benchmark."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(model, args, log) as url:` a live server at `url` (http://127.0.0.1:port)."""

    def __init__(self, model: str, args: Sequence[str], log: Path, env: Optional[Dict[str, str]] = None,
                 start_timeout: float = 420.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.cmd: List[str] = [sys.executable, "-m", "kvp_vllm.serving.cli", "serve", str(model), *args,
                               "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = dict(os.environ)
        # CPU: size the KV pool explicitly (GiB); otherwise vLLM reserves a share of all memory.
        self.env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # the CLI makes a fresh one per server
        self.env.update(env or {})
        self.start_timeout = start_timeout
        self.proc: Optional[subprocess.Popen] = None

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def start(self) -> str:
        import requests

        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        deadline = time.time() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start in {self.start_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(1)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
