/* hotprefix dashboard: polls BASE/data every 2 s, keeps a rolling history in the browser and draws
 * it as plain SVG. No library, no network access beyond this server. Every text that comes from the
 * server (prompt excerpts, tenant names) is set with textContent, never parsed as HTML. */
(function () {
  "use strict";

  const BASE = document.body.dataset.base || "/dashboard";
  const POLL_MS = 2000;
  const VIEW_S = 300;        // the charts show the last 5 minutes
  const KEEP_S = 600;        // history kept in memory (a rolling window)
  const HIT_WINDOW_S = 60;   // the token hit rate is over a sliding window of this many seconds
  const SVG = "http://www.w3.org/2000/svg";
  const REASONS = ["cold", "extended", "evicted", "diverged", "namespace", "salt", "not_admitted",
                   "too_short"];
  const REASON_COLORS = {cold: "#64748b", extended: "#2f6fde", evicted: "#d14343", diverged: "#d97706",
                         namespace: "#8b5cf6", salt: "#db2777", not_admitted: "#0ea5e9",
                         too_short: "#a3a3a3"};
  const GREEN = "#1f9d55", BLUE = "#2f6fde", RED = "#d14343", GREY = "#94a3b8";

  const history = [];  // {x: client seconds, epoch, d: payload, hitWindow, evRate, miss: {reason: tokens/s}}
  let epoch = 0;
  let last = null;
  let stopped = false;

  // ------------------------------------------------------------------ helpers
  function $(id) { return document.getElementById(id); }

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.className = v;
      else if (k === "style") Object.assign(el.style, v);
      else el.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function s(tag, attrs) {
    const el = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, v);
    return el;
  }

  function setText(id, text) { $(id).textContent = text; }
  const fmtInt = (n) => Math.round(n).toLocaleString("en-US");
  const pct = (r) => (r * 100).toFixed(1) + "%";
  function compact(v) {
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a >= 10 || v === 0) return v.toFixed(0);
    return v.toFixed(a >= 1 ? 1 : 2);
  }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : n.toFixed(0)) + " " + u[i];
  }
  function niceMax(v) {
    if (!(v > 0)) return 1;
    const e = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 4, 8, 10]) if (m * e >= v * 1.0001) return m * e;
    return 10 * e;
  }
  const tenantLabel = (name) => name === "-" ? "(no tenant)" : name === "__admin__" ? "admin key" : name;

  // ------------------------------------------------------------------ history
  function push(d) {
    const x = Date.now() / 1000;
    const prev = history.length ? history[history.length - 1] : null;
    if (prev && (d.requests < prev.d.requests || d.queries_tokens < prev.d.queries_tokens ||
                 d.evictions < prev.d.evictions)) {
      epoch++;  // the counters were reset (POST /v1/cache/reset): no rate across that point
    }
    const sample = {x, epoch, d, hitWindow: null, evRate: null, miss: null};
    let base = null;  // the oldest sample inside the hit-rate window
    for (let i = history.length - 1; i >= 0; i--) {
      const o = history[i];
      if (o.epoch !== epoch || x - o.x > HIT_WINDOW_S) break;
      base = o;
    }
    if (base) {
      const dq = d.queries_tokens - base.d.queries_tokens;
      sample.hitWindow = dq > 0 ? (d.hit_tokens - base.d.hit_tokens) / dq : null;
    }
    if (prev && prev.epoch === epoch && d.t > prev.d.t) {
      const dt = d.t - prev.d.t;
      sample.evRate = Math.max(0, d.evictions - prev.d.evictions) / dt;
      sample.miss = {};
      const cur = d.miss_tokens_by_reason, old = prev.d.miss_tokens_by_reason;
      for (const r of new Set([...Object.keys(cur), ...Object.keys(old)])) {
        sample.miss[r] = Math.max(0, (cur[r] || 0) - (old[r] || 0)) / dt;
      }
    }
    history.push(sample);
    while (history.length && x - history[0].x > KEEP_S) history.shift();
  }

  // ------------------------------------------------------------------ charts
  /* series: {name, color, dashed, values: [[x, y|null], ...], latest: text}; stacked: areas. */
  function drawChart(figId, series, opt) {
    const fig = $(figId);
    const box = fig.querySelector(".chart");
    const W = Math.max(200, box.clientWidth), H = Math.max(100, box.clientHeight);
    const m = {l: 42, r: 10, t: 8, b: 18};
    const pw = W - m.l - m.r, ph = H - m.t - m.b;
    const now = history.length ? history[history.length - 1].x : Date.now() / 1000;
    // the window grows with the history, from one minute up to VIEW_S
    const span = Math.min(VIEW_S, Math.max(60, history.length ? now - history[0].x + POLL_MS / 1000 : 0));
    const x0 = now - span;
    const step = [10, 15, 30, 60, 120].find((st) => span / st <= 6) || 120;
    const visible = series.map((se) => se.values.filter(([x]) => x >= x0));
    let top = 0;
    if (opt.stacked) {
      const n = visible.length ? visible[0].length : 0;
      for (let i = 0; i < n; i++) {
        let sum = 0;
        for (const v of visible) if (v[i][1] !== null) sum += v[i][1];
        top = Math.max(top, sum);
      }
    } else {
      for (const v of visible) for (const [, y] of v) if (y !== null) top = Math.max(top, y);
    }
    const yMax = opt.yMax || niceMax(Math.max(top, opt.minTop || 0));
    const X = (x) => m.l + (x - x0) / span * pw;
    const Y = (y) => m.t + ph - Math.min(y, yMax) / yMax * ph;
    let points = 0;
    for (const v of visible) for (const [, y] of v) if (y !== null) points++;

    const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, "data-points": points,
                          role: "img", "aria-label": fig.querySelector("figcaption").textContent});
    for (let i = 0; i <= 4; i++) {
      const y = Y(yMax * i / 4);
      svg.append(s("line", {x1: m.l, x2: W - m.r, y1: y, y2: y, class: "gridline"}));
      const t = s("text", {x: m.l - 5, y: y + 3, "text-anchor": "end", class: "axis"});
      t.textContent = opt.fmt(yMax * i / 4);
      svg.append(t);
    }
    for (let ago = 0; ago <= span + 1e-6; ago += step) {
      const x = X(now - ago);
      const t = s("text", {x, y: H - 4, "text-anchor": ago === 0 ? "end" : x - m.l < 12 ? "start" : "middle",
                           class: "axis"});
      t.textContent = ago === 0 ? "now" : step < 60 ? `-${ago}s` : `-${ago / 60}m`;
      svg.append(t);
    }
    if (opt.stacked) {
      const n = visible.length ? visible[0].length : 0;
      const base = new Array(n).fill(0);
      visible.forEach((v, si) => {
        const topv = v.map(([, y], i) => y === null ? null : base[i] + y);
        let i = 0;
        while (i < n) {
          if (topv[i] === null) { i++; continue; }
          let j = i;
          while (j + 1 < n && topv[j + 1] !== null) j++;
          let dpath = "";
          for (let k = i; k <= j; k++) dpath += `${k === i ? "M" : "L"}${X(v[k][0]).toFixed(1)},${Y(topv[k]).toFixed(1)}`;
          if (j === i) dpath += `L${(X(v[i][0]) + 2).toFixed(1)},${Y(topv[i]).toFixed(1)}`;
          for (let k = j; k >= i; k--) dpath += `L${X(v[k][0]).toFixed(1)},${Y(base[k]).toFixed(1)}`;
          svg.append(s("path", {d: dpath + "Z", fill: series[si].color, "fill-opacity": 0.75,
                                stroke: series[si].color, "stroke-width": 1}));
          i = j + 1;
        }
        topv.forEach((t, k) => { if (t !== null) base[k] = t; });
      });
    } else {
      visible.forEach((v, si) => {
        const se = series[si];
        let dpath = "", pen = false;
        for (const [x, y] of v) {
          if (y === null) { pen = false; continue; }
          dpath += `${pen ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`;
          pen = true;
        }
        if (dpath) {
          svg.append(s("path", {d: dpath, fill: "none", stroke: se.color, "stroke-width": se.dashed ? 1.5 : 2,
                                "stroke-dasharray": se.dashed ? "5 3" : "none", "stroke-linejoin": "round"}));
        }
        // lone points (a value between two gaps) as dots
        v.forEach(([x, y], i) => {
          const before = i > 0 ? v[i - 1][1] : null, after = i + 1 < v.length ? v[i + 1][1] : null;
          if (y !== null && before === null && after === null) {
            svg.append(s("circle", {cx: X(x), cy: Y(y), r: 2.5, fill: se.color}));
          }
        });
      });
    }
    if (!points) {
      const t = s("text", {x: m.l + pw / 2, y: m.t + ph / 2, "text-anchor": "middle", class: "waiting"});
      t.textContent = opt.empty || "waiting for data…";
      svg.append(t);
    }
    box.replaceChildren(svg);
    const legend = fig.querySelector(".legend");
    legend.replaceChildren(...series.filter((se) => !se.hideLegend).map((se) => h("span", {class: "key"},
      h("span", {class: "sw" + (se.dashed ? " dashed" : ""), style: se.dashed ? {color: se.color} : {background: se.color}}),
      se.name, se.latest !== undefined ? " " : null, se.latest !== undefined ? h("b", {}, se.latest) : null)));
  }

  function drawCharts() {
    if (!last) return;
    const d = last;
    const pts = (f) => history.map((o) => [o.x, f(o)]);
    const lastVal = (f) => { for (let i = history.length - 1; i >= 0; i--) { const v = f(history[i]); if (v !== null) return v; } return null; };
    const hw = lastVal((o) => o.hitWindow);
    drawChart("chart-hit", [
      {name: `last ${HIT_WINDOW_S} s`, color: GREEN, values: pts((o) => o.hitWindow), latest: hw === null ? "–" : pct(hw)},
      {name: `last ${fmtInt(d.recent_window_requests)} requests`, color: GREY, dashed: true,
       values: pts((o) => o.d.recent_window_requests ? o.d.hit_rate_recent : null), latest: pct(d.hit_rate_recent)},
    ], {yMax: 1, fmt: (v) => (v * 100).toFixed(0) + "%", empty: "no prompt tokens yet"});
    drawChart("chart-kv", [
      {name: "in use", color: BLUE, values: pts((o) => o.d.kv_usage), latest: pct(d.kv_usage)},
      {name: "holding cached prefixes", color: GREEN, dashed: true,
       values: pts((o) => o.d.pool.cached / o.d.pool.total), latest: pct(d.pool.cached / d.pool.total)},
    ], {yMax: 1, fmt: (v) => (v * 100).toFixed(0) + "%"});
    drawChart("chart-evictions", [
      {name: "per poll", color: RED, values: pts((o) => o.evRate), latest: compact(lastVal((o) => o.evRate) || 0)},
      {name: "last minute (server)", color: GREY, dashed: true, values: pts((o) => o.d.evictions_per_second),
       latest: d.evictions_per_second.toFixed(2)},
    ], {fmt: compact, minTop: 1});
    const seen = new Set();
    for (const o of history) if (o.miss) for (const r of Object.keys(o.miss)) seen.add(r);
    for (const r of Object.keys(d.miss_tokens_by_reason)) seen.add(r);
    const reasons = REASONS.filter((r) => seen.has(r)).concat([...seen].filter((r) => !REASONS.includes(r)));
    drawChart("chart-miss", reasons.map((r) => ({
      name: r, color: REASON_COLORS[r] || "#475569",
      values: pts((o) => o.miss ? (o.miss[r] || 0) : null),
      latest: fmtInt(d.miss_tokens_by_reason[r] || 0),
    })), {stacked: true, fmt: compact, minTop: 1, empty: "no missed tokens yet"});
  }

  // ------------------------------------------------------------------ panels
  function drawTiles(d) {
    setText("meta", `${d.model} · block ${d.block_size} tokens · eviction ${d.eviction_policy}` +
                    (d.enabled ? "" : " · prefix caching OFF"));
    setText("v-requests", fmtInt(d.requests));
    setText("v-tokens", `${fmtInt(d.queries_tokens)} prompt tokens`);
    setText("v-hit-tokens", `${fmtInt(d.hit_tokens)} tokens from cache`);
    setText("v-hit-rate", pct(d.hit_rate));
    setText("v-hit-rate-recent", pct(d.hit_rate_recent));
    setText("v-recent-window", `last ${fmtInt(d.recent_window_requests)} requests`);
    setText("v-kv-usage", pct(d.kv_usage));
    setText("v-evictions", d.evictions_per_second.toFixed(2));
    setText("v-evictions-total", `last minute · ${fmtInt(d.evictions)} in all`);
    setText("v-blocks-cached", fmtInt(d.pool.cached));
    setText("v-blocks-sub", `of ${fmtInt(d.pool.total)} · ${fmtInt(d.pool.pinned)} pinned · ` +
                            `${fmtInt(d.written_blocks)} written`);
    setText("v-queue", `${d.running} · ${d.waiting}`);
    $("logout").hidden = !!d.open;
  }

  function drawCauses(d) {
    const items = d.top_miss_causes.map((c) => h("li", {"data-reason": c.reason}, c.summary,
      h("small", {}, ` (${fmtInt(c.tokens)} tokens)`)));
    $("causes").replaceChildren(...items);
    $("causes-empty").hidden = items.length > 0;
  }

  function drawPool(d) {
    const p = d.pool;
    const idle = Math.max(0, p.total - p.in_use - p.empty);
    const parts = [["in use", p.in_use, "var(--c-inuse)"], ["cached, evictable", idle, "var(--c-cached)"],
                   ["empty", p.empty, "var(--c-empty)"]];
    $("poolbar").replaceChildren(...parts.map(([name, n, color]) =>
      h("div", {title: `${name}: ${fmtInt(n)}`, style: {width: (100 * n / p.total) + "%", background: color}})));
    const rows = parts.map(([name, n, color]) => [name, n, color]).concat([
      ["findable by hash (cached)", p.cached, null], ["pinned", p.pinned, null]]);
    $("poollegend").replaceChildren(...rows.map(([name, n, color]) => h("li", {},
      h("span", {}, h("span", {class: "sw", style: {background: color || "transparent"}}), name),
      h("span", {class: "n", "data-pool": name}, `${fmtInt(n)}  (${(100 * n / p.total).toFixed(1)}%)`))));
    setText("pool-total", `${fmtInt(p.total)} blocks of ${d.block_size} tokens` +
            (d.bytes_per_token ? ` · K/V ${d.kv_cache_dtype}, ${fmtInt(d.bytes_per_token)} bytes/token` : ""));
  }

  function drawTiers(d) {
    const names = Object.keys(d.tiers);
    $("tiers").querySelector("tbody").replaceChildren(...names.map((name) => {
      const t = d.tiers[name];
      const errs = (t.errors || 0) + (t.timeouts || 0) + (t.corrupt || 0);
      return h("tr", {"data-tier": name},
        h("td", {title: t.url || ""}, name, " ", h("small", {}, t.kind || "")),
        h("td", {class: t.status === "ok" ? "ok" : "degraded", title: t.last_error || ""}, t.status || "?"),
        h("td", {class: "n"}, fmtInt(t.hit_tokens || 0)), h("td", {class: "n"}, fmtInt(t.misses || 0)),
        h("td", {class: "n"}, bytes(t.bytes_read)), h("td", {class: "n"}, bytes(t.bytes_written)),
        h("td", {class: "n"}, fmtInt(t.dropped_writes || 0)),
        h("td", {class: "n", title: `errors ${t.errors || 0}, timeouts ${t.timeouts || 0}, corrupt ${t.corrupt || 0}`},
          fmtInt(errs)));
    }));
    $("tiers").hidden = names.length === 0;
    $("tiers-empty").hidden = names.length > 0;
  }

  /* A hybrid pool: a row per KV group and the hits by hit kind; one group of every layer: a line. */
  function drawGroups(d) {
    const g = d.kv_groups;
    $("groups-body").hidden = !g.hybrid;
    $("groups-single").hidden = g.hybrid;
    if (!g.hybrid) {
      setText("groups-single", `One KV group: every layer's K/V (${fmtInt(g.num_layers)} layers) for every ` +
              "token. No sliding-window groups.");
      setText("groups-note", "");
      return;
    }
    const exact = (n) => `${fmtInt(n)} bytes`;
    $("groups").querySelector("tbody").replaceChildren(...g.groups.map((r) => h("tr", {"data-group": r.group},
      h("td", {}, String(r.group)),
      h("td", {}, r.kind),
      h("td", {class: "layers"}, r.layers),
      h("td", {class: "n", "data-bytes": r.bytes_in_use, title: exact(r.bytes_in_use)}, bytes(r.bytes_in_use)),
      h("td", {class: "n", "data-bytes": r.bytes_cached, title: exact(r.bytes_cached)}, bytes(r.bytes_cached)),
      h("td", {class: "n", title: `${fmtInt(r.pages_kept)} of ${fmtInt(r.pages_cached)} cached pages kept`},
        fmtInt(r.pages_kept)))));
    const kinds = Object.entries(g.hits_by_kind).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
    const item = (name, n, attrs) => h("li", {}, h("span", {}, name), h("span", {class: "n", ...attrs}, fmtInt(n)));
    $("group-hits").replaceChildren(...kinds.map(([kind, n]) => item(kind, n, {"data-kind": kind})));
    $("group-hits-empty").hidden = kinds.length > 0;
    $("group-extra").replaceChildren(
      item("resumed earlier (a window was gone)", g.resumed_earlier, {"data-figure": "resumed_earlier"}),
      item("interior blocks (evicted first)", g.blocks_interior, {"data-figure": "blocks_interior"}));
    setText("groups-note", `${g.groups.length} groups of ${fmtInt(g.num_layers)} layers · ` +
            `${bytes(g.page_bytes)} a page`);
  }

  function drawTenants(d) {
    $("tenants").querySelector("tbody").replaceChildren(...d.tenants.map((t) => h("tr", {"data-tenant": t.tenant},
      h("td", {}, tenantLabel(t.tenant)),
      h("td", {class: "n"}, fmtInt(t.requests)),
      h("td", {class: "n"}, fmtInt(t.queries_tokens)),
      h("td", {class: "rate"}, h("span", {class: "ratebar"}, h("span", {style: {width: (100 * t.hit_rate) + "%"}})),
        h("span", {class: "pct"}, pct(t.hit_rate))),
      h("td", {class: "n"}, pct(t.hit_rate_recent)),
      h("td", {class: "cause"}, t.top_miss_cause || "–"))));
    $("tenants").hidden = d.tenants.length === 0;
    $("tenants-empty").hidden = d.tenants.length > 0;
    setText("tenants-note", d.num_tenants > d.tenants.length ?
      `the ${d.tenants.length} most active of ${d.num_tenants}` : "hit rate of prompt tokens, per tenant");
  }

  function drawTree(d) {
    const nodes = d.prefix_tree;
    const byId = new Map(nodes.map((n) => [n.id, n]));
    const kids = new Map();
    const roots = [];
    for (const n of nodes) {
      if (n.parent && byId.has(n.parent)) {
        if (!kids.has(n.parent)) kids.set(n.parent, []);
        kids.get(n.parent).push(n);
      } else {
        roots.push(n);
      }
    }
    const byHits = (a, b) => b.hits - a.hits || a.depth - b.depth;
    const maxHits = Math.max(1, ...nodes.map((n) => n.hits));
    function row(n, skip) {
      // among siblings that share their opening, show where they differ
      const text = skip > 12 ? "\u2026" + n.excerpt.slice(skip - 8) : n.excerpt;
      return h("div", {class: "node" + (n.in_use ? " in-use" : ""), "data-hits": n.hits, "data-depth": n.depth,
                       title: `block ${n.depth} (key ${n.id}): ${n.hits} hits, prompt tokens 0–${n.tokens}` +
                              (n.in_use ? ", in use now" : "")},
        h("span", {class: "hits"}, h("span", {class: "bar", style: {width: (40 * n.hits / maxHits) + "px"}}),
          `${fmtInt(n.hits)}×`),
        h("span", {class: "pos"}, `#${n.depth} · ${n.tokens}`),
        h("span", {class: "excerpt"}, n.tenant ? h("span", {class: "tenant"}, tenantLabel(n.tenant)) : null,
          text));
    }
    // a chain without branches stays at one indentation; a branch point indents its children
    function chain(n, li, skip) {
      li.append(row(n, skip || 0));
      const ks = (kids.get(n.id) || []).sort(byHits);
      if (ks.length === 1) return chain(ks[0], li);
      if (ks.length > 1) {
        let common = ks[0].excerpt.length;
        for (const k of ks) {
          let i = 0;
          while (i < common && i < k.excerpt.length && k.excerpt[i] === ks[0].excerpt[i]) i++;
          common = i;
        }
        li.append(h("ul", {}, ...ks.map((k) => chain(k, h("li"), common))));
      }
      return li;
    }
    const list = h("ul", {}, ...roots.sort(byHits).map((r) => chain(r, h("li"))));
    $("tree").replaceChildren(list);
    $("tree").hidden = nodes.length === 0;
    $("tree-empty").hidden = nodes.length > 0;
  }

  function render(d) {
    drawTiles(d);
    drawCharts();
    drawCauses(d);
    drawPool(d);
    drawTiers(d);
    drawGroups(d);
    drawTenants(d);
    drawTree(d);
  }

  // ------------------------------------------------------------------ polling
  function setStatus(kind, text) {
    $("status-dot").className = "dot " + kind;
    setText("status-text", text);
  }

  async function poll() {
    if (stopped) return;
    try {
      const r = await fetch(BASE + "/data", {credentials: "same-origin", cache: "no-store"});
      if (r.status === 401 || r.status === 403) {
        stopped = true;
        setStatus("error", r.status === 401 ? "signed out: reload to sign in" : "not an admin key");
        return;
      }
      if (!r.ok) throw new Error("HTTP " + r.status);
      const d = await r.json();
      last = d;
      push(d);
      render(d);
      setStatus("live", "live · " + new Date().toLocaleTimeString("en-GB"));
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    } catch (e) {
      setStatus("error", "cannot reach the server: retrying");
    } finally {
      if (!stopped) setTimeout(poll, POLL_MS);
    }
  }

  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(drawCharts, 150);
  });
  poll();
})();
