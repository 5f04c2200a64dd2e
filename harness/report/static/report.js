// The report page's script: mode switch, run pickers, ring, ZeRO and mesh widgets, lazy plotly charts.
(function () {
  "use strict";
  var FIGS = JSON.parse(document.getElementById("report-figures").textContent);
  var PALETTE = ["#4e79a7","#f28e2b","#59a14f","#e15759","#76b7b2","#edc948","#b07aa1","#ff9da7","#9c755f","#bab0ac"];

  function visible(el) { return !!(el.offsetWidth || el.offsetHeight || el.getClientRects().length); }
  function renderPlots(root) {
    (root || document).querySelectorAll(".plot[data-fig]").forEach(function (el) {
      if (el.dataset.rendered || !visible(el)) return;
      var fig = FIGS[el.dataset.fig];
      if (!fig) return;
      el.dataset.rendered = "1";
      // the toolbar only on hover, so it never covers a chart's title
      Plotly.newPlot(el, fig.data, fig.layout, {displaylogo: false, responsive: true, displayModeBar: "hover"});
    });
  }

  // -- the mode switch ----------------------------------------------------------------------------------
  var tabs = document.querySelectorAll("nav.modes button[data-mode]");
  function showMode(mode) {
    tabs.forEach(function (t) { t.setAttribute("aria-selected", t.dataset.mode === mode ? "true" : "false"); });
    document.querySelectorAll(".mode-section").forEach(function (s) { s.hidden = s.dataset.mode !== mode; });
    renderPlots(document.getElementById("mode-" + mode));
    if (history.replaceState) history.replaceState(null, "", "#" + mode);
  }
  tabs.forEach(function (t) { t.addEventListener("click", function () { showMode(t.dataset.mode); }); });

  // -- run pickers (a mode with several candidate configs) ------------------------------------------------
  document.querySelectorAll("select.run-select").forEach(function (sel) {
    sel.addEventListener("change", function () {
      var scope = sel.closest(".mode-section") || document;
      scope.querySelectorAll('.run-panel[data-mode="' + sel.dataset.mode + '"]').forEach(function (p) {
        p.hidden = p.dataset.index !== sel.value;
      });
      renderPlots(scope);
    });
  });

  // -- ring all-reduce step-through -----------------------------------------------------------------------
  document.querySelectorAll(".ring-widget").forEach(function (w) {
    var steps = JSON.parse(w.dataset.steps), n = parseInt(w.dataset.n, 10), id = w.id, k = 0, timer = null;
    var caption = w.querySelector(".ring-caption");
    function draw() {
      var st = steps[k];
      for (var i = 0; i < n; i++) for (var c = 0; c < n; c++) {
        var cell = document.getElementById(id + "-cell-" + i + "-" + c);
        var v = st.state[i][c];
        cell.setAttribute("fill-opacity", n > 1 ? (0.15 + 0.85 * (v - 1) / (n - 1)).toFixed(3) : "1");
        cell.setAttribute("stroke-width", v === n ? "1.6" : "0.4");
      }
      for (var e = 0; e < n; e++) {
        var edge = document.getElementById(id + "-edge-" + e), label = document.getElementById(id + "-edge-label-" + e);
        if (!edge) continue;
        edge.setAttribute("stroke", "#bbb"); edge.setAttribute("stroke-width", "2"); label.textContent = "";
      }
      st.sends.forEach(function (s) {
        var edge = document.getElementById(id + "-edge-" + s[0]), label = document.getElementById(id + "-edge-label-" + s[0]);
        if (!edge) return;
        edge.setAttribute("stroke", PALETTE[s[2] % 10]); edge.setAttribute("stroke-width", "4");
        label.textContent = "chunk " + s[2];
      });
      var total = n - 1, text;
      if (st.phase === "start") text = "start: every rank holds its own gradient, cut into " + n + " chunks of " + w.dataset.chunk + ".";
      else if (st.phase === "reduce-scatter") text = "reduce-scatter step " + (st.k + 1) + " of " + total +
        ": each rank sends one chunk (" + w.dataset.chunk + ") to its right neighbour, which adds it to its own.";
      else text = "all-gather step " + (st.k + 1) + " of " + total +
        ": each rank forwards a fully summed chunk (" + w.dataset.chunk + "); the receiver overwrites its copy.";
      if (k === steps.length - 1 && n > 1) text += " Done: every rank holds the sum of all " + n + " gradients.";
      caption.textContent = "[" + k + "/" + (steps.length - 1) + "] " + text;
      w.dataset.step = String(k);
    }
    function stop() { if (timer) { clearInterval(timer); timer = null; w.querySelector(".ring-play").textContent = "play"; } }
    w.querySelector(".ring-next").addEventListener("click", function () { stop(); k = Math.min(k + 1, steps.length - 1); draw(); });
    w.querySelector(".ring-prev").addEventListener("click", function () { stop(); k = Math.max(k - 1, 0); draw(); });
    w.querySelector(".ring-play").addEventListener("click", function () {
      if (timer) { stop(); return; }
      if (k === steps.length - 1) k = 0;
      this.textContent = "pause";
      timer = setInterval(function () { if (k >= steps.length - 1) { stop(); return; } k++; draw(); }, 900);
      draw();
    });
    draw();
  });

  // -- what ZeRO shards ---------------------------------------------------------------------------------
  document.querySelectorAll(".zero-widget").forEach(function (w) {
    w.querySelectorAll(".zero-btn").forEach(function (b) {
      b.addEventListener("click", function () {
        w.querySelectorAll(".zero-btn").forEach(function (x) { x.classList.toggle("active", x === b); });
        w.querySelectorAll(".zero-stage").forEach(function (g) { g.style.display = g.dataset.stage === b.dataset.stage ? "" : "none"; });
      });
    });
  });

  // -- device mesh: colour ranks by node or by their group on one axis ----------------------------------------
  document.querySelectorAll(".mesh-widget").forEach(function (w) {
    function colour(axis) {
      w.querySelectorAll(".mesh-rank").forEach(function (g) {
        var rect = g.querySelector("rect");
        var key = axis === "node" ? g.dataset.node : g.getAttribute("data-group-" + axis);
        if (axis === "node") rect.setAttribute("fill", parseInt(key, 10) % 2 ? "#e3e9f2" : "#f4f4f4");
        else rect.setAttribute("fill", key === null ? "#fff" : PALETTE[parseInt(key, 10) % 10]);
        rect.setAttribute("fill-opacity", axis === "node" ? "1" : "0.55");
      });
      w.dataset.axis = axis;
    }
    w.querySelectorAll(".mesh-btn").forEach(function (b) {
      b.addEventListener("click", function () {
        w.querySelectorAll(".mesh-btn").forEach(function (x) { x.classList.toggle("active", x === b); });
        colour(b.dataset.axis);
      });
    });
  });

  // the mode in the URL, else the one the page says fits the study best (most runs use its axis)
  var first = (location.hash || "").replace("#", "");
  var modes = Array.prototype.map.call(tabs, function (t) { return t.dataset.mode; });
  showMode(modes.indexOf(first) >= 0 ? first : document.body.dataset.defaultMode);
  renderPlots(document.getElementById("study-views"));
  document.body.dataset.ready = "1";
})();
