"""--plot: a PNG with the latency CDFs (TTFT, TPOT, ITL, E2E) and output throughput over time,
one line per server. matplotlib is imported here only (it is the `bench` extra)."""
from __future__ import annotations

from services.loadgen.driver import RunOutput
from services.loadgen.metrics import output_timeline


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def write_plot(path: str, series: list[tuple[str, list[RunOutput]]]) -> str:
    """series: (label, the runs of that server, in order: compare slices are laid end to end on
    the time axis). Writes `path`; returns it. Raises ImportError with an install hint when
    matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'radixmesh[bench]' (or pip install matplotlib)")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [("TTFT", lambda r: [r.ttft] if r.ttft is not None else []),
              ("TPOT", lambda r: [r.tpot] if r.tpot is not None else []),
              ("ITL", lambda r: r.itl), ("E2E latency", lambda r: [r.e2e])]
    for ax, (name, values) in zip(axes.flat, panels):
        for label, runs in series:
            _cdf(ax, [1e3 * v for run in runs for r in run.results if r.ok for v in values(r)], label)
        ax.set(title=f"{name} CDF", xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[4]
    for label, runs in series:
        xs, ys, offset = [], [], 0.0
        for run in runs:
            for t, v in output_timeline(run.results, run.t0):
                xs.append(offset + t)
                ys.append(v)
            offset += run.wall_s
        ax.step(xs, ys, where="post", label=label)
    ax.set(title="output throughput (1 s bins)", xlabel="s since the run began", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    axes.flat[5].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
