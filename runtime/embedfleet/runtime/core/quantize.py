"""Quantised embeddings (int8, uint8, binary, ubinary) exactly as sentence-transformers makes them.

`quantize` is the arithmetic of `sentence_transformers.quantization.quantize_embeddings`, step for step
in float32, so a client that applies that function to our float vectors with our published ranges gets
the very integers we sent. int8/uint8 need per-dimension ranges (min and max of each dimension); they
come from `Calibration`: a fixed set of embeddings made once when the model loads, either from
`calibration_embeddings.npy` in the model directory (a client's own corpus sample) or from the
CALIBRATION_TEXTS shipped here. Ranges are taken after the same Matryoshka slice and normalisation as
the response, so `dimensions=256` is quantised with ranges of 256-dim unit vectors, not of the full ones.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from embedfleet.runtime.core.postprocess import finish

Precision = Literal["float", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[Precision, ...] = ("float", "int8", "uint8", "binary", "ubinary")
CALIBRATION_FILE = "calibration_embeddings.npy"

_TOPICS = (
    "the quick brown fox jumps over the lazy dog",
    "embedding models map text to dense vectors for semantic search",
    "the central bank raised interest rates to slow inflation",
    "photosynthesis turns sunlight, water and carbon dioxide into sugar",
    "the patient was prescribed antibiotics for a bacterial infection",
    "our quarterly revenue grew twelve percent year over year",
    "the kubernetes operator reconciles the desired and the live state",
    "she scored the winning goal in the last minute of the match",
    "add two cups of flour and a pinch of salt to the dough",
    "the treaty was signed in Vienna after months of negotiation",
    "a black hole bends light so strongly that nothing escapes",
    "reset your password from the account settings page",
    "the museum reopened with an exhibition of impressionist paintings",
    "heavy rain is expected across the north coast tomorrow",
    "the defendant pleaded not guilty to all charges",
    "python lists are dynamic arrays with amortised constant appends",
    "the hotel room had a view of the old harbour",
    "vaccines train the immune system to recognise a pathogen",
    "the startup raised a series B round led by two venture funds",
    "the orchestra performed Beethoven's ninth symphony",
    "a 401 response means the request lacks valid credentials",
    "the river flooded the valley after the snow melted",
    "Ünïcödé text, émojis 🚀 and numbers 12345 are text too",
    "Der Zug nach Berlin fährt um acht Uhr ab",
    "La tour Eiffel a été construite pour l'exposition universelle",
    "El mercado abre todos los días a las nueve de la mañana",
    "how do I cancel my subscription and get a refund",
    "the new phone has a larger battery and a brighter screen",
    "mitochondria are the powerhouse of the cell",
    "the election results will be announced on Sunday evening",
    "gradient descent updates the weights against the loss gradient",
    "the cat slept all afternoon on the warm windowsill",
)
_FORMS = ("{}", "What is meant by: {}?", "{} - a short summary of the topic.", "Notes: {}; see also related work.")
CALIBRATION_TEXTS: tuple[str, ...] = tuple(form.format(topic) for form in _FORMS for topic in _TOPICS)
"""128 short texts across domains and languages: the calibration set when the model directory has none."""


def needs_ranges(kinds: list[str] | str) -> bool:
    """Whether any of these output types (`int8`, `uint8_base64`, ...) needs calibration ranges."""
    kinds = [kinds] if isinstance(kinds, str) else kinds
    return any(kind.partition("_")[0] in ("int8", "uint8") for kind in kinds)


def quantize(vectors: np.ndarray, precision: Precision, ranges: np.ndarray | None = None) -> np.ndarray:
    """sentence-transformers' `quantize_embeddings(vectors, precision, ranges=ranges)`, in float32.

    int8/uint8: 256 equal buckets per dimension between the range's min and max (values outside
    clip to the end buckets); binary/ubinary: one bit per dimension (> 0), packed 8 to a byte, big
    end first, binary offset by -128 into int8. `ranges` (2 x dims) is needed for int8/uint8 only.
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    if precision == "float":
        return vectors
    if precision in ("int8", "uint8"):
        if ranges is None:
            raise ValueError(f"{precision} needs per-dimension ranges")
        ranges = np.asarray(ranges, dtype=np.float32)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(vectors > 0, axis=-1)
    if precision == "ubinary":
        return packed
    if precision == "binary":
        return (packed.astype(np.int16) - 128).astype(np.int8)
    raise ValueError(f"unknown precision {precision!r}; one of {PRECISIONS}")


def as_json(quantized: np.ndarray) -> list[list[int]] | np.ndarray:
    """Rows for the JSON body: float32 arrays as they are (orjson writes them), integers as int lists."""
    return quantized if quantized.dtype == np.float32 else quantized.astype(np.int16).tolist()


def as_base64(quantized: np.ndarray) -> list[str]:
    """Each row's raw bytes in base64: little-endian float32 for float (as OpenAI's and Cohere's SDKs
    decode it), one byte per value for int8/uint8, one byte per 8 dimensions for binary/ubinary."""
    dtype = "<f4" if quantized.dtype == np.float32 else quantized.dtype
    return [base64.b64encode(row.astype(dtype, copy=False).tobytes()).decode("ascii") for row in quantized]


@dataclass
class Calibration:
    """The calibration embeddings of one model (pooled, not yet normalised) and where they came from."""

    rows: np.ndarray
    source: str
    _ranges: dict[int | None, np.ndarray] = field(default_factory=dict, repr=False)

    def ranges(self, dimensions: int | None = None) -> np.ndarray:
        """(2, dims) float32: per-dimension min and max of the calibration vectors, sliced to `dimensions`
        and normalised exactly as a response's vectors are."""
        if dimensions not in self._ranges:
            vectors = finish(self.rows, normalize=True, dimensions=dimensions)
            self._ranges[dimensions] = np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32)
        return self._ranges[dimensions]


def calibration_file(model_dir: Path, hidden_size: int) -> Calibration | None:
    """`calibration_embeddings.npy` (n x hidden float array, n >= 2) from the model directory, if present."""
    path = model_dir / CALIBRATION_FILE
    if not path.exists():
        return None
    rows = np.load(path, allow_pickle=False)
    if rows.ndim != 2 or rows.shape[0] < 2 or rows.shape[1] != hidden_size:
        raise ValueError(f"{path}: expected an (n >= 2, {hidden_size}) array of embeddings, got shape {rows.shape}")
    return Calibration(np.asarray(rows, dtype=np.float32), f"file:{CALIBRATION_FILE}")


def encode_all(vectors: np.ndarray, types: list[str], calibration: Calibration | None,
               dimensions: int | None) -> dict[str, list]:
    """One entry per requested type, Cohere's spelling: float, int8, uint8, binary, ubinary (JSON
    numbers) and base64 (float32 bytes); `vectors` are the response's finished (unit) vectors."""
    out: dict[str, list] = {}
    for kind in types:
        if kind == "base64":
            out[kind] = as_base64(vectors)
            continue
        ranges = calibration.ranges(dimensions) if kind in ("int8", "uint8") and calibration else None
        out[kind] = as_json(quantize(vectors, kind, ranges))  # type: ignore[arg-type]
    return out
