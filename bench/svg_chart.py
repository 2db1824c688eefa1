"""A grouped bar chart as a standalone SVG string: the benchmarks' figures without a plotting library.

``grouped_bars`` draws one group of bars per label (one bar per series, the
series' colours in a legend), a y axis with gridlines, and optional
horizontal target lines. Pure function of its arguments; no file I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")


def grouped_bars(title: str, labels: Sequence[str], series: Mapping[str, Sequence[float]], *,
                 ylabel: str = "", ymax: float | None = None, targets: Mapping[str, float] | None = None,
                 percent: bool = False, width: int = 900, height: int = 420) -> str:
    """The chart; ``series`` maps a name to one value per label (NaN or None: no bar)."""
    left, right, top, bottom = 70, 20, 50, 90
    plot_w, plot_h = width - left - right, height - top - bottom
    values = [v for vals in series.values() for v in vals if v is not None and v == v]
    top_value = ymax if ymax is not None else max([*values, *(targets or {}).values(), 1e-9]) * 1.1
    group_w = plot_w / max(1, len(labels))
    bar_w = group_w * 0.8 / max(1, len(series))

    def y(v: float) -> float:
        return top + plot_h * (1 - min(v, top_value) / top_value)

    def fmt(v: float) -> str:
        return f"{v:.0%}" if percent else f"{v:g}"

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for i in range(6):  # gridlines and y ticks
        v = top_value * i / 5
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{fmt(v)}</text>')
    if ylabel:
        out.append(f'<text transform="translate(16 {top + plot_h / 2}) rotate(-90)" text-anchor="middle">'
                   f'{escape(ylabel)}</text>')
    for g, label in enumerate(labels):
        x0 = left + g * group_w + group_w * 0.1
        for s, (name, vals) in enumerate(series.items()):
            v = vals[g]
            if v is None or v != v:
                continue
            x = x0 + s * bar_w
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w - 1:.1f}" height="{top + plot_h - y(v):.1f}" '
                       f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(name)} {escape(label)}: {fmt(v)}</title></rect>')
        lines = label.split("\n")
        for k, line in enumerate(lines):
            out.append(f'<text x="{left + (g + 0.5) * group_w:.1f}" y="{top + plot_h + 16 + 14 * k}" '
                       f'text-anchor="middle">{escape(line)}</text>')
    for name, v in (targets or {}).items():
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#C44E52" '
                   f'stroke-dasharray="6 4"/>')
        out.append(f'<text x="{width - right - 4}" y="{y(v) - 4:.1f}" text-anchor="end" fill="#C44E52">'
                   f'{escape(name)}</text>')
    lx = left
    for s, name in enumerate(series):
        out.append(f'<rect x="{lx}" y="{height - 24}" width="12" height="12" fill="{PALETTE[s % len(PALETTE)]}"/>')
        out.append(f'<text x="{lx + 16}" y="{height - 14}">{escape(name)}</text>')
        lx += 24 + 8 * len(name)
    out.append("</svg>")
    return "\n".join(out)
