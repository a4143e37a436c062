"""Is bfloat16 safe on this CPU? A start-up probe in a child process, and oneDNN's ISA cap.

Some machines (VMs on recent Xeons among them) advertise AMX (`amx_tile`, `amx_bf16`) but fault
on it: the first bf16 matmul that oneDNN dispatches to an AMX kernel kills the process with
SIGILL, and no Python code can catch that. So before the engine loads a model in bfloat16 on CPU
we run a tiny bf16 forward (an `nn.Linear` and scaled-dot-product attention, after an fp32 one)
in a child process (`sys.executable -c PROBE_CODE`) and look at how it ended:

- it finished: nothing to do;
- it died by a signal: probe again with `ONEDNN_MAX_CPU_ISA` capped (`AVX512_CORE_BF16`: the
  AVX512-BF16 kernels, no AMX); if that finishes, set the cap in this process' environment and
  log one WARNING naming it;
- even capped bf16 dies: bf16 is refused and the engine serves **float32** instead, with a WARNING
  (the same fallback the FP8 gate makes to bf16: the server starts, correct and slower, and
  /v1/models shows `dtype: float32, requested_dtype: bfloat16`). AVX2 is not tried: bf16 there is
  emulated and slower than fp32, so it would be the worse fallback (if fp32 crashed too, under
  every setting tried, the engine refuses to start with that message);
- the probe failed another way (exit status, timeout): inconclusive; nothing is changed, and a
  WARNING says so (a Python-level error in bf16 surfaces, with its message, when the model runs).

A user's own `ONEDNN_MAX_CPU_ISA` is never overridden; it is probed as it is, and bf16 falls back
to float32 if bf16 crashes under it.

oneDNN reads `ONEDNN_MAX_CPU_ISA` once, when its first kernel runs (an fp32 `nn.Linear` is
enough), so `ensure_cpu_bf16()` must run before anything in this process computes with torch;
importing torch first is fine. The answer is cached for the life of the process. `choose_isa` is
the whole decision, pure given its probe function.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
CAPS = ("AVX512_CORE_BF16",)  # tried in order after an uncapped crash
PROBE_TIMEOUT_S = 120.0

PROBE_CODE = """
import torch
x = torch.randn(16, 128)
layer = torch.nn.Linear(128, 128)
q = torch.randn(2, 4, 16, 32)
with torch.inference_mode():
    layer(x)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    print("fp32 ok", flush=True)
    layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    qb = q.to(torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(qb, qb, qb)
    print("bf16 ok", flush=True)
"""


@dataclass(frozen=True)
class Probe:
    """How one probe child ended."""

    fp32: bool  # its fp32 forward finished
    bf16: bool  # its bf16 forward finished
    killed_by: str | None = None  # "SIGILL" when a signal ended it
    error: str = ""  # any other failure: exit status, timeout, the end of its stderr

    @property
    def crashed(self) -> bool:
        return self.killed_by is not None

    def describe(self) -> str:
        if self.bf16:
            return "bf16 ok"
        step = "its bf16 matmul" if self.fp32 else "its fp32 matmul"
        return f"{step} was killed by {self.killed_by}" if self.crashed else f"{step} failed: {self.error}"


@dataclass(frozen=True)
class IsaDecision:
    """What this process does about bf16 on CPU."""

    bf16: bool  # bf16 is safe (with `cap`, if set); False: serve float32
    cap: str | None = None  # ONEDNN_MAX_CPU_ISA to set in this process; None: leave the environment alone
    message: str = ""  # one log line, WARNING level; empty when all is well
    fp32: bool = True  # False: even fp32 crashed in every probe, torch cannot run here at all


def choose_isa(probe: Callable[[str | None], Probe], user_cap: str | None = None) -> IsaDecision:
    """Probe (lazily: a cap only after a crash) and decide. `probe(cap)` runs the child with
    ONEDNN_MAX_CPU_ISA=cap, or with the environment as it is for None. `user_cap`: the value the
    user set, which is probed as it is and never replaced."""
    first = probe(None)
    if first.bf16:
        return IsaDecision(True)
    if not first.crashed:
        return IsaDecision(True, message=f"bfloat16 on CPU: probe inconclusive ({first.describe()}); keeping bf16")
    tried: list[tuple[str, Probe]] = []
    for cap in () if user_cap else CAPS:
        result = probe(cap)
        if result.bf16:
            return IsaDecision(True, cap, (
                f"bfloat16 on CPU: oneDNN's default kernels crash on this CPU ({first.describe()}; it may "
                f"advertise AMX and fault on it); capping {ISA_ENV}={cap} for this process"))
        tried.append((cap, result))
    fp32_cap = None if first.fp32 else next((cap for cap, result in tried if result.fp32), None)
    fp32 = first.fp32 or fp32_cap is not None
    where = (f"with your {ISA_ENV}={user_cap} (unset or lower it to try again)" if user_cap else
             f"even with {ISA_ENV} capped to {', '.join(CAPS)}")
    then = (f"serving float32 instead{f' with {ISA_ENV}={fp32_cap}' if fp32_cap else ''}" if fp32 else
            "float32 crashed too: torch cannot run on this CPU")
    return IsaDecision(False, fp32_cap, f"bfloat16 on CPU: a probe crashed ({first.describe()}) {where}; {then}",
                       fp32=fp32)


def run_probe(cap: str | None, code: str = PROBE_CODE, timeout: float = PROBE_TIMEOUT_S) -> Probe:
    """Run `code` in a child interpreter (with ONEDNN_MAX_CPU_ISA=cap when given) and report how it ended."""
    env = dict(os.environ)
    if cap:
        env[ISA_ENV] = cap
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return Probe("fp32 ok" in out, False, error=f"timed out after {timeout:.0f}s")
    fp32, bf16 = "fp32 ok" in done.stdout, "bf16 ok" in done.stdout
    if done.returncode < 0:
        try:
            name = signal.Signals(-done.returncode).name
        except ValueError:
            name = f"signal {-done.returncode}"
        return Probe(fp32, False, killed_by=name)
    if done.returncode != 0 or not bf16:
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return Probe(fp32, False, error=f"exit status {done.returncode}: {tail[0][:200]}")
    return Probe(fp32, bf16)


@functools.cache
def ensure_cpu_bf16() -> IsaDecision:
    """Probe once per process, set the cap (if one is needed) in os.environ, log the outcome."""
    decision = choose_isa(run_probe, os.environ.get(ISA_ENV) or None)
    if decision.cap:
        os.environ[ISA_ENV] = decision.cap
    if decision.message:
        log.warning("%s", decision.message)
    return decision
