"""The figures as PNG files (matplotlib, no display needed), in the paper's layout."""

from __future__ import annotations

from pathlib import Path

COLORS = {
    "vLLM": "#d62728",
    "Orca (Oracle)": "#1f77b4",
    "Orca (Pow2)": "#2ca02c",
    "Orca (Max)": "#9467bd",
    "FasterTransformer": "#7f7f7f",
}
MARKERS = {"vLLM": "o", "Orca (Oracle)": "s", "Orca (Pow2)": "^", "Orca (Max)": "v", "FasterTransformer": "x"}
PART_LABELS = {
    "token_states": "Token states",
    "reservation": "Reservation",
    "internal_fragmentation": "Internal frag.",
    "external_fragmentation_free": "External frag. & free",
}
PART_COLORS = ["#2ca02c", "#ff7f0e", "#d62728", "#c7c7c7"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, caption: str) -> Path:
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def latency_curves(path: Path, panels: list[dict], caption: str, ylabel: str = "Normalized latency (s/token)") -> Path:
    """One panel per entry: {"title", "curves": {system: [(rate, latency), ...]}, "threshold" (or None),
    optionally "real": {system: [(rate, latency), ...]} drawn as stars}; latencies are clipped
    at 5x the threshold, as the paper's axes cut the exploding tails."""
    plt = _plt()
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        threshold = panel.get("threshold")
        everything = [y for points in [*panel["curves"].values(), *(panel.get("real") or {}).values()] for _, y in points]
        top = 5 * threshold if threshold else 1.2 * max(everything)
        for system, points in panel["curves"].items():
            points = sorted(points)
            xs = [r for r, _ in points]
            ys = [min(latency, top) for _, latency in points]
            ax.plot(xs, ys, marker=MARKERS.get(system, "o"), color=COLORS.get(system), label=system, markersize=4)
        for system, points in (panel.get("real") or {}).items():  # real-clock points, as stars
            for rate, latency in points:
                ax.plot(
                    [rate], [min(latency, top)], marker="*", color=COLORS.get(system), markersize=12, markeredgecolor="black"
                )
        if threshold:
            ax.axhline(threshold, linestyle="--", color="black", linewidth=0.8)
            ax.text(ax.get_xlim()[0], threshold, " 2x vLLM unloaded", va="bottom", fontsize=7)
        ax.set_ylim(0, top * 1.05)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    return _save(fig, path, caption)


def breakdown_bars(path: Path, rows: dict[str, dict[str, float]], paper: dict[str, float], caption: str) -> Path:
    """Stacked horizontal bars: each system's KV slots by part, the paper's token-state share marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(rows) + 1.4))
    names = list(rows)
    for y, name in enumerate(names):
        left = 0.0
        for part, color in zip(PART_LABELS, PART_COLORS):
            share = 100 * rows[name].get(part, 0.0)
            ax.barh(y, share, left=left, color=color, label=PART_LABELS[part] if y == 0 else None)
            if share >= 6:
                ax.text(left + share / 2, y, f"{share:.1f}", ha="center", va="center", fontsize=8)
            left += share
        if name in paper:
            ax.plot([paper[name]], [y], marker="|", color="black", markersize=22, markeredgewidth=2)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlim(0, 100)
    ax.set_xlabel("KV cache slots (%)   | = the paper's token-state share")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.25))
    return _save(fig, path, caption)


def grouped_bars(path: Path, panels: list[dict], caption: str, ylabel: str) -> Path:
    """One panel per entry: {"title", "bars": {label: value}, "paper": {label: value}}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        labels = list(panel["bars"])
        values = [panel["bars"][label] for label in labels]
        colors = [COLORS.get(label, "#1f77b4") for label in labels]
        bars = ax.bar(range(len(labels)), values, color=colors)
        for bar, value in zip(bars, values):
            x = bar.get_x() + bar.get_width() / 2
            ax.text(x, bar.get_height(), f"{value:.1f}", ha="center", va="bottom", fontsize=8)
        for i, label in enumerate(labels):
            if label in (panel.get("paper") or {}):
                ax.plot([i], [panel["paper"][label]], marker="_", color="black", markersize=24, markeredgewidth=2)
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=8)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path, caption)


def length_histograms(path: Path, datasets: dict[str, dict], caption: str) -> Path:
    """Input and output length histograms per dataset: {name: {"input": [...], "output": [...]}}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 3.3), squeeze=False)
    for ax, (name, lengths) in zip(axes.flat, datasets.items()):
        top = max(max(lengths["input"]), max(lengths["output"]))
        bins = [i * top / 50 for i in range(51)]
        for kind, color in (("input", "#1f77b4"), ("output", "#ff7f0e")):
            values = lengths[kind]
            mean = sum(values) / len(values)
            ax.hist(values, bins=bins, alpha=0.6, color=color, density=True, label=f"{kind} (mean {mean:.1f})")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("Tokens")
        ax.set_ylabel("Density")
        ax.legend(fontsize=8)
    return _save(fig, path, caption)


def lines(path: Path, panels: list[dict], caption: str) -> Path:
    """One panel per entry: {"title", "xlabel", "ylabel", "series": {label: [(x, y), ...]},
    "logx": bool, "logy": bool}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.4), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, points in panel["series"].items():
            points = sorted(points)
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=4, label=label)
        if panel.get("logx"):
            ax.set_xscale("log", base=2)
        if panel.get("logy"):
            ax.set_yscale("log")
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path, caption)


def parity(path: Path, points: list[dict], tolerance: float, caption: str) -> Path:
    """Simulated vs real values, one marker per run ({"system", "dataset", "real", "simulated",
    "label"}), on log axes with the y = x line and a +-tolerance band."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.6, 5.0))
    values = [v for p in points for v in (p["real"], p["simulated"])]
    low, high = min(values) / 1.3, max(values) * 1.3
    xs = [low, high]
    ax.plot(xs, xs, color="black", linewidth=0.8)
    band = ([x * (1 - tolerance) for x in xs], [x * (1 + tolerance) for x in xs])
    ax.fill_between(xs, *band, color="#dddddd", label=f"within {tolerance:.0%}")
    shapes = {"sharegpt": "o", "alpaca": "s"}
    seen = set()
    for p in points:
        label = f"{p['system']}" if p["system"] not in seen else None
        seen.add(p["system"])
        marker = shapes.get(p["dataset"], "o")
        ax.scatter([p["real"]], [p["simulated"]], color=COLORS.get(p["system"]), marker=marker, s=45, label=label, zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("Real normalized latency (s/token)")
    ax.set_ylabel("Simulated normalized latency (s/token)")
    ax.set_title("Circles: ShareGPT, squares: Alpaca", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path, caption)
