"""The live status page a launcher serves while its run trains (``output.status_page``).

An aiohttp server on 127.0.0.1, on a port the OS picks, with a fresh random token per launch.
A request must carry the token: ``?token=`` (the page then sets a cookie, so its own polling
needs nothing more), an ``X-Streamrl-Token`` header, or ``Authorization: Bearer``; without it
the answer is 401 (no token) or 403 (a wrong one) and holds no data. The URL, token included,
is printed at start and written to ``<run dir>/status.url`` (mode 0600), which is removed when
the launcher stops.

``/`` is one self-contained HTML page (inline script and SVG, no other request than its own
polling) that renders the snapshot embedded in it at once and then polls ``/api/status`` every
second; ``/api/status`` is the snapshot as JSON (fields in :mod:`streamrl.runtime.run_status`).
The figures come from the launcher's own state (:class:`~streamrl.runtime.run_metrics.RunMetrics`,
:class:`~streamrl.runtime.supervision.Supervisor`) and, once a second, the dock controller's
statistics (samples ready and claimed per consuming stage, leases, in flight).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

import anyio
from aiohttp import web

from streamrl.config import RunConfig
from streamrl.runtime.pipeline import PipelineSpec
from streamrl.runtime.run_metrics import RunMetrics
from streamrl.runtime.run_status import (
    MAX_SHOWN_ERRORS,
    STATUS_URL_FILE,
    TOKEN_HEADER,
    clean,
    curves,
    last_row,
    pipeline_graph,
)
from streamrl.runtime.supervision import Supervisor
from streamrl.security import ClientAuth

log = logging.getLogger("streamrl.status")

POLL_S = 1.0  # how often the dock's statistics are read (and stage throughput sampled)
RATE_WINDOW = 6  # throughput and busy fraction: over the last this many polls


class StatusBoard:
    """Everything the page shows, as one snapshot (:meth:`snapshot`)."""

    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, metrics: RunMetrics,
                 supervisor: Supervisor) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.metrics = metrics
        self.supervisor = supervisor
        self.stages, self.edges = pipeline_graph([
            {"name": s.name, "workers": s.workers, "reads": s.reads, "writes": s.writes} for s in pipeline.stages])
        self.dock: dict[str, Any] | None = None  # the controller's statistics, newest
        self.dock_error = ""
        # (monotonic time, busy seconds per stage, samples per stage), one per poll
        self.history: collections.deque[tuple[float, dict[str, float], dict[str, int]]] = \
            collections.deque(maxlen=RATE_WINDOW)

    def _sample(self) -> None:
        busy: dict[str, float] = {}
        done: dict[str, int] = {}
        for (stage, _), b in list(self.metrics.busy.items()):
            busy[stage] = busy.get(stage, 0.0) + b
        for (stage, _), n in list(self.metrics.samples.items()):
            done[stage] = done.get(stage, 0) + n
        self.history.append((time.monotonic(), busy, done))

    async def poll_dock(self, endpoint: str, auth: ClientAuth | None) -> None:
        """Read the dock controller's statistics every POLL_S until cancelled (a dock that does not
        answer is retried; the page says so)."""
        from streamrl.dock.client import DockClient

        while True:
            try:
                async with DockClient(endpoint, client_id="launcher-status", connect_timeout_s=2,
                                      request_timeout_s=2, auth=auth) as dock:
                    while True:
                        with anyio.fail_after(5):
                            stats = await dock.server_statistics()
                        self.dock, self.dock_error = stats["controller"], ""
                        self._sample()
                        await anyio.sleep(POLL_S)
            except Exception as exc:  # the dock is starting, stopping or dead: the supervisor reports that
                self.dock_error = f"dock statistics unavailable: {exc}"
                self._sample()
                await anyio.sleep(POLL_S)

    def _rates(self) -> tuple[dict[str, float], dict[str, float]]:
        """Busy fraction and samples/s per stage over the last polls."""
        if len(self.history) < 2:
            return {}, {}
        (t0, b0, n0), (t1, b1, n1) = self.history[0], self.history[-1]
        dt = max(t1 - t0, 1e-9)
        workers = {s["name"]: s["workers"] for s in self.stages}
        busy = {k: max(0.0, (v - b0.get(k, 0.0)) / dt / workers.get(k, 1)) for k, v in b1.items()}
        rate = {k: max(0.0, (v - n0.get(k, 0)) / dt) for k, v in n1.items()}
        return busy, rate

    def snapshot(self) -> dict[str, Any]:
        m, sup = self.metrics, self.supervisor
        last = m.train_rows[-1] if m.train_rows else {}
        state = "starting" if not m.t_go else "stopping" if sup.stopping else "training"
        busy, rate = self._rates()
        consumers = (self.dock or {}).get("consumers", {})
        stages = []
        for s in self.stages:
            c = consumers.get(s["name"], {})
            restarts = sum(n for name, n in m.restarts.items()
                           if any(part.rsplit("-", 1)[0] == s["name"] for part in name.split("+")))
            ready = sum(1 for (st, _) in sup.ready if st == s["name"])
            stages.append({**s, "busy": busy.get(s["name"], last.get(f"busy/{s['name']}")),
                           "samples_per_s": rate.get(s["name"]), "ready": c.get("ready"),
                           "claimed": c.get("claimed"), "done": c.get("done"), "restarts": restarts,
                           "workers_ready": ready})
        edges = [{**e, "waiting": consumers.get(e["to"], {}).get("ready")} for e in self.edges]
        dock = None
        if self.dock is not None:
            dock = {k: self.dock.get(k) for k in ("in_flight", "capacity", "leases", "claimed", "leases_expired",
                                                  "dropped_stale", "samples_released", "samples_freed",
                                                  "pending_claims", "clients")}
        errors = list(sup.errors)[-MAX_SHOWN_ERRORS:]
        if self.dock_error and m.t_go:
            errors.append({"time": time.time(), "kind": "dock", "text": self.dock_error})
        return clean({
            "name": self.cfg.output.name, "run_dir": str(self.run_dir), "live": True, "state": state,
            "step": last.get("step", 0), "steps_total": self.cfg.algo.steps,
            "elapsed_s": time.monotonic() - m.t_go if m.t_go else None, "stop_reason": sup.stop_reason,
            "stages": stages, "edges": edges, "dock": dock,
            "staleness": {"mean": last.get("staleness_mean"), "max": last.get("staleness_max"),
                          "limit": self.cfg.algo.max_staleness},
            **curves(m.train_rows, m.eval_rows), "last": last_row(last), "errors": errors,
            "time": time.time(),
        })


class StatusPage:
    """The page's server: :meth:`start` (returns the URL with the token), :meth:`close`."""

    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, metrics: RunMetrics,
                 supervisor: Supervisor) -> None:
        self.board = StatusBoard(cfg, pipeline, run_dir, metrics, supervisor)
        self.token = secrets.token_urlsafe(24)
        self.url_file = run_dir / STATUS_URL_FILE
        self.url = ""
        self.cookie = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application(middlewares=[self._auth], client_max_size=4096)
        app.router.add_get("/", self._page)
        app.router.add_get("/api/status", self._api)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.cookie = f"streamrl_token_{port}"  # cookies ignore ports: one name per page
        self.url = f"http://127.0.0.1:{port}/?token={self.token}"
        fd = os.open(self.url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an older file of this run dir may have had another mode
        with os.fdopen(fd, "w") as f:
            f.write(self.url + "\n")
        return self.url

    async def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.url_file.unlink()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _given(self, request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        return (request.query.get("token") or request.headers.get(TOKEN_HEADER)
                or (auth[len("Bearer "):] if auth.startswith("Bearer ") else None)
                or request.cookies.get(self.cookie))

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = self._given(request)
        if not given:
            return web.Response(status=401, text="streamrl status page: the run's token is required "
                                                 f"(see {STATUS_URL_FILE} in the run dir)\n")
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return web.Response(status=403, text="streamrl status page: wrong token\n")
        resp = await handler(request)
        if request.query.get("token"):
            resp.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict", path="/")
        resp.headers["Cache-Control"] = "no-store"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Content-Security-Policy"] = ("default-src 'none'; script-src 'unsafe-inline'; "
                                                   "style-src 'unsafe-inline'; connect-src 'self'")
        return resp

    async def _api(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.board.snapshot()), content_type="application/json")

    async def _page(self, request: web.Request) -> web.Response:
        data = json.dumps(self.board.snapshot()).replace("<", "\\u003c")  # no "</script>" inside the script
        return web.Response(text=PAGE.replace("__SNAPSHOT__", data), content_type="text/html")


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>streamrl status</title>
<style>
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 4px} h2{font-size:15px;margin:18px 0 6px}
.muted{color:#777} .bad{color:#b00020} table{border-collapse:collapse}
td,th{padding:2px 10px;text-align:right;border-bottom:1px solid #ddd} td:first-child,th:first-child{text-align:left}
svg{background:#fff;border:1px solid #ddd} .row{display:flex;gap:24px;flex-wrap:wrap}
#errors li{white-space:pre-wrap;font-family:monospace;font-size:12px;margin-bottom:4px}
</style></head><body>
<h1 id="title">streamrl</h1>
<div><span id="state"></span> &middot; step <b id="step">0</b>/<span id="steps_total"></span>
 &middot; elapsed <span id="elapsed"></span> s &middot; <span class="muted" id="run_dir"></span>
 &middot; <span class="muted" id="updated"></span></div>
<h2>Pipeline</h2>
<svg id="graph" width="960" height="200" role="img" aria-label="pipeline graph"></svg>
<h2>Stages</h2>
<table id="stages"><thead><tr><th>stage</th><th>workers</th><th>busy</th><th>samples/s</th><th>in work</th>
<th>ready</th><th>done</th><th>restarts</th></tr></thead><tbody></tbody></table>
<div class="row"><div><h2>Dock</h2><table id="dock"><tbody></tbody></table></div>
<div><h2>Last step</h2><table id="last"><tbody></tbody></table></div></div>
<div class="row"><div><h2>Reward</h2><svg id="reward" width="460" height="200"></svg></div>
<div><h2>Eval</h2><svg id="eval" width="460" height="200"></svg></div></div>
<h2>Last errors</h2><ul id="errors"></ul>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const token = new URLSearchParams(location.search).get("token");
function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(v, d) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return v !== 0 && Math.abs(v) < Math.pow(10, -d) ? v.toExponential(1) : v.toFixed(d);
}
function pct(v) { return v === null || v === undefined ? "-" : Math.round(100 * v) + "%"; }
function setText(id, t) { document.getElementById(id).textContent = t; }
function table(id, rows) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren(...rows.map(r => {
    const tr = document.createElement("tr");
    for (const c of r) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    return tr;
  }));
}
function graph(s) {
  const svg = document.getElementById("graph");
  svg.replaceChildren();
  const W = 140, H = 62, GX = 50, GY = 70, pos = {}, depthOf = {}, perDepth = {};
  let side = 0, maxDepth = 0, rows = 1;
  for (const st of s.stages) if (st.depth >= 0) maxDepth = Math.max(maxDepth, st.depth);
  for (const st of s.stages) {
    const d = st.depth;
    depthOf[st.name] = d;
    if (d < 0) { pos[st.name] = [20 + (maxDepth + 1 + side++) * (W + GX), 10]; continue; }
    const i = perDepth[d] = (perDepth[d] || 0) + 1;
    rows = Math.max(rows, i);
    pos[st.name] = [20 + d * (W + GX), 10 + (i - 1) * (H + GY)];
  }
  let bottom = 10 + rows * (H + GY);
  const defs = el("defs", {});
  const marker = el("marker", {id: "arrow", viewBox: "0 0 10 10", refX: "10", refY: "5", markerWidth: "7",
                                markerHeight: "7", orient: "auto-start-reverse"});
  marker.appendChild(el("path", {d: "M 0 0 L 10 5 L 0 10 z", fill: "#888"}));
  defs.appendChild(marker); svg.appendChild(defs);
  for (const e of s.edges) {
    const [x1, y1] = pos[e.from], [x2, y2] = pos[e.to];
    const span = depthOf[e.to] - depthOf[e.from];
    const g = el("g", {"class": "edge", "data-from": e.from, "data-to": e.to});
    let d, lx, ly;
    if (span === 1 || y1 !== y2) {  // neighbours: a curve from the right side to the left side
      const ax = x1 + W, ay = y1 + H / 2, bx = x2, by = y2 + H / 2, mx = (ax + bx) / 2;
      d = `M ${ax} ${ay} C ${mx} ${ay}, ${mx} ${by}, ${bx} ${by}`; lx = mx; ly = (ay + by) / 2 - 4;
    } else {  // skipping stages: an arc under the row, from bottom to bottom
      const ax = x1 + W / 2 + 10, bx = x2 + W / 2 - 10, ay = y1 + H, dip = ay + 14 + 16 * (span - 1);
      d = `M ${ax} ${ay} C ${ax} ${dip}, ${bx} ${dip}, ${bx} ${ay}`; lx = bx - 18; ly = ay + 14;
      bottom = Math.max(bottom, dip + 10);
    }
    g.appendChild(el("path", {d, fill: "none", stroke: "#999", "stroke-width": "1.3", "marker-end": "url(#arrow)"}));
    g.appendChild(el("title", {}, e.from + " → " + e.to + ": " + e.columns.join(", ") + " (samples waiting)"));
    g.appendChild(el("text", {x: lx, y: ly, "text-anchor": "middle", "font-size": "11", fill: "#555",
                              "class": "waiting"}, e.waiting === null ? "-" : String(e.waiting)));
    svg.appendChild(g);
  }
  for (const st of s.stages) {
    const [x, y] = pos[st.name];
    const g = el("g", {"class": "stage", "data-stage": st.name});
    const b = st.busy === null || st.busy === undefined ? 0 : Math.min(1, st.busy);
    g.appendChild(el("rect", {x, y, width: W, height: H, rx: "6", fill: "#eef3fb", stroke: "#4a78c2"}));
    g.appendChild(el("rect", {x, y: y + H - 6, width: W * b, height: 6, fill: "#4a78c2"}));
    g.appendChild(el("text", {x: x + 8, y: y + 18, "font-weight": "bold"}, st.name + (st.workers > 1 ? " ×" + st.workers : "")));
    g.appendChild(el("text", {x: x + 8, y: y + 34, "font-size": "12"}, "busy " + pct(st.busy)));
    g.appendChild(el("text", {x: x + 8, y: y + 49, "font-size": "12"}, fmt(st.samples_per_s, 1) + " samples/s"));
    svg.appendChild(g);
  }
  const width = 40 + (maxDepth + 1 + side) * (W + GX);
  svg.setAttribute("width", width); svg.setAttribute("height", bottom);
  svg.setAttribute("viewBox", `0 0 ${width} ${bottom}`);
}
function plot(id, series) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height"), P = 30;
  const pts = series.flatMap(s => s.points).filter(p => p[1] !== null);
  if (!pts.length) { svg.appendChild(el("text", {x: 10, y: 20, fill: "#777"}, "no points yet")); return; }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(0, ...ys), y1 = Math.max(1, ...ys);
  const X = x => P + (x - x0) / (x1 - x0) * (W - 2 * P), Y = y => H - P + (y0 - y) / (y1 - y0) * (H - 2 * P);
  svg.appendChild(el("line", {x1: P, y1: H - P, x2: W - P, y2: H - P, stroke: "#aaa"}));
  svg.appendChild(el("line", {x1: P, y1: P, x2: P, y2: H - P, stroke: "#aaa"}));
  svg.appendChild(el("text", {x: 2, y: P + 4, "font-size": "10"}, fmt(y1, 2)));
  svg.appendChild(el("text", {x: 2, y: H - P, "font-size": "10"}, fmt(y0, 2)));
  svg.appendChild(el("text", {x: W - P, y: H - 8, "font-size": "10", "text-anchor": "end"}, "step " + x1));
  const colors = ["#c2185b", "#2e7d32", "#1565c0", "#ef6c00", "#6a1b9a"];
  series.forEach((s, i) => {
    const p = s.points.filter(q => q[1] !== null).map(q => X(q[0]).toFixed(1) + "," + Y(q[1]).toFixed(1)).join(" ");
    svg.appendChild(el("polyline", {points: p, fill: "none", stroke: colors[i % colors.length], "stroke-width": "1.5"}));
    svg.appendChild(el("text", {x: W - P, y: P + 12 * i, "font-size": "11", "text-anchor": "end",
                                fill: colors[i % colors.length]}, s.name));
  });
}
function render(s) {
  setText("title", "streamrl: " + s.name);
  const st = document.getElementById("state");
  st.textContent = s.state + (s.live ? "" : " (not live)") + (s.stop_reason ? " — " + s.stop_reason : "");
  st.className = s.state === "training" ? "" : "muted";
  setText("step", String(s.step)); setText("steps_total", fmt(s.steps_total, 0));
  setText("elapsed", fmt(s.elapsed_s, 1)); setText("run_dir", s.run_dir);
  setText("updated", "updated " + new Date().toLocaleTimeString());
  graph(s);
  table("stages", s.stages.map(x => [x.name, x.workers, pct(x.busy), fmt(x.samples_per_s, 1), fmt(x.claimed, 0),
                                     fmt(x.ready, 0), fmt(x.done, 0), x.restarts]));
  const d = s.dock || {};
  const stl = s.staleness || {};
  table("dock", [["in flight", fmt(d.in_flight, 0) + " / " + fmt(d.capacity, 0)], ["leases", fmt(d.leases, 0)],
                 ["samples claimed", fmt(d.claimed, 0)], ["leases expired", fmt(d.leases_expired, 0)],
                 ["dropped as stale", fmt(d.dropped_stale, 0)],
                 ["staleness mean / max", fmt(stl.mean, 2) + " / " + fmt(stl.max, 0) + " (limit " + fmt(stl.limit, 0) + ")"]]);
  table("last", Object.entries(s.last || {}).map(([k, v]) => [k, fmt(v, 4)]));
  plot("reward", [{name: "reward_mean", points: s.rewards || []}]);
  plot("eval", Object.entries(s.evals || {}).map(([k, v]) => ({name: k, points: v})));
  const ul = document.getElementById("errors");
  const errs = (s.errors || []).slice().reverse();
  ul.replaceChildren(...(errs.length ? errs.map(e => {
    const li = document.createElement("li");
    li.className = "bad";
    li.textContent = new Date(e.time * 1000).toLocaleTimeString() + " " + e.kind + ": " + e.text;
    return li;
  }) : [Object.assign(document.createElement("li"), {textContent: "none", className: "muted"})]));
}
async function poll() {
  try {
    const r = await fetch("api/status", {credentials: "same-origin", cache: "no-store",
                                         headers: token ? {"X-Streamrl-Token": token} : {}});
    if (r.ok) render(await r.json());
    else setText("updated", "status " + r.status + " (the run has ended, or the token is wrong)");
  } catch (e) {
    setText("updated", "the launcher does not answer (the run has ended)");
  }
}
render(__SNAPSHOT__);
setInterval(poll, 1000);
</script></body></html>
"""
