// The trajectory inspector's pages. Every string that comes from a job (model output, tool output, ids,
// error messages) goes into the page through textContent or an attribute value, never through innerHTML,
// so markup in a rollout is shown, not run. Links are built only from the page's own paths.
"use strict";

const API = "/dashboard/api/jobs";
const JOBS = "/dashboard/jobs";
const PAGE = 50;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(x, digits = 2) {
  return x === null || x === undefined ? "–" : typeof x === "number" ? x.toFixed(digits) : String(x);
}

function jobLink(jobId) {
  return el("a", { href: JOBS + "/" + encodeURIComponent(jobId) }, jobId);
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) throw new Error(url + ": HTTP " + response.status);
  return response.json();
}

// -- the list -----------------------------------------------------------------------------------------

function listParams(form, offset) {
  const params = new URLSearchParams();
  for (const [k, v] of new FormData(form).entries()) if (String(v).trim() !== "") params.set(k, String(v).trim());
  params.set("offset", String(offset));
  params.set("limit", String(PAGE));
  return params;
}

async function showList() {
  const form = document.getElementById("filters");
  const own = new URLSearchParams(location.search);
  for (const [k, v] of own.entries()) if (form.elements[k]) form.elements[k].value = v;
  let offset = Number(own.get("offset") || 0);

  async function load() {
    const params = listParams(form, offset);
    const page = await getJSON(API + "?" + params.toString());
    const body = document.querySelector("#jobs tbody");
    body.replaceChildren();
    for (const job of page.jobs) {
      const group = job.group_id ? el("a", { href: JOBS + "?group=" + encodeURIComponent(job.group_id) }, job.group_id) : "–";
      body.append(el("tr", { "data-job": job.job_id, class: "job-row" },
        el("td", {}, jobLink(job.job_id)), el("td", {}, job.status), el("td", {}, job.outcome),
        el("td", {}, fmt(job.reward)), el("td", {}, job.data_source || "–"), el("td", {}, job.instance_id || "–"),
        el("td", {}, group), el("td", {}, fmt(job.advantage, 3)), el("td", {}, fmt(job.train_step, 0)), el("td", {}, job.turns), el("td", {}, job.weight_versions.join(", ") || "–"),
        el("td", {}, fmt(job.total_s, 1)), el("td", { class: "failure" }, job.error || "")));
    }
    document.getElementById("total").textContent = String(page.total);
    const last = Math.min(page.total, offset + page.jobs.length);
    document.getElementById("range").textContent = page.total ? `${offset + 1}–${last}` : "0";
    document.getElementById("prev").disabled = offset === 0;
    document.getElementById("next").disabled = last >= page.total;
    history.replaceState(null, "", JOBS + "?" + params.toString());
  }

  form.addEventListener("submit", (event) => { event.preventDefault(); offset = 0; load(); });
  document.getElementById("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); load(); });
  document.getElementById("next").addEventListener("click", () => { offset += PAGE; load(); });
  await load();
}

// -- a job ------------------------------------------------------------------------------------------

function row(key, value) {
  return el("tr", {}, el("th", {}, key), el("td", {}, value));
}

function showMessages(messages) {
  const box = document.getElementById("messages");
  box.replaceChildren();
  for (const m of messages) {
    const node = el("div", { class: "msg " + m.role }, el("div", { class: "role" }, m.role + (m.name ? " (" + m.name + ")" : "")));
    node.append(el("pre", {}, m.text));
    if (m.cut) node.append(el("div", { class: "cut" }, `… ${m.cut} more characters not shown`));
    for (const call of m.tool_calls) {
      node.append(el("div", { class: "call" }, "→ ", el("b", {}, call.name), " ", el("code", {}, JSON.stringify(call.arguments))));
    }
    box.append(node);
  }
}

function showTokens(view) {
  const box = document.getElementById("tokens");
  box.replaceChildren();
  if (!view) { document.getElementById("tokens-box").hidden = true; return; }
  document.getElementById("token-counts").textContent =
    `${view.prompt} prompt, ${view.sampled} sampled, ${view.masked} masked response tokens` +
    (view.shown < view.total ? ` (first ${view.shown} of ${view.total} shown)` : "") +
    (view.segments > 1 ? ` · ${view.segments} token sequences (segments), each shown from its prompt` : "");
  document.getElementById("turns").textContent = view.turns
    .map((t) => `turn ${t.index}: version ${t.weight_version ?? "–"}, segment ${t.segment}, ${t.finish}`).join(" · ");
  let previous = -1;
  let segment = -1;
  const frag = document.createDocumentFragment();
  for (const [text, mask, logprob, turn, seg] of view.tokens) {
    if (seg !== segment) {
      if (view.segments > 1) frag.append(el("div", { class: "segment-break" }, `segment ${seg}`));
      segment = seg;
      previous = -1;
    }
    const node = el("span", { class: "tok m" + mask, "data-turn": String(turn) }, text);
    if (mask && logprob !== null) {
      const p = Math.exp(Math.max(logprob, -10));
      node.style.setProperty("--a", String(0.15 + 0.75 * (1 - p)));
      node.title = `logprob ${logprob.toFixed(3)} · turn ${turn}`;
    } else {
      node.title = turn < 0 ? "prompt" : `turn ${turn}`;
    }
    if (turn >= 0 && turn !== previous) node.classList.add("turn-start");
    previous = turn;
    frag.append(node);
  }
  box.append(frag);
}

async function showJob() {
  const jobId = decodeURIComponent(location.pathname.slice(JOBS.length + 1));
  document.getElementById("job-id").textContent = jobId;
  document.getElementById("raw").href = API + "/" + encodeURIComponent(jobId) + "/raw";
  const job = await getJSON(API + "/" + encodeURIComponent(jobId));
  const r = job.row;
  const summary = document.querySelector("#summary tbody");
  summary.replaceChildren(
    row("status", r.status), row("outcome", r.outcome), row("reward", fmt(r.reward)),
    row("instance", r.instance_id || "–"), row("data source", r.data_source || "–"),
    row("group", r.group_id ? el("a", { href: JOBS + "?group=" + encodeURIComponent(r.group_id) }, r.group_id) : "–"),
    row("turns", r.turns), row("weight versions", r.weight_versions.join(", ") || "–"),
  );
  const timing = document.querySelector("#timing tbody");
  timing.replaceChildren(...Object.entries(job.timing).map(([k, v]) => row(k.replace(/_s$/, ""), fmt(v))));
  if (job.error) {
    document.getElementById("failure-box").hidden = false;
    document.getElementById("failure").textContent = `${job.error.stage} / ${job.error.kind}: ${job.error.message}`;
  }
  const history = document.querySelector("#history tbody");
  history.replaceChildren(...job.transitions.map((t) => el("tr", {},
    el("td", {}, fmt(t.at_s, 2)), el("td", {}, t.status), el("td", {}, t.detail || ""))));
  document.getElementById("history-box").hidden = job.transitions.length === 0;
  const boxes = document.querySelector("#sandboxes tbody");
  boxes.replaceChildren(...job.sandboxes.map((b) => el("tr", { class: "sandbox-row" },
    el("td", {}, fmt(b.at_s, 2)), el("td", {}, b.id || "–"), el("td", {}, b.backend || "–"), el("td", {}, b.image || "–"))));
  document.getElementById("sandboxes-box").hidden = job.sandboxes.length === 0;
  // EVAL's report: each artifact under its name, a string (a patch, a test log) as it is, the rest as JSON
  const artifacts = Object.entries(job.artifacts || {});
  const report = document.getElementById("eval");
  report.replaceChildren(...artifacts.map(([name, value]) => el("div", { class: "artifact" },
    el("h3", {}, name), el("pre", {}, typeof value === "string" ? value : JSON.stringify(value, null, 1)))));
  document.getElementById("eval-box").hidden = artifacts.length === 0;
  showMessages(job.messages);
  showTokens(job.tokens);
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  const run = page === "list" ? showList : showJob;
  run().catch((err) => {
    const note = el("p", { class: "cut", id: "load-error" }, String(err));
    document.querySelector("main").prepend(note);
  });
});
