// The review page: one sample at a time, judged with the keyboard alone. Text from the release is only ever set as
// textContent (never parsed as HTML); every request goes to this page's own server, which checks the access cookie.
"use strict";

const state = {
  session: null, reviewer: null, order: [], judged: {}, left: 0, position: 0,
  view: null, answers: {}, current: 0, reasons: false, typing: false, busy: false,
};
const $ = (id) => document.getElementById(id);

async function api(path, options) {
  const response = await fetch(path, Object.assign({ credentials: "same-origin" }, options || {}));
  const body = (response.headers.get("content-type") || "").startsWith("application/json") ? await response.json() : {};
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function say(text) { $("message").textContent = text || ""; }

async function start() {
  state.session = await api("api/session");
  const s = state.session;
  $("release").textContent = `${s.release.name} ${s.release.version} (${s.release.kind})`;
  $("study").textContent = `study ${s.study.name}${s.study.blind ? " · blind" : ""}`;
  $("total").textContent = s.study.items;
  const reasons = $("reason-list");
  s.reasons.forEach((reason) => { const li = document.createElement("li"); li.textContent = reason; reasons.appendChild(li); });
  const stored = window.localStorage.getItem("lance-cf-reviewer");
  const name = s.reviewer || stored;
  if (name) { await useReviewer(name); } else { $("ask-name").hidden = false; $("name-input").focus(); }
}

async function useReviewer(name) {
  state.reviewer = name;
  window.localStorage.setItem("lance-cf-reviewer", name);
  $("name-input").blur();
  $("ask-name").hidden = true;
  $("reviewer-name").textContent = `reviewer ${name}`;
  const queue = await api(`api/queue?reviewer=${encodeURIComponent(name)}`);
  state.order = queue.order; state.judged = queue.judged; state.left = queue.left;
  const first = state.order.findIndex((item) => !(String(item) in state.judged));
  await show(first < 0 ? state.order.length : first);
}

function renderCaption(element, segments) {
  element.replaceChildren();
  segments.forEach((segment, i) => {
    if (i) element.appendChild(document.createTextNode(" "));
    const node = segment.changed ? document.createElement("mark") : document.createTextNode(segment.text);
    if (segment.changed) node.textContent = segment.text;
    element.appendChild(node);
  });
}

async function show(target) {
  // Everything a key acts on is set before the sample is fetched, so keys typed while it loads are not lost.
  state.position = Math.max(0, Math.min(target, state.order.length));
  state.reasons = false; state.typing = false; state.view = null;
  delete document.body.dataset.shown;
  say("");  // here, not once loaded: a message about a key pressed meanwhile must stay
  $("reasons").hidden = true; $("reason-text").hidden = true;
  $("left").textContent = state.left;
  $("position").textContent = `${Math.min(state.position + 1, state.order.length)} / ${state.order.length}`;
  if (state.position >= state.order.length) {
    $("sample").hidden = true; $("done").hidden = false;
    $("done-text").textContent = state.left ? `End of the list: ${state.left} sample(s) not judged yet.`
      : "Every sample of this study is judged. Thank you.";
    return;
  }
  $("done").hidden = true;
  const position = state.position;
  const item = state.order[position];
  const previous = state.judged[String(item)];
  const questions = state.session.study.questions;
  state.answers = previous ? Object.assign({}, previous.answers) : {};
  state.current = Math.max(0, questions.findIndex((q) => !(q.id in state.answers)));
  const view = await api(`api/item/${item}`);
  if (state.position !== position) return;  // the reviewer moved on while it loaded
  state.view = view;
  $("edited-image").src = view.image;
  $("original-figure").hidden = !view.original;
  if (view.original) $("original-image").src = view.original;
  $("class").textContent = view.label;
  $("edit-type").textContent = view.edit_type || view.fields.shift || "—";
  $("edited-label").textContent = view.config ? `${view.config} · ${view.key}` : "counterfactual";
  renderCaption($("caption"), view.caption.length ? view.caption : [{ text: view.fields.prompt || "—", changed: false }]);
  renderCaption($("edited-caption"), view.edited_caption.length ? view.edited_caption : [{ text: view.edit || "—", changed: true }]);
  $("sensitive").hidden = !view.sensitive;
  $("sensitive").textContent = view.sensitive ? `sensitive edit: ${view.sensitive}` : "";
  const scores = $("scores");
  scores.replaceChildren();
  const rows = Object.entries(view.scores || {}).concat(Object.entries(view.fields || {}));
  rows.forEach(([name, value]) => {
    const tr = document.createElement("tr");
    const a = document.createElement("td"); a.textContent = name;
    const b = document.createElement("td"); b.textContent = String(value);
    tr.append(a, b); scores.appendChild(tr);
  });
  renderQuestions();
  renderStatus(previous);
  $("sample").hidden = false;
  document.body.dataset.shown = String(item);  // rendered: what a test (or an extension) may wait for
}

function renderQuestions() {
  if (!state.view) return;  // drawn once the sample has loaded, with the answers given meanwhile
  const list = $("questions");
  list.replaceChildren();
  state.view.questions.forEach((q, i) => {
    const li = document.createElement("li");
    li.id = `question-${q.id}`;
    if (i === state.current) li.className = "current";
    li.appendChild(document.createTextNode(q.text));
    q.answers.forEach((answer, k) => {
      const span = document.createElement("span");
      span.className = "answer" + (state.answers[q.id] === answer ? " chosen" : "");
      span.textContent = `${k + 1} ${answer}`;
      li.appendChild(span);
    });
    list.appendChild(li);
  });
}

function renderStatus(previous) {
  const status = $("status");
  status.className = previous ? previous.verdict : "";
  status.textContent = previous ? `judged: ${previous.verdict}${previous.reason ? ` (${previous.reason})` : ""}` : "not judged yet";
}

async function judge(verdict, reason) {
  // A flag says "a second look is needed": it is saved with the answers given so far, even none.
  const missing = state.session.study.questions.filter((q) => !(q.id in state.answers));
  if (missing.length && verdict !== "flag") {
    say(`Answer every question first (${missing.map((q) => q.id).join(", ")}), or press f to flag the sample.`);
    return;
  }
  if (state.busy) return;  // one judgement in flight at a time
  state.busy = true;
  const item = state.order[state.position];
  const body = { reviewer: state.reviewer, item, verdict, reason: reason || null, answers: state.answers };
  let saved;
  try {
    saved = await api("api/judgement", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
    });
  } catch (error) {
    say(`Not saved: ${error.message}`);
    return;
  } finally {
    state.busy = false;
  }
  state.judged[String(item)] = { verdict, reason: reason || null, answers: Object.assign({}, body.answers) };
  state.left = saved.left;
  await show(state.position + 1);
}

function openReasons() {
  state.reasons = true;
  $("reasons").hidden = false;
}

function toggleHelp(open) {
  const help = $("help");
  help.hidden = open === undefined ? !help.hidden : !open;
}

function onKey(event) {
  if (event.key === "?" && !state.typing && document.activeElement !== $("name-input")) {
    event.preventDefault(); toggleHelp(); return;
  }
  if (event.key === "Escape" && !$("help").hidden) { toggleHelp(false); return; }
  if (!state.reviewer) {
    if (event.key === "Enter" && $("name-input").value.trim()) useReviewer($("name-input").value.trim()).catch((e) => say(e.message));
    return;
  }
  if (state.typing) {
    if (event.key === "Enter") { event.preventDefault(); const text = $("reason-text").value.trim(); if (text) judge("reject", text); }
    if (event.key === "Escape") { state.typing = false; $("reason-text").hidden = true; $("reason-text").blur(); }
    return;
  }
  if (event.ctrlKey || event.metaKey || event.altKey) return;
  const key = event.key;
  if (state.position >= state.order.length) {
    if (key === "n") { const next = state.order.findIndex((i) => !(String(i) in state.judged)); if (next >= 0) show(next); }
    if (key === "Backspace" || key === "ArrowLeft") { event.preventDefault(); show(state.position - 1); }
    return;
  }
  if (state.reasons) {
    if (/^[1-9]$/.test(key) && Number(key) <= state.session.reasons.length) { judge("reject", state.session.reasons[Number(key) - 1]); return; }
    if (key === "t") { event.preventDefault(); state.typing = true; $("reason-text").hidden = false; $("reason-text").value = ""; $("reason-text").focus(); return; }
    if (key === "Escape") { state.reasons = false; $("reasons").hidden = true; return; }
    return;
  }
  const questions = state.session.study.questions;
  if (/^[1-9]$/.test(key) && questions.length) {
    const q = questions[state.current];
    const k = Number(key) - 1;
    if (k < q.answers.length) {
      state.answers[q.id] = q.answers[k];
      const next = questions.findIndex((other) => !(other.id in state.answers));
      state.current = next < 0 ? state.current : next;
      renderQuestions();
    }
    return;
  }
  switch (key) {
    case "ArrowUp": state.current = Math.max(0, state.current - 1); renderQuestions(); event.preventDefault(); break;
    case "ArrowDown": state.current = Math.min(questions.length - 1, state.current + 1); renderQuestions(); event.preventDefault(); break;
    case "a": judge("accept"); break;
    case "f": judge("flag"); break;
    case "r": openReasons(); break;
    case "s": case "ArrowRight": show(state.position + 1); break;
    case "Backspace": case "ArrowLeft": event.preventDefault(); show(state.position - 1); break;
    case "n": { const next = state.order.findIndex((i) => !(String(i) in state.judged)); if (next >= 0) show(next); break; }
    default: break;
  }
}

document.addEventListener("keydown", onKey);
document.addEventListener("DOMContentLoaded", () => { start().catch((error) => say(error.message)); });
