// The live training view: reads raas train's log lines as the run writes them (every 2 s) and draws them.
// Values from the log go into the page as text or as numbers in SVG attributes, never as markup.
"use strict";

const API = "/dashboard/api/train";
const SVG = "http://www.w3.org/2000/svg";
const rows = [];
let next = 0;
let linkJobs = false;

function num(x) {
  return typeof x === "number" && Number.isFinite(x) ? x : null;
}

function cell(value, digits) {
  const td = document.createElement("td");
  const n = num(value);
  td.textContent = n === null ? (value === undefined || value === null ? "–" : String(value)) : n.toFixed(digits);
  return td;
}

function line(svg, points, cls, lo, hi) {
  const [x0, x1] = [points[0][0], points[points.length - 1][0]];
  const span = (x1 - x0) || 1;
  const poly = document.createElementNS(SVG, "polyline");
  poly.setAttribute("points", points.map(([x, y]) =>
    `${(((x - x0) / span) * 296 + 2).toFixed(1)},${(98 - ((y - lo) / ((hi - lo) || 1)) * 96).toFixed(1)}`).join(" "));
  if (cls) poly.setAttribute("class", cls);
  svg.append(poly);
}

function chart(id, series, lastId, digits) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points.map((p) => p[1]));
  if (!all.length) return;
  const lo = Math.min(0, ...all);
  const hi = Math.max(...all);
  for (const s of series) if (s.points.length) line(svg, s.points, s.cls, lo, hi);
  document.getElementById(lastId).textContent = series
    .filter((s) => s.points.length)
    .map((s) => (s.label ? s.label + " " : "") + s.points[s.points.length - 1][1].toFixed(digits)).join(" · ");
}

function points(kind, key) {
  return rows.filter((r) => r.kind === kind && num(r[key]) !== null && num(r.step) !== null).map((r) => [r.step, r[key]]);
}

function draw() {
  const steps = rows.filter((r) => r.kind === "step");
  document.getElementById("steps").textContent = String(steps.length);
  document.getElementById("evals").textContent = String(rows.filter((r) => r.kind === "eval").length);
  chart("chart-reward", [{ points: points("step", "reward_mean") }], "last-reward", 3);
  chart("chart-pass", [{ points: points("eval", "pass_rate") }], "last-pass", 3);
  chart("chart-informative", [{ points: points("step", "informative_fraction") }], "last-informative", 2);
  chart("chart-time", [
    { points: points("step", "wait_s"), cls: "k-wait", label: "wait" },
    { points: points("step", "train_s"), cls: "k-train", label: "train" },
    { points: points("step", "sync_s"), cls: "k-sync", label: "sync" },
  ], "last-time", 1);
  chart("chart-mismatch", [{ points: points("step", "logprob_abs_diff_mean") }], "last-mismatch", 4);
}

function append(newRows) {
  const body = document.querySelector("#log tbody");
  for (const r of newRows) {
    rows.push(r);
    const tr = document.createElement("tr");
    tr.className = "log-row " + String(r.kind);
    const first = cell(r.step, 0);
    if (linkJobs && r.kind === "step" && num(r.step) !== null) {
      const a = document.createElement("a");
      a.href = "/dashboard/jobs?step=" + String(r.step);  // a number: checked above
      a.className = "step-jobs";
      a.textContent = first.textContent;
      first.replaceChildren(a);
    }
    tr.append(first, cell(r.kind), cell(r.reward_mean, 3), cell(r.pass_rate, 3),
      cell(r.informative_fraction, 2), cell(r.wait_s, 1), cell(r.train_s, 1), cell(r.sync_s, 1),
      cell(r.logprob_abs_diff_mean, 4), cell(r.rollouts, 0), cell(r.rss_mb, 0));
    body.prepend(tr);
  }
}

async function poll() {
  try {
    const response = await fetch(API + "?after=" + next, { credentials: "same-origin" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const body = await response.json();
    document.getElementById("file").textContent = body.file;
    linkJobs = body.jobs === true;
    if (body.rows.length) {
      append(body.rows);
      draw();
    }
    next = body.next;
    document.getElementById("state").textContent = "following";
  } catch (err) {
    document.getElementById("state").textContent = "no answer (" + String(err) + "), retrying";
  }
  setTimeout(poll, 2000);
}

document.addEventListener("DOMContentLoaded", poll);
