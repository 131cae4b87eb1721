"""Run ``relserve serve`` as a child process on free loopback ports (benchmarks and tests).

    with ServerProcess(["--model", "sentiment=defaults/sentiment,max_batch_size=1"]) as srv:
        srv.target        # "127.0.0.1:<port>"
        srv.metrics_url   # "http://127.0.0.1:<port>/metrics"

The server binds port 0 (gRPC and metrics) and the ports are read from its log lines, so no port is
guessed. The log goes to a temporary file (``srv.log_text()``); ``stop()`` sends SIGTERM and waits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

_SERVING = re.compile(r"serving on \S+:(\d+)")
_METRICS = re.compile(r"metrics on http://[^:]+:(\d+)/metrics")
_BOUND = re.compile(r"gRPC bound on \S+:(\d+)")


class ServerProcess:
    """``python -m relserve.service.main serve --host 127.0.0.1 --port 0 --metrics-port 0 <args>``.

    Args:
        args: extra ``serve`` flags (``--model ...``, ``--drain-timeout ...``).
        env: extra environment (e.g. ``OMP_NUM_THREADS``).
        start_timeout: seconds to wait for "serving on" in the log.
    """

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, start_timeout: float = 120.0,
                 python: str = sys.executable, new_session: bool = False) -> None:
        self.args = list(args)
        self.new_session = new_session  # its own process group, as a service manager starts it (killpg reaches all)
        self.env = {**os.environ, **(env or {})}
        self.start_timeout = start_timeout
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.host = "127.0.0.1"  # what the server binds and clients dial
        self._log = tempfile.NamedTemporaryFile("w+", prefix="relserve-", suffix=".log", delete=False)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def command(self) -> list[str]:
        """The child's command line (a subclass may run something else that logs the same lines)."""
        return [self.python, "-m", "relserve.service.main", "serve", "--host", self.host, "--port", "0",
                "--metrics-port", "0", *self.args, "--log-level", "INFO"]  # ports are read from INFO lines

    def start(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=self.new_session)
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            text = self.log_text()
            m = _METRICS.search(text)
            if m:
                self.metrics_port = int(m.group(1))
            m = _SERVING.search(text)
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"relserve exited with {self.proc.returncode} before serving:\n{text[-4000:]}")
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"relserve did not report 'serving on' within {self.start_timeout} s:\n"
                           f"{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        """Send SIGTERM (drain) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait up to ``timeout`` (then kill). Returns the exit code."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
