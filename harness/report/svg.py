"""Hand-drawn schematics (SVG) that no plotting library draws: the ring of an all-reduce, what each
ZeRO stage shards, one transformer block split over tp ranks, and the device mesh.

Plain strings, no dependency. Elements the page's script animates carry ids / data attributes;
everything else is static. Rank r is drawn in RANK_COLOURS[r % 10] throughout.
"""
from __future__ import annotations

import math

from harness.labels import esc, nbytes

RANK_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                "#9c755f", "#bab0ac"]
MAX_RING = 12  # ranks drawn in the ring; beyond that the page says the drawing is cut


def _text(x, y, s, size=12, anchor="middle", weight="normal", fill="#222", extra="") -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}" {extra}>{esc(s)}</text>')


# -- DP: ring all-reduce -----------------------------------------------------------------------------
def ring(widget_id: str, n: int) -> str:
    """Ranks on a circle, each with its n gradient chunks as small cells (filled as they are summed),
    and the ring's edges; the page's script sets cell opacity and edge labels per step."""
    n = max(1, min(n, MAX_RING))
    radius = 150 if n > 4 else (120 if n > 2 else 95)
    size = 2 * radius + 130
    cx = cy = size / 2
    cell = max(7, min(18, 120 // n))
    parts = [f'<svg class="ring" id="{widget_id}-svg" viewBox="0 0 {size} {size}" width="{size}" height="{size}" '
             f'role="img" aria-label="ring all-reduce among {n} ranks">',
             '<defs><marker id="' + widget_id + '-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="11" '
             'markerHeight="11" markerUnits="userSpaceOnUse" orient="auto-start-reverse">'
             '<path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>']
    pos = [(cx + radius * math.sin(2 * math.pi * i / n), cy - radius * math.cos(2 * math.pi * i / n)) for i in range(n)]
    for i in range(n if n > 1 else 0):
        (x1, y1), (x2, y2) = pos[i], pos[(i + 1) % n]
        # shorten the edge so the arrow head stops at the node's rim
        dx, dy = x2 - x1, y2 - y1
        length = math.hypot(dx, dy) or 1
        ux, uy = dx / length, dy / length
        # control point pushed outwards, perpendicular to the edge: a 2-rank ring shows two arcs
        bend = 0.25 * length if n == 2 else 0.12 * length
        mx, my = (x1 + x2) / 2 - uy * bend, (y1 + y2) / 2 + ux * bend
        parts.append(f'<path id="{widget_id}-edge-{i}" class="ring-edge" d="M {x1 + ux * 34:.1f} {y1 + uy * 34:.1f} '
                     f'Q {mx:.1f} {my:.1f} {x2 - ux * 34:.1f} {y2 - uy * 34:.1f}" fill="none" stroke="#bbb" '
                     f'stroke-width="2" marker-end="url(#{widget_id}-arrow)"/>')
        parts.append(_text(mx, my, "", 11, extra=f'id="{widget_id}-edge-label-{i}" class="edge-label"'))
    for i, (x, y) in enumerate(pos):
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="30" fill="#fff" stroke="{RANK_COLOURS[i % 10]}" '
                     f'stroke-width="3"/>')
        parts.append(_text(x, y - 12, f"rank {i}", 11, weight="bold"))
        x0 = x - n * cell / 2
        for c in range(n):
            parts.append(f'<rect id="{widget_id}-cell-{i}-{c}" class="chunk" x="{x0 + c * cell:.1f}" y="{y - 4:.1f}" '
                         f'width="{cell - 1}" height="{cell - 1}" fill="{RANK_COLOURS[c % 10]}" fill-opacity="0.15" '
                         f'stroke="#333" stroke-width="0.4"><title>chunk {c}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


# -- DP: what ZeRO shards ------------------------------------------------------------------------------
ZERO_SHARDS = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}


def zero(widget_id: str, n: int, parts_bytes: dict[str, float], stage_shown: int) -> str:
    """For each ZeRO stage (a <g> per stage, one visible): every dp rank's params / grads / optimizer
    state as bars; a sharded part shows only the rank's 1/n slice."""
    n_draw = max(1, min(n, 8))
    col_w, bar_w, top, height = 92, 22, 34, 150
    width = max(640, 40 + n_draw * col_w)
    total = max(sum(parts_bytes.values()), 1)
    out = [f'<svg class="zero" viewBox="0 0 {width} {top + height + 48}" width="{width}" '
           f'height="{top + height + 48}" role="img" aria-label="what ZeRO shards">']
    names = ("params", "grads", "optimizer")
    colours = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f"}
    for stage in range(4):
        vis = "" if stage == stage_shown else ' style="display:none"'
        out.append(f'<g id="{widget_id}-stage-{stage}" class="zero-stage" data-stage="{stage}"{vis}>')
        per_rank = sum(parts_bytes[k] / (n if k in ZERO_SHARDS[stage] else 1) for k in names)
        out.append(_text(20, 18, f"ZeRO-{stage}: {nbytes(per_rank)} of model states per rank; sharded over "
                                 f"{n} ranks: {', '.join(ZERO_SHARDS[stage]) or 'nothing'}",
                         12, anchor="start", weight="bold"))
        for r in range(n_draw):
            x = 30 + r * col_w
            out.append(_text(x + 1.5 * bar_w, top + height + 16, f"rank {r}", 11))
            for j, k in enumerate(names):
                bx = x + j * (bar_w + 3)
                h = height * parts_bytes[k] / total
                y = top + height - h
                out.append(f'<rect x="{bx}" y="{y:.1f}" width="{bar_w}" height="{h:.1f}" fill="#eee" '
                           f'stroke="#bbb" stroke-width="0.5"/>')
                if k in ZERO_SHARDS[stage]:
                    sh = h / n
                    out.append(f'<rect x="{bx}" y="{y + r * sh if r < n else y:.1f}" width="{bar_w}" height="{sh:.1f}" '
                               f'fill="{colours[k]}"><title>{k}: shard {r} of {n}</title></rect>')
                else:
                    out.append(f'<rect x="{bx}" y="{y:.1f}" width="{bar_w}" height="{h:.1f}" fill="{colours[k]}">'
                               f'<title>{k}: full copy</title></rect>')
        out.append("</g>")
    ly = top + height + 38
    for j, k in enumerate(names):
        out.append(f'<rect x="{30 + j * 110}" y="{ly - 10}" width="12" height="12" fill="{colours[k]}"/>')
        out.append(_text(46 + j * 110, ly, k if k != "optimizer" else "optimizer state", 11, anchor="start"))
    if n > n_draw:
        out.append(_text(width - 10, ly, f"(first {n_draw} of {n} ranks drawn)", 10, anchor="end"))
    out.append("</svg>")
    return "".join(out)


# -- TP: one block split over tp ranks -----------------------------------------------------------------
def tp_block(t: int, h: int, d_ff: int, heads: int, sp: bool, msg_bytes: float, counts: dict) -> str:
    """Megatron's split of one block: q/k/v and fc1 by columns (output features), o and fc2 by rows
    (input features), with the collectives between them (f/g operators of the paper)."""
    height, top = 300, 60
    out: list[str] = []
    t_draw = max(1, min(t, 8))
    fwd_in, bwd_in = ("all-gather", "reduce-scatter") if sp else ("identity", "all-reduce")
    fwd_out, bwd_out = ("reduce-scatter", "all-gather") if sp else ("all-reduce", "identity")
    # q, k, v are separate layers in brigade's model: each reduces its input gradient (x3)
    bwd_attn = bwd_in + (f" x{counts['attn_bwd']}" if counts.get("attn_bwd", 1) > 1 else "")

    def matrix(x, rows_in, cols_out, split, name, shape_txt):
        w, hh = (110, 110) if cols_out <= rows_in else (150, 90)
        if rows_in > cols_out:
            w, hh = 90, 150
        y = top + (150 - hh) / 2
        for k in range(t_draw):
            c = RANK_COLOURS[k % 10]
            if split == "col":
                out.append(f'<rect x="{x + k * w / t_draw:.1f}" y="{y:.1f}" width="{w / t_draw:.1f}" height="{hh}" '
                           f'fill="{c}" fill-opacity="0.75" stroke="#fff"><title>rank {k}: columns</title></rect>')
            else:
                out.append(f'<rect x="{x}" y="{y + k * hh / t_draw:.1f}" width="{w}" height="{hh / t_draw:.1f}" '
                           f'fill="{c}" fill-opacity="0.75" stroke="#fff"><title>rank {k}: rows</title></rect>')
        out.append(f'<rect x="{x}" y="{y:.1f}" width="{w}" height="{hh}" fill="none" stroke="#333"/>')
        out.append(_text(x + w / 2, y - 8, name, 13, weight="bold"))
        out.append(_text(x + w / 2, top + 172, shape_txt, 10))
        out.append(_text(x + w / 2, top + 186, "split by " + ("columns" if split == "col" else "rows"), 10,
                         fill="#555"))
        return x + w

    def collective(x, fwd, bwd, tag):
        y = top + 75
        active = fwd != "identity" or bwd != "identity"
        out.append(f'<rect x="{x - 46}" y="{y - 24}" width="92" height="48" rx="6" fill="{"#fde2e1" if active else "#f3f3f3"}" '
                   f'stroke="{"#e15759" if active else "#bbb"}" class="collective" data-op="{tag}"/>')
        out.append(_text(x, y - 7, f"fwd: {fwd}", 10))
        out.append(_text(x, y + 7, f"bwd: {bwd}", 10))
        out.append(_text(x, y + 38, tag, 10, fill="#e15759", weight="bold"))

    def arrow(x1, x2):
        y = top + 75
        out.append(f'<line x1="{x1 + 4}" y1="{y}" x2="{x2 - 4}" y2="{y}" stroke="#888" stroke-width="1.5"/>')

    hd = h // max(t, 1)
    x = 20
    out.append(_text(x + 25, top + 80, "X", 16, weight="bold"))
    out.append(_text(x + 25, top + 98, "(b, s, h)" if not sp else "(b, s/t, h)", 10))
    x += 50
    arrow(x, x + 20)
    collective(x + 62, fwd_in, bwd_attn, "f")
    arrow(x + 104, x + 124)
    x = matrix(x + 124, h, 3 * h, "col", "W_qkv", f"h x 3h = {h} x {3 * h}; rank: {h} x {3 * hd}")
    arrow(x, x + 16)
    out.append(f'<rect x="{x + 16}" y="{top + 50}" width="92" height="50" rx="6" fill="#fff" stroke="#888"/>')
    out.append(_text(x + 62, top + 72, "attention", 11))
    out.append(_text(x + 62, top + 88, f"{heads // max(t, 1)} of {heads} heads/rank", 10))
    x += 108
    arrow(x, x + 16)
    x = matrix(x + 16, h, h, "row", "W_o", f"h x h = {h} x {h}; rank: {hd} x {h}")
    arrow(x, x + 20)
    collective(x + 62, fwd_out, bwd_out, "g")
    x += 104
    arrow(x, x + 20)
    collective(x + 62, fwd_in, bwd_in, "f")
    x += 124
    arrow(x - 20, x)
    x = matrix(x, h, d_ff, "col", "W_fc1", f"h x d_ff = {h} x {d_ff}; rank: {h} x {d_ff // max(t, 1)}")
    arrow(x, x + 16)
    out.append(f'<rect x="{x + 16}" y="{top + 55}" width="50" height="40" rx="6" fill="#fff" stroke="#888"/>')
    out.append(_text(x + 41, top + 80, "GeLU", 11))
    x += 66
    arrow(x, x + 16)
    x = matrix(x + 16, d_ff, h, "row", "W_fc2", f"d_ff x h = {d_ff} x {h}; rank: {d_ff // max(t, 1)} x {h}")
    arrow(x, x + 20)
    collective(x + 62, fwd_out, bwd_out, "g")
    width = x + 120
    legend_y = height - 26
    for k in range(t_draw):
        out.append(f'<rect x="{20 + k * 84}" y="{legend_y - 10}" width="12" height="12" fill="{RANK_COLOURS[k % 10]}" '
                   f'fill-opacity="0.75"/>')
        out.append(_text(36 + k * 84, legend_y, f"tp rank {k}", 11, anchor="start"))
    out.append(_text(width - 10, legend_y, f"each f/g collective moves one (b, s, h) activation: {nbytes(msg_bytes)}",
                     11, anchor="end"))
    out.append(_text(20, 22, "Attention: W_qkv split by columns (whole heads per rank), W_o by rows; "
                             "MLP: W_fc1 by columns, W_fc2 by rows.", 12, anchor="start", weight="bold"))
    out.append(_text(20, 40, "Between the column- and row-parallel matmuls no communication is needed; "
                             "f and g are where the ranks talk.", 11, anchor="start", fill="#555"))
    head = (f'<svg class="tp-block" viewBox="0 0 {width:.0f} {height}" width="{width:.0f}" height="{height}" role="img" '
            f'aria-label="tensor-parallel split of one block over {t} ranks">')
    return head + "".join(out) + "</svg>"


# -- 3D: the device mesh --------------------------------------------------------------------------------
def mesh(widget_id: str, desc: dict) -> str:
    """pp stages left to right; inside each a dp (rows) x cp*tp (columns, tp innermost) grid of ranks; nodes as
    tinted backgrounds. Each rank carries its group index per axis (data-group-<axis>) for highlighting."""
    pp, dp, cols = desc["grid_shape"]  # stages, dp rows, cp x tp columns (ParallelDims.grid)
    at = {tuple(rk["grid"]): rk for rk in desc["ranks"]}
    cw, ch, gap = 92, 50, 64
    block_w, block_h = cols * cw, dp * ch
    width = max(620, 40 + pp * (block_w + gap))
    height = 80 + block_h + 40
    per_node = desc["ranks_per_node"]
    group_of = {}
    for a in desc["axes"]:
        for gi, g in enumerate(a["groups"]):
            for r in g:
                group_of.setdefault(r, {})[a["axis"]] = gi
    out = [f'<svg class="mesh" id="{widget_id}-svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="device mesh">']
    for s in range(pp):
        x0 = 20 + s * (block_w + gap)
        out.append(f'<rect x="{x0 - 6}" y="44" width="{block_w + 12}" height="{block_h + 12}" rx="8" fill="none" '
                   f'stroke="#999" stroke-dasharray="4 3"/>')
        out.append(_text(x0 + block_w / 2, 36, f"pipeline stage {s}" if pp > 1 else "one stage (pp = 1)", 12,
                         weight="bold"))
        if s < pp - 1:
            out.append(f'<line x1="{x0 + block_w + 8}" y1="{50 + block_h / 2}" x2="{x0 + block_w + gap - 8}" '
                       f'y2="{50 + block_h / 2}" stroke="#59a14f" stroke-width="2"/>')
    if per_node % cols == 0 and (dp * cols) % per_node == 0 and per_node < dp * cols * pp:
        rows = per_node // cols  # a node is `rows` whole rows of one stage: outline it
        for s in range(pp):
            for k in range(dp // rows):
                x0, y0 = 20 + s * (block_w + gap), 50 + k * rows * ch
                node = at[(s, k * rows, 0)]["node"]
                out.append(f'<rect x="{x0 - 2}" y="{y0 - 1}" width="{block_w + 4}" height="{rows * ch + 2}" rx="6" '
                           f'fill="none" stroke="#2f6db5" stroke-width="1.5"><title>node {node}</title></rect>')
    for rk in desc["ranks"]:
        stage, row, col = rk["grid"]
        x = 20 + stage * (block_w + gap) + col * cw
        y = 50 + row * ch
        attrs = " ".join(f'data-group-{a}="{g}"' for a, g in group_of.get(rk["rank"], {}).items())
        node_fill = "#f4f4f4" if rk["node"] % 2 == 0 else "#e3e9f2"
        out.append(f'<g class="mesh-rank" data-rank="{rk["rank"]}" data-node="{rk["node"]}" {attrs}>'
                   f'<rect x="{x + 2}" y="{y + 2}" width="{cw - 4}" height="{ch - 4}" rx="5" fill="{node_fill}" '
                   f'stroke="#555" stroke-width="1"/>'
                   + _text(x + cw / 2, y + ch / 2 - 2, f"rank {rk['rank']}", 11, weight="bold")
                   + _text(x + cw / 2, y + ch / 2 + 11, f"node {rk['node']}", 9, fill="#666")
                   + "</g>")
    out.append(_text(20, height - 14, f"rows: dp rank; columns: {'cp rank x ' if desc['dims']['cp'] > 1 else ''}tp rank; {desc['ranks_per_node']} ranks per node "
                                      f"(blue outlines / alternating backgrounds: nodes)", 11, anchor="start", fill="#555"))
    out.append("</svg>")
    return "".join(out)
