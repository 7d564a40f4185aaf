// Drive Debian's chromium (playwright-core, no browser download) through the built book, served over
// HTTP by tests/test_browser.py or benchmarks/page_speed.py. Prints one JSON report on stdout:
//   pages: for every page at every width of the plan (1280 and 390 px: a laptop and a phone), console
//          errors, requests that left the book's host, failed requests, whether the page scrolls
//          sideways, elements wider than the content column or the viewport (outside a box that
//          scrolls), blocks that scroll sideways that should wrap, SVG text rendered under 9 px,
//          output images shown below the scale that keeps 9 pt text at 110 dpi >= 9 px, and calculator
//          text under 9 px;
//   calcs: for each calculator case (tests/browser/cases.json), whether Pyodide was fetched before the
//          first change, the seconds to the first live result and to each recompute, the numbers shown
//          and the status; for a refused input, the state, status, error and marked controls it left,
//          and whether the next valid change made it live again. A file input's change is a file set on it
//          ({name, mimeType, base64 | text}; playwright's setInputFiles, or with drop: true a DataTransfer dropped on the
//          calculator), its value the data URL the page read.
// Screenshots of the plan's `shots` pages at each width go to plan.screenshots (when set).
import { chromium } from "playwright-core";
import { mkdir, readFile } from "node:fs/promises";

const [base, planFile] = process.argv.slice(2);
const plan = JSON.parse(await readFile(planFile, "utf8"));
const host = new URL(base).host;
const widths = plan.widths || [1280, 390];
const MIN_PX = 9;
const MIN_IMAGE_SCALE = MIN_PX / (9 * 110 / 72);  // matplotlib's 9 pt at 110 dpi: 13.75 px natural -> 0.655
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const contexts = {};
for (const w of widths) {
  contexts[w] = await browser.newContext({ viewport: { width: w, height: w < 600 ? 844 : 900 },
                                           deviceScaleFactor: 1, isMobile: false, hasTouch: w < 600 });
}

function watch(page) {
  const seen = { errors: [], external: [], failed: [], urls: [] };
  page.on("console", (m) => { if (m.type() === "error") seen.errors.push(m.text()); });
  page.on("pageerror", (e) => seen.errors.push(String(e)));
  page.on("request", (r) => {
    const u = new URL(r.url());
    seen.urls.push(r.url());
    if (!["data:", "blob:", "about:"].includes(u.protocol) && u.host !== host) seen.external.push(r.url());
  });
  page.on("requestfailed", (r) => seen.failed.push(`${r.failure()?.errorText} ${r.url()}`));
  page.on("response", (r) => { if (r.status() >= 400) seen.failed.push(`${r.status()} ${r.url()}`); });
  return seen;
}

// runs in the page: the layout and legibility checks
function inspect([MIN_PX, MIN_IMAGE_SCALE]) {
  const column = document.querySelector("article.bd-article") || document.querySelector("main") || document.body;
  const right = Math.min(column.getBoundingClientRect().right, window.innerWidth) + 1;
  const out = { overflow: [], wide: [], scrolls: [], smallText: [], smallImages: [], smallCalcText: [] };
  const doc = document.scrollingElement || document.documentElement;
  if (doc.scrollWidth > window.innerWidth + 1) out.overflow.push(`the page is ${doc.scrollWidth} px wide in a ${window.innerWidth} px window`);
  const name = (el) => `${el.tagName.toLowerCase()}.${String(el.className?.baseVal ?? el.className).split(" ")[0]}: ${(el.textContent || "").trim().replace(/\s+/g, " ").slice(0, 70)}`;
  const inScroller = (el) => {  // inside a box that scrolls or clips: its own overflow is that box's business
    for (let a = el.parentElement; a && a !== column; a = a.parentElement) {
      if (getComputedStyle(a).overflowX !== "visible") return true;
    }
    return false;
  };
  const shown = (el) => {
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0 && el.checkVisibility?.({ visibilityProperty: true }) !== false;
  };
  // a box may scroll sideways when what it holds is a formula, a figure, an image, a table or source code
  const mayScroll = (el) => el.matches("mjx-container, mjx-container *, span.math, .vl-figure, .vl-chart, .vl-table-wrap, table, .pst-scrollable-table-container, "
    + ".highlight pre, .highlight, div[class*='highlight'], .cell_input *") || (el.matches(".cell_output") && el.querySelector("img"));
  for (const el of column.querySelectorAll("*")) {
    if (!shown(el)) continue;
    const cs = getComputedStyle(el);
    const r = el.getBoundingClientRect();
    if (r.right > right && cs.position !== "fixed" && !inScroller(el)) out.wide.push(`${name(el)} (right edge ${Math.round(r.right)} px > ${Math.round(right)})`);
    if (cs.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1 && el.clientWidth > 0 && !mayScroll(el)) out.scrolls.push(name(el));
  }
  // SVG text: its font size times the scale the SVG is drawn at (getScreenCTM: viewBox and transforms)
  for (const t of column.querySelectorAll("svg text")) {
    if (!shown(t) || !t.textContent.trim()) continue;
    const m = t.getScreenCTM();
    const px = parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b);
    if (px < MIN_PX - 0.05) out.smallText.push(`${px.toFixed(1)} px: ${t.textContent.trim().slice(0, 40)}`);
  }
  // output images (matplotlib PNGs): rendered width / natural width
  for (const img of column.querySelectorAll(".cell_output img, .output img")) {
    if (!img.naturalWidth || !shown(img)) continue;
    const scale = img.getBoundingClientRect().width / img.naturalWidth;
    if (scale < MIN_IMAGE_SCALE - 0.005) out.smallImages.push(`${scale.toFixed(2)} of ${img.naturalWidth} px: ${img.getAttribute("src")}`);
  }
  // calculators' own text (controls, numbers, status, result text)
  for (const el of column.querySelectorAll(".vramlab-calc *")) {
    if (el.closest("svg") || !shown(el)) continue;
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    const px = parseFloat(getComputedStyle(el).fontSize);
    if (own && px < MIN_PX - 0.05) out.smallCalcText.push(`${px.toFixed(1)} px: ${name(el)}`);
  }
  for (const k of Object.keys(out)) out[k] = [...new Set(out[k])].slice(0, 25);
  return out;
}

const report = { widths, pages: {}, calcs: [], screenshots: [] };
if (plan.screenshots) await mkdir(plan.screenshots, { recursive: true });
for (const w of widths) {
  for (const path of plan.pages) {
    const page = await contexts[w].newPage();
    const seen = watch(page);
    await page.goto(base + path, { waitUntil: "networkidle" });
    await page.waitForTimeout(300);  // MathJax typesets after load
    const layout = await page.evaluate(inspect, [MIN_PX, MIN_IMAGE_SCALE]);
    report.pages[`${path} @${w}`] = { errors: seen.errors, external: seen.external, failed: seen.failed, ...layout };
    if (plan.screenshots && (plan.shots || []).includes(path)) {
      const file = `${plan.screenshots}/${path.replace(/[/.]/g, "_")}-${w}.png`;
      // a full page of chapter 1 (40,000 px tall) takes ~30 s to paint without a GPU: a picture, not a speed check
      await page.screenshot({ path: file, fullPage: true, timeout: 300000 });
      report.screenshots.push(file);
    }
    await page.close();
  }
}

const context = contexts[widths[0]];
for (const c of plan.calcs) {
  const page = await context.newPage();
  const seen = watch(page);
  await page.goto(base + c.page, { waitUntil: "networkidle" });
  const root = `#vl-${c.calc}`;
  await page.waitForSelector(`${root}[data-state="snapshot"] [data-input]:not([disabled])`);
  const before = seen.urls.filter((u) => u.includes("pyodide")).length;
  const setValue = async (name, value) => {
    const sel = `${root} [data-input="${name}"]`;
    const tag = await page.$eval(sel, (el) => el.tagName.toLowerCase() + (el.dataset.logMin ? ":log" : "") + (el.type === "file" ? ":file" : ""));
    if (tag === "input:file") {  // {name, mimeType, base64 | text}, or a data URL read back by values()
      const file = typeof value === "string"
        ? { name: "file", mimeType: "application/octet-stream", buffer: Buffer.from(value.slice(value.indexOf(",") + 1), "base64") }
        : { name: value.name, mimeType: value.mimeType || "application/octet-stream",
            buffer: value.text !== undefined ? Buffer.from(value.text, "utf8") : Buffer.from(value.base64, "base64") };
      if (value.drop) {  // dropped on the calculator, as a reader drags a file from their desktop
        await page.$eval(root, (el, [b64, name, type]) => {
          const bytes = Uint8Array.from(atob(b64), (ch) => ch.charCodeAt(0));
          const dt = new DataTransfer();
          dt.items.add(new File([bytes], name, { type }));
          for (const kind of ["dragenter", "dragover", "drop"]) el.dispatchEvent(new DragEvent(kind, { dataTransfer: dt, bubbles: true, cancelable: true }));
        }, [file.buffer.toString("base64"), file.name, file.mimeType]);
      } else await page.setInputFiles(sel, file);  // fires "change": live.mjs reads it with FileReader
    } else if (tag === "select") await page.selectOption(sel, String(value));
    else if (tag === "input:log") {
      await page.$eval(sel, (el, v) => {
        const lo = Number(el.dataset.logMin), hi = Number(el.dataset.logMax);
        el.value = String(Math.round(1000 * Math.log(v / lo) / Math.log(hi / lo)));
        el.dispatchEvent(new Event("input", { bubbles: true }));
      }, value);
    } else await page.fill(sel, String(value)).then(() => page.$eval(sel, (el) => el.dispatchEvent(new Event("change", { bubbles: true }))));
  };
  const values = async () => page.$$eval(`${root} [data-input]`, (els) => Object.fromEntries(els.map((el) => [el.dataset.input,
    el.type === "file" ? el.dataset.file : el.dataset.logMin ? Number(el.dataset.logMin) * Math.pow(Number(el.dataset.logMax) / Number(el.dataset.logMin), Number(el.value) / 1000) : el.value])));
  const numbers = async () => page.$$eval(`${root} [data-key]`, (els) => Object.fromEntries(els.map((el) => [el.dataset.key, [el.dataset.value, el.textContent]])));
  const state = async () => page.$eval(root, (el) => ({
    state: el.dataset.state, status: el.querySelector(".vl-status").textContent,
    error: el.querySelector(".vl-result .vl-error")?.textContent ?? "",
    invalid: [...el.querySelectorAll('[aria-invalid="true"]')].map((x) => x.dataset.input),
    statusColor: getComputedStyle(el.querySelector(".vl-status")).color,
  }));
  // apply a change and wait until the calculator settles in `want` (live, or error) with a new result
  const apply = async (change, want) => {
    const old = await page.$eval(`${root} .vl-result`, (el) => el.innerHTML);
    const files = await page.$$eval(`${root} input[type="file"][data-input]`, (els) => Object.fromEntries(els.map((el) => [el.dataset.input, el.dataset.file])));
    const t0 = performance.now();
    for (const [name, value] of Object.entries(change)) await setValue(name, value);
    // a file is read by FileReader before its recompute starts: on a busy machine a result of the inputs before it
    // can land first, so wait until the page holds the new file (its recompute starts in the same task)
    for (const name of Object.keys(change).filter((n) => n in files)) {
      await page.waitForFunction(([sel, was]) => document.querySelector(sel).dataset.file !== was,
        [`${root} [data-input="${name}"]`, files[name]], { timeout: 120000 });
    }
    await page.waitForFunction(([r, o, s]) => {
      const el = document.querySelector(r);
      return el.dataset.state === s && !el.classList.contains("vl-busy") && el.querySelector(".vl-result").innerHTML !== o;
    }, [root, old, want], { timeout: 120000 });
    return (performance.now() - t0) / 1000;
  };
  const runs = [];
  let undo = {};  // the last change's controls as they were before it
  for (const change of c.changes) {
    const now = await values();
    undo = Object.fromEntries(Object.keys(change).map((k) => [k, now[k]]));
    const seconds = await apply(change, "live");
    runs.push({ seconds, values: await values(), numbers: await numbers(), ...(await state()) });
  }
  const last = c.changes[c.changes.length - 1];
  const entry = { calc: c.calc, page: c.page, pyodideBeforeChange: before, runs };
  if (c.bad) {
    await apply(c.bad, "error");
    entry.bad = { values: await values(), ...(await state()) };
    await apply(c.fix, "live");
    entry.fixed = { values: await values(), numbers: await numbers(), ...(await state()) };
  }
  if (c.repeats) {  // benchmarks/page_speed.py: more recomputes to time, undoing and redoing the last change
    if (c.bad) await apply(last, "live");  // after the refused input and its fix: back to the last change's state
    entry.recomputes = [];
    for (let i = 0; i < c.repeats; i++) entry.recomputes.push(await apply(i % 2 ? last : undo, "live"));
  }
  entry.errors = seen.errors;
  entry.external = seen.external;
  report.calcs.push(entry);
  await page.close();
}
await browser.close();
console.log(JSON.stringify(report));
