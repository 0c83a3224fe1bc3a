// pdserve dashboard: polls /dashboard/state every second and renders it. Plain JS, no libraries.
"use strict";
(function () {
  const POLL_MS = 1000;
  const LEVEL_NAMES = { primary: "primary pool (device)", secondary: "secondary pool (host)" };
  const PHASE_SOURCES = { router: "router", prefill: "context / aggregated servers", generation: "generation servers" };
  const $ = (id) => document.getElementById(id);

  const show = {
    int: (v) => (v == null ? "–" : String(Math.round(v))),
    num: (v, digits) => (v == null ? "–" : v.toFixed(digits)),
    pct: (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %"),
    secs: (v) => (v == null ? "–" : v < 1 ? (1000 * v).toFixed(1) + " ms" : v.toFixed(2) + " s"),
    bytesPerS: (v) => {
      if (v == null) return "–";
      const units = ["B/s", "kB/s", "MB/s", "GB/s"];
      let i = 0;
      while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
      return v.toFixed(i ? 2 : 0) + " " + units[i];
    },
  };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "style") node.style.cssText = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }

  function setText(id, text) {
    const node = $(id);
    if (node && node.textContent !== text) node.textContent = text;
  }

  function health(server) {
    if (server.healthy) return "ok";
    return server.status === "draining" ? "draining" : "down";
  }

  function renderTiles(d) {
    setText("rps", show.num(d.requests_per_s, 2));
    setText("requests-total", show.int(d.requests));
    setText("requests-errors", show.int(d.errors));
    for (const name of ["ttft", "tpot"]) {
      for (const p of ["p50", "p90", "p99"]) setText(`${name}-${p}`, show.secs(d[name][p]));
      setText(`${name}-count`, show.int(d[name].count));
    }
    setText("prefix-hit", show.pct(d.prefix_hit_rate));
    setText("offload-rate", show.num(d.offload_per_s, 1));
    setText("onboard-rate", show.num(d.onboard_per_s, 1));
    setText("xfer-count", show.int(d.transfers.count));
    setText("xfer-rate", show.num(d.transfers.per_s, 2));
    setText("xfer-bw", show.bytesPerS(d.transfers.bytes_per_s));
    setText("xfer-failures", show.int(d.transfers.failures));
    setText("xfer-expired", show.int(d.transfers.lease_expired));
    setText("spec-accept", show.pct(d.speculation.acceptance_rate));
    setText("spec-tokens-per-step", show.num(d.speculation.tokens_per_step, 2));
    setText("spec-drafts", show.num(d.speculation.drafts_per_s, 1));
    document.querySelectorAll(".window-s").forEach((n) => { n.textContent = String(d.window_s); });
    document.querySelectorAll(".rate-s").forEach((n) => { n.textContent = String(d.rate_s); });
  }

  function serverRow(s) {
    const req = s.requests || {};
    const status = el("td", { class: "status" }, s.status);
    if (s.last_error) status.append(el("div", { class: "error" }, s.last_error));
    if (s.stale && s.scraped_s_ago != null) status.append(el("div", { class: "muted" }, `figures from ${s.scraped_s_ago} s ago`));
    const xfer = s.transfers;
    return el("tr", { class: "server", "data-url": s.url, "data-role": s.role, "data-health": health(s),
                      "data-stale": String(s.stale) },
      el("td", {}, el("span", { class: "dot", title: health(s) })),
      el("td", { class: "role" }, s.role),
      el("td", { class: "url" }, s.url),
      status,
      el("td", { class: "epoch", title: s.epoch }, s.epoch ? s.epoch.slice(0, 8) : "–"),
      el("td", { class: "restarts" }, show.int(s.restarts)),
      el("td", { class: "running" }, show.int(req.running)),
      el("td", { class: "waiting" }, show.int(req.waiting)),
      el("td", { class: "transferring" }, show.int(req.transferring)),
      el("td", { class: "in-flight" }, show.int(s.in_flight)),
      el("td", { class: "tokens-per-s" }, show.num(s.tokens_per_s, 1)),
      el("td", { class: "ttft" }, s.ttft ? show.secs(s.ttft.p50) : "–"),
      el("td", { class: "tpot" }, s.tpot ? show.secs(s.tpot.p50) : "–"),
      el("td", { class: "prefix-hit" }, show.pct(s.prefix_hit_rate)),
      el("td", { class: "spec-accept" }, s.speculation ? show.pct(s.speculation.acceptance_rate) : "–"),
      el("td", { class: "transfers" }, xfer ? `${xfer.count} (${xfer.failures} failed)` : "–"));
  }

  function phaseRow(p) {
    return el("tr", { class: "phase", "data-phase": p.name },
      el("td", { class: "name" }, p.name.replace(/_/g, " ")),
      el("td", { class: "source muted" }, PHASE_SOURCES[p.source] || p.source),
      el("td", { class: "p50" }, show.secs(p.p50)),
      el("td", { class: "mean" }, show.secs(p.mean)),
      el("td", { class: "count" }, show.int(p.count)));
  }

  function poolBar(bar) {
    const width = (n) => (bar.total ? (100 * n) / bar.total : 0).toFixed(2) + "%";
    return el("div", { class: "bar-row" },
      el("div", { class: "bar-label" },
        el("span", {}, `window ${bar.window} · ${LEVEL_NAMES[bar.level] || bar.level}`),
        el("span", {}, `in use ${bar.in_use} · cached ${bar.cached} · free ${bar.free} of ${bar.total} blocks`)),
      el("div", { class: "bar", "data-window": bar.window, "data-level": bar.level },
        el("span", { class: "seg in_use", style: `width:${width(bar.in_use)}`, title: `in use ${bar.in_use}` }),
        el("span", { class: "seg cached", style: `width:${width(bar.cached)}`, title: `cached ${bar.cached}` }),
        el("span", { class: "seg free", style: `width:${width(bar.free)}`, title: `free ${bar.free}` })));
  }

  function poolCard(s) {
    const card = el("div", { class: "pool", "data-url": s.url, "data-health": health(s) },
      el("h3", {}, `${s.role} · ${s.url}`));
    if (!s.pool || !s.pool.length) card.append(el("div", { class: "muted" }, "no KV pool figures yet"));
    else s.pool.forEach((bar) => card.append(poolBar(bar)));
    return card;
  }

  function expertLayer(l) {
    const top = Math.max(...l.tokens, 1);
    const sum = l.tokens.reduce((a, b) => a + b, 0);
    const bars = el("div", { class: "expert-bars" }, ...l.tokens.map((n, e) => el("span", {
      class: "expert" + (e === l.hottest && sum > 0 ? " hottest" : ""), "data-expert": e, "data-tokens": n,
      style: `height:${((100 * n) / top).toFixed(1)}%`, title: `expert ${e}: ${n} tokens` })));
    return el("div", { class: "layer", "data-layer": l.layer },
      el("div", { class: "layer-label" },
        el("span", {}, `layer ${l.layer} · ${l.tokens.length} experts`),
        el("span", { class: "load" }, `${sum} tokens · max / mean ${show.num(l.imbalance, 2)}` +
          (l.imbalance == null ? "" : ` (expert ${l.hottest})`))),
      bars);
  }

  function expertCard(s) {
    return el("div", { class: "experts", "data-url": s.url, "data-health": health(s) },
      el("h3", {}, `${s.role} · ${s.url}`), ...s.experts.map(expertLayer));
  }

  function renderExperts(servers) {
    const moe = servers.filter((s) => s.experts && s.experts.length);
    $("experts-section").hidden = moe.length === 0;
    $("experts").replaceChildren(...moe.map(expertCard));
  }

  function render(state) {
    const d = state.deployment;
    renderTiles(d);
    document.querySelector("#servers tbody").replaceChildren(...state.servers.map(serverRow));
    document.querySelector("#phases tbody").replaceChildren(...d.phases.map(phaseRow));
    $("pools").replaceChildren(...state.servers.map(poolCard));
    renderExperts(state.servers);
    const overall = $("overall");
    const ok = d.healthy === d.servers;
    overall.textContent = `${d.healthy} of ${d.servers} servers healthy`;
    overall.className = "pill " + (ok ? "ok" : "degraded");
  }

  async function poll() {
    try {
      const response = await fetch("/dashboard/state", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      setText("updated", "updated " + new Date().toLocaleTimeString());
    } catch (err) {
      const overall = $("overall");
      overall.textContent = `router unreachable (${err.message})`;
      overall.className = "pill offline";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }

  poll();
})();
