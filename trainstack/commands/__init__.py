"""CLI command modules: each exposes `register(app)`, listed in trainstack.cli.COMMAND_MODULES."""
