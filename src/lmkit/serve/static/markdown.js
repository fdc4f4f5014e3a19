// A small Markdown renderer for the chat page's replies: fenced code blocks, headings, lists, paragraphs, inline
// code, bold and italic. It builds DOM nodes and writes only textContent, so markup inside a reply stays text.
"use strict";

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+/;
// inline spans, the first that matches wins: `code`, **bold** or __bold__, *italic*
const SPAN = /(`+)([\s\S]+?)\1|\*\*(?=\S)([\s\S]+?)\*\*|__(?=\S)([\s\S]+?)__|\*(?=[^\s*])([^*\n]+?)\*/;

function element(tag, parent) {
  const node = document.createElement(tag);
  if (parent) parent.appendChild(node);
  return node;
}

function renderInline(parent, text) {
  while (text) {
    const m = SPAN.exec(text);
    if (!m) {
      parent.appendChild(document.createTextNode(text));
      return;
    }
    if (m.index) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
    if (m[1]) element("code", parent).textContent = m[2];
    else if (m[3] !== undefined || m[4] !== undefined) renderInline(element("strong", parent), m[3] ?? m[4]);
    else renderInline(element("em", parent), m[5]);
    text = text.slice(m.index + m[0].length);
  }
}

// Replace the children of `target` with `source` rendered; an unclosed fence (a reply still streaming) runs to the end.
function renderMarkdown(target, source) {
  target.replaceChildren();
  const lines = source.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence[1]); i++) body.push(lines[i]);
      i++;
      const code = element("code", element("pre", target));
      if (fence[2]) code.dataset.lang = fence[2];
      code.textContent = body.join("\n");
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      renderInline(element("h" + Math.min(heading[1].length + 2, 6), target), heading[2]);
      i++;
      continue;
    }
    if (ITEM.test(line)) {
      const list = element(/^\s*\d/.test(line) ? "ol" : "ul", target);
      for (; i < lines.length && ITEM.test(lines[i]); i++) renderInline(element("li", list), lines[i].replace(ITEM, ""));
      continue;
    }
    if (!line.trim()) {
      i++;
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !ITEM.test(lines[i]); i++) {
      paragraph.push(lines[i]);
    }
    renderInline(element("p", target), paragraph.join("\n"));
  }
}
