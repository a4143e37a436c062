"""TensorRT-LLM engine (`--engine trtllm`): an ahead-of-time TensorRT build of a BERT-family encoder.

A TensorRT engine is specific to the weights, the GPU model, the precision, the TensorRT-LLM
version and the shape limits it was built for, and building one takes minutes. So engines are
built once per key into the node-local cache (`--engine-cache-dir`, by default an `engines`
folder next to the model directory the operator's pre-pull fills), in the folder of the GPU model
(``cuda-<product>``, engines/cache_dir.py `engine_root`), and reused on every restart;
a file lock keeps two pods on one node from building the same engine twice, and the build lands
in a temporary folder renamed into place, so a crash never leaves a half-written engine behind.

Batches come from the same batch manager as the torch engine; inputs are packed without padding
(TensorRT-LLM's `remove_input_padding`), and pooling runs on the packed hidden states.

Where `tensorrt_llm` is not importable the engine refuses to start with what to install.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embedfleet.operator.cache.engines import gpu_accelerator  # stdlib only
from embedfleet.runtime.engines.base import Capabilities
from embedfleet.runtime.engines.cache_dir import BuildSource, build_lock, build_source, check_part, engine_root
from embedfleet.runtime.models.spec import ModelSpec

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "--engine trtllm needs the `tensorrt_llm` package, which is not importable here: on an NVIDIA GPU image "
    "run `pip install tensorrt_llm` (it needs CUDA and a matching TensorRT), or use the GPU runtime image "
    "built from runtime/Dockerfile.gpu (NVIDIA's TensorRT-LLM release image); otherwise serve with "
    "--engine torch")
ENCODER_TYPES = {"bert", "roberta", "xlm-roberta"}
ROBERTA_TYPES = {"roberta", "xlm-roberta"}


def model_classes(model_type: str) -> tuple[str, str]:
    """TensorRT-LLM's (encoder, sequence classifier) class names for a model type: RoBERTa and XLM-R
    need the RoBERTa classes (built as BERT they run, and give wrong vectors)."""
    if model_type in ROBERTA_TYPES:
        return "RobertaModel", "RobertaForSequenceClassification"
    return "BertModel", "BertForSequenceClassification"


def position_ids(lengths: list[int], model_type: str, pad_token_id: int) -> list[int]:
    """Packed position ids: 0.. per sequence for BERT; RoBERTa and XLM-R count from padding_idx + 1,
    as their embeddings were trained (transformers' create_position_ids_from_input_ids)."""
    start = pad_token_id + 1 if model_type in ROBERTA_TYPES else 0
    return [start + i for n in lengths for i in range(n)]
TRTLLM_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "fp8": "bfloat16"}
MANIFEST = "embedfleet-engine.json"


class TrtLlmUnavailable(RuntimeError):
    """`tensorrt_llm` cannot be imported, or cannot serve this model."""


def require_tensorrt_llm() -> Any:
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise TrtLlmUnavailable(f"{INSTALL_HINT} (import error: {exc})") from exc
    return tensorrt_llm


# -- cache keys and paths (pure) ---------------------------------------------------------------
@dataclass(frozen=True)
class EngineKey:
    """Everything a built engine depends on; a change in any field means a different engine."""

    model_digest: str
    gpu_name: str
    dtype: str
    trtllm_version: str
    max_batch_tokens: int
    max_seq_len: int
    max_batch_size: int  # --max-batch-requests: an engine built for fewer would refuse larger batches

    def hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def dirname(self) -> str:
        """Readable and unique: `<gpu>-<dtype>-trtllm<version>-<hash of all fields>`."""
        gpu = re.sub(r"[^a-z0-9]+", "-", self.gpu_name.lower()).strip("-") or "gpu"
        version = re.sub(r"[^0-9a-z.]+", "", self.trtllm_version.lower()) or "unknown"
        return f"{gpu}-{self.dtype}-trtllm{version}-{self.hash()}"


def engine_path(engines: Path, spec: ModelSpec, key: EngineKey) -> Path:
    """The build's folder under `engines` (the GPU model's folder, `engine_root`): `<served name>-<digest>`,
    the name reduced to what a build folder may hold (engines.PART: `org/model` reads `org-model`)."""
    digest = key.model_digest.replace("sha256:", "")[:16] or "nodigest"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", spec.name)[:64].lstrip("-_.") or "model"
    return engines / check_part(f"{name}-{digest}") / check_part(key.dirname())


def is_built(path: Path, key: EngineKey) -> bool:
    """A finished build: the manifest exists and names exactly this key."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("key") == asdict(key)
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def ensure_engine(path: Path, key: EngineKey, build: Callable[[Path], None]) -> bool:
    """Build into `path` unless a finished build for `key` is there; True when it built.

    `build(tmpdir)` writes the engine files; the manifest is written last and the folder renamed
    into place, so readers see either nothing or a complete engine.
    """
    if is_built(path, key):
        return False
    with build_lock(path):
        if is_built(path, key):  # another process built it while we waited
            return False
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            build(tmp)
            (tmp / MANIFEST).write_text(json.dumps({"key": asdict(key)}, indent=1))
            if path.exists():
                shutil.rmtree(path)  # a stale or foreign build under our name
            tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return True


# -- packed pooling (pure torch) --------------------------------------------------------------
def pool_packed(hidden: torch.Tensor, lengths: torch.Tensor, how: str) -> torch.Tensor:
    """Pool [tokens, hidden] states of concatenated inputs to one fp32 vector per input."""
    hidden = hidden.float()
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    if how == "cls":
        return hidden[starts]
    if how == "last":
        return hidden[ends - 1]
    row = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
    if how == "max":
        out = torch.full((len(lengths), hidden.shape[1]), float("-inf"), device=hidden.device)
        return out.scatter_reduce(0, row.unsqueeze(1).expand_as(hidden), hidden, reduce="amax")
    sums = torch.zeros((len(lengths), hidden.shape[1]), device=hidden.device).index_add_(0, row, hidden)
    return sums / lengths.clamp(min=1).unsqueeze(1).float()


# -- the engine -------------------------------------------------------------------------------
class TrtLlmEngine:
    def __init__(self, spec: ModelSpec, settings: Any) -> None:
        trtllm = require_tensorrt_llm()
        if spec.model_type not in ENCODER_TYPES:
            raise TrtLlmUnavailable(
                f"--engine trtllm serves BERT-family encoders ({', '.join(sorted(ENCODER_TYPES))}); "
                f"{spec.name} is {spec.model_type!r}: serve it with --engine torch")
        if settings.device != "cuda" or not torch.cuda.is_available():
            raise TrtLlmUnavailable("--engine trtllm needs --device cuda and a visible NVIDIA GPU")
        self.spec = spec
        self.trtllm = trtllm
        self.device = torch.device("cuda")
        self.dtype = TRTLLM_DTYPES[settings.dtype]
        self.effective_dtype = self.dtype
        self.fp8_gate = None  # FP8 is not offered on this engine (no start-up gate runs)
        self.int8_gate = None  # nor int8 (a CPU precision)
        self.max_seq_len = spec.max_length
        self.max_batch_tokens = settings.max_batch_tokens
        self.max_batch_size = settings.max_batch_requests
        self.key = EngineKey(spec.digest, torch.cuda.get_device_name(), self.dtype, trtllm.__version__,
                             self.max_batch_tokens, self.max_seq_len, self.max_batch_size)
        engines = engine_root(settings.engine_cache_dir, spec.path, gpu_accelerator(self.key.gpu_name))
        self.path = engine_path(engines, spec, self.key)
        if settings.dtype == "fp8":
            log.warning("--engine trtllm builds bfloat16 engines; FP8 with its quality gate is in --engine torch")
        built = ensure_engine(self.path, self.key, self._build)
        self.build_source: BuildSource = build_source(self.path, built)
        log.info("%s TensorRT-LLM engine %s", "built" if built else "reusing", self.path)
        self._load()
        self.capabilities = Capabilities(
            tasks=(spec.task,), pooling=spec.pooling, max_tokens=spec.max_length, dtypes=tuple(TRTLLM_DTYPES),
            device="cuda", dim=spec.hidden_size if spec.task == "embed" else len(spec.labels))

    def _build(self, out: Path) -> None:
        import tensorrt_llm.models
        from tensorrt_llm import BuildConfig, build

        encoder, classifier = model_classes(self.spec.model_type)
        cls = getattr(tensorrt_llm.models, encoder if self.spec.task == "embed" else classifier)
        model = cls.from_hugging_face(str(self.spec.path), dtype=self.dtype)
        config = BuildConfig(max_batch_size=self.max_batch_size, max_input_len=self.max_seq_len,
                             max_num_tokens=self.max_batch_tokens)
        config.plugin_config.remove_input_padding = True
        config.plugin_config.bert_attention_plugin = self.dtype
        log.info("building TensorRT-LLM engine for %s (%s) into %s; this takes minutes once per node",
                 self.spec.name, self.dtype, out)
        build(model, config).save(str(out))

    def _load(self) -> None:
        from tensorrt_llm.runtime import Session

        engine_file = next(self.path.glob("*.engine"))
        self.session = Session.from_serialized_engine(engine_file.read_bytes())
        self.stream = torch.cuda.Stream()
        self.output_name = "hidden_states" if self.spec.task == "embed" else "logits"

    def warmup(self) -> None:
        run = self.embed if self.spec.task == "embed" else self.classify
        run([[self.spec.pad_token_id + 1] * 8, [self.spec.pad_token_id + 1] * 3])

    def _run(self, batch: list) -> tuple[torch.Tensor, torch.Tensor]:
        from tensorrt_llm.runtime import TensorInfo

        seqs = [getattr(x, "ids", x) for x in batch]
        types = [getattr(x, "type_ids", None) or [0] * len(s) for x, s in zip(batch, seqs, strict=True)]
        lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        host = {
            "input_ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
            "token_type_ids": torch.tensor([t for s in types for t in s], dtype=torch.int32),
            "position_ids": torch.tensor(position_ids([len(s) for s in seqs], self.spec.model_type,
                                                      self.spec.pad_token_id), dtype=torch.int32),
            "input_lengths": lengths,
        }
        # One pinned buffer for the whole batch (not a pinned allocation per tensor); the copies run on the
        # engine's own stream, where the session runs, so they are ordered before it without synchronising
        # the device, and the caching allocator ties the device buffers to that stream. Each input gets
        # its own device tensor (the allocator's alignment), copied from a view of the pinned buffer.
        packed = torch.cat(list(host.values())).pin_memory()
        views = torch.split(packed, [v.numel() for v in host.values()])
        with torch.cuda.stream(self.stream):
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in zip(host, views, strict=True)}
            inputs["max_input_length"] = torch.empty(int(lengths.max()), dtype=torch.int32, device=self.device)
            infos = [TensorInfo(k, self.trtllm.torch_dtype_to_trt(v.dtype), tuple(v.shape)) for k, v in inputs.items()]
            shapes = {i.name: i for i in self.session.infer_shapes(infos)}
            out_info = shapes[self.output_name]
            output = torch.empty(tuple(out_info.shape), dtype=self.trtllm.trt_dtype_to_torch(out_info.dtype),
                                 device=self.device)
        if not self.session.run(inputs, {self.output_name: output}, self.stream.cuda_stream):
            raise RuntimeError("TensorRT-LLM session failed to run the batch")
        self.stream.synchronize()
        return output, inputs["input_lengths"]

    @torch.inference_mode()
    def embed(self, batch: list) -> np.ndarray:
        hidden, lengths = self._run(batch)
        return pool_packed(hidden, lengths, self.spec.pooling).cpu().numpy()

    @torch.inference_mode()
    def classify(self, batch: list) -> np.ndarray:
        logits, _ = self._run(batch)
        return logits.float().cpu().numpy()
