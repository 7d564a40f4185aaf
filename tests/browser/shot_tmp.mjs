import { chromium } from "playwright-core";
const [url, id, out] = process.argv.slice(2);
const b = await chromium.launch({ executablePath: "/usr/bin/chromium", args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking"] });
for (const w of [1280, 390]) {
  const p = await b.newPage({ viewport: { width: w, height: 900 } });
  await p.goto(url, { waitUntil: "networkidle" });
  const y = await p.$eval(`#${id}`, (el) => el.getBoundingClientRect().top + window.scrollY);
  await p.screenshot({ path: `${out}-${w}.png`, clip: { x: 0, y, width: w, height: 3200 }, fullPage: true });
  const wide = await p.evaluate(() => document.documentElement.scrollWidth > window.innerWidth);
  console.log(w, "scrolls sideways:", wide);
}
await b.close();
