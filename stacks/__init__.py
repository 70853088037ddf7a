"""CDK stacks and constructs for trainstack. `stacks.app.build(app, config)` composes them."""
