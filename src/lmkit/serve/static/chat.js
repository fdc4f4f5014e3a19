// The chat page: messages go to /v1/chat/completions as a stream; replies are shown as text (textContent), never
// as HTML, so a reply holding markup shows the markup.
"use strict";
const $ = (id) => document.getElementById(id);
let history = [];
let controller = null;

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(text) {
  $("error").textContent = "";
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  reply.dataset.done = "false";
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...history] : history.slice();
  const body = {
    messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null, tokens = 0, text_so_far = "";
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
                                                           body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) {
      const err = await response.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        if (chunk.sources && chunk.sources.length) {  // `lmkit serve --rag`: the numbered sources of this answer
          const div = document.createElement("div");
          div.className = "sources";
          div.textContent = "sources: " + chunk.sources.map((s) => "[" + s.number + "] " + s.source).join("  ");
          reply.after(div);
        }
        for (const choice of chunk.choices) {
          const delta = choice.delta && choice.delta.content;
          if (delta) {
            if (first === null) first = performance.now();
            text_so_far += delta;
            reply.textContent = text_so_far;
          }
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("error").textContent = String(e.message || e);
  } finally {
    const seconds = (performance.now() - (first || started)) / 1000;
    if (tokens && seconds > 0) $("speed").textContent = (tokens / seconds).toFixed(1) + " tokens/s";
    history.push({ role: "assistant", content: text_so_far });
    reply.dataset.done = "true";
    controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  $("messages").replaceChildren();
  $("error").textContent = "";
  $("speed").innerHTML = "&nbsp;";
});
fetch("/v1/models", { headers: headers() }).then((r) => r.json())
  .then((m) => { if (m.data && m.data[0]) $("model").textContent = m.data[0].id; }).catch(() => {});
