// Drive Debian's chromium (playwright-core, no browser download) through the built book, served over
// HTTP by tests/test_browser.py. Prints one JSON report on stdout:
//   pages: for every page, console errors, requests that left the book's host, failed requests,
//          elements wider than the content column, and blocks that scroll sideways;
//   calcs: for each calculator case, whether Pyodide was fetched before the first change, the
//          seconds to the first live result and to a recompute, and the numbers shown.
import { chromium } from "playwright-core";

const [base, planFile] = process.argv.slice(2);
const plan = JSON.parse(await (await import("node:fs/promises")).readFile(planFile, "utf8"));
const host = new URL(base).host;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });

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

const report = { pages: {}, calcs: [] };
for (const path of plan.pages) {
  const page = await context.newPage();
  const seen = watch(page);
  await page.goto(base + path, { waitUntil: "networkidle" });
  await page.waitForTimeout(300);
  const layout = await page.evaluate(() => {
    const column = document.querySelector("article.bd-article") || document.querySelector("main");
    const right = column.getBoundingClientRect().right + 1;
    const wide = [], scrolls = [];
    const clipped = (el) => {  // inside a box that scrolls or clips: its own overflow is that box's business
      for (let a = el.parentElement; a && a !== column; a = a.parentElement) {
        if (getComputedStyle(a).overflowX !== "visible") return true;
      }
      return false;
    };
    const name = (el) => `${el.tagName.toLowerCase()}.${String(el.className).split(" ")[0]}: ${(el.textContent || "").trim().slice(0, 70)}`;
    for (const el of column.querySelectorAll("*")) {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > right && getComputedStyle(el).position !== "fixed" && !clipped(el)) wide.push(name(el));
      // outputs and formulas must fit the column (source code may scroll: it is code)
      const isOutput = el.matches(".cell_output *, .output *, .vramlab-calc *, mjx-container");
      const cs = getComputedStyle(el);
      if (isOutput && cs.overflowX !== "visible" && el.scrollWidth > el.clientWidth + 1 && el.clientWidth > 0) scrolls.push(name(el));
    }
    return { wide, scrolls };
  });
  report.pages[path] = { errors: seen.errors, external: seen.external, failed: seen.failed, ...layout };
  await page.close();
}

for (const c of plan.calcs) {
  const page = await context.newPage();
  const seen = watch(page);
  await page.goto(base + c.page, { waitUntil: "networkidle" });
  const root = `#vl-${c.calc}`;
  await page.waitForSelector(`${root}[data-state="snapshot"] [data-input]:not([disabled])`);
  const before = seen.urls.filter((u) => u.includes("pyodide")).length;
  const setValue = async (name, value) => {
    const sel = `${root} [data-input="${name}"]`;
    const tag = await page.$eval(sel, (el) => el.tagName.toLowerCase() + (el.dataset.logMin ? ":log" : ""));
    if (tag === "select") await page.selectOption(sel, String(value));
    else if (tag === "input:log") {
      await page.$eval(sel, (el, v) => {
        const lo = Number(el.dataset.logMin), hi = Number(el.dataset.logMax);
        el.value = String(Math.round(1000 * Math.log(v / lo) / Math.log(hi / lo)));
        el.dispatchEvent(new Event("input", { bubbles: true }));
      }, value);
    } else await page.fill(sel, String(value)).then(() => page.$eval(sel, (el) => el.dispatchEvent(new Event("change", { bubbles: true }))));
  };
  const values = async () => page.$$eval(`${root} [data-input]`, (els) => Object.fromEntries(els.map((el) => [el.dataset.input,
    el.dataset.logMin ? Number(el.dataset.logMin) * Math.pow(Number(el.dataset.logMax) / Number(el.dataset.logMin), Number(el.value) / 1000) : el.value])));
  const numbers = async () => page.$$eval(`${root} [data-key]`, (els) => Object.fromEntries(els.map((el) => [el.dataset.key, [el.dataset.value, el.textContent]])));
  const runs = [];
  for (const [i, change] of c.changes.entries()) {
    const old = await page.$eval(`${root} .vl-result`, (el) => el.innerHTML);
    const t0 = Date.now();
    for (const [name, value] of Object.entries(change)) await setValue(name, value);
    await page.waitForFunction(([r, o]) => {
      const el = document.querySelector(r);
      return el.dataset.state === "live" && !el.classList.contains("vl-busy") && el.querySelector(".vl-result").innerHTML !== o;
    }, [root, old], { timeout: 60000 });
    runs.push({ seconds: (Date.now() - t0) / 1000, values: await values(), numbers: await numbers(),
                status: await page.$eval(`${root} .vl-status`, (el) => el.textContent) });
  }
  report.calcs.push({ calc: c.calc, page: c.page, pyodideBeforeChange: before, runs, errors: seen.errors, external: seen.external });
  await page.close();
}
await browser.close();
console.log(JSON.stringify(report));
