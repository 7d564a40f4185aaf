// The book's live calculators. Every .vramlab-calc block arrives as a snapshot computed when the
// page was built, with its controls disabled. This module enables them; the first change starts a
// Web Worker that loads Python (Pyodide, served from this book) and vramlab, and from then on each
// change is recomputed by the same Python function that drew the snapshot. Nothing is fetched until
// a reader changes a control.
const calcs = [...document.querySelectorAll(".vramlab-calc")];
let worker = null;
let ready = null;
let nextId = 0;
const pending = new Map();

function setStatus(calc, state, text) {
  calc.dataset.state = state;
  calc.querySelector(".vl-status").textContent = text;
}

function logValue(el) {  // the slider's position 0..1000 -> a value between data-log-min and data-log-max
  const lo = Number(el.dataset.logMin), hi = Number(el.dataset.logMax);
  return lo * Math.pow(hi / lo, Number(el.value) / 1000);
}

function values(calc) {
  const v = {};
  for (const el of calc.querySelectorAll("[data-input]")) {
    v[el.dataset.input] = el.type === "file" ? el.dataset.file : el.dataset.logMin ? logValue(el) : el.value;
  }
  return v;
}

// A file input (a memory snapshot): read here with FileReader, sent to the worker as a data URL in the
// values; nothing leaves the page. Dropping a file anywhere on the calculator sets it.
function readFile(calc, el) {
  const file = el.files && el.files[0];
  const name = el.parentElement.querySelector(".vl-file-name");
  if (!file) { el.dataset.file = ""; if (name) name.textContent = "the built-in example"; recompute(calc); return; }
  const reader = new FileReader();
  reader.addEventListener("load", () => {
    el.dataset.file = String(reader.result);  // "data:<type>;base64,<data>" ("data:" for an empty file)
    if (name) name.textContent = `${file.name} (${file.size.toLocaleString()} B, read in this page, not uploaded)`;
    recompute(calc);
  });
  reader.addEventListener("error", () => {
    const msg = `snapshot file: this page could not read ${file.name}`;
    calc.querySelector(".vl-result").innerHTML = `<p class="vl-error" role="alert">${msg.replace(/[&<>"]/g, (c) => `&#${c.charCodeAt(0)};`)}</p>`;
    setStatus(calc, "error", "error: nothing computed for these inputs (fix the marked control)");
    el.setAttribute("aria-invalid", "true");
  });
  reader.readAsDataURL(file);
}

function dropTarget(calc, el) {
  calc.addEventListener("dragover", (ev) => { ev.preventDefault(); calc.classList.add("vl-drop"); });
  calc.addEventListener("dragleave", () => calc.classList.remove("vl-drop"));
  calc.addEventListener("drop", (ev) => {
    ev.preventDefault();
    calc.classList.remove("vl-drop");
    if (!ev.dataTransfer || !ev.dataTransfer.files.length || el.disabled) return;
    el.files = ev.dataTransfer.files;
    readFile(calc, el);
  });
}

function startWorker() {
  if (ready) return ready;
  worker = new Worker(new URL("./live-worker.mjs", import.meta.url), { type: "module" });
  ready = new Promise((resolve, reject) => {
    worker.addEventListener("message", (ev) => {
      const m = ev.data;
      if (m.type === "ready") resolve(m);
      else if (m.type === "failed") reject(new Error(m.error));
      else if (m.type === "result" && pending.has(m.id)) { pending.get(m.id)(m); pending.delete(m.id); }
    });
    worker.addEventListener("error", (e) => reject(new Error(e.message || "the worker did not start")));
  });
  return ready;
}

function restore(calc) {  // Python could not start: controls back to the snapshot's values, disabled
  for (const el of calc.querySelectorAll("[data-input]")) {
    if (el.type === "file") { el.value = ""; el.dataset.file = ""; } else el.value = el.dataset.snapshot;
    el.disabled = true;
  }
  for (const out of calc.querySelectorAll("output")) out.textContent = out.dataset.snapshot;
}

async function recompute(calc) {
  const id = ++nextId;
  calc.dataset.want = String(id);
  if (!worker) setStatus(calc, "loading", "loading Python into this page (once; a few seconds)…");
  let info;
  try {
    info = await startWorker();
  } catch (e) {
    restore(calc);
    setStatus(calc, "failed", `snapshot: Python could not start in this page (${e.message})`);
    return;
  }
  calc.classList.add("vl-busy");
  const m = await new Promise((resolve) => {
    pending.set(id, resolve);
    worker.postMessage({ id, name: calc.dataset.calc, values: values(calc) });
  });
  if (calc.dataset.want !== String(id)) return;  // a newer change is on its way
  calc.classList.remove("vl-busy");
  calc.querySelector(".vl-result").innerHTML = m.html;
  const invalid = new Set(m.invalid || []);
  for (const el of calc.querySelectorAll("[data-input]")) {
    if (invalid.has(el.dataset.input)) el.setAttribute("aria-invalid", "true");
    else el.removeAttribute("aria-invalid");
  }
  if (m.error) {  // refused inputs: nothing was computed, and the status says so (never "live" beside an error)
    setStatus(calc, "error", `error: nothing computed for these inputs (${invalid.size ? "fix the marked control" : "see below"})`);
  } else {
    setStatus(calc, "live", `live: computed in this page by vramlab ${info.version} (Python ${info.python}) in ${m.ms.toFixed(1)} ms`);
  }
}

for (const calc of calcs) {
  let timer = null;  // a slider fires many input events while dragged: recompute when it pauses for 30 ms
  const later = () => { clearTimeout(timer); timer = setTimeout(() => recompute(calc), 30); };
  for (const el of calc.querySelectorAll("[data-input]")) {
    el.dataset.snapshot = el.value;
    el.disabled = false;
    const out = el.parentElement.querySelector("output");
    if (el.type === "file") {
      el.dataset.file = "";
      el.addEventListener("change", () => readFile(calc, el));
      dropTarget(calc, el);
    } else if (out) {
      out.dataset.snapshot = out.textContent;
      el.addEventListener("input", () => { out.textContent = logValue(el).toPrecision(4).replace(/\.?0+(e|$)/, "$1"); later(); });
    } else {
      el.addEventListener("change", () => recompute(calc));
    }
  }
  setStatus(calc, "snapshot", "snapshot: computed when this page was built; change a control to compute in this page");
}

// Figures (matplotlib PNGs in the cells' outputs, 9 pt text at 110 dpi): on a narrow screen an image
// is never shown below MIN_SCALE of its natural width, where its text would drop under 9 px; its
// output box scrolls sideways instead (book.css). 9 px / (9 pt * 110 / 72) = 0.655.
const MIN_SCALE = 0.66;
function legible(img) {
  if (img.naturalWidth) img.style.minWidth = `${Math.ceil(MIN_SCALE * img.naturalWidth)}px`;
}
for (const img of document.querySelectorAll(".cell_output img")) {
  if (img.complete) legible(img);
  else img.addEventListener("load", () => legible(img), { once: true });
}
