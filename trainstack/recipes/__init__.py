"""Recipes: what a training run is, read from YAML and validated once.

Owns the pydantic schema (`schema`) and its dotted keys (`keys`), reading and layering the files (base,
`extends`, team defaults and overrides, `--set`: `loader`, `overrides`), the names derived from a recipe
(stacks, runs, jobs, S3 prefixes: `naming`) and the instance catalogue (`hardware`). Pure, no AWS: the
training image imports it. May import `trainstack.errors` only.
"""
