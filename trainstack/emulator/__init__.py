"""The local AWS emulator: moto in server mode on localhost, for `make demo`, the tests and `--local`.

`endpoint` is the client side (start, find and stop a server; boto3 clients that refuse any non-local
endpoint; EventBridge for stack status events); `server` is the server process with moto's gaps patched;
`jobs` runs the training and processing jobs it is given as local processes with SageMaker's container
contract (`stand_in`: a recipe too big for the machine trains scaled down); `events` has the one place a
job's status changes, the test-only modes, StopTrainingJob, and the state-change events. Nothing real AWS
gets is weakened to suit it. May import `errors`, `protocol` (the container contract, the metric lines),
`recipes` and `planner` (the stand-in's decision).
"""
