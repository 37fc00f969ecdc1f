// The chat page: conversations kept in this browser (localStorage), replies
// streamed from /v1/chat/completions, the server's model and KV usage from /status;
// images (file picker, paste, drag and drop) for models that take them.
(function () {
  "use strict";
  const $ = (id) => document.getElementById(id);
  const store = {
    get: (k, d) => { try { return JSON.parse(localStorage.getItem("macinfer." + k)) ?? d; } catch { return d; } },
    set: (k, v) => localStorage.setItem("macinfer." + k, JSON.stringify(v)),
    del: (k) => localStorage.removeItem("macinfer." + k),
  };
  let conversations = store.get("conversations", []);
  let current = store.get("current", null);
  let model = null;
  let controller = null; // the AbortController of the reply in flight
  let attached = []; // data: URLs of the images the next message sends

  // -- the API -------------------------------------------------------------
  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = store.get("apiKey", "");
    if (key) h["Authorization"] = "Bearer " + key;
    return h;
  }

  function askForKey() {
    const dialog = $("key-dialog");
    if (!dialog.open) dialog.showModal();
  }

  async function api(path, init) {
    const r = await fetch(path, { ...init, headers: headers() });
    if (r.status === 401) { askForKey(); throw new Error("this server needs an API key"); }
    if (!r.ok) {
      let message = r.status + " " + r.statusText;
      try { message = (await r.json()).error.message || message; } catch { /* not JSON */ }
      throw new Error(message);
    }
    return r;
  }

  let models = [];

  function showModel() {
    const m = models.find((x) => x.id === model) || models[0];
    model = m.id;
    const parts = models.length > 1 ? [] : [m.id];  // several: the picker names it
    if (m.max_model_len) parts.push("context " + m.max_model_len);
    if (m.state && m.state !== "loaded") parts.push(`${m.state} (loads on the first message)`);
    if ((m.input_modalities || []).includes("image")) parts.push("takes images");
    $("model-name").textContent = parts.join(" · ");
    $("attach").hidden = !(m.input_modalities || []).includes("image");
  }

  // -- images ----------------------------------------------------------------
  function takesImages() { return !$("attach").hidden; }

  function readImage(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function attach(files) {
    const images = [...files].filter((f) => f.type.startsWith("image/"));
    if (!images.length) return;
    if (!takesImages()) { showError("this model takes no images"); return; }
    for (const f of images) attached.push(await readImage(f));
    renderAttachments();
  }

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren(...attached.map((url, i) => {
      const fig = document.createElement("figure");
      const img = document.createElement("img");
      img.src = url; img.alt = "image " + (i + 1);
      const del = document.createElement("button");
      del.type = "button"; del.textContent = "×"; del.title = "Remove";
      del.onclick = () => { attached.splice(i, 1); renderAttachments(); };
      fig.append(img, del);
      return fig;
    }));
    box.hidden = attached.length === 0;
  }

  async function loadModel() {
    models = (await (await api("/v1/models")).json()).data;
    const pick = $("model-pick");
    if (models.length > 1) {  // a multi-model server: choose, and remember the choice
      pick.replaceChildren(...models.map((m) => new Option(m.id, m.id)));
      model = store.get("model", null);
      if (!models.some((m) => m.id === model)) model = models[0].id;
      pick.value = model;
      pick.hidden = false;
    }
    showModel();
  }

  $("model-pick").addEventListener("change", (e) => {
    model = e.target.value;
    store.set("model", model);
    showModel();
    pollStatus();
  });

  async function pollStatus() {
    try {
      const s = await (await api(models.length > 1 ? "/status?model=" + encodeURIComponent(model) : "/status")).json();
      for (const m of s.models || []) {  // several models: states change as they load and unload
        const known = models.find((x) => x.id === m.id);
        if (known) Object.assign(known, { state: m.state, max_model_len: m.max_model_len || known.max_model_len });
      }
      if (s.models) showModel();
      $("kv-usage").textContent = `KV ${Math.round(100 * s.kv.usage)}% (${s.kv.blocks_used}/${s.kv.blocks_total} blocks)` +
        ` · ${s.requests.running} running, ${s.requests.waiting} waiting`;
    } catch { /* shown on the next send */ }
  }

  // -- conversations ---------------------------------------------------------
  const conversation = () => conversations.find((c) => c.id === current);

  function save() {
    try { store.set("conversations", conversations); store.set("current", current); }
    catch { showError("this browser's storage is full: older conversations (or their images) will not be kept"); }
  }

  function newConversation() {
    const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat", messages: [] };
    conversations.unshift(c);
    current = c.id;
    save(); renderAll();
  }

  function renderList() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of conversations) {
      const li = document.createElement("li");
      li.className = c.id === current ? "active" : "";
      const open = document.createElement("button");
      open.className = "open"; open.type = "button"; open.textContent = c.title;
      open.onclick = () => { if (!controller) { current = c.id; save(); renderAll(); } };
      const del = document.createElement("button");
      del.className = "delete"; del.type = "button"; del.textContent = "×"; del.title = "Delete";
      del.onclick = () => {
        if (controller) return;
        conversations = conversations.filter((x) => x.id !== c.id);
        if (current === c.id) current = conversations[0]?.id ?? null;
        if (!current) newConversation(); else { save(); renderAll(); }
      };
      li.append(open, del);
      ul.append(li);
    }
  }

  // Reasoning arrives as `reasoning_content` deltas, or inline as <think>...</think>.
  function splitThink(text) {
    const m = text.match(/^\s*<think>([\s\S]*?)(<\/think>|$)([\s\S]*)$/);
    return m ? { reasoning: m[1], content: m[3] } : { reasoning: "", content: text };
  }

  function messageNode(msg) {
    const div = document.createElement("div");
    div.className = "msg " + msg.role;
    if (msg.role === "user") {
      if (msg.images?.length) {
        const row = document.createElement("div");
        row.className = "images";
        for (const url of msg.images) {
          const img = document.createElement("img");
          img.src = url; img.alt = "attached image";
          row.append(img);
        }
        div.append(row);
      }
      div.append(document.createTextNode(msg.content));
      return div;
    }
    const { reasoning, content } = splitThink(msg.content || "");
    const thoughts = (msg.reasoning || "") + reasoning;
    if (thoughts) {
      const d = document.createElement("details");
      d.className = "reasoning";
      const s = document.createElement("summary");
      s.textContent = "Reasoning";
      d.append(s, document.createTextNode(thoughts));
      div.append(d);
    }
    const body = document.createElement("div");
    body.className = "content";
    body.innerHTML = window.renderMarkdown(content); // renderMarkdown escapes all text
    div.append(body);
    if (msg.meta) {
      const meta = document.createElement("div");
      meta.className = "meta"; meta.textContent = msg.meta;
      div.append(meta);
    }
    return div;
  }

  function renderMessages() {
    const box = $("messages");
    box.replaceChildren(...(conversation()?.messages ?? []).map(messageNode));
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() { renderList(); renderMessages(); }

  function showError(text) {
    const e = $("error");
    e.textContent = text; e.hidden = !text;
  }

  // -- sending -----------------------------------------------------------------
  function requestBody(c) {
    const system = $("system-prompt").value.trim();
    const messages = c.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.images?.length
      ? [...m.images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: m.content }]
      : splitThink(m.content).content }));
    if (system) messages.unshift({ role: "system", content: system });
    return {
      model, messages, stream: true, stream_options: { include_usage: true },
      temperature: Number($("temperature").value), top_p: Number($("top-p").value),
      max_tokens: Number($("max-tokens").value),
    };
  }

  async function send(text, images) {
    const c = conversation();
    c.messages.push(images.length ? { role: "user", content: text, images } : { role: "user", content: text });
    if (c.title === "New chat") c.title = text.slice(0, 40) || "Image";
    const reply = { role: "assistant", content: "", reasoning: "" };
    const body = requestBody(c);
    c.messages.push(reply);
    save(); renderAll();
    let node = $("messages").lastElementChild;
    setBusy(true); showError("");
    const start = performance.now();
    let first = null, chunks = 0, usage = null, finish = null;
    controller = new AbortController();
    try {
      const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
      const reader = r.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        const events = buffer.split("\n\n");
        buffer = events.pop();
        for (const event of events) {
          const data = event.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (!data || data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          if (chunk.usage) usage = chunk.usage;
          const choice = chunk.choices?.[0];
          if (!choice) continue;
          const delta = choice.delta || {};
          if (delta.content || delta.reasoning_content) {
            first ??= performance.now();
            chunks++;
            reply.content += delta.content || "";
            reply.reasoning += delta.reasoning_content || "";
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        const fresh = messageNode(reply);
        node.replaceWith(fresh);
        node = fresh;
        $("messages").scrollTop = $("messages").scrollHeight;
        updateSpeed(start, first, usage ? usage.completion_tokens : chunks);
      }
      reply.meta = stats(start, first, usage ? usage.completion_tokens : chunks) + (finish === "length" ? " · cut at max tokens" : "");
    } catch (e) {
      if (e.name === "AbortError") reply.meta = stats(start, first, chunks) + " · stopped";
      else { reply.error = true; reply.meta = "error: " + e.message; showError(e.message); }
    } finally {
      controller = null;
      setBusy(false);
      save(); renderAll(); pollStatus();
    }
  }

  function stats(start, first, tokens) {
    if (first === null) return "no tokens";
    const ttft = (first - start) / 1000;
    const secs = (performance.now() - first) / 1000;
    const rate = tokens > 1 && secs > 0 ? ((tokens - 1) / secs).toFixed(1) : "–";
    return `${tokens} tokens · TTFT ${ttft.toFixed(2)} s · ${rate} tok/s`;
  }

  function updateSpeed(start, first, tokens) { $("speed").textContent = stats(start, first, tokens); }

  function setBusy(busy) {
    $("send").hidden = busy; $("stop").hidden = !busy;
    $("prompt").disabled = busy;
  }

  // -- wiring --------------------------------------------------------------------
  function bindSetting(id, key) {
    const el = $(id);
    const saved = store.get("settings", {})[key];
    if (saved !== undefined) el.value = saved;
    el.addEventListener("change", () => { store.set("settings", { ...store.get("settings", {}), [key]: el.value }); });
  }

  document.addEventListener("DOMContentLoaded", () => {
    bindSetting("system-prompt", "system"); bindSetting("temperature", "temperature");
    bindSetting("top-p", "top_p"); bindSetting("max-tokens", "max_tokens");
    $("new-chat").onclick = () => { if (!controller) newConversation(); };
    $("stop").onclick = () => controller?.abort();
    $("forget-key").onclick = () => { store.del("apiKey"); askForKey(); };
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if ((!text && !attached.length) || controller) return;
      if (!model) { init(); showError("not connected to the server yet"); return; }
      $("prompt").value = "";
      const images = attached;
      attached = []; renderAttachments();
      send(text, images);
    });
    $("image-input").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
    $("prompt").addEventListener("paste", (e) => {
      const files = [...(e.clipboardData?.files || [])];
      if (files.some((f) => f.type.startsWith("image/"))) { e.preventDefault(); attach(files); }
    });
    const composer = $("composer");
    composer.addEventListener("dragover", (e) => { e.preventDefault(); composer.classList.add("dragging"); });
    composer.addEventListener("dragleave", () => composer.classList.remove("dragging"));
    composer.addEventListener("drop", (e) => {
      e.preventDefault(); composer.classList.remove("dragging");
      attach(e.dataTransfer?.files || []);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
    });
    $("key-form").addEventListener("submit", () => {
      store.set("apiKey", $("api-key").value.trim());
      $("api-key").value = "";
      init();
    });
    if (!conversation()) newConversation(); else renderAll();
    init();
    setInterval(pollStatus, 3000);
  });

  async function init() {
    try { await loadModel(); showError(""); pollStatus(); } catch (e) { showError(e.message); }
  }
})();
