"""The local AWS emulator: moto in server mode on localhost, for `make demo`, the tests and `--local`.

`endpoint` is the client side (start, find and stop a server; boto3 clients that refuse any non-local
endpoint; EventBridge for stack status events); `server` is the server process with moto's gaps patched;
`events` adds training jobs that run until ended, StopTrainingJob, and their state-change events. Nothing
real AWS gets is weakened to suit it. May import `errors` only.
"""
