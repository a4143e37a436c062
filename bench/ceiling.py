"""The in-process ceiling: the same model with no HTTP, corpus sorted by length, packed by token budget.

Prints one JSON line, also appended to bench/results/ceiling-cpu.jsonl: embeddings/s and tokens/s end to
end (tokenize + forward) and forward only, plus the single-query time (tokenize + forward of one short query).

`CeilingProcess` runs the same ceiling in a process of its own, so that a bench can alternate it with a
server round by round and pool several processes: on a shared host one process can run a quarter slower
than another of the same code for its whole life, and a ceiling measured once, in one process, carries that
luck into every ratio taken against it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

from _common import add_results_dir, corpus, record

SINGLE_QUERY = "how do I reset my password"


def packed(batch_ids: list[list[int]], max_tokens: int, max_items: int) -> list[list[list[int]]]:
    order = sorted(batch_ids, key=len)
    batches, current = [], []
    for ids in order:
        if current and (len(ids) * (len(current) + 1) > max_tokens or len(current) >= max_items):
            batches.append(current)
            current = []
        current.append(ids)
    return [*batches, current] if current else batches


class Ceiling:
    """The model called directly: the bench's engine and tokenizer, loaded and warmed once."""

    def __init__(self, dtype: str = "float32", max_tokens: int = 16384, max_items: int = 32) -> None:
        from embedfleet.runtime.core.tokenize import TokenizerPool
        from embedfleet.runtime.engines.torch_engine import TorchEngine
        from embedfleet.runtime.models.spec import load_spec
        from embedfleet.runtime.settings import default_model_dir

        self.spec = load_spec(default_model_dir())
        self.engine = TorchEngine(self.spec, dtype=dtype)
        self.engine.warmup()
        self.pool = TokenizerPool(self.spec.path / "tokenizer.json", 2)
        self.max_tokens, self.max_items = max_tokens, max_items

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [t.ids for t in self.pool._encode_sync(texts, self.spec.max_length, True, "right")]

    def backfill(self, texts: list[str]) -> dict:
        """Tokenize all, sort by length, run packed batches: seconds end to end and for the forward alone."""
        start = time.perf_counter()
        ids = self._ids(texts)
        tokenized = time.perf_counter()
        for batch in packed(ids, self.max_tokens, self.max_items):
            self.engine.embed(batch)
        done = time.perf_counter()
        return {"inputs": len(texts), "tokens": sum(map(len, ids)), "seconds": done - start,
                "forward_seconds": done - tokenized}

    def single(self, reps: int, warm: int = 20) -> list[float]:
        """Seconds for tokenize + forward of one short query, `reps` times after `warm` unmeasured ones (the
        queries serve_load.py sends a server)."""
        samples = []
        for i in range(warm + reps):
            query = f"{SINGLE_QUERY} {i - warm}"
            t0 = time.perf_counter()
            self.engine.embed([self._ids([query])[0]])
            if i >= warm:
                samples.append(time.perf_counter() - t0)
        return samples


def _serve(conn, dtype: str, max_tokens: int, max_items: int) -> None:
    """The child's loop: ("backfill", n, seed) or ("single", reps) in, the method's answer out; None ends it."""
    ceiling = Ceiling(dtype, max_tokens, max_items)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg[0] == "backfill":
            conn.send(ceiling.backfill(corpus(msg[1], seed=msg[2])))
        else:
            conn.send(ceiling.single(msg[1]))


class CeilingProcess:
    """A `Ceiling` in a spawned process (a fresh interpreter, as a server gets), driven over a pipe."""

    def __init__(self, dtype: str = "float32", max_tokens: int = 16384, max_items: int = 32) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, dtype, max_tokens, max_items), daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(600) or self._conn.recv() != "ready":
            self.close()
            raise RuntimeError("the ceiling process did not load its model")

    def backfill(self, n: int, seed: int = 0) -> dict:
        self._conn.send(("backfill", n, seed))
        return self._answer()

    def single(self, reps: int) -> list[float]:
        self._conn.send(("single", reps))
        return self._answer()

    def _answer(self, timeout_s: float = 1800.0):
        """The child's answer; an error, not a hang, when it died or stopped answering."""
        if not self._conn.poll(timeout_s):
            self.close()
            raise RuntimeError(f"the ceiling process gave no answer in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError as exc:
            raise RuntimeError(f"the ceiling process ended (exit code {self._proc.exitcode})") from exc

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(30)

    def __enter__(self) -> CeilingProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure(n: int, dtype: str, max_tokens: int, max_items: int) -> dict:
    ceiling = Ceiling(dtype, max_tokens, max_items)
    run = ceiling.backfill(corpus(n))
    single = ceiling.single(100)
    return {
        "figure": "ceiling", "model": ceiling.spec.name, "dtype": dtype, "inputs": n, "tokens": run["tokens"],
        "max_batch_tokens": max_tokens, "max_batch_requests": max_items,
        "embeddings_per_s": round(n / run["seconds"], 2), "tokens_per_s": round(run["tokens"] / run["seconds"], 1),
        "forward_only_embeddings_per_s": round(n / run["forward_seconds"], 2),
        "single_query_ms": round(statistics.median(single) * 1000, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--max-batch-requests", type=int, default=32)
    add_results_dir(p, "ceiling-cpu.jsonl")
    a = p.parse_args()
    row = measure(a.n, a.dtype, a.max_batch_tokens, a.max_batch_requests)
    print(json.dumps(row))
    record("ceiling", row, results_dir=a.results_dir)


if __name__ == "__main__":
    main()
