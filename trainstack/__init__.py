"""trainstack: recipes, a planner and AWS CDK infrastructure for LLM training on SageMaker P6-B200."""

__version__ = "0.1.0"
