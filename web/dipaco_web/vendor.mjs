// Run by `npm ci` (package.json's postinstall): copies the built browser files of the
// dashboard's npm dependencies into the app's static folder, so Django serves them like
// its own files and a wheel built afterwards ships them. The copies are ignored by git
// (static/dipaco_web/vendor/.gitignore): the lock file pins them, nothing is committed.
import { copyFileSync, mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const app = dirname(fileURLToPath(import.meta.url));
const root = join(app, "..", "..");
const target = join(app, "static", "dipaco_web", "vendor");

// [package file, name under static/dipaco_web/vendor/]
const files = [
  ["uplot/dist/uPlot.iife.min.js", "uPlot.iife.min.js"],
  ["uplot/dist/uPlot.min.css", "uPlot.min.css"],
  ["uplot/LICENSE", "uPlot.LICENSE"],
  ["htmx.org/dist/htmx.min.js", "htmx.min.js"],
  ["htmx.org/LICENSE", "htmx.LICENSE"],
];

mkdirSync(target, { recursive: true });
for (const [source, name] of files) {
  copyFileSync(join(root, "node_modules", source), join(target, name));
}
console.log(`dipaco dashboard: copied ${files.length} files into ${target}`);
