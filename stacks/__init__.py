"""CDK stacks and constructs for trainstack. `stacks.app.build(app, config)` composes them."""

import os

# jsii prints a multi-line banner about this Node version on every run unless silenced before aws_cdk is
# imported; app.py does the same. Here it covers `python -m stacks.pipeline` (docs/gitops.md), whose
# module imports aws_cdk at the top.
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
