"""report.html: one self-contained page drawn from metrics.jsonl, no plotting library: line charts as inline
SVG (loss and eval loss, tokens/s, MFU, memory, grad norm, lr), and per MoE layer a heatmap of expert load
over the logged steps (rows: experts, columns: steps; a PNG encoded here, inside an SVG with its axes),
plus a routing-health table (load imbalance, dead experts)."""

from __future__ import annotations

import base64
import contextlib
import html
import math
import os
import struct
import zlib

from .routing import health, summary

W, H, PAD = 560, 220, (48, 12, 26, 34)  # chart size; padding left, right, top, bottom
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
# viridis at 0, 1/4, 1/2, 3/4, 1
STOPS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    return [i * step for i in range(math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9) + 1)]


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v) -> str:
    if not _finite(v):  # NaN / inf (or None: metrics.jsonl writes non-finite numbers as null)
        return "n/a"
    if v == 0:
        return "0"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.4g}{unit}"
    if abs(v) < 1e-3:
        return f"{v:.1e}".replace("e-0", "e-")
    return f"{v:.4g}"


def line_chart(title: str, series: list[dict]) -> str:
    """series: [{label, points: [(x, y)], dots: bool}] -> <svg>. Points with y None are skipped; a
    non-finite y (NaN, inf) is a gap in the line."""
    runs = []  # per series, its runs of consecutive finite points (the line breaks at a non-finite one)
    for s in series:
        runs.append([[]])
        for x, y in s["points"]:
            if y is None:
                continue
            if _finite(y):
                runs[-1][-1].append((x, y))
            elif runs[-1][-1]:
                runs[-1].append([])
    series = [dict(s, points=[p for r in rs for p in r]) for s, rs in zip(series, runs)]
    pts = [p for s in series for p in s["points"]]
    if not pts:
        return f'<div class="none">{html.escape(title)}: not measured</div>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
    x1 = x1 if x1 > x0 else x0 + 1
    left, right, top, bottom = PAD

    def sx(x):
        return left + (x - x0) / (x1 - x0) * (W - left - right)

    def sy(y):
        return H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom)

    out = [f'<svg class="chart" viewBox="0 0 {W} {H}" width="{W}" height="{H}">']
    out.append(f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>')
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{W - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#e6e6e6"/>')
        out.append(
            f'<text x="{left - 4}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>'
        )
    for t in _ticks(x0, x1, 6):
        out.append(
            f'<text x="{sx(t):.1f}" y="{H - bottom + 14}" class="tick" text-anchor="middle">{_fmt(t)}</text>'
        )
    out.append(f'<text x="{W - right}" y="{H - 4}" class="tick" text-anchor="end">step</text>')
    box = f'x="{left}" y="{top}" width="{W - left - right}" height="{H - top - bottom}"'
    out.append(f'<rect {box} fill="none" stroke="#999"/>')
    for i, s in enumerate(series):
        color, xy = COLORS[i % len(COLORS)], [(sx(x), sy(y)) for x, y in s["points"]]
        for run in runs[i]:
            if len(run) > 1:
                path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in run)
                out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        if s.get("dots") or len(xy) == 1:
            out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in xy]
        lx = W - right - 8 - 110 * (len(series) - 1 - i)
        out.append(
            f'<text x="{lx}" y="16" class="legend" fill="{color}" text-anchor="end">{s["label"]}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _color(t) -> tuple[int, int, int]:
    if not _finite(t):  # a non-finite load: grey
        return (160, 160, 160)
    t = min(max(t, 0.0), 1.0) * (len(STOPS) - 1)
    i = min(int(t), len(STOPS) - 2)
    f = t - i
    return tuple(round(a + (b - a) * f) for a, b in zip(STOPS[i], STOPS[i + 1]))


def png(rows: list[bytes]) -> bytes:
    """An RGB PNG (8 bit, no filter); each row: 3 bytes per pixel."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    h, w = len(rows), len(rows[0]) // 3
    raw = b"".join(b"\x00" + row for row in rows)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def heatmap(title: str, steps: list[int], fractions: list[list[float]]) -> str:
    """fractions[column][expert] -> <svg>: load = fraction x experts, 0 (dark) .. 2 or more (bright)."""
    E, n = len(fractions[0]), len(fractions)
    left, right, top, bottom = PAD
    h = min(max(6 * E, 120), 420)
    # cells of several pixels: viewers that smooth a scaled image (ignoring image-rendering) stay sharp
    cw, ch = -(-(W - left - right) // n), -(-h // E)
    rows = [
        bytes(c for col in fractions for c in _color(col[e] * E / 2 if _finite(col[e]) else None) * cw)
        for e in range(E)
    ]
    rows = [row for row in rows for _ in range(ch)]
    data = base64.b64encode(png(rows)).decode()
    total = top + h + bottom
    out = [f'<svg class="heat" viewBox="0 0 {W} {total}" width="{W}" height="{total}">']
    out.append(f'<text x="{left}" y="16" class="title">{html.escape(title)}</text>')
    out.append(
        f'<image x="{left}" y="{top}" width="{W - left - right}" height="{h}" preserveAspectRatio="none" '
        f'style="image-rendering:pixelated" href="data:image/png;base64,{data}"/>'
    )
    for e in sorted({0, E - 1, *range(0, E, max(1, E // 8))}):
        y = top + (e + 0.5) * h / E
        out.append(f'<text x="{left - 4}" y="{y + 4:.1f}" class="tick" text-anchor="end">{e}</text>')
    for i in sorted({0, n - 1, *range(0, n, max(1, n // 6))}):
        x = left + (i + 0.5) * (W - left - right) / n
        out.append(
            f'<text x="{x:.1f}" y="{top + h + 14}" class="tick" text-anchor="middle">{steps[i]}</text>'
        )
    out.append(
        f'<text x="12" y="{top + h / 2:.0f}" class="tick" transform="rotate(-90 12 {top + h / 2:.0f})" '
        'text-anchor="middle">expert</text>'
    )
    out.append("</svg>")
    return "\n".join(out)


def _legend() -> str:
    cells = "".join(f'<span style="background:rgb{_color(i / 20)}"></span>' for i in range(21))
    return f'<div class="scale">load 0 {cells} 2+ &nbsp;(load = token share x experts; 1 = uniform)</div>'


CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}
.tick{font-size:11px;fill:#555}
.title{font-size:13px;font-weight:600}.legend{font-size:12px;font-weight:600}.none{color:#888;margin:8px 0}
.charts,.heats{display:flex;flex-wrap:wrap;gap:8px}.scale span{display:inline-block;width:10px;height:10px}
.bad{color:#c00}"""


def render(history: list[dict], info: dict, dead_window: int) -> str:
    train = [h for h in history if "loss" in h]

    def pts(key, scale=1.0, rows=None):
        return [(h["step"], None if h.get(key) is None else h[key] * scale) for h in (rows or train)]

    charts = [
        line_chart(
            "loss",
            [
                dict(label="train", points=pts("loss")),
                dict(label="eval", points=pts("eval_loss", rows=history), dots=True),
            ],
        ),
        line_chart("tokens / s", [dict(label="tokens/s", points=pts("tokens_per_s"))]),
        line_chart(
            "router losses (aux, z)",
            [dict(label="aux", points=pts("aux_loss")), dict(label="z", points=pts("z_loss"))],
        ),
        line_chart("MFU (%)", [dict(label="MFU", points=pts("mfu", 100.0))]),
        line_chart("memory (GiB, peak)", [dict(label="GiB", points=pts("memory_gib"))]),
        line_chart("grad norm (before clipping)", [dict(label="grad norm", points=pts("grad_norm"))]),
        line_chart("learning rate", [dict(label="lr", points=pts("lr"))]),
    ]
    routed = [h for h in history if h.get("routing")]
    # routing health from the lines whose fractions are all finite (a NaN run has none)
    clean = [dict(h, routing={n: f for n, f in h["routing"].items() if all(map(_finite, f))}) for h in routed]
    layers = list(routed[-1]["routing"]) if routed else []
    heats = [
        heatmap(
            name,
            [h["step"] for h in routed if name in h["routing"]],
            [h["routing"][name] for h in routed if name in h["routing"]],
        )
        for name in layers
    ]
    hl = health([h for h in clean if h["routing"]], dead_window)
    s = summary(hl)
    rows = "".join(
        f"<tr><td style='text-align:left'>{html.escape(n)}</td><td>{v['experts']}</td><td>{v['imbalance']:.2f}</td>"
        f"<td>{v['mean_imbalance']:.2f}</td><td>{v['max_imbalance']:.2f}</td>"
        f"<td class='{'bad' if v['dead'] else ''}'>{len(v['dead'])} {v['dead'] if v['dead'] else ''}</td></tr>"
        for n, v in hl.items()
    )
    last = train[-1] if train else {}
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    facts = {k: info[k] for k in ("model", "method", "device", "ranks") if k in info}
    if "params" in info:
        facts["parameters"] = f"{info['params'] / 1e6:.2f}M ({info['active'] / 1e6:.2f}M active per token)"
        facts["experts on"] = "moe8" if info.get("moe8") else "transformers"
    facts |= {
        "steps": f"{last.get('step', 0)} of {info.get('steps', '?')}",
        "train loss (last)": _fmt(last.get("loss")) if "loss" in last else "-",
        "eval loss": " -> ".join(_fmt(e) for e in (evals[:1] + evals[-1:] if len(evals) > 1 else evals))
        or "-",
    }
    for k in ("eval_data", "assistant turns", "aux_loss_coef", "z_loss_coef", "cuda_graphs"):
        if info.get(k) is not None:
            facts[k.replace("_", " ")] = info[k]
    if "memory_estimate_gib" in info:
        peaks = [h["memory_gib"] for h in train if _finite(h.get("memory_gib"))]
        measured = f"{max(peaks):.2f} GiB" if peaks else "not measured"
        if peaks and str(info.get("device", "")).startswith("cpu"):  # no allocator statistics on the CPU
            measured += (
                " process peak RSS (with Python, torch and the data; the estimate: the training's tensors)"
            )
        facts["memory: estimate vs measured peak"] = (
            f"{info['memory_estimate_gib']:.2f} GiB vs {measured} ({info.get('memory_parts', '')})"
        )
    ranks_mem = next((h["memory_gib_ranks"] for h in reversed(train) if h.get("memory_gib_ranks")), None)
    if ranks_mem:
        facts["peak memory per rank (GiB)"] = ", ".join(f"{r}: {_fmt(g)}" for r, g in enumerate(ranks_mem))
    tps = [h["tokens_per_s"] for h in train if _finite(h.get("tokens_per_s"))]
    if tps:
        facts["tokens/s (median)"] = f"{sorted(tps)[len(tps) // 2]:,.0f}"
    head = "".join(
        f"<tr><th style='text-align:left'>{k}</th><td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in facts.items()
    )
    health_line = (
        f"max load imbalance {s['max_imbalance']:.2f} ({html.escape(s['max_imbalance_layer'])}), mean "
        f"{s['mean_imbalance']:.2f}; dead experts (no token in the last {dead_window} steps): "
        f"{s['dead_experts']} of {s['experts']}"
        if s
        else "no routing statistics"
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>moe8 finetune report</title>
<style>{CSS}</style></head><body>
<h1>moe8 finetune report</h1><table>{head}</table>
<h2>Training</h2><div class="charts">{"".join(charts)}</div>
<h2>Routing health</h2><p>{health_line}</p>
<table><tr><th>MoE layer</th><th>experts</th><th>imbalance (last)</th><th>mean</th><th>max</th><th>dead</th></tr>{rows}</table>
<p>imbalance = the busiest expert's load, load = its token share x experts (1 = uniform, E = one expert takes
every token).</p>
<h2>Expert load per layer</h2>{_legend()}<div class="heats">{"".join(heats)}</div>
</body></html>
"""


def write(path, history: list[dict], info: dict | None = None, dead_window: int = 50) -> None:
    """Write the report atomically (a temporary file, then os.replace); a failure leaves no temporary file."""
    text = render(history, info or {}, dead_window)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
