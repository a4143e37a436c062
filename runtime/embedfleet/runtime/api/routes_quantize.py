"""GET /v1/models/{model}/quantization: the int8/uint8 ranges a model's quantised outputs use.

Published so a client can check or reproduce our integers with sentence-transformers:
`quantize_embeddings(floats, "int8", ranges=np.array(body["ranges"]))` equals what /v1/embeddings and
/v2/embed answer for the same request (core/quantize.py says where the ranges come from).
"""

from __future__ import annotations

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from embedfleet.runtime.api.errors import ApiError
from embedfleet.runtime.api.gate import tenant_of
from embedfleet.runtime.api.http import JSON
from embedfleet.runtime.api.prepare import select
from embedfleet.runtime.service import Models


class QuantizationRanges(BaseModel):
    model: str
    dimensions: int
    calibration: str = Field(description="`builtin:<n> texts` (shipped set) or `file:calibration_embeddings.npy`")
    calibration_size: int
    ranges: list[list[float]] = Field(description="[per-dimension min, per-dimension max] (float32 values)")


def quantization_router(models: Models) -> APIRouter:
    router = APIRouter(default_response_class=JSON)

    @router.get("/v1/models/{model}/quantization", response_model=QuantizationRanges, tags=["embedfleet"])
    async def quantization(model: str, request: Request, dimensions: int | None = None):
        """The ranges for `dimensions` (default: the model's full width): per-dimension min and max of the
        calibration vectors, sliced and normalised as a response with that `dimensions` is."""
        svc = select(models, model, "/v1/embeddings", tenant_of(request.scope))
        width = svc.spec.hidden_size
        if dimensions is not None and not 1 <= dimensions <= width:
            raise ApiError(422, f"dimensions={dimensions} must be between 1 and the model's {width}",
                           "invalid_dimensions")
        calibration = await svc.calibrated()
        ranges = calibration.ranges(dimensions)
        # float64 holds every float32 exactly, so the decimal text reads back to the very same float32.
        return JSON({"model": svc.name, "dimensions": ranges.shape[1], "calibration": calibration.source,
                     "calibration_size": len(calibration.rows), "ranges": ranges.astype(np.float64).tolist()})

    return router
