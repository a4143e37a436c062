"""bf16 on CPU: the start-up probe's decision (pure, from probe outcomes) and the probe's child process.

The real crash is simulated by a child that kills itself with SIGILL unless ONEDNN_MAX_CPU_ISA is
set, which is what a CPU that faults on AMX does to a bf16 matmul.
"""

from __future__ import annotations

import functools
import signal

import pytest

from embedfleet.runtime.engines.cpu_isa import ISA_ENV, Probe, choose_isa, run_probe

OK = Probe(fp32=True, bf16=True)
BF16_SIGILL = Probe(fp32=True, bf16=False, killed_by="SIGILL")
FP32_SIGILL = Probe(fp32=False, bf16=False, killed_by="SIGILL")
EXIT_1 = Probe(fp32=False, bf16=False, error="exit status 1: ModuleNotFoundError: No module named 'torch'")


def fake(outcomes: dict[str | None, Probe]):
    """A probe answering from `outcomes` (keyed by cap) and recording which caps it was asked about."""
    asked: list[str | None] = []

    def probe(cap: str | None) -> Probe:
        asked.append(cap)
        return outcomes[cap]

    return probe, asked


def test_bf16_that_works_changes_nothing_and_probes_once():
    probe, asked = fake({None: OK})
    decision = choose_isa(probe)
    assert decision.bf16 and decision.cap is None and decision.message == ""
    assert asked == [None]


def test_a_crash_is_capped_to_avx512_bf16_with_one_warning():
    probe, asked = fake({None: BF16_SIGILL, "AVX512_CORE_BF16": OK})
    decision = choose_isa(probe)
    assert decision.bf16 and decision.cap == "AVX512_CORE_BF16"
    assert asked == [None, "AVX512_CORE_BF16"]
    assert "SIGILL" in decision.message and f"capping {ISA_ENV}=AVX512_CORE_BF16" in decision.message


def test_bf16_crashing_even_capped_falls_back_to_float32():
    probe, _ = fake({None: BF16_SIGILL, "AVX512_CORE_BF16": BF16_SIGILL})
    decision = choose_isa(probe)
    assert not decision.bf16 and decision.fp32 and decision.cap is None
    assert "serving float32 instead" in decision.message and "even with" in decision.message


def test_float32_fallback_keeps_the_cap_under_which_float32_works():
    probe, _ = fake({None: FP32_SIGILL, "AVX512_CORE_BF16": BF16_SIGILL})
    decision = choose_isa(probe)
    assert not decision.bf16 and decision.fp32 and decision.cap == "AVX512_CORE_BF16"
    assert f"serving float32 instead with {ISA_ENV}=AVX512_CORE_BF16" in decision.message


def test_nothing_runs_at_all():
    probe, _ = fake({None: FP32_SIGILL, "AVX512_CORE_BF16": FP32_SIGILL})
    decision = choose_isa(probe)
    assert not decision.bf16 and not decision.fp32 and "torch cannot run on this CPU" in decision.message


def test_a_user_cap_is_probed_as_is_and_never_replaced():
    probe, asked = fake({None: OK})
    assert choose_isa(probe, user_cap="AVX2").bf16 and asked == [None]
    probe, asked = fake({None: BF16_SIGILL})
    decision = choose_isa(probe, user_cap="AVX10_1_512_AMX")
    assert asked == [None] and decision.cap is None and not decision.bf16
    assert f"your {ISA_ENV}=AVX10_1_512_AMX" in decision.message and "float32" in decision.message


def test_an_inconclusive_probe_keeps_bf16_and_says_so():
    probe, asked = fake({None: EXIT_1})
    decision = choose_isa(probe)
    assert decision.bf16 and decision.cap is None and asked == [None]
    assert "inconclusive" in decision.message and "ModuleNotFoundError" in decision.message


# -- the child process, for real --------------------------------------------------------------
FAULTS_UNLESS_CAPPED = f"""
import os, signal
print("fp32 ok", flush=True)
if not os.environ.get("{ISA_ENV}"):
    os.kill(os.getpid(), signal.SIGILL)
print("bf16 ok", flush=True)
"""


def test_a_child_killed_by_sigill_is_reported_and_the_cap_rescues_it(monkeypatch):
    monkeypatch.delenv(ISA_ENV, raising=False)
    probe = functools.partial(run_probe, code=FAULTS_UNLESS_CAPPED, timeout=60)
    assert probe(None) == Probe(fp32=True, bf16=False, killed_by=signal.SIGILL.name)
    decision = choose_isa(probe)
    assert decision.bf16 and decision.cap == "AVX512_CORE_BF16"


def test_a_child_that_hangs_or_fails_is_inconclusive():
    hung = run_probe(None, code="import time; print('fp32 ok', flush=True); time.sleep(60)", timeout=5)
    assert not hung.crashed and hung.fp32 and "timed out" in hung.error
    failed = run_probe(None, code="raise SystemExit('no torch here')")
    assert not failed.crashed and not failed.fp32 and "exit status 1" in failed.error


@pytest.mark.parametrize("cap", [None, "AVX512_CORE_BF16"])
def test_the_real_probe_runs_torch(cap):
    """Uncapped it may die by SIGILL on this machine; capped it must not."""
    result = run_probe(cap)
    assert result.fp32 and not result.error, result
    if cap:
        assert result.bf16, result
