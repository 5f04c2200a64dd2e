"""3D mode: the device mesh of a run (which ranks form each dp / tp / pp / ep group, which node each
rank is on, which groups cross nodes) and where each collective runs, with its bytes and share.
"""
from __future__ import annotations

from harness.dims import AXES
from harness.labels import esc, nbytes, pct
from harness.report import mesh as meshmod
from harness.report import svg
from harness.report.blocks import explain, notice, num_span, selector, table
from harness.report.study import Run, Study, candidates, command_for
from harness.run.record import Status

AXIS_WORDS = {a.name: a.title for a in AXES}


def render(study: Study, figs) -> str:
    runs = candidates(study, "mesh")
    head = ""
    if not runs:
        # no run combines two axes: draw the biggest run's mesh anyway, it still shows placement
        runs = sorted([r for r in study.runs if r.status != Status.INVALID and r.r.get("dims")],
                      key=lambda r: (not r.ok, -r.world, r.run_id))[:1]
        head = notice("This study ran no config that combines two or more parallel axes (dp x tp x pp). "
                      + ("Below: the mesh of its largest run." if runs else ""), command_for(study, "mesh"))
    if not runs:
        return head
    return head + selector("mesh", runs, [_panel(r, f"mesh{i}") for i, r in enumerate(runs)])


def _panel(run: Run, wid: str) -> str:
    desc = meshmod.describe(run)
    title = f'<h3>{esc(run.label)} <span class="status s-{esc(run.status)}">{esc(run.status)}</span></h3>'
    if desc is None:
        return title + notice(f"The degrees of this run do not form a valid mesh: {run.dims}")
    buttons = ['<button type="button" class="mesh-btn active" data-axis="node">nodes</button>']
    buttons += [f'<button type="button" class="mesh-btn" data-axis="{a["axis"]}">{a["axis"]} groups</button>'
                for a in desc["axes"]]
    rows = []
    share = run.comm_share_by_axis() or {}
    for a in desc["axes"]:
        meas, pred = run.comm_bytes(a["axis"])
        groups = "; ".join("[" + ", ".join(map(str, g)) + "]" for g in a["groups"][:8])
        if len(a["groups"]) > 8:
            groups += f"; ... ({len(a['groups'])} groups)"
        cross = (f'<b class="cross">{a["crossing"]} of {len(a["groups"])} cross nodes</b>' if a["crossing"]
                 else "all inside a node")
        bw = f"{a['bus_bw_GBps']:g} GB/s" if a["bus_bw_GBps"] else "?"
        rows.append([f"<b>{a['axis']}</b> ({AXIS_WORDS[a['axis']]})", str(a["size"]), esc(groups),
                     f"{cross}<br><span class='small'>{a['link'].replace('_', '-')}, {esc(bw)}</span>",
                     esc(a["collective"]),
                     f"{num_span(nbytes(meas), 'mesh-bytes-' + a['axis'])} / {esc(nbytes(pred, 'not predicted'))}",
                     num_span(pct(share.get(a["axis"])), "mesh-share-" + a["axis"])])
    tbl = (table(["axis", "size", "groups (ranks)", "crosses nodes?", "collective", "bytes/rank/step meas / pred",
                  "comm share meas"], rows, "mesh-table") if rows else
           notice("Every degree is 1: one rank, no collective."))
    return (title + explain(_sentences(run, desc)) +
            f'<div class="mesh-widget" id="{wid}"><div class="mesh-buttons">{"".join(buttons)}</div>'
            f'<div class="scroll">{svg.mesh(wid, desc)}</div></div>' + tbl)


def _sentences(run: Run, desc: dict) -> list[str]:
    d = desc["dims"]
    cp = d.get("cp", 1)
    cp_term = f"cp_rank * {d['tp']} + " if cp > 1 else ""
    out = [f"The {d['world_size']} ranks form a mesh pp({d['pp']}) x dp({d['dp']})"
           + (f" x cp({cp})" if cp > 1 else "") + f" x tp({d['tp']})"
           + (f" with ep({d['ep']}) inside dp" if d["ep"] > 1 else "")
           + (f" and dp = dp_replicate({d['dp_replicate']}) x dp_shard({d['dp'] // d['dp_replicate']})"
              if d.get("dp_replicate", 1) > 1 else "")
           + f", placed tp innermost: rank = pp_rank * {d['dp'] * cp * d['tp']} + dp_rank * {cp * d['tp']} + "
           + f"{cp_term}tp_rank. "
           f"With {desc['ranks_per_node']} ranks per node ({run.cfg('hardware', 'name')}: "
           f"hardware.devices_per_node) that is {desc['nodes']} node{'s' if desc['nodes'] > 1 else ''}."]
    for a in desc["axes"]:
        where = ("crosses nodes, so it runs at the inter-node bandwidth" if a["crossing"]
                 else "stays inside a node")
        out.append(f"Each {AXIS_WORDS[a['axis']]} group ({a['size']} ranks, {len(a['groups'])} groups) runs "
                   f"{esc(a['collective'])}; it {where}.")
    out.append("This order is the point of 3D parallelism: the chattiest axis (tp, every layer) gets the fastest "
               "links, dp's once-per-step gradient traffic comes next, and pp, which only passes boundary "
               "activations, is the one that may cross the slow network.")
    return out
