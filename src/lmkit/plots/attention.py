"""Attention maps per layer and head: a PNG grid (rows: layers, columns: heads) and a self-contained HTML
viewer (the maps as JSON inside the page, drawn by its own script: no network, no CDN)."""
from __future__ import annotations

import html
import textwrap
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from lmkit.atomic import atomic_write_text
from lmkit.plots import new_figure, save, token_label


MAX_TICKS = 24  # token labels per axis; past it every n-th is labelled


def _ticks(ax, axis: str, tokens: Sequence[str]) -> None:
    step = -(-len(tokens) // MAX_TICKS)
    where = list(range(0, len(tokens), step))
    labels = [token_label(tokens[i]) for i in where]
    if axis == "x":
        ax.set_xticks(where, labels, rotation=90, fontsize=6)
    else:
        ax.set_yticks(where, labels, fontsize=6)


def plot_attention_grid(maps: dict[str, np.ndarray], tokens: dict[str, tuple[Sequence[str], Sequence[str]]],
                        out: str | Path, title: str = "") -> Path:
    """maps[label]: (H, T_q, T_k) probabilities of one layer (each row sums to one); tokens[label]: its
    (query tokens, key tokens). Rows of a panel are queries, columns keys, one colour scale [0, 1] for all."""
    labels = list(maps)
    heads = max(m.shape[0] for m in maps.values())
    longest = max(max(len(q), len(k)) for q, k in tokens.values())
    side = 2.2 if longest <= 12 else 3.2
    fig = new_figure(side * heads + 1.5, side * len(labels) + 1.2)
    fig.set_layout_engine("constrained")  # places the colour bar shared by every panel
    image, panels = None, []
    for r, label in enumerate(labels):
        queries, key_tokens = tokens[label]
        for h in range(maps[label].shape[0]):
            ax = fig.add_subplot(len(labels), heads, r * heads + h + 1)
            image = ax.imshow(maps[label][h], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_title(f"{label} \u00b7 head {h + 1}", fontsize=7)
            _ticks(ax, "x", key_tokens)
            _ticks(ax, "y", queries)
            if r == len(labels) - 1:
                ax.set_xlabel("key", fontsize=7)
            if h == 0:
                ax.set_ylabel("query", fontsize=7)
            panels.append(ax)
    width = side * heads + 1.5
    fig.suptitle("\n".join(textwrap.wrap(title or "attention maps", max(30, int(width * 9)))), fontsize=11)
    fig.colorbar(image, ax=panels, label="attention probability", shrink=0.8, fraction=0.03, pad=0.02)
    return save(fig, out, _data(maps, tokens, 6), layout=False)


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
