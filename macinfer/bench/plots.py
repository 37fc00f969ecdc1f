"""PNG plots of benchmark results (matplotlib, no display needed)."""

from __future__ import annotations

import os

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(results: dict) -> str:
    ctx = results["context"]
    hw = ctx["hardware"]
    model = ctx.get("model") or next(iter(ctx.get("targets", {}).values()), {}).get("model", "")
    return f"{os.path.basename(str(model))} · {hw['chip']} · {hw['mlx_device']} · macinfer {ctx['macinfer']}"


def _cdf(ax, samples: list[float], label: str) -> None:
    if samples:
        xs = np.sort(np.asarray(samples)) * 1000
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def _bars(ax, labels: list[str], series: dict[str, list[float]], rotation: int = 0) -> None:
    """Grouped bars: one group per label, one bar per series."""
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name)
    ax.set_xticks(x, labels, rotation=rotation)
    ax.legend()


def write(results: dict, out_dir: str) -> list[str]:
    """Writes the plots for `results` (any mode) into out_dir; returns their paths."""
    plt = _pyplot()
    mode = results["mode"]
    paths = []

    def save(fig, name: str) -> None:
        fig.suptitle(_title(results), fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{mode}_{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    if mode == "engine":
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, e in results["engines"].items():
            cs = sorted(e["throughput"], key=int)
            ax.plot([int(c) for c in cs], [e["throughput"][c] for c in cs], marker="o", label=name)
        ax.set(xscale="log", xlabel="concurrent sequences", ylabel="output tok/s", title="Offline throughput")
        ax.legend()
        save(fig, "throughput_vs_concurrency")
        return paths

    if mode == "step":
        fig, ax = plt.subplots(figsize=(7, 4))
        rows = results["steps"]
        series = {"macinfer": [r["macinfer_ms"] for r in rows]}
        if rows and "mlx_lm_ms" in rows[0]:
            series["mlx-lm"] = [r["mlx_lm_ms"] for r in rows]
        _bars(ax, [f"{r['batch']}x{r['context']}" for r in rows], series, rotation=30)
        ax.set(xlabel="batch x context", ylabel="decode step (ms)", title="Decode step time")
        save(fig, "time")
        return paths

    if mode == "spec":
        fig, ax = plt.subplots(figsize=(7, 4))
        tasks = results["tasks"]
        names = list(max((t["engines"] for t in tasks.values()), key=len))
        series = {n: [t["engines"][n]["decode_tok_s"] if n in t["engines"] else 0 for t in tasks.values()]
                  for n in names}
        _bars(ax, list(tasks), series, rotation=15)
        ax.set(xlabel="task", ylabel="decode tok/s (single stream)", title="Prompt-lookup speculative decoding")
        save(fig, "decode")
        return paths

    servers = results["servers"]
    if mode == "serve":
        conc_levels = [lv for lv in results["levels"] if lv.startswith("c")]
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, per in servers.items():
            ax.plot([int(lv[1:]) for lv in conc_levels], [per[lv]["throughput_tok_s"] for lv in conc_levels],
                    marker="o", label=name)
        ax.set(xscale="log", xlabel="concurrent streams", ylabel="output tok/s", title="Serving throughput")
        ax.legend()
        save(fig, "throughput_vs_concurrency")

        top = results["levels"][-1] if results["levels"] else None
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for name, per in servers.items():
            _cdf(a1, per[top]["ttft_samples"], name)
            _cdf(a2, per[top]["itl_samples"], name)
        a1.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT CDF ({top})")
        a2.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps", title=f"ITL CDF ({top})", xscale="log")
        a1.legend()
        a2.legend()
        save(fig, "latency_cdf")
    else:  # prefix
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for name, r in servers.items():
            ttfts = r["multi_turn"]["ttft_per_turn"]
            a1.plot(range(1, len(ttfts) + 1), [t * 1000 for t in ttfts], marker="o", label=name)
            _cdf(a2, r["shared_system"]["ttft_samples"], name)
        a1.set(xlabel="turn", ylabel="TTFT (ms)", title="Multi-turn: TTFT per turn")
        a2.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="Shared system prompt: TTFT CDF")
        a1.legend()
        a2.legend()
        save(fig, "ttft")

    if any(per.get("memory_gb_over_time") for per in servers.values()):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, per in servers.items():
            samples = per.get("memory_gb_over_time") or []
            if samples:
                ax.plot([t for t, _ in samples], [gb for _, gb in samples], label=name)
        ax.set(xlabel="seconds since the server was up", ylabel="RSS (GB)", title="Server memory over time")
        ax.legend()
        save(fig, "memory")
    return paths
