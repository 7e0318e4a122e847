// The console's live parts: the event stream, streamed answers, lazy panels, table refreshes.
// Every value from the daemon reaches the page through textContent, never as markup.
"use strict";

(function () {
  const ROWS_SHOWN = 200; // rows in the live table: the buffer may hold more, the DOM stays small
  const RENDER_EVERY_MS = 250; // a burst is drawn a few times a second, not once per event

  function levelOf(name, data) {
    if (/:(error|failed)$/.test(name) || (data && (data.code || data.error))) return "error";
    if (/:(cancelled|overflow|dropped|retry|expired)$/.test(name)) return "warning";
    if (name === "completion:chunk") return "debug";
    return "info";
  }

  function clip(text, size) {
    return text.length > size ? text.slice(0, size) + "…" : text;
  }

  function liveEvents(root) {
    const capacity = parseInt(root.dataset.buffer, 10) || 2000;
    const rows = root.querySelector("[data-rows]");
    const counter = (name) => root.querySelector(`[data-count="${name}"]`);
    const state = root.querySelector("[data-state]");
    const pausedNote = root.querySelector("[data-paused]");
    const pauseButton = root.querySelector("[data-pause]");
    const form = root.querySelector("form.filters");
    const stats = { received: 0, dropped: 0, trimmed: 0, shown: 0, pending: 0, renders: 0, lastRender: 0 };
    const buffer = [];
    let paused = false;
    let dirty = false;
    window.ksiEvents = stats; // read by the browser tests and the benchmark

    function filters() {
      const value = (name) => {
        const field = form && form.elements.namedItem(name);
        return field ? field.value.trim() : "";
      };
      const own = form && form.elements.namedItem("own");
      return { namespace: value("namespace"), agent: value("agent"), conversation: value("conversation"),
               level: value("level"), own: Boolean(own && own.checked) };
    }

    function matches(entry, f) {
      if (f.namespace && !entry.name.startsWith(f.namespace.replace(/:?\*?$/, "") + ":")) return false;
      if (f.agent && entry.agent !== f.agent) return false;
      if (f.conversation && entry.conversation !== f.conversation) return false;
      if (f.level && entry.level !== f.level) return false;
      if (!f.own && entry.console) return false;
      return true;
    }

    function row(entry) {
      const tr = document.createElement("tr");
      tr.className = "level-" + entry.level;
      for (const text of [entry.time, entry.level, entry.name, entry.agent, entry.conversation, entry.summary]) {
        const td = document.createElement("td");
        td.textContent = text;
        tr.appendChild(td);
      }
      return tr;
    }

    function render() {
      if (!dirty || paused) return;
      dirty = false;
      const f = filters();
      const picked = [];
      let matching = 0;
      for (let i = buffer.length - 1; i >= 0; i--) {
        if (matches(buffer[i], f)) {
          matching++;
          if (picked.length < ROWS_SHOWN) picked.push(buffer[i]);
        }
      }
      const fragment = document.createDocumentFragment();
      for (const entry of picked) fragment.appendChild(row(entry));
      rows.replaceChildren(fragment);
      stats.shown = matching;
      stats.renders++;
      stats.lastRender = performance.now();
      for (const name of ["received", "dropped", "trimmed", "shown"]) counter(name).textContent = stats[name];
    }

    function add(frame) {
      const data = frame.data || {};
      const entry = {
        name: frame.event || "",
        time: (frame.timestamp || "").slice(11, 23),
        agent: frame.agent_id || data.agent_id || "",
        conversation: data.conversation_id || "",
        level: levelOf(frame.event || "", data),
        summary: clip(JSON.stringify(data), 300),
        console: (frame.correlation_id || "").startsWith("console-read-"),
      };
      buffer.push(entry);
      if (buffer.length > capacity + capacity / 4) { // trimmed in batches: one shift per many events
        const extra = buffer.length - capacity;
        buffer.splice(0, extra);
        stats.trimmed += extra;
      }
      stats.received++;
      if (paused) {
        stats.pending++;
        counter("pending").textContent = stats.pending;
      }
      dirty = true;
    }

    const source = new EventSource(root.dataset.events);
    source.onopen = () => { state.textContent = "live"; };
    source.onerror = () => { state.textContent = "reconnecting"; };
    source.onmessage = (message) => add(JSON.parse(message.data));
    source.addEventListener("dropped", (message) => {
      stats.dropped = JSON.parse(message.data).dropped;
      dirty = true;
    });
    window.addEventListener("pagehide", () => source.close());

    pauseButton.addEventListener("click", () => {
      paused = !paused;
      pauseButton.textContent = paused ? "Resume" : "Pause";
      pauseButton.setAttribute("aria-pressed", String(paused));
      pausedNote.hidden = !paused;
      stats.pending = 0;
      counter("pending").textContent = "0";
      dirty = true;
      render();
    });
    root.querySelector("[data-clear]").addEventListener("click", () => {
      buffer.length = 0;
      dirty = true;
      const wasPaused = paused;
      paused = false;
      render();
      paused = wasPaused;
    });
    if (form) form.addEventListener("input", () => { dirty = true; const p = paused; paused = false; render(); paused = p; });
    setInterval(render, RENDER_EVERY_MS);
  }

  function usageLine(usage) {
    if (!usage || typeof usage !== "object") return "";
    const n = (value) => (Number(value) || 0).toLocaleString("en-US");
    const parts = [n(usage.prompt_tokens) + " in", n(usage.completion_tokens) + " out"];
    if (usage.total_tokens != null) parts.push(n(usage.total_tokens) + " tokens");
    return parts.join(" · ");
  }

  // The page's own rendering of exchange `n` (Markdown, links, "what was sent") joins its list.
  async function joinTurn(n) {
    const list = document.querySelector("ol.turns");
    if (!list) return false;
    const response = await fetch(location.pathname, { credentials: "same-origin" });
    if (!response.ok) return false;
    const fetched = new DOMParser().parseFromString(await response.text(), "text/html");
    const turn = fetched.getElementById("turn-" + n);
    if (!turn) return false;
    const old = document.getElementById("turn-" + n);
    const added = document.importNode(turn, true);
    if (old) old.replaceWith(added);
    else {
      list.querySelectorAll(":scope > li.muted").forEach((placeholder) => placeholder.remove());
      list.appendChild(added);
    }
    const facts = document.querySelector("dl.facts");
    const counted = fetched.querySelector("dl.facts");
    if (facts && counted) facts.replaceWith(document.importNode(counted, true)); // turns, tokens, cost
    added.querySelectorAll("details[data-sent]").forEach(lazyPanel);
    added.dispatchEvent(new CustomEvent("ksi:turn-added", { bubbles: true })); // for other live parts
    return true;
  }

  // A form whose answer streams back as server-sent events over a POST (fetch, not EventSource).
  function streamedAnswer(form) {
    const out = form.querySelector("[data-answer-out]");
    const text = form.querySelector("[data-answer-text]");
    const status = form.querySelector("[data-answer-state]");
    const label = out.querySelector(".role");
    const prompt = form.querySelector("textarea[name=prompt]");
    form.addEventListener("submit", async (submitted) => {
      submitted.preventDefault();
      const button = form.querySelector("button[type=submit]");
      button.disabled = true;
      out.hidden = false;
      text.textContent = "";
      label.textContent = "assistant (streaming)";
      delete form.dataset.done;
      status.textContent = "sending…";
      let answered = false;
      try {
        const response = await fetch(form.action, {
          method: "POST", body: new URLSearchParams(new FormData(form)), credentials: "same-origin",
        });
        if (!(response.headers.get("content-type") || "").startsWith("text/event-stream")) {
          // refused before any stream began (too large, not from this page): the error object says why
          const error = (await response.json().catch(() => ({}))).error || {};
          status.textContent = (error.code || response.status) + ": " + (error.message || response.statusText);
          form.dataset.done = "error";
          return;
        }
        const reader = response.body.getReader();
        const decoder = new TextDecoder();
        let pending = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          pending += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = pending.indexOf("\n\n")) >= 0) {
            const block = pending.slice(0, cut);
            pending = pending.slice(cut + 2);
            let name = "message";
            let data = "";
            for (const line of block.split("\n")) {
              if (line.startsWith("event: ")) name = line.slice(7);
              else if (line.startsWith("data: ")) data += line.slice(6);
            }
            if (!data) continue;
            const payload = JSON.parse(data);
            if (name === "queued") status.textContent = "queued at position " + (payload.queue_position ?? 0);
            else if (name === "chunk") { text.textContent += payload.text; status.textContent = "streaming…"; }
            else if (name === "result") {
              text.textContent = payload.content;
              label.textContent = "assistant";
              const usage = usageLine(payload.usage);
              status.textContent = "done: exchange #" + payload.exchange + " (" + payload.response_id + ")"
                + (usage ? " · " + usage : "");
              prompt.value = "";
              answered = true;
              if (await joinTurn(payload.exchange)) out.hidden = true; // shown once, in the list
              form.dataset.done = "result";
            } else if (name === "error" || name === "cancelled") {
              label.textContent = "assistant (no answer)";
              status.textContent = (payload.code || name) + ": " + (payload.message || "");
              form.dataset.done = "error";
              answered = true;
            }
          }
        }
        if (!answered) {
          label.textContent = "assistant (no answer)";
          status.textContent = "the stream ended without an answer";
        }
      } catch (failure) {
        label.textContent = "assistant (no answer)";
        status.textContent = "failed: " + failure;
      } finally {
        button.disabled = false;
      }
    });
  }

  function lazyPanel(details) {
    details.addEventListener("toggle", async () => {
      if (!details.open || details.dataset.loaded) return;
      details.dataset.loaded = "1";
      const body = details.querySelector("[data-sent-body]");
      const response = await fetch(details.dataset.sent, { credentials: "same-origin" });
      body.classList.remove("muted");
      body.innerHTML = await response.text(); // server-rendered and escaped
    });
  }

  function refresh(element) {
    const every = parseInt(element.dataset.every, 10) || 3000;
    setInterval(async () => {
      if (document.hidden) return;
      const response = await fetch(element.dataset.refresh, { credentials: "same-origin" });
      if (response.ok) element.innerHTML = await response.text(); // server-rendered and escaped
    }, every);
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("[data-events]").forEach(liveEvents);
    document.querySelectorAll("form[data-answer]").forEach(streamedAnswer);
    document.querySelectorAll("details[data-sent]").forEach(lazyPanel);
    document.querySelectorAll("[data-refresh]").forEach(refresh);
  });
})();
