"""Upper bound on what one-step lookahead (building step n+1's graph while step n
computes, `mx.async_eval`) could save here: the same decode step run back to back,
first sequentially (build, evaluate, read the tokens), then pipelined. No engine
changes: steps at a fixed context are independent, so this is the best case.

    python scripts/overlap_bound.py [MODEL] [--batch 1 --batch 32] [--context 64]
"""

from __future__ import annotations

import statistics
import time

import click
import mlx.core as mx

from macinfer.bench.step import MacinferStep


@click.command()
@click.argument("model", default="smollm2")
@click.option("--batch", "batches", type=int, multiple=True, default=(1, 32))
@click.option("--context", type=int, default=64)
@click.option("--steps", type=int, default=12)
@click.option("--repeats", type=int, default=5)
def main(model: str, batches: tuple[int, ...], context: int, steps: int, repeats: int) -> None:
    runner = MacinferStep(model, [(b, context) for b in batches])
    for b in batches:
        seqs = runner._seqs(b, context)

        def sequential() -> float:
            t = time.perf_counter()
            for _ in range(steps):
                out = runner._graph(seqs)
                mx.eval(*out)
                out[0].tolist()
            return 1000 * (time.perf_counter() - t) / steps

        def pipelined() -> float:
            t = time.perf_counter()
            cur = runner._graph(seqs)
            mx.async_eval(*cur)
            for _ in range(steps - 1):
                nxt = runner._graph(seqs)  # built while `cur` computes
                mx.async_eval(*nxt)
                cur[0].tolist()
                cur = nxt
            cur[0].tolist()
            return 1000 * (time.perf_counter() - t) / steps

        sequential(), pipelined()  # warm-up
        s = statistics.median(sequential() for _ in range(repeats))
        p = statistics.median(pipelined() for _ in range(repeats))
        click.echo(f"batch {b:>3} x context {context}: sequential {s:.1f} ms/step, pipelined {p:.1f} "
                   f"({100 * (s - p) / s:+.1f}% saved)")
        for s_ in seqs:
            runner.engine.block_manager.free(s_)


if __name__ == "__main__":
    main()
