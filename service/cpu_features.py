"""What this CPU offers: how many cores this process may use (:func:`available_cores`), and whether it runs
bfloat16 natively (no torch here: config validation asks too).

torch computes bfloat16 on any x86 CPU, but without AVX512-BF16 (``avx512_bf16``: Cooper Lake, Sapphire Rapids,
Zen 4 and later) or AMX-BF16 (``amx_bf16``: Sapphire Rapids and later) every bf16 matmul is emulated through
float32 and runs slower than float32 itself, so ``dtype: bfloat16`` on CPU is only worth serving where one of
those flags is present. The flags are read from ``/proc/cpuinfo`` (Linux); elsewhere support is not assumed.

One documented override, the environment variable :data:`CPU_BF16_ENV` (``RELSERVE_CPU_BF16``), because the
hardware cannot be changed to test the paths that depend on it:

* ``detect`` (or unset): read the CPU flags;
* ``assume``: report support whatever the CPU has (bfloat16 then runs, emulated and slow, on a CPU without the
  flags: for tests of ``dtype: auto`` and its agreement gate on such machines);
* ``off``: report no support (serve float32 on a bf16 CPU without touching the model configs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from .errors import ConfigError

CPU_BF16_ENV = "RELSERVE_CPU_BF16"
CPU_BF16_MODES = ("detect", "assume", "off")
# /proc/cpuinfo flag names of the native bfloat16 instructions torch's oneDNN kernels use on x86
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


def cpu_bf16_mode(environ: Mapping[str, str] | None = None) -> str:
    """The value of ``RELSERVE_CPU_BF16`` (lower-cased; unset or empty: ``detect``).

    Raises:
        ConfigError: a value other than detect, assume or off.
    """
    env = os.environ if environ is None else environ
    mode = (env.get(CPU_BF16_ENV) or "detect").strip().lower()
    if mode not in CPU_BF16_MODES:
        raise ConfigError(f"{CPU_BF16_ENV}={env.get(CPU_BF16_ENV)!r} is not one of {list(CPU_BF16_MODES)}")
    return mode


def cpu_flags(cpuinfo: Path = _CPUINFO) -> set[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo``; empty when the file cannot be read."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def bf16_support(environ: Mapping[str, str] | None = None, cpuinfo: Path = _CPUINFO) -> tuple[bool, str]:
    """``(supported, why)``: whether bfloat16 on this CPU is native (see the module docstring), and the
    sentence the server logs and reports as part of the dtype reason.

    Raises:
        ConfigError: a bad ``RELSERVE_CPU_BF16`` value.
    """
    mode = cpu_bf16_mode(environ)
    if mode == "assume":
        return True, f"{CPU_BF16_ENV}=assume (CPU bfloat16 support assumed, not detected)"
    if mode == "off":
        return False, f"{CPU_BF16_ENV}=off (CPU bfloat16 support switched off)"
    flags = cpu_flags(cpuinfo)
    found = [f for f in CPU_BF16_FLAGS if f in flags]
    if found:
        return True, f"this CPU has {' and '.join(found)}"
    if not flags:
        return False, f"the CPU flags cannot be read from {cpuinfo} (bfloat16 support is not assumed)"
    return False, (f"this CPU has no AVX512-BF16/AMX-BF16 (none of the cpuinfo flags {', '.join(CPU_BF16_FLAGS)}), "
                   f"so bfloat16 would be emulated and slower than float32")


def available_cores(environ: Mapping[str, str] | None = None) -> int:
    """The cores torch would size its pool for: ``OMP_NUM_THREADS`` when set, else the CPUs this process
    may run on (``sched_getaffinity``: a cpuset of a container counts, a CFS quota does not)."""
    env = os.environ if environ is None else environ
    try:
        n = int(env.get("OMP_NUM_THREADS", "") or 0)
    except ValueError:
        n = 0
    if n > 0:
        return n
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1
