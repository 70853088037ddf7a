"""The `trainstack` command line: `main` lists the commands and turns user mistakes into one line,
`completion` completes recipes, teams and `--set` keys, and `commands/` holds one module per command.
The top of the stack: may import every other trainstack package.
"""
