"""CLI command modules: each exposes `register(app)`, listed in trainstack.cli.main.COMMAND_MODULES."""
