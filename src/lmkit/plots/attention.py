"""Attention maps per layer and head: a PNG grid (rows: layers, columns: heads) and a self-contained HTML
viewer (the maps as JSON inside the page, drawn by its own script: no network, no CDN)."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from lmkit.atomic import atomic_write_text
from lmkit.plots import new_figure, save


def plot_attention_grid(maps: dict[str, np.ndarray], tokens: dict[str, tuple[Sequence[str], Sequence[str]]],
                        out: str | Path, title: str = "") -> Path:
    """maps[label]: (H, T_q, T_k) probabilities of one layer (each row sums to one); tokens[label]: its
    (query tokens, key tokens)."""
    labels = list(maps)
    heads = max(m.shape[0] for m in maps.values())
    fig = new_figure(2.2 * heads + 1, 2.2 * len(labels) + 1)
    small = max(len(q) for q, _ in tokens.values()) <= 16
    for r, label in enumerate(labels):
        queries, key_tokens = tokens[label]
        for h in range(maps[label].shape[0]):
            ax = fig.add_subplot(len(labels), heads, r * heads + h + 1)
            ax.imshow(maps[label][h], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"{label} · head {h + 1}", fontsize=7)
            if small:
                ax.set_xticks(range(len(key_tokens)), [repr(t)[1:-1] for t in key_tokens], rotation=90, fontsize=5)
                ax.set_yticks(range(len(queries)), [repr(t)[1:-1] for t in queries], fontsize=5)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
    if title:
        fig.suptitle(title)
    return save(fig, out, _data(maps, tokens, 6))


def _data(maps: dict[str, np.ndarray], tokens: dict, digits: int) -> dict:
    return {"layers": list(maps), "queries": {l: list(tokens[l][0]) for l in maps},
            "keys": {l: list(tokens[l][1]) for l in maps}, "maps": {l: np.round(m, digits).tolist() for l, m in maps.items()}}


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }} td {{ width: 22px; height: 22px; padding: 0; }}
th {{ font-weight: normal; font-size: 11px; white-space: pre; }} th.k {{ writing-mode: vertical-rl; }}
#info {{ margin: .6em 0; min-height: 1.2em; }}
</style></head><body>
<h2>{title}</h2>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<div id="info">hover a cell: query token, key token, probability</div>
<table id="map"></table>
<script id="data" type="application/json">{data}</script>
<script>
const D = JSON.parse(document.getElementById("data").textContent);
const layer = document.getElementById("layer"), head = document.getElementById("head");
const table = document.getElementById("map"), info = document.getElementById("info");
D.layers.forEach((l, i) => layer.add(new Option(l, i)));
function heads() {{
  head.innerHTML = "";
  D.maps[D.layers[layer.value]].forEach((_, h) => head.add(new Option(h + 1, h)));
}}
function draw() {{
  const name = D.layers[layer.value], m = D.maps[name][head.value], keys = D.keys[name], queries = D.queries[name];
  table.innerHTML = "";
  const top = table.insertRow(); top.appendChild(document.createElement("th"));
  keys.forEach(k => {{ const th = document.createElement("th"); th.className = "k"; th.textContent = k; top.appendChild(th); }});
  m.forEach((row, q) => {{
    const tr = table.insertRow(), th = document.createElement("th");
    th.textContent = queries[q]; tr.appendChild(th);
    row.forEach((p, k) => {{
      const td = tr.insertCell();
      td.style.background = `rgba(30, 80, 200, ${{p}})`;
      td.onmouseenter = () => info.textContent = `${{queries[q]}} → ${{keys[k]}}: ${{p.toFixed(4)}}`;
    }});
  }});
}}
layer.onchange = () => {{ heads(); draw(); }}; head.onchange = draw;
heads(); draw();
</script></body></html>
"""


def attention_html(maps: dict[str, np.ndarray], tokens: dict[str, tuple[Sequence[str], Sequence[str]]],
                   out: str | Path, title: str = "attention maps") -> Path:
    """One HTML file holding every map; `<script type="application/json">` keeps the data inert text."""

    data = _data(maps, tokens, 5)
    text = json.dumps(data, ensure_ascii=False).replace("</", "<\\/")  # no "</script>" inside the data block
    atomic_write_text(out, _PAGE.format(title=html.escape(title), data=text))
    return Path(out)
