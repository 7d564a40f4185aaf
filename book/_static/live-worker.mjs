// Python in a Web Worker, so that loading it never freezes the page: Pyodide from this book's own
// files (no CDN), then vramlab's pure-Python calculators from the archive the build wrote.
import { loadPyodide } from "./vendor/pyodide/pyodide.mjs";

let runHtml = null;

async function init() {
  const base = new URL("./", import.meta.url);
  const t0 = performance.now();
  const py = await loadPyodide({ indexURL: new URL("vendor/pyodide/", base).href });
  const manifest = await (await fetch(new URL("vramlab-live.json", base))).json();
  const archive = await (await fetch(new URL(manifest.archive, base))).arrayBuffer();
  py.unpackArchive(archive, "zip", { extractDir: "/home/pyodide/vramlab-live" });
  py.runPython("import sys; sys.path.insert(0, '/home/pyodide/vramlab-live')");
  runHtml = py.pyimport("vramlab.present.calculators").run_html;
  const python = py.runPython("import sys; '.'.join(map(str, sys.version_info[:3]))");
  postMessage({ type: "ready", ms: performance.now() - t0, version: manifest.version, python });
}

const started = init().catch((e) => postMessage({ type: "failed", error: String(e && e.message || e) }));

onmessage = async (ev) => {
  await started;
  const { id, name, values } = ev.data;
  const t0 = performance.now();
  let out;
  try {
    out = JSON.parse(runHtml(name, JSON.stringify(values)));
  } catch (e) {
    const text = String(e).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
    out = { html: `<p class="vl-error" role="alert">${text}</p>`, error: String(e), invalid: [], numbers: {} };
  }
  postMessage({ type: "result", id, ms: performance.now() - t0, ...out });
};
