// The run page's charts: uPlot draws each <div data-chart="NAME"> from the JSON in
// <script id="run-charts">, and redraws whenever an htmx poll swaps in new JSON.
// The live uPlot objects are window.dipacoCharts[NAME] (the browser tests read them).
// A series with "lower" and "upper" (a path's loss one standard error either side) gets a
// band in its colour under its line; plot.dipacoBands counts the bands last drawn.
(function () {
  "use strict";

  // Tableau 10: distinct in colour and in lightness; the routed mean is black and dashed.
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                   "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
  const HEIGHT = 240;
  const charts = {};
  const shown = {}; // NAME -> the chart JSON its plot shows (the band hook reads it)
  window.dipacoCharts = charts;
  let drawn = null; // the JSON text last drawn: polls that bring nothing new redraw nothing

  function formatBytes(value) {
    if (value == null) return "—";
    const units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let i = 0;
    while (Math.abs(value) >= 1000 && i < units.length - 1) { value /= 1000; i++; }
    return Number(value.toPrecision(3)) + " " + units[i];
  }

  function formatNumber(value) {
    return value == null ? "—" : Number(value.toPrecision(4)).toString();
  }

  function colour(series, index) {
    return series.label === "routed mean" ? "#1b1b1b" : PALETTE[index % PALETTE.length];
  }

  function seriesOptions(series, index, unit) {
    const routed = series.label === "routed mean";
    return {
      label: series.label,
      stroke: colour(series, index),
      width: routed ? 2.5 : 1.5,
      dash: routed ? [6, 4] : undefined,
      spanGaps: true, // a path not evaluated in some round keeps one line
      points: { show: true, size: 5 },
      value: (u, v) => (unit === "bytes" ? formatBytes(v) : formatNumber(v)),
    };
  }

  // On a log axis, ticks and grid lines at powers of ten only.
  function decades(u, splits) {
    return splits.map((v) => (Math.abs(Math.log10(v) % 1) < 1e-9 ? v : null));
  }

  function yAxis(log, format) {
    const axis = { size: 64, values: (u, ticks) => ticks.map((v) => (v == null ? "" : format(v))) };
    if (log) {
      axis.filter = decades;
      axis.grid = { filter: decades };
      axis.ticks = { filter: decades };
    }
    return axis;
  }

  // A run with a dense phase 1: a vertical line between its last round and phase 2's first.
  function phaseBoundary(round) {
    return (u) => {
      const x = u.valToPos(round - 0.5, "x", true);
      if (x < u.bbox.left || x > u.bbox.left + u.bbox.width) return;
      const ctx = u.ctx;
      ctx.save();
      ctx.strokeStyle = "#6b6b6b";
      ctx.setLineDash([4, 4]);
      ctx.lineWidth = 1.5 * devicePixelRatio;
      ctx.beginPath();
      ctx.moveTo(x, u.bbox.top);
      ctx.lineTo(x, u.bbox.top + u.bbox.height);
      ctx.stroke();
      ctx.fillStyle = "#6b6b6b";
      ctx.font = `${11 * devicePixelRatio}px sans-serif`;
      ctx.fillText("phase 2 →", x + 4 * devicePixelRatio, u.bbox.top + 12 * devicePixelRatio);
      ctx.restore();
    };
  }

  // Each series' band: a polygon along its upper values and back along its lower ones,
  // over the rounds that have both (spanning the rounds between, as the line does); a
  // single point draws a bar. Drawn after the grid, before the lines (drawAxes).
  const drawBands = (name) => (u) => {
    const chart = shown[name];
    let bands = 0;
    if (!chart) return;
    const ctx = u.ctx;
    ctx.save();
    ctx.beginPath();
    ctx.rect(u.bbox.left, u.bbox.top, u.bbox.width, u.bbox.height);
    ctx.clip();
    chart.series.forEach((s, i) => {
      const line = u.series[i + 1];
      if (!s.lower || !s.upper || !line || !line.show) return;
      const at = [];
      chart.x.forEach((_, j) => {
        if (s.lower[j] != null && s.upper[j] != null) at.push(j);
      });
      if (!at.length) return;
      const px = (j) => u.valToPos(u.data[0][j], "x", true);
      const py = (v) => u.valToPos(v, "y", true);
      const half = 2 * devicePixelRatio;
      ctx.fillStyle = colour(s, i) + "33";
      ctx.beginPath();
      if (at.length === 1) {
        const j = at[0];
        ctx.rect(px(j) - half, py(s.upper[j]), 2 * half, py(s.lower[j]) - py(s.upper[j]));
      } else {
        at.forEach((j, k) => (k ? ctx.lineTo : ctx.moveTo).call(ctx, px(j), py(s.upper[j])));
        at.slice().reverse().forEach((j) => ctx.lineTo(px(j), py(s.lower[j])));
        ctx.closePath();
      }
      ctx.fill();
      bands++;
    });
    ctx.restore();
    u.dipacoBands = bands;
  };

  // A linear y range that holds the bands as well as the lines, with a margin.
  const withBands = (name) => (u, min, max) => {
    const chart = shown[name];
    (chart ? chart.series : []).forEach((s) => {
      [s.lower, s.upper].forEach((band) => (band || []).forEach((v) => {
        if (v != null) { min = Math.min(min, v); max = Math.max(max, v); }
      }));
    });
    if (min == null || max == null) return [min, max];
    const pad = (max - min) * 0.05 || Math.abs(max) * 0.05 || 1;
    return [min - pad, max + pad];
  };

  function options(box, chart) {
    const unit = box.dataset.unit;
    const positive = chart.series.every((s) => s.values.every((v) => v == null || v > 0));
    const log = unit === "bytes" && positive;
    const format = unit === "bytes" ? formatBytes : formatNumber;
    const banded = chart.series.some((s) => s.lower && s.upper);
    return {
      width: box.clientWidth,
      height: HEIGHT,
      scales: {
        x: { time: false },
        y: log ? { distr: 3 } : banded ? { range: withBands(box.dataset.chart) } : {},
      },
      axes: [
        { label: "outer round", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] },
        yAxis(log, format),
      ],
      series: [{ label: "round" }, ...chart.series.map((s, i) => seriesOptions(s, i, unit))],
      hooks: {
        drawAxes: [drawBands(box.dataset.chart)],
        ...(chart.phase_boundary == null ? {} : { draw: [phaseBoundary(chart.phase_boundary)] }),
      },
    };
  }

  function sameSeries(plot, chart) {
    const labels = plot.series.slice(1).map((s) => s.label);
    return labels.join("\n") === chart.series.map((s) => s.label).join("\n");
  }

  function draw() {
    const source = document.getElementById("run-charts");
    if (!source || source.textContent === drawn || typeof uPlot === "undefined") return;
    drawn = source.textContent;
    const all = JSON.parse(drawn);
    document.querySelectorAll("[data-chart]").forEach((box) => {
      const name = box.dataset.chart;
      const chart = all[name] || { x: [], series: [] };
      const data = [chart.x, ...chart.series.map((s) => s.values)];
      const plot = charts[name];
      if (plot && chart.x.length && sameSeries(plot, chart)) {
        shown[name] = chart;
        plot.setData(data);
        return;
      }
      if (plot) plot.destroy();
      delete charts[name];
      box.replaceChildren();
      box.classList.toggle("empty", !chart.x.length);
      if (!chart.x.length) {
        box.textContent = "No points yet: they appear as rounds are evaluated.";
        return;
      }
      shown[name] = chart;
      charts[name] = new uPlot(options(box, chart), data, box);
    });
  }

  function resize() {
    document.querySelectorAll("[data-chart]").forEach((box) => {
      const plot = charts[box.dataset.chart];
      if (plot) plot.setSize({ width: box.clientWidth, height: HEIGHT });
    });
  }

  // A button with data-confirm asks first (cancelling a run is final).
  document.addEventListener("submit", (event) => {
    const button = event.submitter;
    if (button && button.dataset.confirm && !window.confirm(button.dataset.confirm)) {
      event.preventDefault();
    }
  });
  // The prompt box shows refusals too (422, 429: their message says what to do).
  document.addEventListener("htmx:beforeSwap", (event) => {
    if (event.detail.target && event.detail.target.id === "generated" && event.detail.xhr.status >= 400) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:oobAfterSwap", draw);
  document.addEventListener("htmx:afterSettle", draw);
  let pending = null;
  window.addEventListener("resize", () => {
    clearTimeout(pending);
    pending = setTimeout(resize, 100);
  });
})();
