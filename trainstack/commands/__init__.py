"""CLI commands: one module per command, each with `register(app)`; listed in trainstack.cli.COMMAND_MODULES."""
