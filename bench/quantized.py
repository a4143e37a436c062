"""What quantised outputs cost and save: /v2/embed with all six embedding types vs float only, same server.

Rounds alternate between the two bodies (same texts, so the engine work is identical) and the figure
is the ratio of their throughputs; the response sizes per vector show what int8 and binary save on the
wire (/v1/embeddings: float JSON vs each `encoding_format`). Prints one JSON line, also appended to
bench/results/quantized-cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from _common import Server, add_results_dir, corpus, record

TYPES = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
FORMATS = ["float", "base64", "int8", "int8_base64", "binary", "ubinary_base64"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    add_results_dir(p, "quantized-cpu.jsonl")
    a = p.parse_args()
    texts = corpus(a.texts, seed=2)
    server = Server()
    try:
        with httpx.Client(base_url=server.url, timeout=600) as c:
            seconds = {"float": 0.0, "all": 0.0}
            for round_ in range(a.rounds + 1):
                for name, types in (("float", ["float"]), ("all", TYPES)):
                    start = time.perf_counter()
                    c.post("/v2/embed", json={"texts": texts, "embedding_types": types}).raise_for_status()
                    if round_:  # the first round warms both paths
                        seconds[name] += time.perf_counter() - start
            sizes = {}
            for fmt in FORMATS:
                body = c.post("/v1/embeddings", json={"input": texts, "encoding_format": fmt}).raise_for_status()
                sizes[fmt] = round(len(body.content) / len(texts))
    finally:
        server.stop()
    rate = {k: a.rounds * len(texts) / v for k, v in seconds.items()}
    row = {"figure": "quantized", "texts": a.texts, "rounds": a.rounds,
           "float_only_texts_per_s": round(rate["float"], 1), "six_types_texts_per_s": round(rate["all"], 1),
           "six_types_over_float": round(rate["all"] / rate["float"], 3),
           "bytes_per_vector": sizes,
           "int8_base64_over_float_json": round(sizes["int8_base64"] / sizes["float"], 3)}
    print(json.dumps(row))
    record("quantized", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
