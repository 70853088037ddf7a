"""AWS: a recipe's training jobs as SageMaker, Step Functions and DynamoDB see them.

Owns the CreateTrainingJob request (`request`, one pure function) and its checks against botocore's model
and SageMaker's documented rules (`request_check`), the CDK app's validated configuration
(`deployment`), boto3 access for real AWS or the emulator (`session`), the run registry (`registry`),
a run's recorded request and its deliberate changes (`run_request`), a run's checkpoints on S3
(`checkpoints`), the runs view and its trends (`runs`, `trends`) and the supervisor's pure decision
(`supervisor`).
May import `planner`, `recipes`, `protocol`, `errors`, and `emulator.endpoint` (to find a local endpoint).
"""
