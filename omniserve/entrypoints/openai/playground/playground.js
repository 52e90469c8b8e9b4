// omniserve playground: a chat page over the server's own OpenAI API (no build step, no CDN).
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "omniserve.apiKey";
const MODALITIES = ["image", "audio", "video"];
const EXTENSIONS = {
  image: ["png", "jpg", "jpeg", "gif", "webp", "bmp"],
  audio: ["wav", "mp3", "flac", "ogg", "opus", "m4a", "webm"],
  video: ["mp4", "webm", "mov", "mkv", "avi"],
};
const state = { info: null, messages: [], attachments: [], busy: false, recorder: null };

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY_STORAGE);
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addMessage(role, text) {
  const node = el("div", `message ${role}`);
  node.dataset.role = role;
  const body = el("span", "body", text);
  node.appendChild(body);
  $("chat").appendChild(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function showError(node, message) {
  node.className = "message error";
  node.dataset.role = "error";
  node.querySelector(".body").textContent = message;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON */ }
  return `HTTP ${response.status} ${response.statusText}`;
}

// ---- server info and the API key ---------------------------------------------------------------
async function loadInfo() {
  const response = await fetch("/playground/info", { headers: apiHeaders() });
  if (!response.ok) {
    $("model").textContent = await errorMessage(response);
    return;
  }
  const info = await response.json();
  if (info.api_key_required) {
    state.info = null;
    $("model").textContent = "this server needs an API key";
    $("key-status").textContent = localStorage.getItem(KEY_STORAGE)
      ? "That key was refused; enter the server's API key." : "Enter the server's API key.";
    $("send").disabled = true;
    return;
  }
  state.info = info;
  $("model").textContent = info.model;
  const limits = [`max_model_len ${info.max_model_len}`];
  for (const modality of MODALITIES) {
    if (modality in info.media) {
      const limit = info.media[modality];
      limits.push(limit === null ? modality : `${modality} ≤ ${limit}`);
    }
  }
  if (info.voices.length) limits.push(`speaks (${info.voices.join(", ")})`);
  $("limits").textContent = limits.join(" · ");
  $("key-status").textContent = localStorage.getItem(KEY_STORAGE) ? "Key in use." : "";
  const accepted = Object.keys(info.media);
  $("attach-label").hidden = accepted.length === 0;
  $("attach").accept = accepted.map((m) => `${m}/*`).join(",");
  $("record").hidden = !("audio" in info.media && navigator.mediaDevices && window.MediaRecorder);
  $("speech").hidden = info.voices.length === 0;
  $("voice").replaceChildren(...info.voices.map((voice) => {
    const option = el("option", "", voice);
    option.selected = voice === info.default_voice;
    return option;
  }));
  $("send").disabled = false;
}

// ---- attachments ---------------------------------------------------------------------------------
function modalityOf(file) {
  const major = (file.type || "").split("/")[0];
  if (MODALITIES.includes(major)) return major;
  const extension = file.name.split(".").pop().toLowerCase();
  return MODALITIES.find((m) => EXTENSIONS[m].includes(extension)) || null;
}

function readDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function attach(blob, name) {
  const modality = modalityOf({ type: blob.type, name });
  if (!modality) {
    addMessage("error", `${name}: not an image, audio or video file.`);
    return;
  }
  state.attachments.push({ modality, name, url: await readDataUrl(blob) });
  renderAttachments();
}

function renderAttachments() {
  $("attachments").replaceChildren(...state.attachments.map((item, index) => {
    const chip = el("span", "chip", `${item.modality}: ${item.name}`);
    const remove = el("button", "", "×");
    remove.type = "button";
    remove.title = "Remove";
    remove.onclick = () => { state.attachments.splice(index, 1); renderAttachments(); };
    chip.appendChild(remove);
    return chip;
  }));
}

function mediaPart(item) {
  const key = `${item.modality}_url`;
  return { type: key, [key]: { url: item.url } };
}

function mediaPreview(item) {
  if (item.modality === "image") {
    const image = el("img", "media");
    image.src = item.url;
    image.alt = item.name;
    return image;
  }
  const player = el(item.modality, "media");
  player.controls = true;
  player.src = item.url;
  return player;
}

async function toggleRecording() {
  if (state.recorder) {
    state.recorder.stop();
    return;
  }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (error) {
    addMessage("error", `Microphone: ${error.message}`);
    return;
  }
  const chunks = [];
  const recorder = new MediaRecorder(stream);
  recorder.ondataavailable = (event) => chunks.push(event.data);
  recorder.onstop = async () => {
    stream.getTracks().forEach((track) => track.stop());
    state.recorder = null;
    $("record").textContent = "● Record";
    const blob = new Blob(chunks, { type: recorder.mimeType || "audio/webm" });
    await attach(blob, `recording.${blob.type.includes("ogg") ? "ogg" : "webm"}`);
  };
  recorder.start();
  state.recorder = recorder;
  $("record").textContent = "■ Stop";
}

// ---- speech output -------------------------------------------------------------------------------
function wavFromPcm16(chunks, sampleRate) {
  const length = chunks.reduce((n, c) => n + c.length, 0);
  const buffer = new ArrayBuffer(44 + length);
  const view = new DataView(buffer);
  const text = (offset, s) => [...s].forEach((ch, i) => view.setUint8(offset + i, ch.charCodeAt(0)));
  text(0, "RIFF"); view.setUint32(4, 36 + length, true); text(8, "WAVE"); text(12, "fmt ");
  view.setUint32(16, 16, true); view.setUint16(20, 1, true); view.setUint16(22, 1, true);
  view.setUint32(24, sampleRate, true); view.setUint32(28, sampleRate * 2, true);
  view.setUint16(32, 2, true); view.setUint16(34, 16, true); text(36, "data");
  view.setUint32(40, length, true);
  let offset = 44;
  for (const chunk of chunks) { new Uint8Array(buffer, offset, chunk.length).set(chunk); offset += chunk.length; }
  return new Blob([buffer], { type: "audio/wav" });
}

function base64Bytes(data) {
  const binary = atob(data);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

// ---- one turn ------------------------------------------------------------------------------------
function usageLine(usage, ttft, seconds) {
  const details = usage.prompt_tokens_details || {};
  const media = MODALITIES.map((m) => [m, details[`${m}_tokens`] || 0]).filter(([, n]) => n);
  const text = usage.prompt_tokens - media.reduce((n, [, k]) => n + k, 0);
  const parts = [`text ${text}`, ...media.map(([m, n]) => `${m} ${n}`)];
  const line = [`prompt ${usage.prompt_tokens} tokens (${parts.join(", ")})`,
                `cached ${details.cached_tokens || 0}`,
                `completion ${usage.completion_tokens}`];
  if (ttft !== null) line.push(`TTFT ${Math.round(ttft)} ms`);
  if (seconds > 0) line.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`);
  const node = el("span", "usage", line.join(" · "));
  node.dataset.prompt = usage.prompt_tokens;
  for (const modality of MODALITIES) node.dataset[modality] = details[`${modality}_tokens`] || 0;
  node.dataset.cached = details.cached_tokens || 0;
  node.dataset.completion = usage.completion_tokens;
  return node;
}

function requestBody() {
  const number = (id) => { const v = $(id).value; return v === "" ? undefined : Number(v); };
  const body = {
    model: state.info.model, messages: state.messages, stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature"), top_p: number("top_p"),
    max_tokens: number("max_tokens"), seed: number("seed"),
  };
  if (!$("speech").hidden && $("speak").checked) {
    body.modalities = ["text", "audio"];
    body.audio = { voice: $("voice").value, format: "pcm16" };
  }
  return body;
}

async function send(text) {
  const items = state.attachments.splice(0);
  renderAttachments();
  const content = items.length ? [...items.map(mediaPart), { type: "text", text }] : text;
  const user = addMessage("user", text);
  const userText = user.querySelector(".body");
  items.forEach((item) => user.insertBefore(mediaPreview(item), userText));
  state.messages.push({ role: "user", content });
  const reply = addMessage("assistant", "");
  const body = reply.querySelector(".body");
  const start = performance.now();
  let first = null, answer = "", usage = null, failed = null;
  const pcm = [];
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(requestBody()),
    });
    if (!response.ok) {
      failed = await errorMessage(response);
    } else {
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
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
            const chunk = JSON.parse(line.slice(6));
            if (chunk.error) { failed = chunk.error.message; continue; }
            if (chunk.usage) usage = chunk.usage;
            for (const choice of chunk.choices || []) {
              const delta = choice.delta || {};
              if (delta.content) {
                if (first === null) first = performance.now();
                answer += delta.content;
                body.textContent = answer;
              }
              if (delta.audio && delta.audio.data) pcm.push(base64Bytes(delta.audio.data));
              if (delta.audio && delta.audio.transcript) {
                if (first === null) first = performance.now();
                answer += delta.audio.transcript;
                body.textContent = answer;
              }
            }
          }
        }
        reply.scrollIntoView({ block: "end" });
      }
    }
  } catch (error) {
    failed = `The request failed: ${error.message}`;
  }
  if (failed !== null) {
    showError(reply, failed);
    state.messages.pop();  // the turn did not happen: it is not sent again as history
    return;
  }
  state.messages.push({ role: "assistant", content: answer });
  if (pcm.length) {
    const player = el("audio", "media");
    player.controls = true;
    player.src = URL.createObjectURL(wavFromPcm16(pcm, 24000));
    reply.appendChild(player);
  }
  if (usage) {
    const seconds = first === null ? 0 : (performance.now() - first) / 1000;
    reply.appendChild(usageLine(usage, first === null ? null : first - start, seconds));
  }
  reply.dataset.done = "true";
}

// ---- wiring --------------------------------------------------------------------------------------
$("composer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (state.busy || !state.info || (!text && !state.attachments.length)) return;
  state.busy = true;
  $("send").disabled = true;
  $("prompt").value = "";
  try {
    await send(text);
  } finally {
    state.busy = false;
    $("send").disabled = false;
    $("prompt").focus();
  }
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("attach").addEventListener("change", async () => {
  for (const file of $("attach").files) await attach(file, file.name);
  $("attach").value = "";
});
$("record").addEventListener("click", toggleRecording);
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("chat").replaceChildren();
});
$("save-key").addEventListener("click", async () => {
  const key = $("api-key").value.trim();
  if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  $("api-key").value = "";
  await loadInfo();
});
$("send").disabled = true;
loadInfo();
