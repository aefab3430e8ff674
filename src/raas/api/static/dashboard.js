// The raas dashboard: reads /dashboard/events (Server-Sent Events) and draws what it gets.
// Every value from the service is put into the page as text (textContent) or as a number attribute,
// never parsed as HTML: job errors and instance ids are whatever a task or a model produced.
"use strict";
(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const STAGES = ["init", "run", "eval"];
  const MAX_POINTS = 600;
  let series = [];

  const $ = (id) => document.getElementById(id);

  function show(id, value) {
    const el = $(id);
    if (el) el.textContent = value === null || value === undefined ? "–" : String(value);
  }

  function num(x, digits) {
    return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
  }

  function clock(t) {
    return typeof t === "number" ? new Date(t * 1000).toLocaleTimeString() : "–";
  }

  // Rows of plain text cells; ``cells`` returns the values of one row.
  function fillTable(id, rows, cells, rowClass) {
    const body = $(id).tBodies[0];
    const made = rows.map((row) => {
      const tr = document.createElement("tr");
      if (rowClass) {
        const cls = rowClass(row);
        if (cls) tr.className = cls;
      }
      for (const value of cells(row)) {
        const td = document.createElement("td");
        if (value && typeof value === "object") {
          td.textContent = value.text === null || value.text === undefined ? "–" : String(value.text);
          td.className = value.cls;
        } else {
          td.textContent = value === null || value === undefined ? "–" : String(value);
        }
        tr.appendChild(td);
      }
      return tr;
    });
    body.replaceChildren(...made);
  }

  function svgEl(name, attrs) {
    const el = document.createElementNS(SVG_NS, name);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    return el;
  }

  // Lines over time: ``lines`` is [{cls, values: [[t, y], ...]}], all on one y scale from 0.
  function lineChart(svg, lines) {
    const box = svg.viewBox.baseVal;
    const all = lines.flatMap((l) => l.values);
    const shapes = [svgEl("line", { class: "axis", x1: 0, y1: box.height - 1, x2: box.width, y2: box.height - 1 })];
    if (all.length > 1) {
      const t0 = Math.min(...all.map((p) => p[0]));
      const t1 = Math.max(...all.map((p) => p[0]));
      const top = Math.max(1, ...all.map((p) => p[1])) * 1.1;
      const x = (t) => (t1 > t0 ? ((t - t0) / (t1 - t0)) * box.width : 0);
      const y = (v) => box.height - 2 - (v / top) * (box.height - 4);
      for (const line of lines) {
        const pts = line.values.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(" ");
        shapes.push(svgEl("polyline", { class: line.cls, points: pts }));
      }
      show(`${svg.id}-max`, Number.isInteger(top / 1.1) ? top / 1.1 : (top / 1.1).toFixed(2));
    }
    svg.replaceChildren(...shapes);
  }

  function barChart(svg, hist) {
    const box = svg.viewBox.baseVal;
    const counts = (hist && hist.counts) || [];
    const top = Math.max(1, ...counts);
    const w = counts.length ? box.width / counts.length : 0;
    const bars = counts.map((c, i) => {
      const h = (c / top) * (box.height - 4);
      return svgEl("rect", { class: "bar", x: i * w + 1, y: box.height - h, width: Math.max(w - 2, 1), height: h });
    });
    svg.replaceChildren(svgEl("line", { class: "axis", x1: 0, y1: box.height - 1, x2: box.width, y2: box.height - 1 }), ...bars);
  }

  function render(s) {
    show("updated", clock(s.t));
    show("accepting", s.accepting === undefined ? null : s.accepting ? "open" : "closed");
    const tp = s.throughput || {};
    show("window", tp.window_s);
    show("rollouts-per-s", num(tp.rollouts_per_s, 2));
    show("completed-per-s", num(tp.completed_per_s, 2));
    show("pending", s.pending);
    show("max-pending", s.max_pending);
    const fin = s.finished || {};
    for (const status of ["completed", "failed", "timeout", "cancelled"]) show(`finished-${status}`, fin[status] || 0);
    const reward = s.reward || {};
    show("reward-mean", num(reward.mean, 3));
    show("reward-count", reward.count);
    show("reward-window", reward.count);
    show("reward-min", num(reward.min, 3));
    show("reward-max", num(reward.max, 3));
    barChart($("reward-hist"), reward.histogram);

    const stages = s.stages || {};
    for (const stage of STAGES) {
      const n = stages[stage] || {};
      show(`stage-${stage}-queued`, n.queued);
      show(`stage-${stage}-active`, n.active);
      show(`stage-${stage}-workers`, n.workers);
    }
    fillTable("ledger", Object.entries(s.ledger || {}), (e) => e);
    fillTable("kinds", s.failure_kinds || [], (k) => [k.stage, k.kind, k.count]);

    const llm = s.llm || {};
    show("llm-in-flight", llm.in_flight);
    $("llm-paused").hidden = !llm.paused;
    fillTable(
      "servers",
      llm.servers || [],
      (v) => [v.address, v.kind, v.healthy ? "yes" : "no", v.in_flight, v.requests, v.failures, v.pinned,
              v.weight_version, { text: v.last_error, cls: "msg" }],
      (v) => (v.healthy ? "" : "unhealthy"),
    );

    const nodes = s.nodes || [];
    $("nodes-panel").hidden = nodes.length === 0;
    fillTable(
      "nodes",
      nodes,
      (n) => [n.node_id ?? n.name, n.url, n.host, n.healthy ? "yes" : "no", n.jobs, num(n.load, 2), n.capacity,
              Array.isArray(n.llm_servers) ? n.llm_servers.join(" ") : n.llm_servers, { text: n.error, cls: "msg" }],
      (n) => (n.healthy ? "" : "unhealthy"),
    );

    const sandboxes = s.sandboxes || {};
    show("sandboxes-live", sandboxes.live);
    fillTable("sandboxes", sandboxes.items || [], (b) => [b.id, b.backend, b.owner, num(b.age_s, 0)]);
    fillTable("failures", s.recent_failures || [], (f) => [
      clock(f.at), f.job_id, f.instance_id, f.status, f.stage, f.kind, { text: f.message, cls: "msg" },
    ]);

    lineChart($("stage-chart"), STAGES.flatMap((stage) => [
      { cls: `s-${stage} queued`, values: series.map((p) => [p.t, (p.queued || {})[stage] || 0]) },
      { cls: `s-${stage} active`, values: series.map((p) => [p.t, (p.active || {})[stage] || 0]) },
    ]));
    lineChart($("throughput-chart"), [{ cls: "s-rate", values: series.map((p) => [p.t, p.rollouts_per_s || 0]) }]);
  }

  function setConn(state) {
    const el = $("conn");
    el.dataset.state = state;
    el.textContent = state;
  }

  function connect() {
    const events = new EventSource("/dashboard/events");
    events.addEventListener("history", (e) => {
      series = JSON.parse(e.data).slice(-MAX_POINTS);
    });
    events.addEventListener("snapshot", (e) => {
      const s = JSON.parse(e.data);
      const last = series[series.length - 1];
      if (s.point && (!last || s.point.t > last.t)) {
        series.push(s.point);
        if (series.length > MAX_POINTS) series.shift();
      }
      render(s);
      setConn("live");
    });
    events.onerror = () => {
      // EventSource retries by itself after a dropped connection; a refused one (401) stays closed.
      setConn(events.readyState === EventSource.CLOSED ? "disconnected" : "reconnecting");
    };
  }

  connect();
})();
