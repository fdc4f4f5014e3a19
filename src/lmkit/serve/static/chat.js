// The chat page: messages go to /v1/chat/completions as a stream. Replies are rendered by markdown.js, which writes
// only text nodes, so a reply holding markup shows the markup. Before each turn the conversation is counted with
// /tokenize and the oldest exchanges are dropped (with a notice) until it and Max tokens fit the model's context, as
// `lmkit chat` does; a turn that fails is taken back (its message returns to the box), never kept in the history.
"use strict";
const $ = (id) => document.getElementById(id);
const DEFAULT_REPLY_TOKENS = 256;  // at most half the context: chat_session.reply_room
let history = [];  // {role, content, node}: what the next request sends
let context = null;  // the model's positions, from /v1/models
let controller = null, busy = false;

function addMessage(role, text, before) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("messages").insertBefore(div, before || null);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setBusy(value) {
  busy = value;
  $("send").disabled = value;
  $("stop").disabled = !value;
}

function withSystem(turns) {
  const system = $("system").value.trim();
  const messages = turns.map((m) => ({ role: m.role, content: m.content }));
  return system ? [{ role: "system", content: system }, ...messages] : messages;
}

async function errorText(response) {
  const err = await response.json().catch(() => ({}));
  return (err.error && err.error.message) || response.statusText;
}

async function promptTokens(messages) {
  const response = await fetch("/tokenize", { method: "POST", headers: headers(),
                                              body: JSON.stringify({ messages, add_generation_prompt: true }) });
  if (!response.ok) throw new Error(await errorText(response));
  return (await response.json()).count;
}

// Drop the oldest exchanges (a user turn and the replies after it) until the prompt and maxTokens fit the context;
// returns how many went. A last message that cannot fit even alone is an error.
async function fit(maxTokens) {
  let dropped = 0;
  if (context === null) return dropped;
  if (maxTokens >= context) {
    throw new Error(`Max tokens ${maxTokens} leaves no room for the conversation: the model has ${context} positions; ` +
                    `use at most ${context - 1}`);
  }
  for (;;) {
    const count = await promptTokens(withSystem(history));
    if (count + maxTokens <= context) return dropped;
    const users = history.map((m, i) => (m.role === "user" ? i : -1)).filter((i) => i >= 0);
    if (users.length < 2) {
      throw new Error(`the message takes ${count} of the model's ${context} positions and Max tokens ${maxTokens} ` +
                      "more; send a shorter message or lower Max tokens");
    }
    for (const m of history.slice(0, users[1])) m.node.classList.add("dropped");
    history = history.slice(users[1]);
    dropped++;
  }
}

function takeBack(turn, nodes, text) {
  history = history.filter((m) => m !== turn);
  for (const node of nodes) if (node) node.remove();
  if (!$("prompt").value) $("prompt").value = text;
}

async function send(text) {
  $("error").textContent = "";
  const maxTokens = Number($("max-tokens").value);
  const turn = { role: "user", content: text, node: addMessage("user", text) };
  history.push(turn);
  setBusy(true);
  let reply = null, notice = null, replyText = "", failed = null, aborted = false, first = null, tokens = 0;
  const started = performance.now();
  try {
    const dropped = await fit(maxTokens);
    if (dropped) {
      notice = addMessage("notice", `dropped the oldest ${dropped === 1 ? "exchange" : dropped + " exchanges"} ` +
                                    `to fit the model's ${context} positions`, turn.node);
    }
    reply = addMessage("assistant", "");
    reply.dataset.done = "false";
    const body = { messages: withSystem(history), stream: true, stream_options: { include_usage: true },
                   temperature: Number($("temperature").value), top_p: Number($("top-p").value),
                   max_tokens: maxTokens };
    controller = new AbortController();
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
                                                           body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
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
        if (chunk.error) throw new Error(chunk.error.message);
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
            replyText += delta;
            renderMarkdown(reply, replyText);
          }
        }
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
  } catch (e) {
    if (e.name === "AbortError") aborted = true;
    else failed = String(e.message || e);
  } finally {
    const seconds = (performance.now() - (first || started)) / 1000;
    if (tokens && seconds > 0) $("speed").textContent = (tokens / seconds).toFixed(1) + " tokens/s";
    if (failed === null && !replyText && !aborted) failed = "the model ended its reply at once (nothing to show)";
    if (failed !== null || !replyText) {  // nothing to keep: the message goes back to the box
      takeBack(turn, [turn.node, reply, notice], text);
      if (failed !== null) $("error").textContent = failed;
    } else {
      history.push({ role: "assistant", content: replyText, node: reply });
      reply.dataset.done = "true";
    }
    controller = null;
    setBusy(false);
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || busy) return;
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
for (const id of ["temperature", "top-p", "max-tokens"]) {  // a value typed before /v1/models answers is kept
  $(id).addEventListener("input", () => { $(id).dataset.touched = "true"; });
}
function setDefault(id, value) {
  if (!$(id).dataset.touched) $(id).value = String(value);
}
fetch("/v1/models", { headers: headers() }).then((r) => r.json()).then((m) => {
  const card = m.data && m.data[0];
  if (!card) return;
  $("model").textContent = card.id;
  const sampling = card.sampling_defaults || {};  // the folder's generation_config.json: the API's defaults too
  setDefault("temperature", sampling.temperature ?? 1);
  setDefault("top-p", sampling.top_p ?? 1);
  if (card.max_model_len) {
    context = card.max_model_len;
    $("max-tokens").max = String(context - 1);
    setDefault("max-tokens", Math.max(1, Math.min(DEFAULT_REPLY_TOKENS, Math.floor(context / 2))));
  }
}).catch(() => {});
