"""The job's runtime: stopping on SIGTERM or the time limit (`stopping`), capacity notices (`capacity`),
non-finite losses and traces (`health`), and test-only fault injection (`faults`).

May import nothing else of the trainer.
"""
