"""Time a running process holds the GIL, by thread, from py-spy's GIL-only sampling.

    sampler = GilSampler(pid, seconds=10)     # starts ``py-spy record --gil --nonblocking`` on the process
    ...                                         # the load runs meanwhile
    report = sampler.result()                  # {"held_s": ..., "held_fraction": ..., "by_thread": {...}}

py-spy (https://github.com/benfred/py-spy, ``pip install py-spy``) samples the process ``rate`` times a second
without pausing it (``--nonblocking``); with ``--gil`` a sample is recorded only for the thread that holds the
GIL at that moment, so samples / rate estimates the seconds the GIL was held, and each thread's share of them.
Thread names are grouped into the server's roles (:func:`thread_role`): the gRPC event loop, the tokenizer
pools (``relserve-tok-*``), the model executors (``relserve-<model>_N``: backend calls) and the rest.

py-spy is a development tool, not a dependency: :func:`available` says whether it is on the PATH, and the
benchmarks print "n/a" without it. Attaching needs ptrace rights over the process (a child of the caller, or
``CAP_SYS_PTRACE``); a failed attach is reported as an error string in the result, not raised.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\): (?P<name>.*)$")


def available() -> str | None:
    """The py-spy executable (next to this interpreter first, then on the PATH), or None."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.is_file() else shutil.which("py-spy")


def thread_role(name: str) -> str:
    """``event loop`` (the main thread: the server's asyncio loop and gRPC handlers), ``tokenizer``,
    ``model executor`` or ``other`` (gRPC's poller, metrics HTTP, ...) for one thread name."""
    if name == "MainThread":
        return "event loop"
    if name.startswith("relserve-tok-"):
        return "tokenizer"
    if name.startswith("relserve-"):
        return "model executor"
    return "other"


def parse_raw(text: str, rate: float) -> dict[str, Any]:
    """py-spy ``--format raw --threads`` output (one ``thread (id): name;frame;...;frame count`` line per
    distinct stack) -> ``{"samples", "held_s", "by_thread": {name: s}, "by_role": {role: s}}``."""
    by_thread: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        first = stack.split(";", 1)[0]
        m = _THREAD.match(first)
        by_thread[m.group("name") if m else "?"] += int(count)
    by_role: Counter[str] = Counter()
    for name, n in by_thread.items():
        by_role[thread_role(name)] += n
    samples = sum(by_thread.values())
    return {"samples": samples, "held_s": samples / rate,
            "by_thread": {k: v / rate for k, v in by_thread.most_common()},
            "by_role": {k: v / rate for k, v in by_role.most_common()}}


class GilSampler:
    """``py-spy record --gil`` on ``pid`` for ``seconds`` at ``rate`` Hz, started at construction.

    Raises:
        RuntimeError: py-spy is not installed (check :func:`available` first).
    """

    def __init__(self, pid: int, seconds: float, rate: int = 200) -> None:
        exe = available()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install py-spy)")
        self.seconds, self.rate = seconds, rate
        self._dir = tempfile.TemporaryDirectory(prefix="relserve-gil-")
        self._out = Path(self._dir.name) / "gil.txt"
        self._proc = subprocess.Popen(
            [exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
             "--gil", "--nonblocking", "--threads", "--format", "raw", "--output", str(self._out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for py-spy; the parsed samples plus ``seconds`` and ``held_fraction`` (GIL-held / wall), or
        ``{"error": ...}`` when py-spy failed (no ptrace rights, the process ended)."""
        try:
            _, err = self._proc.communicate(timeout=timeout)
            if self._proc.returncode != 0 or not self._out.is_file():
                return {"error": (err or "").strip().splitlines()[-1:] or [f"py-spy exit {self._proc.returncode}"]}
            out = parse_raw(self._out.read_text(encoding="utf-8", errors="replace"), self.rate)
            out["seconds"] = float(max(1, round(self.seconds)))
            out["held_fraction"] = out["held_s"] / out["seconds"]
            return out
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return {"error": ["py-spy did not finish"]}
        finally:
            self._dir.cleanup()
